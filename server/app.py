"""The HTTP surface: OpenAI's completions and chat completions (streamed as server-sent events or
not), `/v1/models`, `/health` and Prometheus `/metrics`, over an `Engine` (FastAPI: pydantic
checks every request body, and it is the stack vLLM and SGLang serve the same API with).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a body
that does not parse or a bad value (the field named), an unknown model or a prompt too long for
the context; 401 without the `--api-key`; 429 (with `Retry-After`) when the queue is full.
"""
from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from arena_jax.models.text import TextStream, TextTokenizer
from arena_jax.server.engine import Engine, QueueFull
from arena_jax.server.protocol import ChatRequest, CompletionRequest, Sampling, StopText

__all__ = ["create_app"]

log = logging.getLogger("arena_jax.server")


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 headers: dict | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.headers = status, message, param, kind, headers


def _error(status: int, message: str, param=None, kind="invalid_request_error", headers=None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine: Engine, tokenizer: TextTokenizer | None, model_name: str, *, api_key: str | None = None) -> FastAPI:
    """The app serving `engine` (started: `Engine.warm_up`) under `model_name`."""
    app = FastAPI(title="arena-serve", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, f"the body is not valid JSON: {first.get('msg', '')}")
        param = ".".join(loc) or None
        return _error(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error(exc.status, exc.message, exc.param, exc.kind, exc.headers)

    @app.middleware("http")
    async def _auth_and_log(request: Request, call_next):
        start = time.perf_counter()
        if api_key is not None and request.url.path.startswith("/v1/"):
            if not hmac.compare_digest(request.headers.get("authorization", "").encode(), f"Bearer {api_key}".encode()):
                return _error(401, "a valid API key is required (Authorization: Bearer ...)", kind="authentication_error")
        response = await call_next(request)
        log.info("%s %s %d %.3fs", request.method, request.url.path, response.status_code, time.perf_counter() - start)
        return response

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return _error(503, f"the engine stopped: {engine.error!r}", kind="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "arena-jax",
                                            "max_model_len": engine.max_model_len}]}  # fmt: skip

    def _settings(body: Sampling, prompt_tokens: int) -> dict:
        if body.model is not None and body.model != model_name:
            raise ApiError(400, f"model {body.model!r} is not served here (this server serves {model_name!r})", "model")
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        room = engine.max_model_len - prompt_tokens
        if room < 1:
            raise ApiError(400, f"this model's context is {engine.max_model_len} tokens; the prompt has {prompt_tokens}",
                           "messages" if isinstance(body, ChatRequest) else "prompt")  # fmt: skip
        if max_tokens is None:
            max_tokens = min(room, 16 if isinstance(body, CompletionRequest) else room)
        if prompt_tokens + max_tokens > engine.max_model_len:
            raise ApiError(400, f"this model's context is {engine.max_model_len} tokens; you asked for {prompt_tokens + max_tokens} "
                                f"({prompt_tokens} in the prompt, {max_tokens} to generate)", "max_tokens")  # fmt: skip
        vocab = engine.model.config.vocab_size
        if body.stop_token_ids and max(body.stop_token_ids) >= vocab:
            raise ApiError(400, f"stop_token_ids: token ids must be below the vocabulary size {vocab}", "stop_token_ids")
        stop = set(body.stop_token_ids or ()) | (set() if body.ignore_eos else set(engine.model.config.eos_token_ids))
        return dict(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                    seed=body.seed, stop_tokens=stop, logprobs=body.logprobs_wanted(), speculative=body.speculative)  # fmt: skip

    def _text_tokenizer(param: str) -> TextTokenizer:
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: give the prompt as token ids", param)
        return tokenizer

    def _submit(ids: list[int], settings: dict, n: int) -> list:
        """n token streams of the prompt (the engine's `TokenStream`s): the first computes the
        prompt, the others join once its K/V are in the cache (`Engine.submit(after=)`); a seed
        gives choice i the seed + i."""
        streams = []
        try:
            for i in range(n):
                seed = settings["seed"]
                each = dict(settings, seed=None if seed is None else (seed + i) % (2**31))
                streams.append(engine.stream(ids, after=streams[0].request if streams else None, **each))
        except (QueueFull, ValueError) as exc:
            for stream in streams:
                engine.cancel(stream.request)
            if isinstance(exc, QueueFull):
                raise ApiError(429, str(exc), kind="rate_limit_error", headers={"Retry-After": "1"}) from None
            raise ApiError(400, str(exc), "logprobs" if str(exc).startswith("logprobs") else None) from None
        return streams

    async def _text(tokens, stops: list[str]) -> AsyncIterator[tuple[str, tuple | None, list]]:
        """One choice: (text delta, None, logprobs) ... then ("", (finish reason, tokens), logprobs):
        logprobs, the `TokenLogprobs` of the tokens since the last item (with `logprobs` asked)."""
        stream = TextStream(tokenizer) if tokenizer is not None else None
        stop_text = StopText(stops)
        entries, sent, count = tokens.request.entries, 0, 0

        def new_entries():
            nonlocal sent
            out, sent = [e for e in entries[sent:count] if e is not None], count
            return out

        try:
            async for kind, value in tokens:
                if kind == "token":
                    count += 1
                    out = stop_text.feed(stream.push(value) if stream is not None else f" {value}")
                    if stop_text.stopped:
                        yield out, ("stop", count), new_entries()
                        return
                    if out or tokens.request.logprobs is not None:
                        yield out, None, new_entries()
                else:
                    rest = (stop_text.feed(stream.finish()) if stream is not None else "") + stop_text.finish()
                    yield rest, (value, count), new_entries()
                    return
        finally:
            await tokens.aclose()  # leaving early (a stop string, a client gone) cancels the request

    def _token_text(token: int) -> str:
        return tokenizer.decode([token]) if tokenizer is not None else f" {token}"

    def _chat_logprobs(entries) -> dict:
        """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
        def one(token, logprob):
            text = _token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [dict(one(e.token, e.logprob), top_logprobs=[one(t, lp) for t, lp in e.top]) for e in entries]}

    def _completion_logprobs(entries, offset: int) -> dict:
        """OpenAI's completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
        texts = [_token_text(e.token) for e in entries]
        offsets = list(itertools.accumulate((len(t) for t in texts[:-1]), initial=offset)) if texts else []
        return {"tokens": texts, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{_token_text(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    async def _merged(choices) -> AsyncIterator[tuple[int, str, tuple | None, list]]:
        """(choice index, text delta, end, logprobs) from every choice as it comes."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, gen):
            try:
                async for piece, end, entries in gen:
                    await queue.put((i, piece, end, entries))
            finally:
                await gen.aclose()

        tasks = [asyncio.create_task(pump(i, gen)) for i, gen in enumerate(choices)]
        try:
            open_choices = len(tasks)
            while open_choices:
                item = await queue.get()
                open_choices -= item[2] is not None
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(body: Sampling, ids: list[int], chat: bool):
        settings = _settings(body, len(ids))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created, name, kind = int(time.time()), model_name, ("chat.completion" if chat else "text_completion")
        streams = _submit(ids, settings, body.n)  # a 400 / 429 here, before any byte is sent
        choices = [_text(s, body.stop_strings()) for s in streams]

        def usage(ends):
            n = sum(e[1] for e in ends)
            return {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}

        wants = body.logprobs_wanted() is not None

        def logprobs(entries, offset):
            if not wants:
                return None
            return _chat_logprobs(entries) if chat else _completion_logprobs(entries, offset)

        if not body.stream:
            texts, ends, entries = [""] * len(choices), [None] * len(choices), [[] for _ in choices]
            async for i, piece, end, got in _merged(choices):
                texts[i] += piece
                ends[i] = end or ends[i]
                entries[i] += got
            out = []
            for i, (t, e, lp) in enumerate(zip(texts, ends, entries)):
                choice = {"index": i, "message": {"role": "assistant", "content": t}} if chat else {"index": i, "text": t}
                out.append(dict(choice, logprobs=logprobs(lp, 0), finish_reason=e[0]))
            return {"id": rid, "object": kind, "created": created, "model": name, "choices": out, "usage": usage(ends)}

        async def events():
            chunk_kind = kind + ".chunk" if chat else kind
            ends = {}
            if chat:  # each choice's role first, as OpenAI sends it
                for i in range(len(choices)):
                    yield _sse({"id": rid, "object": chunk_kind, "created": created, "model": name,
                                "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})  # fmt: skip
            offsets = [0] * len(choices)
            async for i, piece, end, got in _merged(choices):
                if not piece and end is None and not got:
                    continue
                reason = end[0] if end else None
                delta = ({"index": i, "delta": {"content": piece} if piece else {}, "finish_reason": reason}
                         if chat else {"index": i, "text": piece, "finish_reason": reason})  # fmt: skip
                delta["logprobs"] = logprobs(got, offsets[i]) if got else None
                if delta["logprobs"] and not chat:  # the next chunk's tokens start after these
                    offsets[i] += sum(map(len, delta["logprobs"]["tokens"]))
                chunk = {"id": rid, "object": chunk_kind, "created": created, "model": name, "choices": [delta]}
                if end is not None:
                    ends[i] = end
                    if len(ends) == len(choices):
                        chunk["usage"] = usage(list(ends.values()))
                yield _sse(chunk)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        if isinstance(body.prompt, str):
            ids = _text_tokenizer("prompt").encode(body.prompt)
        else:
            ids = list(body.prompt)
        if not ids:
            raise ApiError(400, "prompt: empty", "prompt")
        return await _serve(body, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        tok = _text_tokenizer("messages")
        try:
            ids = tok.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages])
        except Exception as exc:  # noqa: BLE001 - the template's own raise_exception, or no template
            raise ApiError(400, f"messages: {exc}", "messages") from None
        return await _serve(body, ids, chat=True)

    return app


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
