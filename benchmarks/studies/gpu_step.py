"""The whole decode step on one GPU: layer weights read in place or copied (issue 39, item 1).

    python -m arena_jax.benchmarks.studies.gpu_step [--model llama3-8b] [--cases 8:512,32:512,1:512] [--json out.json]

A random-weight model (`--model`, a preset of `arena-bench`, bf16 by default), every row holding
`context` tokens (random K/V written at every layer), one greedy decode step per call, the cache
donated. Variants, alternated call by call in one process:

- arena:          `models.decode_step` (reserve + every layer's append / attend + greedy) jitted
                  with `STEP_COMPILER_OPTIONS`, as the bound steps of `generate`, the scheduler and
                  the server compile it: on a GPU the layer scan's matmuls go to cuBLAS, which
                  reads each layer's slice of the stacked weights in place;
- arena-triton:   the same step with XLA's default options (Triton GEMMs: each layer's weights
                  are copied out of the stack every step, `studies.sm90_steps`);
- arena-cublas-only: the step as session 19 left it: Triton GEMMs off but XLA's dot merger on
                  (at batch 32 it concatenates each layer's q / k / v weights every step) and
                  one-row dots left to XLA (`layers.one_row_safe_einsum` traced as a plain einsum:
                  at batch 1 a transposed copy of the k / v weights and a float32 copy of the LM
                  head every step);
- dense, dense-triton: the dense baseline's step (`dense_baseline.dense_decode`, heads-major
                  cache of the same capacity), with and without the options;
- arena-unrolled: `scan_layers=False` (a Python loop over per-layer weights: nothing to slice),
                  XLA's default options; only at the batches of `--unrolled-batches`;
- arena-1split:   the arena step with the decode attention kernel's split-K off (`BlockSizes.
                  num_splits` = 1: one program per (row, KV head) reads the whole context, no
                  log-sum-exp merge), where the default splits until the device holds two waves of
                  programs (up to 64, from the page table's capacity, `--capacity`);
- arena-xla-reserve: the arena step with `allocator.RESERVE_KERNEL` off: `reserve` as XLA's ops
                  (a conditional between its branches), where "arena" runs its table work as one
                  Pallas kernel every step (the default since session 62; issue 39, item 4);
- arena-noplan:   the arena step without the step's plan (`aj.plan_step` traced as returning
                  None): every layer's append and attend classify their rows again, as before
                  the plan (issue 39, item 2; `sm90_steps` counts the kernels either way).

"must read" is what one step has to read at least: every weight but the embedding table (a
step gathers B of its rows), plus the K/V of `context` tokens per row at every layer. GB/s is
that over the median step time, and "% copy" its share of the device's copy bandwidth
(`copy_bandwidth`, wall clock, measured in the same run). Figures are medians of `--repeats` calls after
one untimed call, whose extra time is "compile s".
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.benchmarks.presets import PRESETS
from arena_jax.benchmarks.studies.context_cost import _timed
from arena_jax.benchmarks.studies.dense_ratio import DenseRunner
from arena_jax.models import layers, llama
from arena_jax.models import steps as model_steps

__all__ = ["VARIANTS", "run", "main"]

VARIANTS = ("arena", "arena-triton", "arena-cublas-only", "dense", "dense-triton", "arena-unrolled", "arena-1split",
            "arena-noplan", "arena-xla-reserve")


def copy_bandwidth(nbytes: int | None = None, repeats: int = 10) -> float:
    """Bytes/s of one elementwise read + write over `nbytes` (8 GiB on an accelerator, where a
    wall-clock figure needs a long kernel; 256 MiB on a CPU), in place (the buffer donated: no
    allocation timed), median of `repeats` calls."""
    nbytes = nbytes or (2**28 if jax.default_backend() == "cpu" else 8 * 2**30)
    state = {"x": jnp.zeros((nbytes // 4,), jnp.uint32)}
    f = jax.jit(lambda x: x + 1, donate_argnums=0)

    def call():
        state["x"] = f(state["x"])
        return state["x"]

    _timed(call)
    return 2 * nbytes / float(np.median([_timed(call) for _ in range(repeats)]))


def device_kernels(trace_dir: str, steps: int, top: int = 20) -> tuple[float, list[tuple[str, int, float]]]:
    """From a `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` of `steps` calls: the
    device's busy microseconds per call, and its `top` kernels by time as (name, launches per
    call, microseconds per call). Empty where the trace has no device rows (a CPU run)."""
    import collections
    import glob
    import gzip

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        return 0.0, []
    with gzip.open(paths[-1]) as f:
        events = json.load(f)["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if name.startswith("/device:")}
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            total[e["name"]] += float(e.get("dur", 0.0))
            count[e["name"]] += 1
    busy = sum(total.values()) / steps
    return busy, [(n, count[n] // steps, t / steps) for n, t in total.most_common(top)]


def _options(variant: str):
    if variant == "arena-cublas-only":
        return {"xla_gpu_enable_triton_gemm": False}
    return None if variant.endswith(("-triton", "-unrolled")) else dict(model_steps.STEP_COMPILER_OPTIONS)


@contextlib.contextmanager
def _one_row_dots_plain():
    """Trace with `one_row_safe_einsum` as a plain einsum (the models' code before it)."""

    def plain(spec, x, w, **kwargs):
        return jnp.einsum(spec, x, w, **kwargs)

    with mock.patch.object(layers, "one_row_safe_einsum", plain), mock.patch.object(llama, "one_row_safe_einsum", plain):
        yield


@contextlib.contextmanager
def _one_split():
    """Trace with the attention kernels' default `num_splits` set to 1."""
    from pallas_kernels._common import BlockSizes

    default = BlockSizes.for_attention

    def one(*args, **kwargs):
        return dataclasses.replace(default(*args, **kwargs), num_splits=1)

    with mock.patch.object(BlockSizes, "for_attention", one):
        yield


@contextlib.contextmanager
def _no_plan():
    """Trace with `aj.plan_step` returning None: the layers classify their rows per call."""
    with mock.patch.object(aj, "plan_step", lambda *args, **kwargs: None):
        yield


@contextlib.contextmanager
def _xla_reserve():
    """Trace with `allocator.RESERVE_KERNEL` off: `reserve` as XLA's ops."""
    from arena_jax import allocator

    with mock.patch.object(allocator, "RESERVE_KERNEL", False):
        yield


_TRACE_CONTEXTS = {"arena-cublas-only": _one_row_dots_plain, "arena-1split": _one_split,
                   "arena-noplan": _no_plan, "arena-xla-reserve": _xla_reserve}  # how a variant traces  # fmt: skip


def filled_arena(layout: aj.KVLayout, batch: int, context: int, seed: int) -> aj.KVCache:
    """Every row holds `context` tokens of random K/V (drawn on the device) at every layer."""
    slots = jnp.arange(batch, dtype=jnp.int32)
    cache, ok = aj.reserve(aj.create(layout), slots, context)
    if not bool(np.all(jax.device_get(ok))):
        raise ValueError(f"the arena refused {context} tokens for {batch} rows")
    shape = (batch, context, layout.num_kv_heads, layout.head_dim)
    for layer in range(layout.num_layers):
        k, v = jax.random.normal(jax.random.key(seed + layer), (2, *shape), jnp.float32).astype(layout.dtype)
        cache = aj.append(cache, layer, slots, k, v)
    return cache


class _Arena:
    def __init__(self, model, cache: aj.KVCache, batch: int, options, trace_context=contextlib.nullcontext):
        graphdef, self.state = nnx.split(model)
        raw = model_steps.decode_step.__wrapped__
        self.fn = jax.jit(lambda state, cache, tokens, slots: raw(graphdef, state, cache, tokens, slots, slots, 0),
                          donate_argnums=(1,), compiler_options=options)  # fmt: skip
        self.cache, self.slots = cache, jnp.arange(batch, dtype=jnp.int32)
        self.tokens = jnp.zeros((batch,), jnp.int32)
        self.trace_context = trace_context

    def call(self):
        with self.trace_context():  # (the first call traces)
            out = self.fn(self.state, self.cache, self.tokens, self.slots)
        self.cache, self.tokens = out.cache, out.tokens
        return out.tokens


def must_read_bytes(model, layout: aj.KVLayout, batch: int, context: int) -> int:
    """Bytes one decode step reads at least: every weight but the embedding table, its B rows,
    and `context` tokens of K/V per row at every layer."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        nbytes = leaf.size * leaf.dtype.itemsize
        if "embed" in jax.tree_util.keystr(path) and not model.config.tie_word_embeddings:
            nbytes = batch * leaf.shape[-1] * leaf.dtype.itemsize
        total += nbytes
    return total + batch * context * layout.bytes_per_token


def measure(models_by_kind: dict, batch: int, context: int, variants, repeats: int, page_size: int, seed: int,
            profile: str | None = None, log=print, capacity: int | None = None) -> list[dict]:
    model = models_by_kind["scan"]
    # Tokens a row's page table holds (and the dense cache's length): every step's token fits
    # (5 more to profile); `capacity`, where larger, as a server's table would be.
    capacity = -(-max(context + repeats + 8, capacity or 0) // page_size) * page_size
    layout = model.config.kv_layout(page_size=page_size, num_pages=batch * capacity // page_size, max_seqs=batch,
                                    max_seq_len=capacity, dtype=model.dtype)  # fmt: skip
    filled = filled_arena(layout, batch, context, seed)
    runners = {}
    for v in variants:
        if v.startswith("arena"):
            runners[v] = _Arena(models_by_kind["unrolled" if v == "arena-unrolled" else "scan"],
                                jax.tree.map(jnp.copy, filled), batch, _options(v),
                                _TRACE_CONTEXTS.get(v, contextlib.nullcontext))  # fmt: skip
        else:
            runners[v] = DenseRunner(model, batch, context, capacity, _options(v))
    del filled
    first = {v: _timed(r.call) for v, r in runners.items()}
    times = {v: [] for v in runners}
    for _ in range(repeats):
        for v, r in runners.items():  # alternated
            times[v].append(_timed(r.call))
    must = must_read_bytes(model, layout, batch, context)
    busy = {}
    for v, r in runners.items() if profile else ():
        trace_dir = os.path.join(profile, f"{v}-b{batch}-c{context}")
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(5):
                jax.block_until_ready(r.call())
        busy[v], top = device_kernels(trace_dir, 5)
        log(f"# {v}, batch {batch}: device busy {busy[v]:,.0f} us a step; top kernels (launches, us a step):")
        for name, n, us in top:
            log(f"#   {us:9.1f} us  x{n:<3} {name[:110]}")
    rows = []
    for v in runners:
        ms = float(np.median(times[v]) * 1e3)
        rows.append(dict(variant=v, batch=batch, context=context, step_ms=ms, compile_s=first[v] - ms / 1e3,
                         must_read_bytes=must, gbps=must / ms / 1e6, tokens_per_s=batch / ms * 1e3,
                         device_busy_us=busy.get(v)))  # fmt: skip
    return rows


@dataclasses.dataclass(frozen=True)
class Settings:
    model: str = "llama3-8b"
    layers: int | None = None
    dtype: str = "bfloat16"
    cases: tuple[tuple[int, int], ...] = ((8, 512), (32, 512), (1, 512))
    # (gpu_check.sh's `plan` and `reserve` steps run the last two variants)
    variants: tuple[str, ...] = tuple(v for v in VARIANTS if v not in ("arena-noplan", "arena-xla-reserve"))
    unrolled_batches: tuple[int, ...] = (1,)
    repeats: int = 20
    page_size: int = 16
    seed: int = 0
    profile: str | None = None  # a folder: trace 5 more calls of each variant, print the device's top kernels
    capacity: int | None = None  # tokens per row of the page table (and the dense cache), if more than a run needs


def run(s: Settings, log=print) -> dict:
    config = PRESETS[s.model]()
    if s.layers:
        config = dataclasses.replace(config, num_layers=s.layers)
    dtype = jnp.dtype(s.dtype)
    copy_bw = copy_bandwidth()
    log(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}; {s.model}, "
        f"{config.num_layers} layers, {s.dtype}; attention backend {aj.default_backend()}; "
        f"copy bandwidth {copy_bw / 1e9:,.0f} GB/s (read + write)")  # fmt: skip
    models_by_kind = {"scan": models.init_random(config, seed=s.seed, dtype=dtype)}
    if "arena-unrolled" in s.variants and any(b in s.unrolled_batches for b, _ in s.cases):
        models_by_kind["unrolled"] = models.init_random(config, seed=s.seed, dtype=dtype, scan_layers=False)
    log("| batch | context | variant | step ms | tokens/s | compile s | must read GB | GB/s | % copy | vs arena |")
    log("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for batch, context in s.cases:
        variants = [v for v in s.variants if v != "arena-unrolled" or batch in s.unrolled_batches]
        case = measure(models_by_kind, batch, context, variants, s.repeats, s.page_size, s.seed, s.profile, log, s.capacity)
        arena_ms = next((r["step_ms"] for r in case if r["variant"] == "arena"), None)
        for r in case:
            r["copy_fraction"] = r["gbps"] * 1e9 / copy_bw
            r["vs_arena"] = r["step_ms"] / arena_ms if arena_ms else None
            vs = f"{r['vs_arena']:.2f}x" if r["vs_arena"] else ""
            log(f"| {batch} | {context} | {r['variant']} | {r['step_ms']:.3f} | {r['tokens_per_s']:,.0f} "
                f"| {r['compile_s']:.1f} | {r['must_read_bytes'] / 1e9:.2f} | {r['gbps']:,.0f} "
                f"| {100 * r['copy_fraction']:.0f}% | {vs} |")  # fmt: skip
        rows += case
    return dict(settings=dataclasses.asdict(s), copy_bandwidth_gbps=copy_bw / 1e9, device=jax.devices()[0].device_kind,
                jax=jax.__version__, rows=rows)  # fmt: skip


def _cases(text: str) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(x) for x in item.split(":")) for item in text.split(",") if item)


def main(argv=None) -> int:
    d = Settings()
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.gpu_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=d.model, choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    p.add_argument("--dtype", default=d.dtype, choices=("bfloat16", "float32"))
    p.add_argument("--cases", type=_cases, default=d.cases, help="comma-separated batch:context")
    p.add_argument("--variants", type=lambda t: tuple(t.split(",")), default=d.variants)
    p.add_argument("--unrolled-batches", type=lambda t: tuple(int(x) for x in t.split(",") if x), default=d.unrolled_batches)
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--profile", default=None, help="a folder: trace 5 calls of each variant, print the top device kernels")
    p.add_argument("--capacity", type=int, default=None, help="tokens per row of the page table and the dense cache "
                   "(default: what the run needs; the attention's default split count follows it)")
    p.add_argument("--json", default=None, help="write the rows here")
    a = p.parse_args(argv)
    bad = [v for v in a.variants if v not in VARIANTS]
    if bad or "arena" not in a.variants:
        p.error(f"--variants: unknown {bad} or no 'arena' (the ratios' base); choose from {VARIANTS}")
    s = dataclasses.replace(d, model=a.model, layers=a.layers, dtype=a.dtype, cases=a.cases, variants=a.variants,
                            unrolled_batches=a.unrolled_batches, repeats=a.repeats, profile=a.profile,
                            capacity=a.capacity)  # fmt: skip
    result = run(s)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
