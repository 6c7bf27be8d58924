"""Decode rows and prompt chunks in ONE Mosaic call: continuous batching's mixed step on a TPU.

`tpu_paged_attention_mixed` takes a mixed step's two parts, decode rows (one query token each)
and prefill chunks (up to T tokens each), and runs both through one `pallas_call`: the grid
is (B + P rows, row blocks of a chunk), its first B rows the decode rows (their block 0 does
the work, the others nothing), the rest the chunks. Each program runs the attention kernel's
body (`attention._attention_kernel`) for its part, with that part's static tiling: a decode
row's G query rows a head, a chunk's `block_tokens x G`. So a decode row costs what it costs
in a decode call, with no padding to the chunk width, and the two parts share one launch and
the DMA pipeline's warm-up. Each part has its buffers as its own call has them
(`attention.slot_scratch`: decode's slots allocations of their own, the chunk's one).

How the parts' blocks stay out of each other's way: the decode part's q and output blocks
are indexed by min(row, B - 1) and the chunks' by max(row - B, 0), so while one part runs the
other's block index does not change; Pallas then neither fetches nor writes it back between
those programs, and the last program to write a block is the one that owns it. The grid
runs in order (both dimensions "arbitrary").

Over 8-bit scale rows the decode part reads a block whose pages are a run one DMA a buffer, as
a decode call does (`attention.reads_runs`: the run flags a sixth scalar table, the arenas also
passed as rows); the chunks read page by page, as a prefill call.

Contract: the decode part == `tpu_paged_attention` on (q_dec, page_map_dec, lengths_dec,
num_tokens_dec) and the chunk part == `tpu_paged_attention` on the chunk arguments, bit for
bit (the same body, the same tiles); `tests/test_kernels_tpu.py` checks both and the reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import BlockSizes, check_arena, check_layer, check_rows, check_tokens
from pallas_kernels.tpu.attention import (TpuAttentionTiles, _attention_kernel, _meta, check_geometry, grouped,
                                          hole_ends, reads_runs, row_pages, run_blocks, scale_bytes, scale_shifts,
                                          scale_views, slot_scratch, ungrouped, FAST_BLOCKS)
from pallas_kernels.tpu.common import check_smem_tables, logical_scales, resolve_tpu_interpret

__all__ = ["tpu_paged_attention_mixed"]


def _mixed_kernel(meta_ref, lengths_ref, num_tokens_ref, page_map_ref, hole_end_ref, *refs, quantized: bool,
                  num_decode: int, decode: dict, prefill: dict, decode_scratch: int, runs: bool = False):
    # refs: (runs: the run flags, scalar-prefetched), q_dec, q_pre, K, V, zero page, (8-bit: the scales,
    # scale rows: + shifts), (runs: K and V as rows), the two outputs, then scratch
    run_ref, refs = (refs[0], refs[1:]) if runs else (None, refs)
    q_dec_ref, q_pre_ref, k_hbm, v_hbm, zero_page_hbm, *refs = refs
    scales = refs[:(2 if k_hbm.shape[3] % 128 == 0 else 3)] if quantized else ()  # (+ scale shifts: scale rows)
    refs = refs[len(scales):]
    row_views, refs = (refs[:2], refs[2:]) if runs else (None, refs)
    o_dec_ref, o_pre_ref, *scratch, sem = refs
    # The decode part's scratch (its first `decode_scratch` refs, `slot_scratch`) and the chunk's.
    dec_scratch, pre_scratch = (*scratch[:decode_scratch], sem), (*scratch[decode_scratch:], sem)
    b, rb = pl.program_id(0), pl.program_id(1)
    common = (meta_ref, lengths_ref, num_tokens_ref, page_map_ref, hole_end_ref)

    @pl.when((b < num_decode) & (rb == 0))
    def _():
        _attention_kernel(*common, q_dec_ref, k_hbm, v_hbm, zero_page_hbm, *scales, o_dec_ref, *dec_scratch, row=b,
                          row_block=0, quantized=quantized, run_ref=run_ref, row_views=row_views, **decode)

    @pl.when(b >= num_decode)
    def _():
        _attention_kernel(*common, q_pre_ref, k_hbm, v_hbm, zero_page_hbm, *scales, o_pre_ref, *pre_scratch, row=b,
                          row_block=rb, quantized=quantized, **prefill)


@functools.partial(jax.jit, static_argnames=("sm_scale", "has_window", "soft_cap", "tiles", "interpret", "runs"))
def _mixed_call(q_dec, q_pre, k_arena, v_arena, meta, page_map, lengths, num_tokens, k_scale, v_scale, *, sm_scale,
                has_window, soft_cap, tiles, interpret, runs=False):
    num_decode, _, num_q_heads, head_dim = q_dec.shape
    num_chunks, tokens = q_pre.shape[:2]
    _, num_kv_heads, _, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    block_k, block_tokens = tiles.block_k, tiles.block_tokens
    row_blocks = -(-tokens // block_tokens)
    quantized = k_scale is not None
    qd = grouped(q_dec, 1, 1, num_kv_heads)  # [B, Hkv, G, D]
    qp = grouped(q_pre, row_blocks, block_tokens, num_kv_heads)  # [P, Hkv, RB * bt * G, D]
    static = dict(sm_scale=sm_scale, has_window=has_window, soft_cap=soft_cap, group=group,
                  max_pages=page_map.shape[1], compute=jnp.dtype(q_dec.dtype), num_kv_heads=num_kv_heads,
                  num_pages=k_arena.shape[2])
    kernel = functools.partial(_mixed_kernel, quantized=quantized, num_decode=num_decode, runs=runs,
                               decode=dict(static, block_tokens=1, tokens=1),
                               prefill=dict(static, block_tokens=block_tokens, tokens=tokens))
    dec_spec = pl.BlockSpec((None, num_kv_heads, group, head_dim),
                            lambda b, rb, *_: (jnp.minimum(b, num_decode - 1), 0, 0, 0))
    pre_spec = pl.BlockSpec((None, num_kv_heads, block_tokens * group, head_dim),
                            lambda b, rb, *_: (jnp.maximum(b - num_decode, 0), 0, jnp.where(b < num_decode, 0, rb), 0))
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    # Each part its own buffers: decode's slots allocations of their own (static slot numbers),
    # the chunk's one allocation (`attention.Slots`); one pair of DMA semaphores.
    dec_scratch, pre_scratch = (slot_scratch(block_k, head_dim, k_arena.dtype, page_size, quantized, static=static,
                                             num_kv_heads=num_kv_heads, rows=rows)
                                for static, rows in ((True, group), (False, block_tokens * group)))
    scratch = [*dec_scratch, *pre_scratch, pltpu.SemaphoreType.DMA((2,))]
    kernel = functools.partial(kernel, decode_scratch=len(dec_scratch))
    extra = (scale_views(k_scale, page_size), scale_views(v_scale, page_size)) if quantized else ()
    extra_specs = [hbm] * len(extra)
    if quantized and page_size % 128:
        shifts = scale_shifts(page_map, page_size, k_arena.shape[2], block_k // page_size)
        extra += (shifts,)
        extra_specs.append(pl.BlockSpec((None, *shifts.shape[1:]), lambda b, rb, *_: (b, 0, 0)))
    prefetch = [meta, lengths, num_tokens, page_map.reshape(-1), hole_ends(page_map, lengths, page_size)]
    if runs:  # the run flags of every row's blocks (the decode rows' are read) and the arenas as rows
        prefetch.append(run_blocks(page_map, page_size, k_arena.shape[2], block_k // page_size))
        extra += (row_pages(k_arena), row_pages(v_arena))
        extra_specs += [hbm, hbm]
    zero_page = jnp.zeros((num_kv_heads, page_size, head_dim), k_arena.dtype)
    rows = num_decode + num_chunks
    keys = page_map.shape[1] * page_size
    scale_page_bytes = scale_bytes(page_size) if quantized else 0
    page_bytes = 2 * page_size * head_dim * jnp.dtype(k_arena.dtype).itemsize + scale_page_bytes
    programs = (num_decode + num_chunks * row_blocks) * num_kv_heads
    cost = pl.CostEstimate(  # at the workload bound: every row at the page table's full length
        flops=int(4 * keys * head_dim * num_kv_heads * group * (num_decode + num_chunks * row_blocks * block_tokens)),
        transcendentals=int(keys * num_kv_heads * group * (num_decode + num_chunks * row_blocks * block_tokens)),
        bytes_accessed=int(programs * page_map.shape[1] * page_bytes
                           + 2 * (qd.size + qp.size) * qd.dtype.itemsize),
    )
    name = f"tpu_paged_attention_mixed_bt{block_tokens}_g{group}_bk{block_k}x{FAST_BLOCKS}_h{num_kv_heads}_d{head_dim}"
    if quantized:
        name += f"_{jnp.dtype(k_arena.dtype).name}"
    if runs:
        name += "_runs"
    o_dec, o_pre = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(rows, row_blocks),
            in_specs=[dec_spec, pre_spec, hbm, hbm, hbm] + extra_specs,
            out_specs=[dec_spec, pre_spec],
            scratch_shapes=scratch,
        ),
        out_shape=[jax.ShapeDtypeStruct(qd.shape, q_dec.dtype), jax.ShapeDtypeStruct(qp.shape, q_pre.dtype)],
        # In order: a part's blocks stay put (neither fetched nor written back) while the other runs.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary"), disable_bounds_checks=True),
        interpret=interpret,
        name=name,
        cost_estimate=cost,
    )(*prefetch, qd, qp, k_arena, v_arena, zero_page, *extra)
    return ungrouped(o_dec, 1, num_q_heads), ungrouped(o_pre, tokens, num_q_heads)


def tpu_paged_attention_mixed(
    q_dec,
    q_pre,
    k_arena,
    v_arena,
    layer,
    page_map_dec,
    lengths_dec,
    num_tokens_dec,
    page_map_pre,
    lengths_pre,
    num_tokens_pre,
    *,
    k_scale=None,
    v_scale=None,
    sm_scale: float | None = None,
    sliding_window=None,
    logits_soft_cap: float | None = None,
    interpret=None,
    block_sizes: BlockSizes | None = None,
):
    """A mixed step's attention in one call. q_dec: [B, 1, Hq, D] (decode rows; num_tokens_dec
    0 or 1), q_pre: [P, T, Hq, D] (prefill chunks); page maps i32[B, M] / i32[P, M] (the same M),
    lengths and num_tokens per row of each part. The options are `tpu_paged_attention`'s, for
    both parts. Returns (out_dec [B, 1, Hq, D], out_pre [P, T, Hq, D]) in q's dtype, each equal
    to `tpu_paged_attention` on its part."""
    (ks, rows_k), (vs, rows_v) = logical_scales(k_arena, k_scale), logical_scales(k_arena, v_scale)
    num_layers, num_kv_heads, _, page_size, head_dim = check_arena(k_arena, v_arena, ks, vs)
    check_tokens("q_dec", q_dec, batch=None, heads=None, head_dim=head_dim)
    check_tokens("q_pre", q_pre, batch=None, heads=q_dec.shape[2], head_dim=head_dim)
    num_decode, one, num_q_heads, _ = q_dec.shape
    num_chunks, tokens = q_pre.shape[:2]
    if one != 1 or num_decode < 1 or num_chunks < 1:
        raise ValueError(f"q_dec must be [B >= 1, 1, Hq, D] and q_pre [P >= 1, T, Hq, D], got {q_dec.shape} and "
                         f"{q_pre.shape} (one part alone: tpu_paged_attention)")
    if q_pre.dtype != q_dec.dtype:
        raise ValueError(f"q_dec and q_pre must share a dtype, got {q_dec.dtype} and {q_pre.dtype}")
    check_geometry(num_q_heads, k_arena, k_scale, q_dec.dtype, scale_rows=rows_k and rows_v)
    layer = check_layer(layer, num_layers)
    dec = check_rows(page_map_dec, lengths_dec, num_tokens_dec, num_decode)
    pre = check_rows(page_map_pre, lengths_pre, num_tokens_pre, num_chunks)
    if dec[0].shape[1] != pre[0].shape[1]:
        raise ValueError(f"page_map_dec and page_map_pre must have the same width, got {dec[0].shape[1]} and "
                         f"{pre[0].shape[1]}")
    page_map, lengths, num_tokens = (jnp.concatenate([d, p]) for d, p in zip(dec, pre))
    rows = num_decode + num_chunks
    check_smem_tables(f"page_map [{rows}, {page_map.shape[1]}]", page_map.size + 3 * rows + 2)
    meta = _meta(layer, num_layers, sliding_window, logits_soft_cap, page_map.shape[1] * page_size)
    tiles = TpuAttentionTiles.choose(tokens=tokens, group=num_q_heads // num_kv_heads, page_size=page_size,
                                     max_pages=page_map.shape[1], block_sizes=block_sizes, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, itemsize=jnp.dtype(q_dec.dtype).itemsize,
                                     arena_itemsize=jnp.dtype(k_arena.dtype).itemsize)
    return _mixed_call(
        q_dec, q_pre, k_arena, v_arena, meta, page_map, lengths, num_tokens, k_scale, v_scale,
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale), has_window=sliding_window is not None,
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap), tiles=tiles,
        interpret=resolve_tpu_interpret(interpret),
        # The decode part reads runs of pages one DMA a buffer where a decode call would.
        runs=reads_runs(quantized=k_scale is not None, page_size=page_size, block_k=tiles.block_k, block_tokens=1,
                        num_pages=k_arena.shape[2]))
