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
    arena_format,
    cdiv,
    check_arena,
    check_layer,
    check_rotate,
    check_rows,
    check_tokens,
    compiler_params,
    head_tile,
    index_of,
    masked_load,
    masked_store,
    resolve_interpret,
)
from pallas_kernels.gpu._tiles import lane_parts, part_lanes, part_width, rotated_part, rotation_inputs
from pallas_kernels.quant import quantize_chunks, quantize_rows
from pallas_kernels.quant4 import GROUP, HALF, finite_flags, quantize_halves
from pallas_kernels.reference import append_reference
from pallas_kernels.rotation import rotate_rows

__all__ = ["paged_append", "append_reference"]


def _append_kernel(
    # inputs
    layer_ref,  # i32[1]
    lengths_ref,  # i32[batch]
    num_tokens_ref,  # i32[batch]
    page_map_ref,  # i32[batch, max_pages]
    k_ref,  # [batch, tokens, kv_heads, head_dim]
    v_ref,  # [batch, tokens, kv_heads, head_dim]
    k_arena_in_ref,  # [layers, kv_heads, pages, page_size, head_dim (int4: head_dim / 2 bytes)] (aliased)
    v_arena_in_ref,  # the same (aliased to v_arena_ref)
    *refs,  # quantized arenas: k_scale_in_ref, v_scale_in_ref [layers, kv_heads, pages, page_size(, groups)]
    #         (aliased); rotated keys: m_ref f32[head_dim, head_dim], cs_ref f32[head_dim]; then
    # outputs: k_arena_ref, v_arena_ref (quantized arenas: then k_scale_ref, v_scale_ref)
    block_tokens: int,
    tile_d: int,
    head_dim: int,
    fmt: str,
    rotate: bool,
    part_width: int,
):
    del k_arena_in_ref, v_arena_in_ref  # same buffers as the outputs
    quantized = fmt != "float"
    if quantized:
        _, _, *refs = refs  # the scale inputs, aliased to the outputs
    m_ref = cs_ref = None
    if rotate:
        m_ref, cs_ref, *refs = refs
    if quantized:
        k_arena_ref, v_arena_ref, k_scale_ref, v_scale_ref = refs
    else:
        k_arena_ref, v_arena_ref = refs
        k_scale_ref = v_scale_ref = None
    b, h, tb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_layers, _, num_pages, page_size, _ = k_arena_ref.shape
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
    t_src = jnp.minimum(t, tokens - 1)[:, None]

    d = jnp.arange(tile_d, dtype=jnp.int32)[None, :]  # [1, tile_d]; lanes >= head_dim are padding
    mask = live[:, None] & (d < head_dim)  # [block_tokens, tile_d]
    src = index_of(b, t_src, h, d)  # [block_tokens, tile_d] each
    dst = index_of(layer, h, page[:, None], offset[:, None], d)
    for x_ref, arena_ref, scale_ref, is_k in ((k_ref, k_arena_ref, k_scale_ref, True),
                                              (v_ref, v_arena_ref, v_scale_ref, False)):
        rotated = rotate and is_k
        if fmt == "float" or (fmt == "8bit" and not rotated):
            x = masked_load(x_ref.at[src], mask=mask, other=0)  # [block_tokens, tile_d]
            if scale_ref is None:
                masked_store(arena_ref.at[dst], x.astype(arena_ref.dtype), mask=mask)
                continue
            # Padding lanes (d >= head_dim) and dead rows loaded as 0: they change no row's absmax.
            values, scale = quantize_rows(x, arena_ref.dtype, scale_ref.dtype)  # [block_tokens, tile_d], [block_tokens]
            masked_store(arena_ref.at[dst], values, mask=mask)
            masked_store(scale_ref.at[index_of(layer, h, page, offset)], scale, mask=live)
            continue
        # The row in parts (lanes [start, start + width)): rotated keys are computed part by part
        # from the whole row (x @ M[:, part] in f32), other rows are loaded part by part.
        if fmt == "int4":  # the two 16-lane halves of each group: the low and high nibbles of its 16 bytes
            parts = [(g * GROUP + half * HALF, HALF) for g in range(head_dim // GROUP) for half in (0, 1)]
        else:
            parts = lane_parts(head_dim, tile_d, int4=False, width=part_width)
        if rotated:  # the dots in x's dtype (f32: three exact bf16 parts), the products exact
            x = masked_load(x_ref.at[src], mask=mask, other=0)  # [block_tokens, tile_d]
            chunks = [rotated_part(x, m_ref, cs_ref, part, head_dim, tile_d) for part in parts]
        else:
            chunks = [masked_load(x_ref.at[index_of(b, t_src, h, part_lanes(p)[None, :])],
                                  mask=live[:, None] & (part_lanes(p)[None, :] < head_dim), other=0) for p in parts]
        if fmt == "8bit":  # one scale over the whole (rotated) row
            values, scale = quantize_chunks(chunks, arena_ref.dtype, scale_ref.dtype)
            for part, vals in zip(parts, values):
                lanes = part_lanes(part)[None, :]
                masked_store(arena_ref.at[index_of(layer, h, page[:, None], offset[:, None], lanes)], vals,
                             mask=live[:, None] & (lanes < head_dim))
            masked_store(scale_ref.at[index_of(layer, h, page, offset)], scale, mask=live)
            continue
        # int4: one scale per group of 32 lanes (two parts: its 16-lane halves, one byte each
        # lane pair); a non-finite lane anywhere poisons the whole row (every group's scale NaN).
        finite = finite_flags(*chunks)  # [block_tokens]
        for g in range(head_dim // GROUP):
            packed, scale = quantize_halves(chunks[2 * g], chunks[2 * g + 1], finite, scale_ref.dtype)
            nbytes = g * HALF + jnp.arange(HALF, dtype=jnp.int32)[None, :]  # [1, 16]
            masked_store(arena_ref.at[index_of(layer, h, page[:, None], offset[:, None], nbytes)], packed,
                         mask=live[:, None] & (nbytes >= 0))
            masked_store(scale_ref.at[index_of(layer, h, page, offset, g)], scale, mask=live)


@functools.partial(jax.jit, static_argnames=("rotate_keys", "block_sizes", "interpret"))
def _paged_append_call(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens, k_scale, v_scale, *, rotate_keys,
                       block_sizes, interpret):
    num_layers, num_kv_heads, num_pages, page_size, _ = k_arena.shape
    batch, tokens, _, head_dim = k.shape
    block_tokens = block_sizes.block_tokens
    fmt = arena_format(k_arena.dtype)
    quantized = k_scale is not None
    tile_d = head_tile(head_dim)
    grid = (batch, num_kv_heads, cdiv(tokens, block_tokens))
    if rotate_keys and jnp.dtype(k.dtype) == jnp.dtype(jnp.float32):  # [B, T, Hkv, D] rotated in f32, then as given
        k, rotate_keys = rotate_rows(k), False
    kernel = functools.partial(_append_kernel, block_tokens=block_tokens, tile_d=tile_d, head_dim=head_dim, fmt=fmt,
                               rotate=rotate_keys, part_width=part_width(tile_d, 2))
    arena_shape = jax.ShapeDtypeStruct(k_arena.shape, k_arena.dtype)
    out_shape, aliases, arenas = (arena_shape, arena_shape), {6: 0, 7: 1}, (k_arena, v_arena)
    name = f"paged_append_bt{block_tokens}_d{tile_d}"
    if quantized:
        scale_shape = jax.ShapeDtypeStruct(k_scale.shape, k_scale.dtype)
        out_shape, aliases, arenas = out_shape + (scale_shape, scale_shape), {6: 0, 7: 1, 8: 2, 9: 3}, arenas + (k_scale, v_scale)
        name += "_int4" if fmt == "int4" else f"_{jnp.dtype(k_arena.dtype).name}"
    rotation = ()
    if rotate_keys:
        rotation = rotation_inputs(head_dim, k.dtype)
        name += "_rot"
    # No BlockSpecs: every ref is the whole array (the kernel gathers by page itself).
    return pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=compiler_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name=name,
    )(layer, lengths, num_tokens, page_map, k, v, *arenas, *rotation)


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
    rotate_keys: bool = False,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
):
    """Write `k, v: [B, T, Hkv, D]` into the last `num_tokens[b]` positions of each row, in place.

    k_arena, v_arena: [L, Hkv, P, S, D] (bf16/fp16/fp32; k, v are cast to the arena dtype);
    layer: int or traced i32 scalar; page_map: i32[B, M] (-1 unmapped); lengths, num_tokens:
    i32[B] (lengths counts the new tokens). Returns the updated (k_arena, v_arena). Call it
    inside a jit that donates the arena: the aliasing then updates it in place (called
    eagerly, XLA copies the arena first, leaving the input intact).

    Quantized arenas take `k_scale, v_scale` and return (k_arena, v_arena, k_scale, v_scale);
    k, v (bf16/fp16/fp32) are quantized on write. 8-bit (int8 / float8_e4m3fn / float8_e5m2):
    one scale per token and head, [L, Hkv, P, S] (`pallas_kernels.quant`). int4: uint8 arenas
    [L, Hkv, P, S, D / 2] (two codes a byte), one scale per group of 32 lanes, [L, Hkv, P, S,
    D / 32] (`pallas_kernels.quant4`). Scales are float32 or bfloat16. `rotate_keys`
    (quantized arenas): keys are rotated before quantization (`pallas_kernels.rotation`;
    attention must then be called with `rotate_keys=True` too).
    """
    num_layers, num_kv_heads, _, page_size, head_dim = check_arena(k_arena, v_arena, k_scale, v_scale)
    rotate_keys = check_rotate(rotate_keys, arena_format(k_arena.dtype))
    check_tokens("k", k, batch=None, heads=num_kv_heads, head_dim=head_dim)
    check_tokens("v", v, batch=k.shape[0], heads=num_kv_heads, head_dim=head_dim)
    if k.shape != v.shape:
        raise ValueError(f"k {k.shape} and v {v.shape} must have the same shape")
    layer = check_layer(layer, num_layers)
    page_map, lengths, num_tokens = check_rows(page_map, lengths, num_tokens, k.shape[0])
    # float32 keys are rotated by XLA before the kernel (`rotate_rows`, the reference's own
    # product): the kernel's exact three-dot split of an f32 row spills at head_dim 256.
    rotate_in_kernel = rotate_keys and jnp.dtype(k.dtype) != jnp.dtype(jnp.float32)
    defaults = BlockSizes.for_append(tokens=k.shape[1], head_dim=head_dim, rotate=rotate_in_kernel,
                                     int4=arena_format(k_arena.dtype) == "int4")
    block_sizes = (block_sizes or BlockSizes()).filled(defaults)
    if rotate_in_kernel and block_sizes.block_tokens < 16:
        raise ValueError(f"BlockSizes.block_tokens={block_sizes.block_tokens}: a rotated append needs >= 16 "
                         "(the rotation is a dot, and Triton's dots take 16 rows or more)")
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
        rotate_keys=rotate_keys,
        block_sizes=block_sizes,
        interpret=resolve_interpret(interpret),
    )
