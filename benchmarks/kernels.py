"""Kernel benchmark: paged decode attention and paged append, against peers, on one device.

GPU: for each (batch, context) that fits in memory, decode attention (one query token per
row, every row holding `context` tokens, scrambled page tables) is timed for
- ours: `pallas_kernels.paged_attention` (including its split-K merge),
- jax_pallas: JAX's own `jax.experimental.pallas.ops.gpu.paged_attention` (Triton, decode
  only; its constraints are met by adapting its parameters: block_h=16 pads the GQA group,
  k_splits and pages_per_compute_block are divisors of the pages per sequence; it has no
  sm_scale, so it gets q pre-scaled),
- reference: the jnp gather reference `paged_attention_reference`,
- dense: `jax.nn.dot_product_attention` over a contiguous cache (cuDNN where it runs, else XLA),
and reported as time, GB/s of KV read, % of the device's copy bandwidth measured in the same
run, and each peer's time / our time (> 1: ours is faster). Append is timed separately per
batch (bytes written / time).

Timing: CUPTI kernel timings (`jax.experimental.mosaic.gpu.profiler.measure`: device-side,
summed over every kernel of the call) when available, else wall clock around
`block_until_ready`. Each timed call runs the op once on each of `n` input copies whose
total exceeds the L2 cache (rotation, so reads come from HBM); time per op = median over
`repeats` calls / n. Compilation happens in a warm-up call first.

CPU: kernel timings need a GPU. Only the jnp reference path is timed, at tiny sizes, so that
`arena-bench kernels` has something to show.

8-bit arenas (`dtype` int8 / float8_e4m3fn / float8_e5m2): values quantized per token and KV
head with float32 scales (`pallas_kernels.quant`); queries and new K/V in bfloat16; KV bytes
read count the scales (head_dim + 4 bytes per token row); JAX's Pallas peer gets the same
pages and scales (its `k_scales_pages` / `v_scales_pages`); the dense peer runs in bfloat16.

Run: `python -m arena_jax.benchmarks.kernels --help`.
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels import paged_append, paged_attention, paged_attention_reference
from pallas_kernels.quant import is_quantized, quantize_rows

__all__ = ["run_kernel_benchmark", "main"]

L2_BYTES = 50 * 2**20  # H100/H200 L2 is 50 MiB; rotation makes the inputs exceed 2x this
MAX_COPIES = 32
CPU_MAX_BATCH, CPU_MAX_CONTEXT = 4, 512
CPU_NOTE = "kernel timings need a GPU: on CPU only the jnp reference path is timed, at tiny sizes"


# ---- timing ------------------------------------------------------------------------------------


def _cupti_measure():
    """JAX's CUPTI profiler, or None with the reason it is unavailable."""
    try:
        from jax.experimental.mosaic.gpu import profiler
    except ImportError as e:
        return None, f"no Mosaic GPU profiler ({e})"
    try:  # probe on a trivial op; the kernels under test are never inside this try
        _, t = profiler.measure(lambda x: x + 1)(jnp.ones(1024, jnp.float32))
    except RuntimeError as e:  # "CUPTI profiling is not supported on this platform"
        return None, f"CUPTI unavailable ({e})"
    if t is None:
        return None, "CUPTI recorded no kernels"
    return profiler.measure, None


class Timer:
    """Seconds per call of a jitted function: CUPTI device time if available, else wall clock."""

    def __init__(self, repeats: int, use_cupti: bool):
        self.repeats = max(1, repeats)
        self.measure, self.cupti_reason = _cupti_measure() if use_cupti else (None, "not a GPU")
        self.mode = "cupti (device kernel time)" if self.measure else "wall clock (block_until_ready)"

    def __call__(self, fn, *args) -> float:
        if self.measure is not None:
            _, ms = self.measure(fn, iterations=self.repeats)(*args)  # warm-up inside
            ms = ms if isinstance(ms, list) else [ms]
            return float(np.median(ms)) / 1e3
        jax.block_until_ready(fn(*args))  # warm-up (compiles)
        times = []
        for _ in range(self.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
        return float(np.median(times))


def _memory_limit() -> int | None:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except (AttributeError, NotImplementedError, RuntimeError):  # backends without memory stats
        stats = {}
    return int(stats["bytes_limit"]) if stats.get("bytes_limit") else None


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "seed"))
def _fill(shape, dtype, seed):
    """Deterministic pseudo-random values in [-1, 1], one fused kernel (no RNG temporaries)."""
    idx = sum(lax.broadcasted_iota(jnp.float32, shape, d) * p for d, p in enumerate((7.1, 3.3, 1.7, 0.9, 0.37)[: len(shape)]))
    return jnp.sin(idx * 0.731 + seed).astype(dtype)


@functools.partial(jax.jit, static_argnames=("shape", "dtype", "seed"))
def _fill_arena(shape, dtype, seed):
    """(values, scales): `_fill` stored in an arena of `dtype`; scales (float32, shape[:-1]) only
    for 8-bit arenas, else None."""
    if not is_quantized(dtype):
        return _fill(shape, dtype, seed), None
    return quantize_rows(_fill(shape, jnp.float32, seed), dtype)


def _compute_dtype(dtype):
    """q and new K/V: the arena's dtype, or bfloat16 over an 8-bit arena."""
    return jnp.dtype(jnp.bfloat16) if is_quantized(dtype) else jnp.dtype(dtype)


def _row_bytes(head_dim, dtype) -> int:
    """Bytes of one token of one head in the arena: values, plus an 8-bit arena's float32 scale."""
    return head_dim * jnp.dtype(dtype).itemsize + (4 if is_quantized(dtype) else 0)


def copy_bandwidth(timer: Timer, nbytes: int = 2 * 2**30) -> float:
    """Device copy bandwidth in bytes/s: one elementwise read+write kernel over `nbytes`."""
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    t = timer(jax.jit(lambda x: x + 1), x)
    return 2 * nbytes / t


# ---- one (batch, context) point ----------------------------------------------------------------


def _peer_jax_pallas():
    try:
        from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged
    except ImportError as e:
        return None, f"not importable ({e})"
    return jax_paged.paged_attention, None


def _bench_point(timer, batch, context, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype, copy_bw, budget):
    row_bytes = _row_bytes(head_dim, dtype)
    compute = _compute_dtype(dtype)
    itemsize = compute.itemsize
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    copy_bytes = 2 * num_pages * page_size * num_kv_heads * row_bytes  # K and V (and scales) of one copy
    kv_read = 2 * batch * context * num_kv_heads * row_bytes
    row = dict(batch=batch, context=context, kv_bytes=kv_read)
    n = max(2, min(MAX_COPIES, math.ceil(2 * L2_BYTES / copy_bytes)))
    if budget is not None:
        n = min(n, int(budget // (3 * copy_bytes)))  # ours + one peer's copies + headroom
        if n < 1:
            row["skipped"] = f"needs {3 * copy_bytes / 1e9:.1f} GB, budget {budget / 1e9:.1f} GB"
            return row
    row["copies"] = n

    keys = jax.random.split(jax.random.PRNGKey(batch * 100003 + context), 2)
    page_map = jax.random.permutation(keys[0], num_pages).astype(jnp.int32).reshape(batch, pages_per_seq)
    lengths = jnp.full((batch,), context, jnp.int32)
    ones = jnp.ones((batch,), jnp.int32)
    q = jax.random.normal(keys[1], (batch, 1, num_q_heads, head_dim), compute)
    shape = (n, num_kv_heads, num_pages, page_size, head_dim)
    (k_arena, k_scale), (v_arena, v_scale) = _fill_arena(shape, dtype, 0.0), _fill_arena(shape, dtype, 1.0)
    scales = dict(k_scale=k_scale, v_scale=v_scale) if k_scale is not None else {}

    def record(name, seconds):
        row[f"{name}_ms"] = seconds * 1e3
        row[f"{name}_gbps"] = kv_read / seconds / 1e9
        if name != "ours":
            row[f"{name}_ratio"] = seconds / (row["ours_ms"] / 1e3)

    # ours: the layer axis holds the copies, so rotation costs no extra arrays.
    ours = jax.jit(lambda q, k, v, pm, l, t, sc: [paged_attention(q, k, v, i, pm, l, t, interpret=False, **sc)
                                                  for i in range(n)])
    t = timer(ours, q, k_arena, v_arena, page_map, lengths, ones, scales) / n
    record("ours", t)
    row["ours_pct_copy_bw"] = 100 * row["ours_gbps"] * 1e9 / copy_bw
    out0 = ours(q, k_arena, v_arena, page_map, lengths, ones, scales)[0][:, 0].astype(jnp.float32)  # [B, Hq, D]

    # reference: gathers every row's pages (with float32 copies) before a dense softmax.
    ref_temp = 2 * batch * context * num_kv_heads * head_dim * (jnp.dtype(dtype).itemsize + 4)
    if budget is not None and ref_temp + 3 * copy_bytes * n > budget * 1.5:
        row["reference_skipped"] = f"gather temporaries ~{ref_temp / 1e9:.1f} GB exceed the memory budget"
    else:
        ref = jax.jit(lambda q, k, v, pm, l, t, sc: [paged_attention_reference(q, k, v, i, pm, l, t, **sc)
                                                     for i in range(n)])
        record("reference", timer(ref, q, k_arena, v_arena, page_map, lengths, ones, scales) / n)
        got = ref(q, k_arena, v_arena, page_map, lengths, ones, scales)[0][:, 0]
        row["reference_max_abs_diff"] = float(jnp.max(jnp.abs(got - out0)))

    # JAX's Pallas paged attention: per-layer [kv_heads, pages, page_size, head_dim] arrays.
    jax_paged, why = _peer_jax_pallas()
    if jax_paged is None:
        row["jax_pallas_skipped"] = why
    else:
        k_layers = [k_arena[i] for i in range(n)]
        v_layers = [v_arena[i] for i in range(n)]
        # Its scales: [kv_heads, pages, page_size] per layer, as ours without the layer axis.
        s_layers = [(k_scale[i], v_scale[i]) for i in range(n)] if k_scale is not None else [(None, None)] * n
        del k_arena, v_arena, k_scale, v_scale, scales
        k_splits = math.gcd(pages_per_seq, 16)
        ppcb = math.gcd(pages_per_seq // k_splits, 8)
        row["jax_pallas_params"] = f"block_h=16 k_splits={k_splits} pages_per_compute_block={ppcb}"
        call = functools.partial(jax_paged, block_h=16, pages_per_compute_block=ppcb, k_splits=k_splits)
        q_scaled = (q[:, 0].astype(jnp.float32) * head_dim**-0.5).astype(compute)  # it applies no sm_scale
        peer = jax.jit(lambda q, ks, vs, ss, pm, l: [call(q, k, v, pm, l, *sc) for k, v, sc in zip(ks, vs, ss)])
        try:
            t = timer(peer, q_scaled, k_layers, v_layers, s_layers, page_map, lengths) / n
        except jax.errors.JaxRuntimeError as e:  # e.g. its Triton kernel out of shared memory
            row["jax_pallas_skipped"] = f"JaxRuntimeError: {str(e)[:200]}"
        else:
            record("jax_pallas", t)
            got = peer(q_scaled, k_layers, v_layers, s_layers, page_map, lengths)[0].astype(jnp.float32)
            row["jax_pallas_max_abs_diff"] = float(jnp.max(jnp.abs(got - out0)))
        del k_layers, v_layers, s_layers

    # dense attention over a contiguous cache [B, context, kv_heads, head_dim].
    dense_shape = (batch, context, num_kv_heads, head_dim)
    if budget is not None and 2 * n * batch * context * num_kv_heads * head_dim * itemsize > budget / 2:
        n_dense = 1
    else:
        n_dense = n
    ks = [_fill(dense_shape, compute, 2.0 + i) for i in range(n_dense)]  # 8-bit arenas: a bf16 dense cache
    vs = [_fill(dense_shape, compute, 3.0 + i) for i in range(n_dense)]
    for impl in ("cudnn", "xla"):
        dense = jax.jit(lambda q, ks, vs, impl=impl: [jax.nn.dot_product_attention(q, k, v, implementation=impl) for k, v in zip(ks, vs)])
        try:
            t = timer(dense, q, ks, vs) / n_dense
        # cuDNN absent (RuntimeError "cuDNN is not detected") or refusing this shape/dtype; peer only.
        except (RuntimeError, ValueError, NotImplementedError) as e:
            row[f"dense_{impl}_skipped"] = f"{type(e).__name__}: {str(e)[:200]}"
            continue
        row["dense_impl"] = impl
        record("dense", t)
        break
    return row


def _bench_append(timer_repeats, batch, *, num_kv_heads, head_dim, page_size, dtype, tokens):
    """In-place append of `tokens` new tokens per row, arena donated; wall clock over 16 appends per call."""
    unroll = 16
    pages_per_row = -(-tokens // page_size)
    num_pages = batch * pages_per_row
    shape = (unroll, num_kv_heads, num_pages, page_size, head_dim)
    arenas = (jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
    if is_quantized(dtype):  # + the scales, written by the same kernel
        arenas += (jnp.zeros(shape[:4], jnp.float32), jnp.zeros(shape[:4], jnp.float32))
    page_map = jnp.arange(num_pages, dtype=jnp.int32).reshape(batch, pages_per_row)
    lengths = jnp.full((batch,), tokens, jnp.int32)
    k = _fill((batch, tokens, num_kv_heads, head_dim), _compute_dtype(dtype), 4.0)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(arenas, k):
        for layer in range(unroll):
            scales = dict(k_scale=arenas[2], v_scale=arenas[3]) if len(arenas) == 4 else {}
            arenas = paged_append(arenas[0], arenas[1], layer, k, k, page_map, lengths, lengths, interpret=False, **scales)
        return arenas

    arenas = jax.block_until_ready(step(arenas, k))  # compile
    times = []
    for _ in range(max(1, timer_repeats)):
        t0 = time.perf_counter()
        arenas = jax.block_until_ready(step(arenas, k))
        times.append((time.perf_counter() - t0) / unroll)
    t = float(np.median(times))
    written = 2 * batch * tokens * num_kv_heads * _row_bytes(head_dim, dtype)
    return dict(batch=batch, tokens=tokens, bytes_written=written, append_us=t * 1e6, append_gbps=written / t / 1e9)


# ---- entry points ------------------------------------------------------------------------------


def _cpu_reference_rows(batches, contexts, *, num_q_heads, num_kv_heads, head_dim, page_size, dtype, repeats):
    rows = []
    timer = Timer(min(repeats, 5), use_cupti=False)
    for batch in sorted({min(b, CPU_MAX_BATCH) for b in batches}):
        for context in sorted({min(c, CPU_MAX_CONTEXT) for c in contexts}):
            pages = -(-context // page_size)
            shape = (1, num_kv_heads, batch * pages, page_size, head_dim)
            (k_arena, k_scale), (v_arena, v_scale) = _fill_arena(shape, dtype, 0.0), _fill_arena(shape, dtype, 1.0)
            page_map = jax.random.permutation(jax.random.PRNGKey(context), batch * pages).astype(jnp.int32).reshape(batch, pages)
            q = _fill((batch, 1, num_q_heads, head_dim), _compute_dtype(dtype), 5.0)
            lengths, ones = jnp.full((batch,), context, jnp.int32), jnp.ones((batch,), jnp.int32)
            ref = jax.jit(lambda *a, **kw: paged_attention_reference(*a, **kw))
            t = timer(functools.partial(ref, k_scale=k_scale, v_scale=v_scale), q, k_arena, v_arena, 0, page_map,
                      lengths, ones)
            kv = 2 * batch * context * num_kv_heads * _row_bytes(head_dim, dtype)
            rows.append(dict(batch=batch, context=context, kv_bytes=kv, reference_ms=t * 1e3, reference_gbps=kv / t / 1e9))
    return rows


def run_kernel_benchmark(
    batches=(1, 8, 64),
    contexts=(512, 4096, 32768),
    *,
    num_q_heads=32,
    num_kv_heads=8,
    head_dim=128,
    page_size=16,
    dtype="bfloat16",
    repeats=50,
    progress=None,
) -> dict:
    """Decode-attention and append timings; returns {"metadata": {...}, "rows": [...], "append_rows": [...]}.

    `progress`: a `benchmarks.report.Progress` (add_task/finish_task) or None.
    Row keys (GPU): batch, context, kv_bytes, copies, ours_ms, ours_gbps, ours_pct_copy_bw, and
    for each peer in (jax_pallas, reference, dense): <peer>_ms, <peer>_gbps, <peer>_ratio
    (= peer time / our time) or <peer>_skipped (why); skipped (why) for points beyond memory.
    """
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    dtype = jnp.dtype(dtype)
    dev = jax.devices()[0]
    meta = dict(
        device=str(getattr(dev, "device_kind", dev.platform)),
        backend=jax.default_backend(),
        jax_version=jax.__version__,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype.name,
        repeats=repeats,
        workload="decode: 1 query token per row, every row holding `context` tokens, scrambled page tables",
    )
    on_gpu = jax.default_backend() == "gpu"
    combos = [(b, c) for b in batches for c in contexts]
    advance = progress.add_task("kernels", total=len(combos)) if progress else None
    try:
        if not on_gpu:
            meta["note"] = CPU_NOTE
            meta["timing"] = "wall clock (block_until_ready), jnp reference only"
            rows = _cpu_reference_rows(batches, contexts, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, page_size=page_size, dtype=dtype, repeats=repeats)
            if advance:
                advance(len(combos))
            return dict(metadata=meta, rows=rows, append_rows=[])

        timer = Timer(repeats, use_cupti=True)
        meta["timing"] = timer.mode if timer.measure else f"{timer.mode}; {timer.cupti_reason}"
        meta["l2_bytes_assumed"] = L2_BYTES
        copy_bw = copy_bandwidth(timer)
        meta["copy_bandwidth_gbps"] = copy_bw / 1e9
        meta["ratio"] = "peer time / our time (> 1: ours is faster)"
        budget = _memory_limit()
        meta["memory_limit_bytes"] = budget
        rows = []
        for batch, context in combos:
            rows.append(_bench_point(timer, batch, context, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, page_size=page_size, dtype=dtype, copy_bw=copy_bw, budget=budget))
            if advance:
                advance()
        append_rows = [
            _bench_append(repeats, batch, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                          dtype=dtype, tokens=tokens)
            for batch in batches
            for tokens in (1, 512)
        ]
        meta["append_timing"] = "wall clock, 16 in-place appends per jitted call (arena donated), median / 16"
        return dict(metadata=meta, rows=rows, append_rows=append_rows)
    finally:
        if progress:
            progress.finish_task()


def _print_table(result: dict) -> None:
    meta = result["metadata"]
    print(f"device: {meta['device']} ({meta['backend']}), jax {meta['jax_version']}, timing: {meta['timing']}")
    if "note" in meta:
        print(f"NOTE: {meta['note']}")
    if "copy_bandwidth_gbps" in meta:
        print(f"copy bandwidth: {meta['copy_bandwidth_gbps']:.0f} GB/s (read + write)")
    cols = ["batch", "context", "ours_ms", "ours_gbps", "ours_pct_copy_bw", "jax_pallas_ratio", "reference_ms",
            "reference_ratio", "dense_ratio"]
    cols = [c for c in cols if any(c in r for r in result["rows"])]
    print(" ".join(f"{c:>16}" for c in cols))
    for r in result["rows"]:
        cells = [r.get(c, "-") for c in cols]
        print(" ".join(f"{c:>16.3f}" if isinstance(c, float) else f"{c!s:>16}" for c in cells))
        for k, v in r.items():
            if k.endswith("skipped"):
                print(f"  {k}: {v}")
    for r in result.get("append_rows", []):
        print(f"append batch={r['batch']} tokens={r['tokens']}: {r['append_us']:.1f} us, {r['append_gbps']:.1f} GB/s written")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16",
                   choices=["bfloat16", "float16", "float32", "int8", "float8_e4m3fn", "float8_e5m2"])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--json", help="write the result (metadata + rows) to this path")
    a = p.parse_args(argv)
    result = run_kernel_benchmark(tuple(a.batches), tuple(a.contexts), num_q_heads=a.num_q_heads,
                                  num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, page_size=a.page_size,
                                  dtype=a.dtype, repeats=a.repeats)
    _print_table(result)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
