"""A page of every KV head in one DMA: how far it could take TPU decode attention (issue 42, item 2).

    python -m arena_jax.benchmarks.studies.tpu_heads_dma [--target tpu-v5e] [--check]

Our TPU decode kernel (`pallas_kernels/tpu/attention.py`) reads a block one KV head at a time:
a DMA a page for K, one for V and, over 8-bit scale rows (pages under 128), one for each scale
row; ~8 scalar ops a DMA. At 8-bit pages of 32 and 64 keys those scalar ops, not the bytes, set
the loop's length (RESULTS.md, "Where the int8 bundles go at pages 32 and 64"), and even one DMA
a page and head leaves v6e's page 32 at 1.6x its HBM time ("How far fewer DMAs a page can take
int8"). The arena's format `[L, Hkv, P, S, D]` allows another cut: page p of every KV head is
`Hkv` equal chunks at a fixed stride, which one strided DMA moves (`k_hbm.at[layer, :, page]`
-> `kbuf.at[:, rows of page p]`); the scale rows likewise. Per page and head that is `1 / Hkv`
of the DMAs and of their scalar work, with no change of format.

This study builds that kernel's steady state alone (`heads_kernel`): decode, one query token a
row, every block whole (rows' lengths multiples of two blocks), no hole, no window; a loop of two
blocks an iteration, each block all KV heads (`Hkv x block_k` keys), its softmax, scale and
poison work the same ops as ours' fast step, head by head (unrolled). It compiles it for a TPU
target without a TPU, reads libtpu's final bundles with `pallas_kernels.offline.tpu_bundles`,
and prints the figures of `arena-bench kernels --compile-report` per (KV head x 512 keys) on
the report's shapes (Llama-3-8B decode, batch 8, 4,096 keys a row). `--check` first runs the
kernel in TPU interpret mode against `pallas_kernels.reference.paged_attention_reference` on
fresh random data (bf16 and int8 pages of 32). A bound for the design, not the library's kernel:
partial blocks, holes, windows, soft-cap and the general step are not here.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.attention import scale_lanes, scale_shifts

__all__ = ["heads_attention", "main"]

BLOCK_K = 512  # keys a block, of every KV head


def _dot_t(a, b):
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def heads_kernel(lengths_ref, page_map_ref, q_ref, k_hbm, v_hbm, *refs, quantized: bool, sm_scale: float,
                 max_pages: int, num_pages: int):
    """One program a batch row. q_ref [Hkv, G, D]; k_hbm, v_hbm [L, Hkv, P, S, D] (HBM, layer 0);
    8-bit: ks_hbm, vs_hbm scale rows [L, Hkv, P * S / 128, 128] and the row's shifts [blocks, ppb]
    (`scale_shifts`); o_ref [Hkv, G, D]; scratch: K, V (and scale) slots x 2, a DMA semaphore a slot."""
    if quantized:
        ks_hbm, vs_hbm, shifts_ref, o_ref, k0, k1, v0, v1, ks0, ks1, vs0, vs1, sem = refs
        ksbuf, vsbuf = (ks0, ks1), (vs0, vs1)
    else:
        o_ref, k0, k1, v0, v1, sem = refs
    kbuf, vbuf = (k0, k1), (v0, v1)
    num_kv_heads, page_size, head_dim = k_hbm.shape[1], k_hbm.shape[3], k_hbm.shape[4]
    ppb = BLOCK_K // page_size
    row_shift = (128 // page_size).bit_length() - 1
    b = pl.program_id(0)
    n_blocks = lax.div(lengths_ref[b], BLOCK_K)  # whole blocks (the study's rows: an even count)

    def start(j, slot):
        for p in range(ppb):
            entry = page_map_ref[b * max_pages + j * ppb + p]
            page = jnp.minimum(entry.astype(jnp.uint32), jnp.uint32(num_pages - 1)).astype(jnp.int32)
            dst = pl.ds(p * page_size, page_size)
            pltpu.make_async_copy(k_hbm.at[0, :, page], kbuf[slot].at[:, dst], sem.at[slot]).start()
            pltpu.make_async_copy(v_hbm.at[0, :, page], vbuf[slot].at[:, dst], sem.at[slot]).start()
            if quantized:
                srow = pl.ds(lax.shift_right_logical(page, row_shift), 1)
                pltpu.make_async_copy(ks_hbm.at[0, :, srow], ksbuf[slot].at[:, pl.ds(p, 1)], sem.at[slot]).start()
                pltpu.make_async_copy(vs_hbm.at[0, :, srow], vsbuf[slot].at[:, pl.ds(p, 1)], sem.at[slot]).start()

    def wait(slot):
        for buf in (kbuf, vbuf) + ((ksbuf, vsbuf) if quantized else ()):
            pltpu.make_async_copy(buf[slot], buf[slot], sem.at[slot]).wait()

    def block(j, slot, state):
        """Block j (in `slot`) of every head: wait, attend, start block j + 2 into the same slot
        (the other slot's block is in flight meanwhile), write the output so far (no branch)."""
        wait(slot)
        shifts = shifts_ref[pl.ds(j, 1), :] if quantized else None
        out = []
        for h in range(num_kv_heads):
            m_prev, l_prev, acc_prev, bad_prev = state[h]
            q = q_ref[h]  # [G, D]
            k = kbuf[slot][h].astype(q.dtype)  # [block_k, D]
            dots = _dot_t(q, k)  # [G, block_k] f32
            if quantized:
                s = dots * (scale_lanes(ksbuf[slot][h], shifts, page_size) * sm_scale)
                vs = scale_lanes(vsbuf[slot][h], shifts, page_size)
                v_ok = jnp.isfinite(vs)
                vs = jnp.where(v_ok, vs, 0.0)
            else:
                s = dots * sm_scale
            s_ok = jnp.isfinite(s)
            bad = jnp.max(jnp.where(~s_ok, 1.0, 0.0), axis=1, keepdims=True)
            if quantized:
                bad = jnp.maximum(bad, jnp.max(jnp.where(~v_ok, 1.0, 0.0), axis=1, keepdims=True))
            s = jnp.where(s_ok, s, -jnp.inf)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
            m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)
            alpha = jnp.exp(m_prev - m_safe)
            p = jnp.exp(s - m_safe)
            l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
            if quantized:
                p = p * vs
            acc = acc_prev * alpha + _dot(p.astype(q.dtype), vbuf[slot][h].astype(q.dtype))
            bad = jnp.maximum(bad_prev, bad)
            seen = l_next != 0
            o = jnp.where(seen, acc / jnp.where(seen, l_next, 1.0), 0.0)
            if not quantized:
                bad = jnp.maximum(bad, jnp.max(jnp.where(jnp.isfinite(acc), 0.0, 1.0), axis=1, keepdims=True))
            o_ref[h] = jnp.where(bad > 0.5, jnp.nan, o).astype(o_ref.dtype)
            out.append((m_next, l_next, acc, bad))
        start(jnp.minimum(j + 2, n_blocks - 1), slot)  # (past the end: a harmless re-read, waited below)
        return out

    rows = q_ref.shape[1]
    f32 = jnp.float32
    init = [(jnp.full((rows, 1), -jnp.inf, f32), jnp.zeros((rows, 1), f32), jnp.zeros((rows, head_dim), f32),
             jnp.zeros((rows, 1), f32)) for _ in range(num_kv_heads)]
    start(0, 0)
    start(1, 1)

    def two(i, state):
        return block(2 * i + 1, 1, block(2 * i, 0, state))

    lax.fori_loop(0, lax.div(n_blocks, 2), two, init)
    wait(0)  # the two re-reads started by the last iteration
    wait(1)


def heads_attention(q, k_arena, v_arena, page_map, lengths, k_scale_rows=None, v_scale_rows=None, *, interpret=False):
    """Decode attention (one token a row), every block whole: q [B, 1, Hq, D]; arenas [1, Hkv, P, S, D];
    8-bit: scale rows [1, Hkv, P * S / 128, 128]; lengths i32[B], multiples of 2 x BLOCK_K."""
    batch, _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    max_pages = page_map.shape[1]
    quantized = k_scale_rows is not None
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    row = pl.BlockSpec((None, num_kv_heads, group, head_dim), lambda b, *_: (b, 0, 0, 0))
    in_specs, extra = [row, hbm, hbm], ()
    scratch = [pltpu.VMEM((num_kv_heads, BLOCK_K, head_dim), k_arena.dtype) for _ in range(4)]
    if quantized:
        shifts = scale_shifts(page_map, page_size, num_pages, BLOCK_K // page_size)
        in_specs += [hbm, hbm, pl.BlockSpec((None, *shifts.shape[1:]), lambda b, *_: (b, 0, 0))]
        extra = (k_scale_rows, v_scale_rows, shifts)
        scratch += [pltpu.VMEM((num_kv_heads, BLOCK_K // page_size, 128), jnp.float32) for _ in range(4)]
    scratch.append(pltpu.SemaphoreType.DMA((2,)))
    kernel = functools.partial(heads_kernel, quantized=quantized, sm_scale=head_dim**-0.5, max_pages=max_pages,
                               num_pages=num_pages)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=2, grid=(batch,), in_specs=in_specs,
                                               out_specs=row, scratch_shapes=scratch),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), disable_bounds_checks=True),
        interpret=interpret,
        name=f"heads_dma_attention_{jnp.dtype(k_arena.dtype).name}_p{page_size}",
    )(lengths, page_map.reshape(-1), qg, k_arena, v_arena, *extra)
    return out.reshape(batch, 1, num_q_heads, head_dim)


def check(page_size: int = 32, seed: int = 0, batch: int = 2) -> list[str]:
    """Interpret mode against the reference on fresh random data (bf16 and int8; `batch` rows of
    two blocks, 2 KV heads of 4 query heads, an arena of twice the pages they map, shuffled): one
    line each; an AssertionError past bf16's rounding."""
    from pallas_kernels.reference import paged_attention_reference
    from pallas_kernels.tpu.common import resolve_tpu_interpret, scale_rows

    lines = []
    for dtype in ("bfloat16", "int8"):
        keys = jax.random.split(jax.random.key(seed), 6)
        hkv, group, d = 2, 4, 128
        per_row = 2 * BLOCK_K // page_size
        num_pages = 2 * batch * per_row
        page_map = jax.random.permutation(keys[0], num_pages)[: batch * per_row].reshape(batch, per_row).astype(jnp.int32)
        lengths = jnp.full((batch,), 2 * BLOCK_K, jnp.int32)
        q = jax.random.normal(keys[1], (batch, 1, hkv * group, d), jnp.float32).astype(jnp.bfloat16)
        shape = (1, hkv, num_pages, page_size, d)
        if dtype == "int8":
            k = jax.random.randint(keys[2], shape, -127, 128, jnp.int32).astype(jnp.int8)
            v = jax.random.randint(keys[3], shape, -127, 128, jnp.int32).astype(jnp.int8)
            ks = jax.random.uniform(keys[4], shape[:-1], jnp.float32, 0.001, 0.02)
            vs = jax.random.uniform(keys[5], shape[:-1], jnp.float32, 0.001, 0.02)
            got = heads_attention(q, k, v, page_map, lengths, scale_rows(ks), scale_rows(vs),
                                  interpret=resolve_tpu_interpret(True))
            want = paged_attention_reference(q, k, v, 0, page_map, lengths, jnp.ones((batch,), jnp.int32), k_scale=ks,
                                             v_scale=vs)
        else:
            k = jax.random.normal(keys[2], shape, jnp.float32).astype(jnp.bfloat16)
            v = jax.random.normal(keys[3], shape, jnp.float32).astype(jnp.bfloat16)
            got = heads_attention(q, k, v, page_map, lengths, interpret=resolve_tpu_interpret(True))
            want = paged_attention_reference(q, k, v, 0, page_map, lengths, jnp.ones((batch,), jnp.int32))
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        lines.append(f"{dtype} p{page_size}: max |heads_dma - reference| = {err:.3g}")
        if not err <= 2e-2:
            raise AssertionError(lines[-1])
    return lines


CASES = tuple((dt, p) for dt in ("bfloat16", "int8") for p in (16, 32, 64, 128))


def _case_args(dtype: str, page_size: int):
    from pallas_kernels.offline import tpu_bundles as tb

    S = jax.ShapeDtypeStruct
    batch, hkv, d = tb.BATCH, tb.KV_HEADS, 128
    max_pages = tb.CONTEXT // page_size
    num_pages = batch * max_pages * tb.ARENA_SPARE
    kv = S((1, hkv, num_pages, page_size, d), jnp.dtype(dtype))
    q = S((batch, 1, tb.Q_HEADS, d), jnp.bfloat16)
    pm, n = S((batch, max_pages), jnp.int32), S((batch,), jnp.int32)
    if dtype == "int8":
        if page_size >= 128:
            return None  # (pages of 128: scales [L, Hkv, P, S], another layout; not this study's)
        rows = S((1, hkv, num_pages * page_size // 128, 128), jnp.float32)
        return lambda q, k, v, ks, vs, pm, n: heads_attention(q, k, v, pm, n, ks, vs), (q, kv, kv, rows, rows, pm, n)
    return lambda q, k, v, pm, n: heads_attention(q, k, v, pm, n), (q, kv, kv, pm, n)


def _worker(target: str, dump_dir: str) -> None:
    from pallas_kernels.offline import tpu as tpu_compile
    from pallas_kernels.offline import tpu_bundles as tb

    jax.config.update("jax_enable_compilation_cache", False)
    chip = tb.CHIPS[target]
    rows = []
    for dtype, page_size in CASES:
        made = _case_args(dtype, page_size)
        if made is None:
            continue
        before = set(os.listdir(dump_dir))
        tpu_compile.compile_for_tpu(made[0], made[1], target=target)
        new = [f for f in set(os.listdir(dump_dir)) - before
               if tb._NAME.match(f) and tb._NAME.match(f).group(1).startswith("heads_dma_attention")]
        with open(os.path.join(dump_dir, sorted(new)[0])) as f:
            loop = tb.block_loop(tb.parse_bundles(f.read()))
        it = tb.per_iteration(loop)
        keys, heads = 2 * BLOCK_K, tb.KV_HEADS
        per = keys * heads / tb.BLOCK_KEYS
        item = jnp.dtype(dtype).itemsize
        key_bytes = 2 * (128 * item + (512 // page_size if dtype == "int8" else 0))  # K + V rows (+ scale rows)
        issue_ns = it["bundles"] / chip.clock_hz * 1e9 / per
        hbm_ns = keys * heads * key_bytes / chip.hbm_bytes_per_s * 1e9 / per
        rows.append(dict(target=target, case=f"heads-dma {'bf16' if dtype == 'bfloat16' else dtype} d128 p{page_size}",
                         bundles_per_iter=it["bundles"], bundles_per_512=round(it["bundles"] / per, 1),
                         dmas_per_page=it["dma_starts"] / (keys // page_size),
                         pushes_per_512=it["mxu_pushes"] / per, issue_ns=round(issue_ns),
                         hbm_ns=round(hbm_ns), issue_over_hbm=round(issue_ns / hbm_ns, 2), cold=it["cold"]))
        for f in set(os.listdir(dump_dir)) - before:
            os.remove(os.path.join(dump_dir, f))
    print("RESULT " + json.dumps(rows), flush=True)


def capture(target: str) -> list[dict]:
    """Compile every case for `target` in a child process with libtpu's dump flags; its rows."""
    with tempfile.TemporaryDirectory(prefix="heads_dma_") as dump_dir:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["LIBTPU_INIT_ARGS"] = (env.get("LIBTPU_INIT_ARGS", "") + f" --xla_jf_dump_to={dump_dir} --xla_jf_dump_llo_text").strip()
        out = subprocess.run([sys.executable, "-m", __spec__.name, "--target", target, "--worker", dump_dir], env=env,
                             capture_output=True, text=True, check=False)
        result = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
        if not result:
            raise RuntimeError(f"the capture for {target} failed (exit {out.returncode}): {out.stderr[-3000:]}")
        return json.loads(result[0][len("RESULT "):])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tpu-v5e", choices=("tpu-v5e", "tpu-v6e"))
    ap.add_argument("--check", action="store_true", help="first check the kernel in interpret mode against the reference")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args.target, args.worker)
    if args.check:
        for line in check():
            print(line)
    print("| target | case | bundles an iteration | bundles / 512 keys x head | DMAs a page | MXU pushes / 512 | issue ns "
          "| HBM ns | issue / HBM |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in capture(args.target):
        print(f"| {r['target']} | {r['case']} | {r['bundles_per_iter']} | {r['bundles_per_512']} | {r['dmas_per_page']:.2f} "
              f"| {r['pushes_per_512']:g} | {r['issue_ns']} | {r['hbm_ns']} | {r['issue_over_hbm']} |")


if __name__ == "__main__":
    main()
