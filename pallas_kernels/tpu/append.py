"""Paged append for TPU (Mosaic): new K/V rows land in their pages by HBM -> HBM DMA, in place.

TPU DMAs move whole tiles of rows: a 16-bit arena packs 2 token rows per 32-bit sublane word,
an 8-bit one 4, and Mosaic rejects a copy of one bf16 row at an odd offset. So the unit of a
write is an aligned chunk of `C = tpu_common.append_chunk(S, dtype)` rows of one page (8 rows of
float32, 16 of 16-bit, 32 of 8-bit: one (8, 128) tile of 32-bit words; the whole page when it is
smaller). The new tokens of row b cover positions `[start, start + n)`, i.e. `count` chunks
(at most `K = cdiv(T + C - 1, C)`); only the first and the last can hold rows that must keep
their old contents. Three steps, all inside the caller's jit:

1. Gather (Mosaic kernel, DMA only): the arena's current first and last chunk of each row,
   `[C, D]` per KV head, into a small staging array (and, for 8-bit arenas, the page rows
   `[1, S]` of scales of every page the row touches).
2. Stage (plain XLA, fused, on arrays of the new tokens' size): each touched chunk whole, in
   the arena dtype: new rows from k / v (cast, or quantized by `quant.quantize_rows`: the
   reference's rules, bit for bit), the other rows from the gathered chunks; scale rows alike.
3. Scatter (Mosaic kernel, DMA only): one program per KV head walks a compacted list of live
   chunks in SMEM (scalar prefetch: page, row offset, staging index) and copies each staged
   chunk into `arena[layer, h, page, off:off + C]`, keeping up to `IN_FLIGHT` copies in
   flight; then the scale rows. The arena is aliased in place (`input_output_aliases`).

Nothing of the arena passes through VMEM or through an XLA gather/scatter (an XLA gather on
the arena makes XLA relayout the whole arena for it). Chunks that hold no new token, sit in an
unmapped page (-1) or past the page table, rows with num_tokens == 0 and a layer outside
[0, L) are not in the lists: they write nothing. Under a jit that donates the arena, only the
touched chunks move (decode: one chunk of C rows per row and head, read and written back).
Contract: `pallas_kernels.reference.append_reference`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import check_arena, check_layer, check_rows, check_tokens
from pallas_kernels.quant import quantize_rows
from pallas_kernels.tpu.common import (append_chunk, check_smem_tables, logical_scales, resolve_tpu_interpret,
                                      tpu_unsupported_reason)

__all__ = ["tpu_paged_append"]

IN_FLIGHT = 16  # DMAs a program keeps in flight per stream (chunks, scale rows)


def _stream(count, make):
    """Start the copies make(i) for i < count, keeping at most IN_FLIGHT iterations in flight
    (every copy of a stream has the same size, so any one's wait accounts for one)."""

    def body(i, _):
        for c in make(i):
            c.start()

        @pl.when(i >= IN_FLIGHT)
        def _():
            for c in make(i - IN_FLIGHT):
                c.wait()

        return 0

    lax.fori_loop(0, count, body, 0)

    def drain(i, _):
        for c in make(i):
            c.wait()
        return 0

    lax.fori_loop(jnp.maximum(count - IN_FLIGHT, 0), count, drain, 0)


def _chunk_dma_kernel(
    # scalar prefetch (SMEM)
    meta_ref,  # i32[3]: layer (clipped), live chunks, live scale rows
    page_ref,  # i32[N]: page of live chunk i
    off_ref,  # i32[N]: its first row in the page (a multiple of C)
    idx_ref,  # i32[N]: its slab in the staging arrays
    s_page_ref,  # i32[Ns]: page of live scale row i (8-bit arenas)
    s_idx_ref,  # i32[Ns]: its slab in the scale staging arrays
    *refs,
    to_arena: bool,
    quantized: bool,
    chunk: int,
):
    """One program per KV head copies chunks between the arena and the staging slabs.

    to_arena=False (gather): refs = arenas k, v [L, Hkv, P, S, D] (and scales [L, Hkv, P, S]),
    then the staging outputs k, v [N, Hkv, C, D] (and scale rows [Ns, Hkv, 1, S]), then 2 sems.
    to_arena=True (scatter): refs = staging k, v (and scale rows), the arenas in (aliased),
    the arenas out, 2 sems."""
    n = 4 if quantized else 2
    if to_arena:
        stage, arena, (sem, s_sem) = refs[:n], refs[2 * n: 3 * n], refs[3 * n:]
    else:
        arena, stage, (sem, s_sem) = refs[:n], refs[n: 2 * n], refs[2 * n:]
    h = pl.program_id(0)
    layer = meta_ref[0]

    def pair(src, dst, s):
        return pltpu.make_async_copy(dst, src, s) if to_arena else pltpu.make_async_copy(src, dst, s)

    def chunks(i):
        rows = pl.ds(pl.multiple_of(off_ref[i], chunk), chunk)
        return [pair(a.at[layer, h, page_ref[i], rows], st.at[idx_ref[i], h], sem) for a, st in zip(arena[:2], stage[:2])]

    _stream(meta_ref[1], chunks)
    if quantized:
        def scale_rows(i):
            return [pair(a.at[layer, h, pl.ds(s_page_ref[i], 1)], st.at[s_idx_ref[i], h], s_sem)
                    for a, st in zip(arena[2:], stage[2:])]

        _stream(meta_ref[2], scale_rows)


def _chunk_dma(tables, arenas, stage_or_shapes, *, to_arena: bool, chunk: int, interpret, name: str, moved: int):
    """Run `_chunk_dma_kernel` over the KV heads: gather into new staging arrays (returned), or
    scatter staging arrays into the arenas (aliased; the updated arenas are returned)."""
    quantized = len(arenas) == 4
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    num_kv_heads = arenas[0].shape[1]
    if to_arena:
        inputs = tuple(stage_or_shapes) + tuple(arenas)
        out_shape = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arenas]
        aliases = {len(tables) + len(stage_or_shapes) + i: i for i in range(len(arenas))}
    else:
        inputs, out_shape, aliases = tuple(arenas), list(stage_or_shapes), {}
    return pl.pallas_call(
        functools.partial(_chunk_dma_kernel, to_arena=to_arena, quantized=quantized, chunk=chunk),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(tables),
            grid=(num_kv_heads,),
            in_specs=[hbm] * len(inputs),
            out_specs=[hbm] * len(out_shape),
            scratch_shapes=[pltpu.SemaphoreType.DMA(()), pltpu.SemaphoreType.DMA(())],
        ),
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), has_side_effects=to_arena),
        interpret=interpret,
        name=name,
        cost_estimate=pl.CostEstimate(flops=0, transcendentals=0, bytes_accessed=int(2 * moved)),  # read + write
    )(*tables, *inputs)


def _compact(live, *fields):
    """Live entries first (stable): (count, each field reordered) for flat [N] arrays."""
    order = jnp.argsort(~live, stable=True)
    return (jnp.sum(live).astype(jnp.int32),) + tuple(f[order].astype(jnp.int32) for f in fields)


@functools.partial(jax.jit, static_argnames=("interpret",))
def _tpu_append_call(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens, k_scale, v_scale, *, interpret):
    num_layers, num_kv_heads, num_pages, page_size, head_dim = k_arena.shape
    batch, tokens, _, _ = k.shape
    max_pages = page_map.shape[1]
    quantized = k_scale is not None
    arenas = (k_arena, v_arena) + ((k_scale, v_scale) if quantized else ())
    chunk = append_chunk(page_size, k_arena.dtype)
    num_chunks = -(-(tokens + chunk - 1) // chunk)  # chunks one row's new tokens may touch
    layer_ok = (layer >= 0) & (layer < num_layers)
    layer_c = jnp.clip(layer, 0, num_layers - 1)
    n = jnp.clip(num_tokens, 0, tokens)
    start = lengths - num_tokens  # position of new token 0 (the reference's rule)
    end = jnp.minimum(start + n, max_pages * page_size)  # positions past the page table are dropped
    flat = lambda a: a.reshape(-1)  # noqa: E731
    arange = lambda m: jnp.arange(m, dtype=jnp.int32)  # noqa: E731

    def units(unit, count):
        """The `count` units (chunks, pages) of `unit` positions from the row's first new one:
        token index of each position [B, count, unit], which are new, the unit's page, its
        row offset in the page, and whether it is written (live)."""
        pos = (lax.div(jnp.maximum(start, 0), unit)[:, None, None] + arange(count)[None, :, None]) * unit
        pos = pos + arange(unit)[None, None, :]
        t = pos - start[:, None, None]
        new = (t >= 0) & (t < n[:, None, None]) & (pos < end[:, None, None])
        logical = lax.div(pos[:, :, 0], page_size)  # [B, count]
        page = jnp.take_along_axis(page_map, jnp.clip(logical, 0, max_pages - 1), axis=1)
        live = jnp.any(new, axis=2) & (page >= 0) & (logical < max_pages) & layer_ok
        return jnp.clip(t, 0, tokens - 1), new, jnp.clip(page, 0, num_pages - 1), lax.rem(pos[:, :, 0], page_size), live

    t, new, page, offset, live = units(chunk, num_chunks)  # [B, K, C] x2, [B, K] x3
    count = jnp.sum(jnp.any(new, axis=2), axis=1)  # chunks of the row holding a new token
    last = jnp.maximum(count - 1, 0)
    edge = jnp.stack([jnp.zeros_like(last), last], axis=1)  # [B, 2]: the row's first and last chunk
    edge_tables = (jnp.take_along_axis(page, edge, 1), jnp.take_along_axis(offset, edge, 1), arange(2 * batch))
    partial = live & ~jnp.all(new, axis=2)  # a chunk whose old rows must be kept
    edge_live = jnp.take_along_axis(partial, edge, 1) & jnp.stack([count > 0, count > 1], axis=1)  # one chunk: once
    edge_live = flat(edge_live)
    n_edges, e_page, e_off, e_idx = _compact(edge_live, *(flat(x) for x in edge_tables))
    s_tables, s_shapes, n_srows = (jnp.zeros((1,), jnp.int32),) * 2, (), jnp.int32(0)
    rows_format = quantized and page_size % 128 != 0  # scales as rows of 128 / S pages (`scale_rows`)
    if quantized:
        num_spages = -(-(tokens + page_size - 1) // page_size)  # pages one row's new tokens may touch
        st, snew, spage, _, slive = units(page_size, num_spages)
        sentries = batch * num_spages
        if rows_format:
            # Each touched page's scales live in a 128-lane row shared with 128 / S - 1 other pages,
            # which other rows of this call may write: each row is read and written once, by the
            # first entry naming it (`owner`); every entry's new scales are merged into that copy.
            srow = flat(spage) // (128 // page_size)
            same = flat(slive)[None, :] & (srow[None, :] == srow[:, None])  # [E, E]
            owner = jnp.argmax(same, axis=1).astype(jnp.int32)  # the first live entry of the row
            moved_rows = flat(slive) & (owner == arange(sentries))
            n_srows, sp, s_idx = _compact(moved_rows, srow, arange(sentries))
        else:
            n_srows, sp, s_idx = _compact(flat(slive), flat(spage), arange(sentries))
        s_tables = (sp, s_idx)
        s_shapes = (jax.ShapeDtypeStruct((sentries, num_kv_heads, 1, 128 if rows_format else page_size),
                                         k_scale.dtype),) * 2
    meta = jnp.stack([layer_c, jnp.where(layer_ok, n_edges, 0), jnp.where(layer_ok, n_srows, 0)]).astype(jnp.int32)
    c_shape = jax.ShapeDtypeStruct((2 * batch, num_kv_heads, chunk, head_dim), k_arena.dtype)
    dtype_tag = f"_{jnp.dtype(k_arena.dtype).name}" if quantized else ""
    nbytes = lambda shapes: sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in shapes)  # noqa: E731
    old = _chunk_dma((meta, e_page, e_off, e_idx) + s_tables, arenas, (c_shape, c_shape) + s_shapes, to_arena=False,
                     chunk=chunk, interpret=interpret, name=f"tpu_append_gather_c{chunk}_d{head_dim}{dtype_tag}",
                     moved=nbytes((c_shape, c_shape) + s_shapes))

    # Staging in the slabs' own order [B, K, Hkv, C, D] (head before row): the gathered chunks
    # [B, 2, Hkv, C, D] need no relayout, the new rows are taken along T of k as [B, Hkv, T, D].
    first = (arange(num_chunks) == 0)[None, :, None, None, None]  # [1, K, 1, 1, 1]
    t_flat = t.reshape(batch, 1, num_chunks * chunk, 1)
    staged, new_scales = [], []
    for x, arena, old_edges in zip((k, v), arenas, old):
        if quantized:
            values, scale = quantize_rows(x, arena.dtype, k_scale.dtype)  # [B, T, Hkv, D], [B, T, Hkv]
            new_scales.append(scale)
        else:
            values = x.astype(arena.dtype)
        taken = jnp.take_along_axis(values.transpose(0, 2, 1, 3), t_flat, axis=2)  # [B, Hkv, K*C, D]
        taken = taken.reshape(batch, num_kv_heads, num_chunks, chunk, head_dim).transpose(0, 2, 1, 3, 4)
        old_edges = old_edges.reshape(batch, 2, num_kv_heads, chunk, head_dim)
        kept = jnp.where(first, old_edges[:, :1], old_edges[:, 1:])  # [B, K, Hkv, C, D]
        rows = jnp.where(new[:, :, None, :, None], taken, kept)
        staged.append(rows.reshape(batch * num_chunks, num_kv_heads, chunk, head_dim))
    if quantized:
        st_flat = st.reshape(batch, 1, num_spages * page_size)
        for scale, old_rows in zip(new_scales, old[2:]):  # [B, T, Hkv], [B * Kp, Hkv, 1, S or 128]
            taken = jnp.take_along_axis(scale.transpose(0, 2, 1), st_flat, axis=2)  # [B, Hkv, Kp*S]
            taken = taken.reshape(batch, num_kv_heads, num_spages, page_size).transpose(0, 2, 1, 3)
            if rows_format:  # each new scale into its row's owner's copy, at its page's lanes
                lane = (flat(spage) % (128 // page_size))[:, None] * page_size + arange(page_size)[None, :]  # [E, S]
                written = snew.reshape(sentries, page_size) & flat(slive)[:, None]
                target = jnp.where(written, owner[:, None], sentries)  # [E, S]: out of range = not written
                rows = old_rows[:, :, 0].transpose(0, 2, 1).at[target, lane].set(
                    taken.reshape(sentries, num_kv_heads, page_size).transpose(0, 2, 1), mode="drop")  # [E, 128, Hkv]
                staged.append(rows.transpose(0, 2, 1)[:, :, None])
                continue
            old_rows = old_rows.reshape(batch, num_spages, num_kv_heads, page_size)
            rows = jnp.where(snew[:, :, None, :], taken, old_rows)  # [B, Kp, Hkv, S]
            staged.append(rows.reshape(batch * num_spages, num_kv_heads, 1, page_size))
    n_live, c_page, c_off, c_idx = _compact(flat(live), flat(page), flat(offset), arange(batch * num_chunks))
    meta = meta.at[1].set(jnp.where(layer_ok, n_live, 0))
    return tuple(_chunk_dma((meta, c_page, c_off, c_idx) + s_tables, arenas, staged, to_arena=True, chunk=chunk,
                            interpret=interpret, name=f"tpu_append_scatter_c{chunk}_d{head_dim}{dtype_tag}",
                            moved=nbytes(staged)))


def tpu_paged_append(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens, *, k_scale=None, v_scale=None,
                     interpret=None):
    """`pallas_kernels.paged_append`'s contract, as a Mosaic TPU kernel (see the module docstring).

    k_arena, v_arena: [L, Hkv, P, S, D]; k, v: [B, T, Hkv, D]; layer: int or traced i32
    scalar; page_map: i32[B, M] (-1 unmapped); lengths, num_tokens: i32[B]. Returns the
    updated (k_arena, v_arena), and for an 8-bit arena (float32 `k_scale, v_scale` [L, Hkv, P, S];
    pages of 16, 32 or 64: scale rows [L, Hkv, P * S / 128, 128], `tpu.common.scale_rows`)
    (k_arena, v_arena, k_scale, v_scale). Donate the arena in your jit to update it in place.
    `interpret`: None (compile on a TPU, TPU interpret mode elsewhere), True, or `InterpretParams`.
    """
    (ks, rows_k), (vs, rows_v) = logical_scales(k_arena, k_scale), logical_scales(k_arena, v_scale)
    num_layers, num_kv_heads, _, page_size, head_dim = check_arena(k_arena, v_arena, ks, vs)
    check_tokens("k", k, batch=None, heads=num_kv_heads, head_dim=head_dim)
    check_tokens("v", v, batch=k.shape[0], heads=num_kv_heads, head_dim=head_dim)
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    reason = tpu_unsupported_reason(head_dim=head_dim, page_size=page_size, dtype=k_arena.dtype,
                                    scale_dtype=None if k_scale is None else k_scale.dtype, scale_rows=rows_k and rows_v)
    if reason:
        raise ValueError(reason)
    layer = check_layer(layer, num_layers)[0]
    page_map, lengths, num_tokens = check_rows(page_map, lengths, num_tokens, k.shape[0])
    batch, tokens = k.shape[:2]
    chunks = -(-(tokens + append_chunk(page_size, k_arena.dtype) - 1) // append_chunk(page_size, k_arena.dtype))
    scale_rows = -(-(tokens + page_size - 1) // page_size) if k_scale is not None else 0
    check_smem_tables(f"append of [{batch}, {tokens}] tokens (chunk lists)", 3 * batch * max(chunks, 2) + 2 * batch * scale_rows + 3)
    return _tpu_append_call(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens, k_scale, v_scale,
                            interpret=resolve_tpu_interpret(interpret))
