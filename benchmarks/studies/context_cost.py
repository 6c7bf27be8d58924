"""Does attention cost follow the context, or the arena's capacity? (issue 17, item 1)

For each context c (tokens every row holds), the same work runs on two arenas that differ
only in capacity: `--capacity` tokens per row (8,192 by default: the arena a `generate` call
sizes for its longest prompt) and a tight one (c plus the steps timed, rounded up to a page).
Two workloads, each per backend (`--backends`, default "xla" = the blockwise jnp path and
"reference" = the dense jnp oracle, today's path before it):

- step:   `models.decode_step` of a mid-size random model (hidden 512, 8 layers, 8 query / 2
          KV heads, head_dim 64, vocab 32,000, float32; `--layers` etc. change it), batch 8:
          reserve + every layer's append / attend + greedy sampling, one jitted call, the
          cache donated. Each call appends one token, so context c grows by the calls made.
- attend: `aj.attend` alone (in a jit, as a model calls it): one decode query token per row
          over c keys, the same geometry, one layer.

Caches are filled without a model (reserve c tokens, append random K/V at every layer). The
two capacities alternate call by call in one process (big, tight, big, tight, ...: drift on a
shared machine hits both alike); each figure is the median over `--repeats` timed calls
after one untimed warm-up call (compile), `block_until_ready` before the clock is read. The
ratio column is the median of the per-pair ratios big / tight. "compile s" is the first
call's time minus the median (the capacity-8k arena's program).

Run: `python -m arena_jax.benchmarks.studies.context_cost [--contexts 128,512,2048,8176] [--json out.json]`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models import preset_table
from arena_jax.models import steps as model_steps

__all__ = ["Settings", "run", "main"]

PARTS = ("step", "attend")
_MID = preset_table.mid()


@dataclasses.dataclass(frozen=True)
class Settings:
    contexts: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8176)
    capacity: int = 8192
    batch: int = 8
    page_size: int = 16
    # The mid model's geometry (`models.LlamaConfig.mid()`, `arena-bench decode --model mid`).
    hidden: int = _MID["hidden_size"]
    intermediate: int = _MID["intermediate_size"]
    layers: int = _MID["num_layers"]
    q_heads: int = _MID["num_heads"]
    kv_heads: int = _MID["num_kv_heads"]
    vocab: int = _MID["vocab_size"]
    dtype: str = "float32"
    kv_dtype: str | None = None  # the arena's dtype (None: `dtype`, the model's)
    repeats: int = 7
    backends: tuple[str, ...] = ("xla", "reference")
    parts: tuple[str, ...] = PARTS
    seed: int = 0

    def config(self) -> models.LlamaConfig:
        return models.LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                                  num_layers=self.layers, num_heads=self.q_heads, num_kv_heads=self.kv_heads,
                                  max_position_embeddings=max(self.capacity, 16))  # fmt: skip


def _layout(s: Settings, cfg, capacity: int, layers: int) -> aj.KVLayout:
    pages = -(-capacity // s.page_size)
    return dataclasses.replace(cfg, num_layers=layers).kv_layout(
        page_size=s.page_size, num_pages=s.batch * pages, max_seqs=s.batch, max_seq_len=pages * s.page_size,
        dtype=s.kv_dtype or s.dtype)  # fmt: skip


def _filled_cache(s: Settings, layout: aj.KVLayout, context: int, rng) -> aj.KVCache:
    """Every row holds `context` tokens of random K/V at every layer (reserved and written)."""
    slots = jnp.arange(s.batch, dtype=jnp.int32)
    cache, ok = aj.reserve(aj.create(layout), slots, context)
    assert bool(np.all(jax.device_get(ok))), "the arena refused the context"
    shape = (s.batch, context, layout.num_kv_heads, layout.head_dim)
    for layer in range(layout.num_layers):
        written = layout.dtype if not layout.quantized else jnp.float32  # a quantized arena quantizes on write
        k, v = (jnp.asarray(rng.standard_normal(shape), written) for _ in range(2))
        cache = aj.append(cache, layer, slots, k, v)
    return cache


def _timed(fn):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - t0


class _Runner:
    """One workload on one arena: `call()` runs it once (advancing its own state)."""

    def __init__(self, s: Settings, part: str, backend: str, cache: aj.KVCache, model=None):
        self.slots = jnp.arange(s.batch, dtype=jnp.int32)
        if part == "step":
            graphdef, self.state = nnx.split(model)
            raw = model_steps.decode_step.__wrapped__  # a jit of our own per backend: the backend is fixed at trace
            self.fn = jax.jit(lambda *a: raw(graphdef, *a), donate_argnums=(1,))
            self.cache, self.tokens = cache, jnp.zeros((s.batch,), jnp.int32)
        else:
            self.fn = jax.jit(lambda q, c: aj.attend(q, c, 0, self.slots, backend=backend))
            self.cache = cache
            self.q = jnp.asarray(np.random.default_rng(1).standard_normal((s.batch, 1, s.q_heads, cache.layout.head_dim)),
                                 s.dtype)  # fmt: skip (the model's compute dtype)
        self.part, self.backend, self.traced = part, backend, False

    def call(self):
        if self.part == "attend":
            return self.fn(self.q, self.cache)
        args = (self.state, self.cache, self.tokens, self.slots)  # seq_ids, seed: defaults
        if self.traced:  # the backend is fixed in the trace: later calls time the step alone
            out = self.fn(*args)
        else:  # the first call traces: the backend is read from the environment then
            with mock.patch.dict(os.environ, {aj.BACKEND_ENV: self.backend}):
                out = self.fn(*args)
            self.traced = True
        self.cache, self.tokens = out.cache, out.tokens
        return out.tokens


def _measure(s: Settings, part: str, backend: str, context: int, model, rng) -> dict:
    layers = s.layers if part == "step" else 1
    cfg = s.config()
    tight = context + s.repeats + 2  # the steps' appended tokens fit
    runners = {name: _Runner(s, part, backend, _filled_cache(s, _layout(s, cfg, cap, layers), context, rng), model)
               for name, cap in (("big", s.capacity), ("tight", tight))}  # fmt: skip
    first = {name: _timed(r.call) for name, r in runners.items()}
    times = {name: [] for name in runners}
    for _ in range(s.repeats):
        for name, r in runners.items():  # alternated: big, tight, big, tight, ...
            times[name].append(_timed(r.call))
    big, tight_t = np.asarray(times["big"]), np.asarray(times["tight"])
    return {
        "part": part, "backend": backend, "context": context,
        "capacity": runners["big"].cache.layout.max_seq_len, "tight_capacity": runners["tight"].cache.layout.max_seq_len,
        "big_ms": float(np.median(big) * 1e3), "tight_ms": float(np.median(tight_t) * 1e3),
        "ratio": float(np.median(big / tight_t)), "compile_s": float(first["big"] - np.median(big)),
    }  # fmt: skip


def run(s: Settings, log=print) -> list[dict]:
    rng = np.random.default_rng(s.seed)
    model = models.init_random(s.config(), seed=s.seed, dtype=jnp.dtype(s.dtype)) if "step" in s.parts else None
    rows = []
    for part in s.parts:
        for context in s.contexts:
            if context + s.repeats + 2 > s.capacity:
                raise ValueError(f"context {context} + {s.repeats + 2} steps does not fit --capacity {s.capacity}")
            for backend in s.backends:
                row = _measure(s, part, backend, context, model, rng)
                rows.append(row)
                log(f"| {part} | {backend} | {context} | {row['big_ms']:.2f} | {row['tight_ms']:.2f} "
                    f"| {row['ratio']:.2f} | {row['compile_s']:.1f} |")  # fmt: skip
    return rows


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv=None) -> int:
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.context_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", type=_ints, default=d.contexts, help="comma-separated tokens per row")
    p.add_argument("--capacity", type=int, default=d.capacity, help="tokens per row of the big arena")
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--page-size", type=int, default=d.page_size)
    p.add_argument("--layers", type=int, default=d.layers)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--backends", type=lambda t: tuple(t.split(",")), default=d.backends)
    p.add_argument("--parts", type=lambda t: tuple(t.split(",")), default=d.parts, help="step,attend")
    p.add_argument("--kv-dtype", default=None, choices=aj.layout.ARENA_DTYPES, help="the arena's dtype (default: the model's, float32)")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    bad = [b for b in a.backends if b not in aj.BACKENDS] + [x for x in a.parts if x not in PARTS]
    if bad:
        p.error(f"unknown backend or part: {bad}")
    s = dataclasses.replace(d, contexts=a.contexts, capacity=a.capacity, batch=a.batch, page_size=a.page_size,
                            layers=a.layers, repeats=a.repeats, backends=a.backends, parts=a.parts,
                            kv_dtype=a.kv_dtype)  # fmt: skip
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, {os.cpu_count()} cores; "
          f"{json.dumps(dataclasses.asdict(s))}")  # fmt: skip
    print(f"| part | backend | context | capacity-{a.capacity} ms | tight ms | ratio (median of pairs) | compile s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    rows = run(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": dataclasses.asdict(s), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
