"""Paged append: write new K/V tokens into their pages, in place.

One program per (batch row, KV head, block of new tokens). Each token looks up its own
physical page (`page_map[b, pos // page_size]`), so a block may straddle page boundaries.
The arena is updated through `input_output_aliases`: under a jit that donates the arena only
the new tokens' bytes move. Masked lanes (padding tokens, rows with num_tokens == 0,
unmapped pages, positions past the page table) are pointed at the out-of-range page
`num_pages` and masked, so they neither write on GPU nor collide with a live lane when
interpret mode discharges the store into a scatter (which drops out-of-range indices).
`head_dim` (any multiple of 8) is padded to a power-of-two tile; lanes past it are masked
(and out of range, so interpret mode drops them too): nothing past a head is read or written.

8-bit arenas (int8, float8_e4m3fn, float8_e5m2): the program quantizes its block of tokens
in registers (`pallas_kernels.quant.quantize_rows`: absmax per token row of one head, the
rounding and saturation rules written there) and stores the 8-bit values and one scale per
token into `k_scale` / `v_scale` [layers, kv_heads, pages, page_size], aliased in place like
the values; dead lanes write neither.
Contract: `pallas_kernels.reference.append_reference`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    BlockSizes,
    cdiv,
    check_arena,
    check_layer,
    check_rows,
    check_tokens,
    compiler_params,
    head_tile,
    index_of,
    masked_load,
    masked_store,
    resolve_interpret,
)
from pallas_kernels.quant import quantize_rows
from pallas_kernels.reference import append_reference

__all__ = ["paged_append", "append_reference"]


def _append_kernel(
    # inputs
    layer_ref,  # i32[1]
    lengths_ref,  # i32[batch]
    num_tokens_ref,  # i32[batch]
    page_map_ref,  # i32[batch, max_pages]
    k_ref,  # [batch, tokens, kv_heads, head_dim]
    v_ref,  # [batch, tokens, kv_heads, head_dim]
    k_arena_in_ref,  # [layers, kv_heads, pages, page_size, head_dim] (aliased to k_arena_ref)
    v_arena_in_ref,  # [layers, kv_heads, pages, page_size, head_dim] (aliased to v_arena_ref)
    *refs,  # 8-bit arenas: k_scale_in_ref, v_scale_in_ref [layers, kv_heads, pages, page_size] (aliased)
    # outputs: k_arena_ref, v_arena_ref [layers, kv_heads, pages, page_size, head_dim]
    #          (8-bit arenas: then k_scale_ref, v_scale_ref [layers, kv_heads, pages, page_size])
    block_tokens: int,
    tile_d: int,
    quantized: bool,
):
    del k_arena_in_ref, v_arena_in_ref  # same buffers as the outputs
    if quantized:
        _, _, k_arena_ref, v_arena_ref, k_scale_ref, v_scale_ref = refs  # inputs aliased to the outputs
    else:
        k_arena_ref, v_arena_ref = refs
        k_scale_ref = v_scale_ref = None
    b, h, tb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_layers, _, num_pages, page_size, head_dim = k_arena_ref.shape
    _, tokens, _, _ = k_ref.shape
    max_pages = page_map_ref.shape[1]

    layer = layer_ref[0]
    length = lengths_ref[b]
    n_new = num_tokens_ref[b]
    n_valid = jnp.clip(n_new, 0, tokens)

    t = tb * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)  # [block_tokens]
    pos = length - n_new + t  # position of each new token in its sequence
    pos_c = jnp.maximum(pos, 0)
    logical = lax.div(pos_c, page_size)
    live = (t < n_valid) & (pos >= 0) & (logical < max_pages) & (layer >= 0) & (layer < num_layers)
    (pm_b, pm_l) = index_of(b, jnp.minimum(logical, max_pages - 1))
    page = masked_load(page_map_ref.at[pm_b, pm_l], mask=live, other=-1)  # [block_tokens]
    live &= (page >= 0) & (page < num_pages)
    # Dead lanes aim at page `num_pages` (out of range): masked on GPU, dropped in interpret.
    page = jnp.where(live, page, num_pages)
    offset = jnp.where(live, lax.rem(pos_c, page_size), 0)
    layer = jnp.clip(layer, 0, num_layers - 1)

    d = jnp.arange(tile_d, dtype=jnp.int32)[None, :]  # [1, tile_d]; lanes >= head_dim are padding
    mask = live[:, None] & (d < head_dim)  # [block_tokens, tile_d]
    src = index_of(b, jnp.minimum(t, tokens - 1)[:, None], h, d)  # [block_tokens, tile_d] each
    dst = index_of(layer, h, page[:, None], offset[:, None], d)
    for x_ref, arena_ref, scale_ref in ((k_ref, k_arena_ref, k_scale_ref), (v_ref, v_arena_ref, v_scale_ref)):
        x = masked_load(x_ref.at[src], mask=mask, other=0)  # [block_tokens, tile_d]
        if scale_ref is None:
            masked_store(arena_ref.at[dst], x.astype(arena_ref.dtype), mask=mask)
            continue
        # Padding lanes (d >= head_dim) and dead rows loaded as 0: they change no row's absmax.
        values, scale = quantize_rows(x, arena_ref.dtype, scale_ref.dtype)  # [block_tokens, tile_d], [block_tokens]
        masked_store(arena_ref.at[dst], values, mask=mask)
        masked_store(scale_ref.at[index_of(layer, h, page, offset)], scale, mask=live)


@functools.partial(jax.jit, static_argnames=("block_sizes", "interpret"))
def _paged_append_call(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens, k_scale, v_scale, *, block_sizes,
                       interpret):
    num_layers, num_kv_heads, num_pages, page_size, head_dim = k_arena.shape
    batch, tokens, _, _ = k.shape
    block_tokens = block_sizes.block_tokens
    quantized = k_scale is not None
    grid = (batch, num_kv_heads, cdiv(tokens, block_tokens))
    kernel = functools.partial(_append_kernel, block_tokens=block_tokens, tile_d=head_tile(head_dim), quantized=quantized)
    arena_shape = jax.ShapeDtypeStruct(k_arena.shape, k_arena.dtype)
    out_shape, aliases, arenas = (arena_shape, arena_shape), {6: 0, 7: 1}, (k_arena, v_arena)
    name = f"paged_append_bt{block_tokens}_d{head_tile(head_dim)}"
    if quantized:
        scale_shape = jax.ShapeDtypeStruct(k_scale.shape, k_scale.dtype)
        out_shape, aliases, arenas = out_shape + (scale_shape, scale_shape), {6: 0, 7: 1, 8: 2, 9: 3}, arenas + (k_scale, v_scale)
        name += f"_{jnp.dtype(k_arena.dtype).name}"
    # No BlockSpecs: every ref is the whole array (the kernel gathers by page itself).
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name=name,
    )(layer, lengths, num_tokens, page_map, k, v, *arenas)


def paged_append(
    k_arena,
    v_arena,
    layer,
    k,
    v,
    page_map,
    lengths,
    num_tokens,
    *,
    k_scale=None,
    v_scale=None,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
):
    """Write `k, v: [B, T, Hkv, D]` into the last `num_tokens[b]` positions of each row, in place.

    k_arena, v_arena: [L, Hkv, P, S, D] (bf16/fp16/fp32; k, v are cast to the arena dtype);
    layer: int or traced i32 scalar; page_map: i32[B, M] (-1 unmapped); lengths, num_tokens:
    i32[B] (lengths counts the new tokens). Returns the updated (k_arena, v_arena). Call it
    inside a jit that donates the arena: the aliasing then updates it in place (called
    eagerly, XLA copies the arena first, leaving the input intact).

    8-bit arenas (int8 / float8_e4m3fn / float8_e5m2) take `k_scale, v_scale: [L, Hkv, P, S]`
    (float32 or bfloat16); k, v (bf16/fp16/fp32) are quantized per token and head
    (`pallas_kernels.quant`) and (k_arena, v_arena, k_scale, v_scale) are returned.
    """
    num_layers, num_kv_heads, _, page_size, head_dim = check_arena(k_arena, v_arena, k_scale, v_scale)
    check_tokens("k", k, batch=None, heads=num_kv_heads, head_dim=head_dim)
    check_tokens("v", v, batch=k.shape[0], heads=num_kv_heads, head_dim=head_dim)
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    layer = check_layer(layer, num_layers)
    page_map, lengths, num_tokens = check_rows(page_map, lengths, num_tokens, k.shape[0])
    block_sizes = (block_sizes or BlockSizes()).filled(BlockSizes.for_append(tokens=k.shape[1], head_dim=head_dim))
    return _paged_append_call(
        k_arena,
        v_arena,
        layer,
        k,
        v,
        page_map,
        lengths,
        num_tokens,
        k_scale,
        v_scale,
        block_sizes=block_sizes,
        interpret=resolve_interpret(interpret),
    )
