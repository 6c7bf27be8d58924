"""`Engine`: an online generation engine over the paged cache. Requests join the running batch
at the next step, whatever is running; the device loop runs in its own thread and never blocks
the caller (an HTTP server's event loop); the arena is sized once and every program is compiled
by `warm_up` before requests are taken, so serving compiles nothing (`compiles_since_warm_up`).

    engine = Engine(model, max_seqs=8, max_model_len=1024)
    engine.warm_up()                                   # compiles every program the loop can run
    async for kind, value in engine.stream(prompt_ids, max_tokens=64, temperature=0.7):
        ...                                            # ("token", id) ..., then ("finish", "stop" | "length" | "abort")
    engine.stop()

It is `models.scheduler.Scheduler` (the loop `generate` runs) stepped by a thread: admission,
chunked prefill, decode blocks, run-ahead and preemption are the same code, with per-request
settings (`Seq.max_new`, `.stop`, `.sampling`, `.key`) and cancellation. A request's random
draws are keyed by its `seed` (or a number of its own), so a seeded request gives the same
tokens whatever else runs. Cancelling a request (a client gone) ends it at its next step's
read-back: its row and pages are released then.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

import arena_jax as aj
from arena_jax.models import Llama, PromptLookup, Sampling, calibrate_key_factors
from arena_jax.models.compile_clock import CompileClock
from arena_jax.models.fingerprint import fingerprint
from arena_jax.models.host_tier import HostTier, SwapPolicy
from arena_jax.models.steps import drop_host_page_rows, evict_to_host_rows, offload_page_rows, swap_out_rows
from arena_jax.models.scheduler import Scheduler, Seq

__all__ = ["Engine", "Request", "QueueFull", "TokenStream", "TokenLogprobs", "token_logprobs"]

log = logging.getLogger("arena_jax.server")
INT32_MAX = 2**31 - 1


class QueueFull(Exception):
    """The engine's queue of waiting requests is full (`max_queue`): try again later."""


@dataclasses.dataclass
class Request:
    """One submitted request: its Seq in the scheduler and the callbacks the engine thread calls."""

    seq: Seq
    on_token: Callable[[int], None] | None
    on_finish: Callable[[str], None] | None
    submitted: float
    last_token: float | None = None
    finish: str | None = None  # "stop" | "length" | "abort", once it ended
    followers: list = dataclasses.field(default_factory=list)  # requests admitted once this one's prompt is in the cache
    logprobs: int | None = None  # top alternatives per token wanted (0: the chosen token's only); None: no logprobs
    entries: list = dataclasses.field(default_factory=list)  # per token with logprobs: `TokenLogprobs` (engine thread)

    @property
    def done(self) -> bool:
        return self.finish is not None


MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability under the model (log-softmax of its raw logits, before
    temperature and top-k / top-p, as vLLM reports them) and the `top` most likely tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """`TokenLogprobs` of `token` from its step's logits f32[V] (numpy, on the host)."""
    x = np.asarray(logits, np.float64)
    peak = x.max()
    logp = x - (peak + np.log(np.exp(x - peak).sum()))
    best = np.argpartition(-logp, top - 1)[:top] if top else np.zeros((0,), np.int64)
    best = best[np.argsort(-logp[best], kind="stable")]
    return TokenLogprobs(int(token), float(logp[token]), tuple((int(i), float(logp[i])) for i in best))


class TokenStream:
    """A request's tokens as they come (`Engine.stream`): ("token", id) ..., ("finish", reason)."""

    def __init__(self, engine: Engine, request: Request, queue: asyncio.Queue):
        self.engine, self.request, self._queue, self._ended = engine, request, queue, False

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> tuple[str, object]:
        if self._ended:
            raise StopAsyncIteration
        item = await self._queue.get()
        self._ended = item[0] == "finish"
        return item

    async def aclose(self) -> None:
        """Cancel the request unless it ended."""
        self._ended = True
        if not self.request.done:
            self.engine.cancel(self.request)

    async def __aenter__(self) -> TokenStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class Engine:
    """An online engine: `submit` / `stream` requests, `cancel` them, `stop` it (module docstring)."""

    def __init__(self, model: Llama, *, max_seqs: int = 8, max_model_len: int | None = None, page_size: int = 16,
                 num_pages: int | None = None, kv_memory: int | None = None, kv_dtype=None, chunk_size: int = 64,
                 decode_block: int = 4, max_queue: int = 256, seed: int = 0, prefix_cache: bool = False,
                 speculative: int = 0, host_pages: int = 0, swap_policy: SwapPolicy | None = None):  # fmt: skip
        if not isinstance(model, Llama):
            raise ValueError(f"model must be a models.Llama, got {type(model).__name__}")
        config = model.config
        max_model_len = min(config.max_position_embeddings, 4096) if max_model_len is None else max_model_len
        for name, value, low in (("max_seqs", max_seqs, 1), ("max_model_len", max_model_len, 2), ("page_size", page_size, 1),
                                 ("chunk_size", chunk_size, 1), ("decode_block", decode_block, 1), ("max_queue", max_queue, 1)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(host_pages, int) or isinstance(host_pages, bool) or host_pages < 0:
            raise ValueError(f"host_pages must be an integer >= 0 (0: no host tier), got {host_pages!r}")
        if swap_policy is not None and not isinstance(swap_policy, SwapPolicy):
            raise ValueError(f"swap_policy must be a models.SwapPolicy, got {type(swap_policy).__name__}")
        if num_pages is not None and kv_memory is not None:
            raise ValueError("give at most one of num_pages and kv_memory")
        dtype = model.dtype if kv_dtype is None else kv_dtype
        per_seq = -(-max_model_len // page_size)
        if kv_memory is not None:
            layout = config.kv_layout(page_size=page_size, budget_bytes=kv_memory, max_seqs=max_seqs,
                                      max_seq_len=max_model_len, dtype=dtype)  # fmt: skip
        else:
            layout = config.kv_layout(page_size=page_size, num_pages=num_pages or max_seqs * per_seq, max_seqs=max_seqs,
                                      max_seq_len=max_model_len, dtype=dtype)  # fmt: skip
        if layout.num_pages < per_seq:
            raise ValueError(f"the arena ({layout.num_pages} pages of {page_size}) cannot hold one sequence of "
                             f"max_model_len={max_model_len} tokens ({per_seq} pages): raise kv_memory / num_pages")
        self.model, self.layout, self.max_model_len, self.max_queue = model, layout, max_model_len, max_queue
        factors = calibrate_key_factors(model) if layout.smooth_keys else None
        cache = aj.create(layout, key_factors=factors)
        eos = frozenset(config.eos_token_ids)
        self.index = None
        host = aj.create_host(cache, host_pages) if host_pages else None
        if prefix_cache:  # K/V of earlier prompts reused (decode blocks are off with an index: one step a call)
            tag = fingerprint(model)  # hashes the sampled weights: once
            self.index = aj.PrefixCache(layout, tag=tag, host_pages=host_pages)
            self.index.bind(cache, tag=tag, host=host)
        # without an index: swap preemption (a preempted request's pages go to host memory and come
        # back); with one: the index's spill tier (evicted pages go there, a hit brings them back)
        tier = HostTier.beside(host, layout, swap_policy, self.index)
        self._sched = Scheduler(model, cache, layout, max_seqs, min(chunk_size, max_model_len), Sampling(), seed, eos,
                                max_model_len, False, self.index, tier, 0, decode_block)  # fmt: skip
        self._sched.row_sampling = True
        if not isinstance(speculative, int) or isinstance(speculative, bool) or speculative < 0:
            raise ValueError(f"speculative must be an integer >= 0 (proposals per step; 0: off), got {speculative!r}")
        if speculative:  # prompt lookup: every decode is a verify call (models.speculative)
            self._sched.speculative = PromptLookup(k=speculative)
        self._sched.on_token = self._on_token
        self._sched.on_finish = self._on_finish
        self._waiting: collections.deque[Seq] = collections.deque()
        self._incoming: list[Request] = []
        self._cancels: list[Request] = []
        self._requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._idle = threading.Event()  # set by the loop once nothing runs or waits and its pages are released
        self.error: BaseException | None = None
        self._clock = CompileClock().__enter__()  # programs compiled since the engine was made
        self._warm_programs: int | None = None
        self._metrics()

    # ---- metrics ----------------------------------------------------------------------------
    def _metrics(self) -> None:
        self.registry = r = CollectorRegistry()
        self.m_requests = Counter("arena_requests", "Requests finished, by finish reason", ["finish_reason"], registry=r)
        self.m_tokens = Counter("arena_generated_tokens", "Tokens generated", registry=r)
        self.m_ttft = Histogram("arena_time_to_first_token_seconds", "From submit to the first token", registry=r,
                                buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))  # fmt: skip
        self.m_itl = Histogram("arena_inter_token_latency_seconds", "Between a request's tokens", registry=r,
                               buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))  # fmt: skip
        Gauge("arena_running_requests", "Requests in the batch", registry=r).set_function(
            lambda: sum(s is not None for s in self._sched.rows))
        Gauge("arena_waiting_requests", "Requests waiting for a row", registry=r).set_function(
            lambda: len(self._waiting) + len(self._incoming))
        Gauge("arena_pages_used", "KV pages the running requests hold", registry=r).set_function(self.pages_used)
        Gauge("arena_pages_free", "KV pages free", registry=r).set_function(lambda: self.layout.num_pages - self.pages_used())
        Gauge("arena_preemptions", "Requests preempted (recomputed later)", registry=r).set_function(
            lambda: self._sched.preemptions)
        Gauge("arena_prefix_cached_pages", "KV pages the prefix cache holds (0 without --prefix-cache)", registry=r).set_function(
            lambda: self.index.num_pages if self.index is not None else 0)
        Gauge("arena_prefix_hit_tokens", "Prompt tokens mapped from the prefix cache instead of computed", registry=r).set_function(
            lambda: self._sched.hit_tokens)
        Gauge("arena_prompt_tokens", "Prompt tokens admitted (hits included)", registry=r).set_function(
            lambda: self._sched.prompt_tokens)
        Gauge("arena_speculative_proposed_tokens", "Tokens prompt lookup proposed (0 without --speculative-k)", registry=r).set_function(
            lambda: self._sched.proposed_tokens)
        Gauge("arena_speculative_accepted_tokens", "Of those, the ones the model agreed with", registry=r).set_function(
            lambda: self._sched.accepted_tokens)
        tier = self._sched.tier
        host_total = tier.host.num_pages if tier is not None else 0

        def host_used() -> int:  # swap preemption: the tier's own pages; with a prefix cache: the index's spilled ones
            if tier is None:
                return 0
            return self.index.num_host_pages if self.index is not None else host_total - len(tier.free)

        Gauge("arena_host_pages_total", "Pages of the host tier (0 without --host-pages)", registry=r).set(host_total)
        Gauge("arena_host_pages_used", "Host-tier pages in use: swapped-out requests', or the prefix cache's spilled pages",
              registry=r).set_function(host_used)  # fmt: skip
        Gauge("arena_host_bytes_used", "Bytes of those host-tier pages", registry=r).set_function(
            lambda: host_used() * self.layout.page_bytes)
        Gauge("arena_swap_outs", "Preempted requests whose pages went to the host tier (not recomputed)", registry=r).set_function(
            lambda: tier.swap_outs if tier is not None else 0)
        Gauge("arena_compiles_since_warm_up", "Programs compiled after warm_up (0 while serving)", registry=r).set_function(
            lambda: self.compiles_since_warm_up)

    def pages_used(self) -> int:
        """Pages the running sequences hold, as the scheduler counts them (no device read)."""
        return sum(self.layout.pages_for(s.fed) for s in list(self._sched.rows) if s is not None)

    @property
    def compiles_since_warm_up(self) -> int:
        """Programs JAX compiled since `warm_up` finished (None before): 0 while serving."""
        programs = self._clock.programs if self._clock is not None else self._clock_programs
        return -1 if self._warm_programs is None else programs - self._warm_programs

    # ---- requests ---------------------------------------------------------------------------
    def submit(self, prompt, *, max_tokens: int = 16, temperature: float = 0.0, top_p: float = 1.0,
               top_k: int | None = None, seed: int | None = None, stop_tokens=None,
               on_token: Callable[[int], None] | None = None, on_finish: Callable[[str], None] | None = None,
               after: Request | None = None, logprobs: int | None = None, speculative: bool = True) -> Request:  # fmt: skip
        """Queue a request (token ids); the callbacks run in the engine thread. `stop_tokens`: the
        token ids that end it (None: the model's eos tokens). ValueError names a bad argument;
        QueueFull when `max_queue` requests wait already. `after`: queue it only once that request
        has its first token, i.e. its prompt's K/V are written (with `prefix_cache`, a copy of the
        same prompt then maps those pages instead of computing them: `n > 1` choices). `logprobs`:
        each token's `TokenLogprobs` with that many alternatives (0-20) in `Request.entries`, filled
        before its `on_token` call (steps read their logits back while such a request runs: one
        step per call, no decode blocks; on a speculating engine, plain steps, as a verify call
        keeps no per-token logits). `speculative=False` opts the request out of the engine's
        speculative decoding: it gets no proposals and decodes plainly (in the same calls)."""
        ids = [int(t) for t in prompt]
        vocab = self.model.config.vocab_size
        if not ids:
            raise ValueError("prompt: no token")
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"this model's context is {self.max_model_len} tokens; the prompt's {len(ids)} + "
                             f"max_tokens {max_tokens} = {len(ids) + max_tokens}")
        if not (np.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        if not (np.isfinite(top_p) and 0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
        if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= INT32_MAX):
            raise ValueError(f"top_k must be an integer >= 1, got {top_k!r}")
        if seed is not None and not (isinstance(seed, int) and 0 <= seed <= INT32_MAX):
            raise ValueError(f"seed must be an integer in [0, 2**31 - 1], got {seed!r}")
        if logprobs is not None:
            if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_LOGPROBS:
                raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {logprobs!r}")
        if not isinstance(speculative, (bool, np.bool_)):
            raise ValueError(f"speculative must be a bool (False: no proposals for this request), got {speculative!r}")
        stop = None if stop_tokens is None else frozenset(int(t) for t in stop_tokens)  # None: the model's eos tokens
        index = next(self._ids)
        seq = Seq(index, ids, max_new=max_tokens, stop=stop, sampling=(float(temperature), top_k or 0, float(top_p)),
                  key=seed if seed is not None else (INT32_MAX - index % INT32_MAX), speculate=bool(speculative))  # fmt: skip
        request = Request(seq, on_token, on_finish, time.perf_counter(), logprobs=logprobs)
        with self._cond:
            if self.error is not None:
                raise RuntimeError(f"the engine stopped: {self.error!r}")
            if self._stopping:
                raise RuntimeError("the engine is stopping")
            if len(self._waiting) + len(self._incoming) >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are waiting (max_queue)")
            self._requests[index] = request
            if after is not None and not after.done and after.last_token is None:
                after.followers.append(request)  # queued by `_on_token` at the leader's first token
            else:
                self._incoming.append(request)
            self._idle.clear()
            self._cond.notify()
        return request

    def cancel(self, request: Request) -> None:
        """End a request (its client is gone): released at its next step, `finish` "abort"."""
        with self._cond:
            if not request.done:
                self._cancels.append(request)
                self._cond.notify()

    def stream(self, prompt, **settings) -> TokenStream:
        """`submit` (now: a bad argument or a full queue raises here), as an async iterator of
        ("token", id) and finally ("finish", reason); `aclose()` (or leaving an `async with`)
        before the end cancels the request. Call it from a running event loop."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def post(item):
            if not loop.is_closed():  # a loop gone (its server stopped) has no one to tell
                loop.call_soon_threadsafe(queue.put_nowait, item)

        request = self.submit(prompt, on_token=lambda t: post(("token", t)), on_finish=lambda why: post(("finish", why)),
                              **settings)  # fmt: skip
        return TokenStream(self, request, queue)

    # ---- the engine thread ------------------------------------------------------------------
    def _on_token(self, index: int, token: int) -> None:
        request = self._requests[index]
        now = time.perf_counter()
        (self.m_ttft if request.last_token is None else self.m_itl).observe(now - (request.last_token or request.submitted))
        request.last_token = now
        self.m_tokens.inc()
        logits = request.seq.logits
        if request.logprobs is not None:
            request.entries.append(token_logprobs(logits[-1], token, request.logprobs) if logits else None)
        logits.clear()  # (every row's are read back while a logprobs request runs: keep none)
        if request.followers:  # its prompt is in the cache now: the requests that waited for it go in
            with self._cond:
                self._incoming.extend(request.followers)
            request.followers = []
        self._call(request.on_token, token)

    def _on_finish(self, seq: Seq) -> None:
        request = self._requests.pop(seq.index, None)
        self._sched.first_token.pop(seq.index, None)
        if request is None or request.done:
            return
        if request.followers:  # it ended before its first token (cancelled): they go in anyway
            with self._cond:
                self._incoming.extend(request.followers)
            request.followers = []
        request.finish = seq.finish
        self.m_requests.labels(seq.finish).inc()
        self._call(request.on_finish, seq.finish)

    @staticmethod
    def _call(callback, value) -> None:
        if callback is not None:
            try:
                callback(value)
            except Exception:  # noqa: BLE001 - one request's callback never stops the engine
                log.exception("a request's callback failed")

    def _abort(self, request: Request) -> None:
        """End a request that is not running (waiting, or never admitted)."""
        request.seq.finish = "abort"
        self._on_finish(request.seq)

    def _cancel_now(self, request: Request) -> None:
        row = self._row_of(request.seq)
        if request.seq in self._waiting:
            self._waiting.remove(request.seq)
            self._abort(request)
        elif row is not None:
            if self._sched._ahead is None:
                self._sched._end(row, "abort")  # its row and pages go now
            else:
                request.seq.cancelled = True  # ends when the step in flight is read back
        elif not request.done:
            self._abort(request)

    def _row_of(self, seq: Seq) -> int | None:
        for r, s in enumerate(self._sched.rows):
            if s is seq:
                return r
        return None

    def _loop(self) -> None:
        sched, waiting = self._sched, self._waiting
        try:
            while True:
                with self._cond:
                    while not (self._stopping or self._incoming or self._cancels or sched.busy(waiting)):
                        self._cond.wait()
                    incoming, self._incoming = self._incoming, []
                    cancels, self._cancels = self._cancels, []
                    stopping = self._stopping
                    # logits come back with the steps while a request wants logprobs (one step a call then)
                    sched.return_logits = any(r.logprobs is not None for r in self._requests.values())
                waiting.extend(r.seq for r in incoming if not r.done)  # (a follower may be cancelled already)
                for request in cancels:
                    self._cancel_now(request)
                if stopping:
                    for request in list(self._requests.values()):
                        self._cancel_now(request)
                    while sched._ahead is not None:  # read back the step in flight: it ends the cancelled rows
                        sched.step(waiting)
                    sched._flush()
                    return
                if sched.busy(waiting):
                    sched.step(waiting)
                if not sched.busy(waiting):
                    sched._flush()  # the finished sequences' pages go back now
                    with self._cond:
                        if not self._incoming:
                            self._idle.set()
        except BaseException as exc:  # noqa: BLE001 - reported to every request and to `error`
            log.exception("the engine loop failed")
            with self._cond:
                self.error = exc
                pending = list(self._requests.values()) + self._incoming
                self._incoming = []
            for request in pending:
                if not request.done:
                    self._abort(request)

    def start(self) -> Engine:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="arena-engine", daemon=True)
            self._thread.start()
        return self

    def warm_up(self) -> float:
        """Compile every program the loop runs (prefill chunks, one decode step, decode blocks,
        releases, greedy and sampled rows) with a few requests of its own; returns the seconds."""
        start = time.perf_counter()
        self._warm_host_tier()
        self.start()
        batch, chunk, block = self._sched.batch, self._sched.chunk, self._sched.block
        vocab = self.model.config.vocab_size
        length = min(chunk + 1, self.max_model_len - 1)  # two prefill chunks where the context allows
        new = max(1, min(2 * block + 2, self.max_model_len - length))
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, vocab, length).tolist() for _ in range(batch + 1)]
        rounds = [prompts]  # one more than the batch: decode steps while a request waits, then blocks
        if self.index is not None:  # the same prompts again, longer: prefix hits (a page mapped, a partial one copied)
            rounds.append([p[:-1] + [int(t) for t in rng.integers(0, vocab, 2)] for p in prompts])
        speculating = [True] * len(rounds)
        if self._sched.speculative is not None:  # verify calls above; then requests that opt out: plain steps
            rounds.append(prompts)
            speculating.append(False)
        for group, speculate in zip(rounds, speculating):
            done, left = threading.Event(), [len(group)]

            def finished(_, left=left, done=done):
                left[0] -= 1
                if left[0] == 0:
                    done.set()

            for i, prompt in enumerate(group):
                self.submit(prompt, max_tokens=new, temperature=0.7 * (i % 2), on_finish=finished, stop_tokens=(),
                            speculative=speculate)  # fmt: skip
            if not done.wait(timeout=3600) or not self._idle.wait(timeout=600) or self.error is not None:
                raise RuntimeError(f"warm-up failed: {self.error!r}")  # (idle: its last release compiled too)
        self._warm_programs = self._clock.programs
        return time.perf_counter() - start

    def _warm_host_tier(self) -> None:
        """Compile the host tier's page moves (swap out, or with a prefix cache its spills; swap in,
        host pages freed) with rows that move nothing: preemption and spills happen only under
        pressure, which a warm-up cannot count on.
        Before the loop's thread starts (it owns the cache afterwards)."""
        sched, tier = self._sched, self._sched.tier
        if tier is None or self._thread is not None:
            return
        batch, width = sched.batch, self.layout.max_pages_per_seq
        pads = lambda *shape: jnp.asarray(np.full(shape, aj.PAD_PAGE, np.int32))  # noqa: E731  (as the tier makes them)
        if self.index is None:  # swap preemption
            sched.cache, tier.host = swap_out_rows(sched.cache, tier.host, pads(batch), pads(batch, width))
        else:  # the index's spill tier: evicted pages copied to the host (with the frees and drops of a flush, or alone)
            rows = batch * width  # (`models.scheduler.prefix`: a flush's rows)
            sched.cache, tier.host = evict_to_host_rows(sched.cache, tier.host, *(pads(rows) for _ in range(4)))
            sched.cache, tier.host = offload_page_rows(sched.cache, tier.host, pads(rows), pads(rows))
        sched.cache, _ = tier.swap_in(sched.cache, [], batch)  # (with an index: a hit's host pages brought back)
        sched.cache, tier.host = drop_host_page_rows(sched.cache, tier.host, pads(batch * width))

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing runs or waits and every finished request's pages are released."""
        return self._idle.wait(timeout)

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop taking requests, abort the ones in flight, release their pages, end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._clock is not None:
            self._clock.__exit__(None, None, None)  # the compile listener goes (counts stay readable)
            self._clock_programs, self._clock = self._clock.programs, None

    @property
    def cache(self) -> aj.KVCache:
        """The arena (read it only once the engine is stopped: the thread donates it every step)."""
        return self._sched.cache
