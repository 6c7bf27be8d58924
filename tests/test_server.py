"""`arena-serve` (issue 41): the OpenAI API over the online engine, talked to with the real
`openai` client on 127.0.0.1 (a free port; no other traffic). Greedy completions equal
`generate_text`; streams concatenate to the non-streamed text; chat prompts are the chat
template's tokens; bad input is a 400 naming the field; a full queue a 429; a client gone
mid-stream frees its pages; a load of 400 requests (10% cancelled) loses or duplicates none,
leaves no page held and compiles nothing after the warm-up; SIGTERM drains and exits 0."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import openai
import pytest
import uvicorn

import arena_jax as aj
from arena_jax import models
from arena_jax.server.app import create_app
from arena_jax.server.engine import Engine
from text_checkpoint import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 96


class Served:
    """An app on a free port in a thread. The socket is bound here and handed to uvicorn: a port
    picked free and bound later could be taken in between (the other CI line's servers and client
    connections use the same ephemeral range)."""

    def __init__(self, app):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]), daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = write_checkpoint(tmp_path_factory.mktemp("serve") / "ckpt")
    model, _ = models.load_pretrained(str(folder), dtype="float32")
    tokenizer = models.TextTokenizer.from_pretrained(str(folder))
    engine = Engine(model, max_seqs=8, max_model_len=MAX_LEN, chunk_size=32, decode_block=4, max_queue=512)
    engine.warm_up()
    served = Served(create_app(engine, tokenizer, "tiny-text"))
    yield engine, model, tokenizer, served
    served.close()
    engine.stop()


def _client(served, **kw):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, **kw)


def _post(url: str, body: bytes | str, headers=None) -> tuple[int, dict, dict]:
    data = body.encode() if isinstance(body, str) else body
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def test_greedy_completions_and_chat_equal_generate_text(setup):
    engine, model, tokenizer, served = setup
    client = _client(served)
    chat = [{"role": "user", "content": "Name three colours."}]
    prompts = ["The arena holds", "Grüße aus Köln", "Pages are fixed-size blocks of tokens. The capital"]
    want = models.generate_text(model, tokenizer, prompts + [chat], 12)  # one call: one compile
    for prompt, text, tokens in zip(prompts, want.texts, want.tokens):
        got = client.completions.create(model="tiny-text", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == text and got.usage.completion_tokens == len(tokens)
        assert got.usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert got.choices[0].finish_reason == ("stop" if len(tokens) < 12 else "length")
    got = client.chat.completions.create(model="tiny-text", messages=chat, max_tokens=12, temperature=0)
    assert got.choices[0].message.content == want.texts[3]
    assert got.usage.prompt_tokens == len(tokenizer.apply_chat_template(chat))  # the template's tokens, exactly
    got = client.completions.create(model="tiny-text", prompt=tokenizer.encode(prompts[0]), max_tokens=12, temperature=0)
    assert got.choices[0].text == want.texts[0]  # token ids in


def test_stream_concatenates_to_the_text(setup):
    engine, model, tokenizer, served = setup
    client = _client(served)
    for seed, temperature in ((None, 0.0), (7, 0.9)):
        kw = dict(model="tiny-text", prompt="Hello, world!", max_tokens=20, temperature=temperature, seed=seed)
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(stream=True, **kw))
        assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    chat = dict(model="tiny-text", messages=[{"role": "user", "content": "hi"}], max_tokens=15, temperature=0)
    whole = client.chat.completions.create(**chat).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **chat)]
    assert "".join(parts) == whole


def test_n_choices(setup):
    """n > 1: greedy choices are the one greedy text; seeded choice i is the single request seeded seed + i."""
    engine, model, tokenizer, served = setup
    client = _client(served)
    got = client.completions.create(model="tiny-text", prompt="The arena holds", max_tokens=8, temperature=0, n=3)
    want = models.generate_text(model, tokenizer, ["The arena holds"], 8).texts[0]
    assert [c.index for c in got.choices] == [0, 1, 2] and all(c.text == want for c in got.choices)
    sampled = client.completions.create(model="tiny-text", prompt="Pages", max_tokens=8, temperature=1.0, n=2, seed=5)
    for choice, seed in zip(sampled.choices, (5, 6)):
        one = client.completions.create(model="tiny-text", prompt="Pages", max_tokens=8, temperature=1.0, seed=seed)
        assert choice.text == one.choices[0].text
    chunks = list(client.completions.create(model="tiny-text", prompt="Pages", max_tokens=8, temperature=1.0, n=2,
                                            seed=5, stream=True))  # fmt: skip
    for i in range(2):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == sampled.choices[i].text
    assert engine.wait_idle(30) and engine.pages_used() == 0


def test_stop_strings_end_the_text(setup):
    engine, model, tokenizer, served = setup
    client = _client(served)
    full = client.completions.create(model="tiny-text", prompt="The arena", max_tokens=24, temperature=0).choices[0].text
    stop = full[5:8]
    assert len(stop) == 3
    got = client.completions.create(model="tiny-text", prompt="The arena", max_tokens=24, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="tiny-text", prompt="The arena", max_tokens=24, temperature=0,
                                         stop=stop, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == full[: full.index(stop)]
    assert engine.wait_idle(30) and engine.pages_used() == 0


@pytest.mark.parametrize("body, param", [
    ('{"prompt": "x", "max_tokens": ', None),                               # malformed JSON
    ('{"model": "other", "prompt": "x"}', "model"),
    ('{"prompt": "x", "max_tokens": -1}', "max_tokens"),
    ('{"prompt": "x", "temperature": NaN}', None),                          # NaN: not JSON, or refused
    ('{"prompt": "x", "top_p": 0}', "top_p"),
    ('{"prompt": "x", "n": 0}', "n"),
    ('{"prompt": "' + "word " * 200 + '"}', "prompt"),                      # longer than the context
    ('{"prompt": "x", "max_tokens": 500}', "max_tokens"),
    ('{"prompt": [1, 2, 100000]}', None),                                   # a token id past the vocabulary
    ('{"prompt": "x", "stop_token_ids": [100000]}', "stop_token_ids"),
    ('{"prompt": "x", "logprobs": 21}', "logprobs"),
])  # fmt: skip
def test_bad_input_is_a_400_naming_the_field(setup, body, param):
    engine, _, _, served = setup
    status, _, reply = _post(f"{served.url}/v1/completions", body)
    assert status == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["message"]
    if param is not None:
        assert reply["error"]["param"] == param, reply
    status, _, reply = _post(f"{served.url}/v1/chat/completions", '{"messages": []}')
    assert status == 400 and reply["error"]["param"] == "messages"
    assert engine.error is None  # nothing a request sends stops the engine


def test_logprobs_are_the_models(setup):
    """`logprobs` (completions: alternatives per token; chat: `logprobs` + `top_logprobs`): each
    token's log-softmax under the model, as `generate(return_logits=True)` gives its logits, the
    alternatives most likely first (greedy: the token itself first); a stream's logprobs are the
    whole response's; nothing compiled (the same programs, one step a call while they run)."""
    engine, model, tokenizer, served = setup
    client = _client(served)
    prompt = "Pages are fixed-size blocks of tokens. The capital"
    ids = tokenizer.encode(prompt)
    want = models.generate(model, [ids], 10, return_logits=True)
    compiled = engine.compiles_since_warm_up  # (after the reference's own compiles: the counter is the process's)
    logits = want.logits[0].astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    want_lp = [logp[i, t] for i, t in enumerate(want.tokens[0])]
    got = client.completions.create(model="tiny-text", prompt=prompt, max_tokens=10, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == got.usage.completion_tokens == len(want.tokens[0])
    np.testing.assert_allclose(lp.token_logprobs, want_lp, atol=1e-4)
    for top, token_lp in zip(lp.top_logprobs, lp.token_logprobs):  # (keyed by text: two tokens may share one)
        assert 1 <= len(top) <= 3 and token_lp >= max(top.values()) - 1e-6  # greedy: nothing more likely than the token
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model="tiny-text", prompt=prompt, max_tokens=10, temperature=0, logprobs=3,
                                            stream=True))  # fmt: skip
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(streamed, lp.token_logprobs, atol=1e-6)
    chat = dict(model="tiny-text", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    got = client.chat.completions.create(logprobs=True, top_logprobs=2, **chat)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == c.logprob and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
               for c in content)  # fmt: skip
    assert client.chat.completions.create(**chat).choices[0].logprobs is None  # none unless asked
    status, _, reply = _post(f"{served.url}/v1/chat/completions", json.dumps(dict(chat, top_logprobs=2)))
    assert status == 400 and "top_logprobs" in reply["error"]["message"]
    assert engine.wait_idle(30) and engine.compiles_since_warm_up == compiled


def test_full_queue_is_a_429_and_api_key(setup, monkeypatch):
    engine, _, tokenizer, served = setup
    monkeypatch.setattr(engine, "max_queue", 0)
    status, headers, reply = _post(f"{served.url}/v1/completions", '{"prompt": "x", "max_tokens": 2}')
    assert status == 429 and headers.get("retry-after") == "1" and reply["error"]["type"] == "rate_limit_error"
    monkeypatch.undo()
    keyed = Served(create_app(engine, tokenizer, "tiny-text", api_key="sesame"))
    try:
        assert _post(f"{keyed.url}/v1/completions", '{"prompt": "x", "max_tokens": 2}')[0] == 401
        ok = _post(f"{keyed.url}/v1/completions", '{"prompt": "x", "max_tokens": 2}', {"Authorization": "Bearer sesame"})
        assert ok[0] == 200 and ok[2]["usage"]["completion_tokens"] == 2
    finally:
        keyed.close()


def test_a_client_gone_mid_stream_frees_its_pages(setup, monkeypatch):
    engine, _, _, served = setup
    step = engine._sched.step

    def slow_step(*args, **kwargs):
        # 50 ms a step (a decode call runs up to 4 tokens): the server sees the client gone long
        # before the 80 tokens are done. Unslowed, a fast machine finished them first about
        # two runs in three (finish "length", no abort): the test raced the tiny model.
        out = step(*args, **kwargs)
        time.sleep(0.05)
        return out

    monkeypatch.setattr(engine._sched, "step", slow_step)  # looked up on each call by the engine's loop

    def aborts():
        return engine.registry.get_sample_value("arena_requests_total", {"finish_reason": "abort"}) or 0

    aborted = aborts()
    client = _client(served)
    stream = client.completions.create(model="tiny-text", prompt="The arena holds", max_tokens=80, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()  # the connection goes
    deadline = time.time() + 30
    while aborts() == aborted and time.time() < deadline:
        time.sleep(0.05)
    assert aborts() == aborted + 1
    assert engine.wait_idle(30) and engine.pages_used() == 0


def test_load_loses_nothing_and_compiles_nothing(setup):
    """400 requests of mixed lengths, 64 at a time, every tenth cancelled mid-stream."""
    engine, _, _, served = setup
    compiled = engine.compiles_since_warm_up  # (the process-wide count: generate_text above compiled its own)
    rng = random.Random(0)
    words = "the arena holds every page of tokens in blocks".split()
    jobs = [(i, " ".join(rng.choice(words) for _ in range(rng.randint(1, 15))), rng.randint(1, 12)) for i in range(400)]
    results: dict[int, tuple[str, str]] = {}

    async def one(client, sem, i, prompt, new):
        async with sem:
            stream = await client.completions.create(model="tiny-text", prompt=prompt, max_tokens=new, stream=True,
                                                     temperature=0.8 if i % 3 else 0.0, user=str(i))  # fmt: skip
            text, reason = "", None
            async for chunk in stream:
                text += chunk.choices[0].text
                reason = chunk.choices[0].finish_reason or reason
                if i % 10 == 0 and text:  # cancelled mid-stream
                    await stream.close()
                    reason = "cancelled"
                    break
            assert i not in results
            results[i] = (text, reason)

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
        sem = asyncio.Semaphore(64)
        await asyncio.gather(*(one(client, sem, *job) for job in jobs))
        await client.close()

    asyncio.run(run())
    assert sorted(results) == list(range(400))
    assert all(reason in ("stop", "length") for i, (_, reason) in results.items() if i % 10)
    assert engine.wait_idle(60) and engine.pages_used() == 0
    assert engine.compiles_since_warm_up == compiled  # serving compiled nothing
    metrics = urllib.request.urlopen(f"{served.url}/metrics", timeout=30).read().decode()
    assert "arena_pages_used 0.0" in metrics and 'arena_requests_total{finish_reason="abort"}' in metrics
    health = aj.health(engine.cache)  # the device's page table, read while the idle engine runs nothing (its
    # small reads compile programs of their own: after the count above)
    assert health["pages_in_use"] == health["active_sequences"] == 0 and health["free_pages"] == engine.layout.num_pages


def test_http_benchmark_load_generator(setup):
    """`arena-bench serve --http`'s load (benchmarks.http_serve._load) against this server: every
    request answered, its tokens counted from `usage`, the texts the server gives unstreamed."""
    from arena_jax.benchmarks.http_serve import HttpSettings, _jobs, _load

    engine, _, _, served = setup
    jobs = _jobs(HttpSettings(requests=8, prompt_words=(2, 10)), 200.0, random.Random(3))
    assert all(b >= a for (a, _), (b, _) in zip(jobs, jobs[1:]))  # arrivals in order
    got = asyncio.run(_load(served.url, "tiny-text", jobs, 6))
    assert got["errors"] == 0 and got["tokens_per_s"] > 0
    client = _client(served)
    want = [client.completions.create(model="tiny-text", prompt=p, max_tokens=6, temperature=0) for _, p in jobs]
    assert got["texts"] == [w.choices[0].text for w in want]
    assert got["tokens"] == sum(w.usage.completion_tokens for w in want)


def test_prefix_cache_serves_shared_prompts_and_choices(setup):
    """`--prefix-cache`: n choices and repeated prompts map the first one's pages; the same texts;
    nothing compiled after the warm-up (this engine's own programs: hits, copies, evictions)."""
    _, model, tokenizer, _ = setup
    system = "The arena holds every page. Pages are fixed-size blocks of tokens. "
    prompts = [system + q for q in ("Hello, world!", "Grüße aus Köln", "The capital", "Name three colours:")]
    want = models.generate_text(model, tokenizer, prompts, 10).texts  # (before the engine: its compiles are not the engine's)
    engine = Engine(model, max_seqs=4, max_model_len=MAX_LEN, chunk_size=32, num_pages=16, prefix_cache=True)
    engine.warm_up()
    served = Served(create_app(engine, tokenizer, "tiny-text"))
    try:
        compiled = engine.compiles_since_warm_up
        client = _client(served)
        hits = engine._sched.hit_tokens
        for prompt, text in zip(prompts, want):
            got = client.completions.create(model="tiny-text", prompt=prompt, max_tokens=10, temperature=0, n=2)
            assert [c.text for c in got.choices] == [text, text]
        assert engine._sched.hit_tokens > hits  # the system prompt and each first choice's prompt were mapped
        assert engine.wait_idle(30) and engine.pages_used() == 0
        assert engine.compiles_since_warm_up == compiled  # serving with hits, copies and evictions compiled nothing
    finally:
        served.close()
        engine.stop()


def test_speculative_engine_serves_the_same_greedy_texts(setup):
    """`--speculative-k`: prompt lookup in the engine; the same greedy texts, nothing compiled
    after warm-up. A request with `"speculative": false` (or asking for logprobs) gets no
    proposals: it decodes plainly, to the same text."""
    _, model, tokenizer, _ = setup
    prompts = ["The arena holds every page. The arena holds every page. The arena", "Pages are fixed-size blocks"]
    want = models.generate_text(model, tokenizer, prompts, 16).texts  # (before the engine: its compiles are not the engine's)
    engine = Engine(model, max_seqs=2, max_model_len=MAX_LEN, chunk_size=32, speculative=4)
    engine.warm_up()
    served = Served(create_app(engine, tokenizer, "tiny-text"))
    try:
        compiled = engine.compiles_since_warm_up
        client = _client(served)
        for prompt, text in zip(prompts, want):
            got = client.completions.create(model="tiny-text", prompt=prompt, max_tokens=16, temperature=0)
            assert got.choices[0].text == text
        assert engine._sched.verify_calls > 0 and engine._sched.proposed_tokens > 0
        proposed, verified = engine._sched.proposed_tokens, engine._sched.verify_calls
        for extra in ({"speculative": False}, {"logprobs": 1}):
            got = client.completions.create(model="tiny-text", prompt=prompts[0], max_tokens=16, temperature=0, extra_body=extra)
            assert got.choices[0].text == want[0]
            assert (engine._sched.proposed_tokens, engine._sched.verify_calls) == (proposed, verified)  # no proposal
        assert len(got.choices[0].logprobs.token_logprobs) == got.usage.completion_tokens
        assert engine.wait_idle(30) and engine.pages_used() == 0 and engine.compiles_since_warm_up == compiled
        with pytest.raises(ValueError, match="speculative must be a bool"):
            engine.submit([1, 2], speculative=None)
    finally:
        served.close()
        engine.stop()
    with pytest.raises(ValueError, match="speculative must be an integer >= 0"):
        Engine(model, speculative=-1)


def test_prefix_cache_spills_to_the_host_tier_and_hits_there(setup):
    """`--prefix-cache --host-pages`: the index's spill tier. An arena of 8 pages: the first
    prompt's cached pages are evicted to host memory by the prompts after it, and the first
    prompt asked again maps them back from there; the texts are generate_text's, nothing is
    compiled after warm-up (the spills were compiled by it), and the index's host pages are
    exactly the host tier's held pages."""
    _, model, tokenizer, _ = setup
    first = "Pages are fixed-size blocks of tokens, and the arena holds every page of them."
    prompts = [first] + [f"Request {i}: a different prompt of about the same length, {i * 7} words." for i in range(4)] + [first]
    want = models.generate_text(model, tokenizer, prompts, 8).texts  # (before the engine: its compiles are not the engine's)
    engine = Engine(model, max_seqs=2, max_model_len=MAX_LEN, chunk_size=32, num_pages=8, host_pages=16, prefix_cache=True)
    engine.warm_up()
    served = Served(create_app(engine, tokenizer, "tiny-text"))
    try:
        compiled, before = engine.compiles_since_warm_up, engine.index.metrics()
        client = _client(served)
        got = [client.completions.create(model="tiny-text", prompt=p, max_tokens=8, temperature=0).choices[0].text
               for p in prompts]  # fmt: skip
        assert got == want
        after = engine.index.metrics()
        assert after["prefix_host_hit_tokens"] > before["prefix_host_hit_tokens"]  # the last prompt, from the host tier
        assert after["prefix_offloaded_pages"] > before["prefix_offloaded_pages"] and engine.wait_idle(30)
        assert engine.compiles_since_warm_up == compiled
        with urllib.request.urlopen(f"{served.url}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        spilled = engine.index.num_host_pages
        assert spilled > 0 and f"arena_host_pages_used {float(spilled)}" in metrics
        assert f"arena_host_bytes_used {float(spilled * engine.layout.page_bytes)}" in metrics
        del client
    finally:
        served.close()
        engine.stop()
    health = aj.health(engine.cache, engine.index, engine._sched.tier.host)
    assert health["prefix_host_index_matches"] and health["prefix_index_matches"] and health["host_pages_held"] > 0


def test_host_tier_swaps_preempted_requests_and_compiles_nothing_while_serving(setup):
    """`--host-pages`: an arena of 8 pages for 4 rows of up to 96 tokens preempts; the preempted
    requests' pages go to the host tier and come back (a policy that always prefers moving), the
    texts are generate_text's, nothing is compiled after warm-up and no host page stays held;
    /metrics reports the tier."""
    _, model, tokenizer, _ = setup
    prompts = [f"Request {i}: pages are fixed-size blocks of tokens, and the arena holds them all." for i in range(6)]
    want = models.generate_text(model, tokenizer, prompts, 24).texts  # (before the engine: its compiles are not the engine's)
    engine = Engine(model, max_seqs=4, max_model_len=MAX_LEN, chunk_size=32, num_pages=8, host_pages=16,
                    swap_policy=models.SwapPolicy(prefill_tokens_per_s=1.0))  # fmt: skip
    engine.warm_up()
    served = Served(create_app(engine, tokenizer, "tiny-text"))
    try:
        compiled = engine.compiles_since_warm_up
        client = _client(served)

        async def all_at_once():
            aclient = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
            got = await asyncio.gather(*(aclient.completions.create(model="tiny-text", prompt=p, max_tokens=24,
                                                                    temperature=0) for p in prompts))  # fmt: skip
            return [g.choices[0].text for g in got]

        assert asyncio.run(all_at_once()) == want
        tier = engine._sched.tier
        assert tier.swap_outs > 0 and engine._sched.preemptions > 0
        assert engine.wait_idle(30) and engine.pages_used() == 0 and len(tier.free) == 16
        assert engine.compiles_since_warm_up == compiled  # the swap programs were compiled by the warm-up
        with urllib.request.urlopen(f"{served.url}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        assert "arena_host_pages_total 16.0" in metrics and "arena_host_bytes_used 0.0" in metrics
        assert f"arena_swap_outs {float(tier.swap_outs)}" in metrics
        del client
    finally:
        served.close()
        engine.stop()
    with pytest.raises(ValueError, match="host_pages must be an integer >= 0"):
        Engine(model, host_pages=-1)


def test_stopped_engine_holds_no_page(setup):
    engine, _, _, served = setup
    served.close()
    engine.stop()
    health = aj.health(engine.cache)
    assert health["pages_in_use"] == 0 and health["active_sequences"] == 0


def test_sigterm_drains_and_exits_zero(tmp_path):
    """`arena-serve` as a process: after its warm-up a request compiles nothing (its /metrics);
    SIGTERM with a stream in flight lets it finish, then the process exits 0. It takes any free
    port (--port 0) and says which on stdout once bound, whatever the log level. Its warm-up
    wrote the programs it compiled to its persistent compilation cache (the default folder, from
    $ARENA_JAX_COMPILE_CACHE: here a fresh one, never the user's)."""
    folder = tmp_path / "compiled"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), ARENA_JAX_COMPILE_CACHE=str(folder))
    proc = subprocess.Popen([sys.executable, "-m", "arena_jax.server.cli", "--model", "tiny", "--port", "0",
                             "--max-seqs", "2", "--max-model-len", "64", "--chunk-size", "16", "--grace-period", "20",
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        printed = []
        for line in proc.stdout:  # (the warm-up first: tens of seconds; the suite's timeout bounds it)
            printed.append(line.decode())
            if printed[-1].startswith("arena-serve: listening on http://127.0.0.1:"):
                break
        else:
            raise AssertionError(f"arena-serve exited {proc.wait()} before it listened:\n{''.join(printed)[-3000:]}")
        url = printed[-1].split()[-1]
        assert int(url.rsplit(":", 1)[1]) > 0
        assert any(folder.iterdir()), "the warm-up wrote nothing to the compilation cache"
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode()[-3000:]
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        done = client.completions.create(model="tiny", prompt=[5] * 40, max_tokens=20, temperature=0.5)
        assert done.usage.completion_tokens == 20
        assert "arena_compiles_since_warm_up 0.0" in urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
        stream = client.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=40, stream=True)
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)  # in flight: it finishes within the grace period
        rest = list(stream)
        assert (rest or [first])[-1].choices[0].finish_reason == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
