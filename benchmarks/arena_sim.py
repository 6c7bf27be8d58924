"""The arena's capacity simulation with the scheduler on the device: many steps per jitted call.

Same policy, same real cache operations as `capacity.simulate` with `allocators.ArenaBackend`
(the host-scheduled reference; a test checks both give identical figures), but the queue and
per-request state are arrays and `lax.while_loop` runs up to `chunk` steps per call, so the
host reads back once per chunk instead of once per step. Each step is `allocators.arena_step`:
`aj.release` of last step's finished/preempted sequences, then one `aj.reserve` for every
running sequence's next token and the admitted prompts.

Queue order (as the host deque): a request preempted at step t from grow row j gets key
-(t+1) * max_seqs + j (the latest preemptions first, each batch in running order); a new
request's key is its index (arrival order). Running order for growth: admission order.
Which slot a sequence gets may differ from the host scheduler; no reported figure depends on it.
"""
from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import arena_jax as aj
from arena_jax.benchmarks.allocators import _newest_refused, arena_step

__all__ = ["SimState", "run_arena_on_device"]

_BIG = np.iinfo(np.int32).max
_QUEUED, _RUNNING, _DONE = 0, 1, 2


@struct.dataclass
class SimState:
    t: jax.Array  # i32[] current step
    status: jax.Array  # i32[N] 0 queued (or not yet arrived), 1 running, 2 done
    gen: jax.Array  # i32[N] tokens generated so far
    qkey: jax.Array  # i32[N] queue order (smaller first)
    admit_seq: jax.Array  # i32[N] admission order of running sequences
    first_admit: jax.Array  # i32[N] step of first admission, -1 before
    preemptions: jax.Array  # i32[N]
    stalls: jax.Array  # i32[] sequence-steps refused growth without being preempted
    admissions: jax.Array  # i32[] admissions so far
    owner: jax.Array  # i32[S] request in each slot, -1 free
    pending: jax.Array  # i32[S] slots to release at the next step (PAD_SLOT padded)
    errors: jax.Array  # i32[] steps where the scheduler and the allocator disagreed (must stay 0)

    @classmethod
    def start(cls, n: int, max_seqs: int) -> "SimState":
        z = jnp.zeros((n,), jnp.int32)
        return cls(
            t=jnp.zeros((), jnp.int32),
            status=z,
            gen=z,
            qkey=jnp.arange(n, dtype=jnp.int32),
            admit_seq=z,
            first_admit=jnp.full((n,), -1, jnp.int32),
            preemptions=z,
            stalls=jnp.zeros((), jnp.int32),
            admissions=jnp.zeros((), jnp.int32),
            owner=jnp.full((max_seqs,), -1, jnp.int32),
            pending=jnp.full((max_seqs,), aj.PAD_SLOT, jnp.int32),
            errors=jnp.zeros((), jnp.int32),
        )


def _step(cache, st: SimState, arrival, prompt, output, watermark, max_admit: int):
    """One scheduler step; returns (cache, state, (running, tokens_held, pages_in_use, queued))."""
    n, s = st.status.shape[0], st.owner.shape[0]
    t = st.t
    occupied = st.owner >= 0
    own = jnp.maximum(st.owner, 0)
    # Running sequences in admission order: the grow rows.
    gkey = jnp.where(occupied, st.admit_seq[own], _BIG)
    order = jnp.argsort(gkey).astype(jnp.int32)
    g_valid = gkey[order] < _BIG
    grow_slots = jnp.where(g_valid, order, aj.PAD_SLOT)
    g_req = jnp.where(g_valid, st.owner[order], n)
    g_safe = jnp.minimum(g_req, n - 1)
    finishing = g_valid & (st.gen[g_safe] + 1 == output[g_safe])
    # The queue head: arrived, queued requests with the smallest keys, each given a free slot.
    waiting = (st.status == _QUEUED) & (arrival <= t)
    n_cand = jnp.minimum(jnp.minimum(jnp.sum(waiting), jnp.sum(~occupied)), max_admit)
    _, cand = jax.lax.top_k(jnp.where(waiting, -st.qkey, -_BIG), max_admit)
    cand = cand.astype(jnp.int32)
    c_valid = jnp.arange(max_admit) < n_cand
    slot_ids = jnp.arange(s, dtype=jnp.int32)
    free_first = jnp.argsort(jnp.where(occupied, s + slot_ids, slot_ids))[:max_admit].astype(jnp.int32)
    admit_slots = jnp.where(c_valid, free_first, aj.PAD_SLOT)
    admit_tokens = jnp.where(c_valid, prompt[cand] + st.gen[cand], 0)

    cache, ok_grow, ok_admit, tokens_held, pages, leaving = arena_step(
        cache, st.pending, grow_slots, finishing, admit_slots, admit_tokens, watermark
    )

    fin = ok_grow & finishing
    pre = _newest_refused(g_valid, ok_grow)  # preempted; other refused rows stall
    stalls = st.stalls + jnp.sum(g_valid & ~ok_grow & ~pre)
    gen = st.gen.at[jnp.where(ok_grow, g_req, n)].add(1, mode="drop")
    status = st.status.at[jnp.where(fin, g_req, n)].set(_DONE, mode="drop")
    status = status.at[jnp.where(pre, g_req, n)].set(_QUEUED, mode="drop")
    qkey = st.qkey.at[jnp.where(pre, g_req, n)].set(-(t + 1) * s + slot_ids, mode="drop")  # slot_ids = grow row j
    preemptions = st.preemptions.at[jnp.where(pre, g_req, n)].add(1, mode="drop")
    owner = st.owner.at[jnp.where(fin | pre, grow_slots, s)].set(-1, mode="drop")
    # Admissions are a prefix of the candidates (first come, first served).
    not_prefix = ok_admit & (jnp.cumsum(~ok_admit) > 0)
    a_req = jnp.where(ok_admit, cand, n)
    status = status.at[a_req].set(_RUNNING, mode="drop")
    admit_seq = st.admit_seq.at[a_req].set(st.admissions + jnp.arange(max_admit, dtype=jnp.int32), mode="drop")
    first = st.first_admit[cand]
    first_admit = st.first_admit.at[a_req].set(jnp.where(first < 0, t, first), mode="drop")
    owner = owner.at[jnp.where(ok_admit, admit_slots, s)].set(cand, mode="drop")
    running = status == _RUNNING
    queued = jnp.sum((status == _QUEUED) & (arrival <= t))
    held = jnp.sum(jnp.where(running, prompt + gen, 0))
    errors = st.errors + (held != tokens_held) + jnp.any(not_prefix)
    st = st.replace(
        t=t + 1,
        status=status,
        gen=gen,
        qkey=qkey,
        admit_seq=admit_seq,
        first_admit=first_admit,
        preemptions=preemptions,
        stalls=stalls,
        admissions=st.admissions + jnp.sum(ok_admit),
        owner=owner,
        pending=leaving,
        errors=errors,
    )
    figures = (jnp.sum(running), tokens_held, pages, queued)
    return cache, st, tuple(x.astype(jnp.int32) for x in figures)


@functools.partial(jax.jit, static_argnames=("chunk", "max_admit"), donate_argnames=("cache",))
def _run_chunk(cache, st: SimState, arrival, prompt, output, watermark, *, chunk: int, max_admit: int):
    """Up to `chunk` steps (idle gaps skipped). Per executed step: t, running, tokens held, pages, queued."""
    bufs = jnp.zeros((5, chunk), jnp.int32)

    def cond(c):
        _, st, k, _ = c
        return (k < chunk) & jnp.any(st.status != _DONE)

    def body(c):
        cache, st, k, bufs = c
        idle = ~jnp.any(st.status == _RUNNING) & ~jnp.any((st.status == _QUEUED) & (arrival <= st.t))

        def skip(args):  # nothing runs or waits: jump to the next arrival (not a step)
            cache, st, k, bufs = args
            nxt = jnp.min(jnp.where(st.status == _QUEUED, arrival, _BIG))
            return cache, st.replace(t=nxt), k, bufs

        def step(args):
            cache, st, k, bufs = args
            t = st.t
            cache, st, figures = _step(cache, st, arrival, prompt, output, watermark, max_admit)
            bufs = bufs.at[:, k].set(jnp.stack([t, *figures]))
            return cache, st, k + 1, bufs

        return jax.lax.cond(idle, skip, step, (cache, st, k, bufs))

    cache, st, k, bufs = jax.lax.while_loop(cond, body, (cache, st, jnp.zeros((), jnp.int32), bufs))
    return cache, st, k, bufs


@functools.partial(jax.jit, donate_argnames=("cache",))
def _release(cache, slots):
    return aj.release(cache, slots)


def run_arena_on_device(cache, workload, settings, *, chunk: int = 256, advance=None, check=None, steps_limit: int):
    """Serve the workload; returns (cache, raw) with per-step series and per-request outcomes."""
    reqs = workload.requests
    n = len(reqs)
    padded = -(-n // 64) * 64  # shapes in buckets of 64 requests: fewer compilations
    arrival = np.full(padded, _BIG, np.int32)
    prompt, output = np.ones(padded, np.int32), np.ones(padded, np.int32)
    arrival[:n] = [r.arrival for r in reqs]
    prompt[:n] = [r.prompt_len for r in reqs]
    output[:n] = [r.output_len for r in reqs]
    st = SimState.start(padded, settings.max_seqs)
    st = st.replace(status=st.status.at[n:].set(_DONE))  # padding: never arrives, already done
    watermark = jnp.asarray(settings.watermark_pages, jnp.int32)
    parts, done = [], 0
    start = time.perf_counter()
    while True:
        cache, st, k, bufs = _run_chunk(cache, st, arrival, prompt, output, watermark, chunk=chunk, max_admit=settings.max_admit)
        k, bufs, status, errors, t = jax.device_get((k, bufs, st.status, st.errors, st.t))
        parts.append(bufs[:, :k])
        if errors:
            raise AssertionError(f"arena simulation: scheduler and allocator disagreed on {errors} step(s)")
        now_done = int(np.sum(status[:n] == _DONE))
        if advance is not None and now_done > done:
            advance(now_done - done)
        done = now_done
        if check is not None and k:
            last = parts[-1][:, -1]
            check(cache, np.asarray(st.pending), int(last[1]), int(last[2]), int(last[3]))
        if done == len(reqs):
            break
        if t > steps_limit:
            raise RuntimeError(f"arena: no progress after {t} steps (livelock?)")
    cache = _release(cache, st.pending)
    wall = time.perf_counter() - start
    series = np.concatenate(parts, axis=1)
    host = jax.device_get(st)
    return cache, {
        "t": series[0],
        "running": series[1],
        "tokens": series[2],
        "pages": series[3],
        "queued": series[4],
        "total_steps": int(host.t),
        "first_admit": np.asarray(host.first_admit)[:n],
        "preemptions": int(np.sum(host.preemptions[:n])),
        "stalls": int(host.stalls),
        "wall_s": wall,
    }
