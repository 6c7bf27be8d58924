"""In-kernel pieces shared by the append and attention kernels: the key rotation as dots and
lane parts of a row (int4 nibbles: `quant4.nibbles`). Every function here runs inside a Pallas kernel (and
in interpret mode on CPU); shapes are Triton tiles (powers of two, >= 16 for dots)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import index_of, masked_load
from pallas_kernels.quant4 import GROUP, HALF
from pallas_kernels.rotation import rotation

__all__ = ["dot", "rotation_inputs", "rotated_part", "lane_parts", "part_lanes", "part_width", "int4_group", "split_f32"]


def dot(a, b, *, transpose_b: bool = False):
    """a @ b (or a @ b.T) accumulated in float32; fp32 inputs use full (IEEE) precision."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    contract = (((1,), (1,)) if transpose_b else ((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, contract, precision=precision, preferred_element_type=jnp.float32)


def rotation_inputs(head_dim: int, dtype):
    """The rotation as kernel inputs: (M [D, D] in the dots' 16-bit dtype (fp16 for fp16 rows,
    else bf16), entries +-1 / 0, exact; col_scale f32[D]). `pallas_kernels.rotation` defines them."""
    m, col_scale = rotation(head_dim)
    m_dtype = jnp.float16 if jnp.dtype(dtype) == jnp.dtype(jnp.float16) else jnp.bfloat16
    return jnp.asarray(m, m_dtype), jnp.asarray(col_scale, jnp.float32)


def part_width(tile_d: int, itemsize: int) -> int:
    """Lanes per part of a rotated 8-bit row: the [tile_d, width] block of M stays within 32 KiB
    of shared memory (bf16 tile 128: one part; 256: four of 64; f32 256: eight of 32)."""
    return max(16, min(tile_d, 32768 // (tile_d * itemsize)))


def lane_parts(head_dim: int, tile_d: int, *, int4: bool, width: int | None = None) -> list[tuple[int, int]]:
    """The lanes of a row's parts as (first lane, width), each a contiguous range: int4, its
    groups of 32 lanes; otherwise blocks of `width` lanes over the tile (lanes >= head_dim are
    masked wherever a part is loaded or stored)."""
    if int4:
        return [(g * GROUP, GROUP) for g in range(head_dim // GROUP)]
    return [(start, width) for start in range(0, tile_d, width)]


def int4_group(ref, layer, h, page, offset, live, g: int):
    """Codes int32 [block_k, 32] of group g of a block of keys (rows `page`, `offset` i32[block_k])
    of an int4 arena, in lane order: lane c of the group is byte 16 g + c % 16, low nibble for
    c < 16, high for c >= 16 (the two halves load the same 16 contiguous bytes: vector loads)."""
    c = jnp.arange(GROUP, dtype=jnp.int32)[None, :]
    byte = g * HALF + lax.rem(c, HALF)
    packed = masked_load(ref.at[index_of(layer, h, page[:, None], offset[:, None], byte)],
                         mask=live[:, None] & (c >= 0), other=0).astype(jnp.int32)
    nib = (packed >> (lax.div(c, HALF) * 4)) & 15
    return (nib ^ 8) - 8


def part_lanes(part: tuple[int, int]):
    """i32[width]: the lanes of a part (built from an iota: kernels capture no array constants)."""
    start, width = part
    return start + jnp.arange(width, dtype=jnp.int32)


def split_f32(x):
    """x f32 -> (hi, mid, lo) bf16 with hi + mid + lo == x exactly (8 + 8 + 8 significant bits)."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)  # exact
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)  # exact: what is left fits 8 bits
    return hi, mid, lo


def rotated_part(x, m_ref, cs_ref, part: tuple[int, int], head_dim: int, tile_d: int):
    """x [rows, tile_d] (lanes >= head_dim zero) -> the part's lanes of the rotated rows, float32
    [rows, width]: `(x @ M[:, lanes]) * col_scale[lanes]`. M's entries are +-1 / 0, so every
    product is exact and only the f32 sums round: bf16 / fp16 x in one tensor-core dot of its
    dtype; f32 x as three bf16 dots over its exact split (`split_f32`: Triton's f32 FMA dots
    spill at these sizes). M is given in bf16 / fp16 (any 16-bit dtype holds +-1 exactly)."""
    i = jnp.arange(tile_d, dtype=jnp.int32)[:, None]
    j = part_lanes(part)
    col_live = j < head_dim
    m = masked_load(m_ref.at[index_of(i, j[None, :])], mask=(i < head_dim) & col_live[None, :], other=0)
    scale = masked_load(cs_ref.at[j], mask=col_live, other=0.0)
    if x.dtype == jnp.float32:
        m = m.astype(jnp.bfloat16)
        hi, mid, lo = split_f32(x)
        y = dot(hi, m) + dot(mid, m) + dot(lo, m)
    else:
        y = dot(x, m.astype(x.dtype))
    return y * scale[None, :]
