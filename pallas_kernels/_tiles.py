"""In-kernel pieces shared by the append and attention kernels: the key rotation as dots and
lane parts of a row (int4 nibbles: `quant4.nibbles`). Every function here runs inside a Pallas kernel (and
in interpret mode on CPU); shapes are Triton tiles (powers of two, >= 16 for dots)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import index_of, masked_load
from pallas_kernels.quant4 import GROUP, HALF
from pallas_kernels.rotation import rotation

__all__ = ["dot", "rotation_inputs", "rotated_part", "lane_parts", "part_lanes", "part_width"]


def dot(a, b, *, transpose_b: bool = False):
    """a @ b (or a @ b.T) accumulated in float32; fp32 inputs use full (IEEE) precision."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    contract = (((1,), (1,)) if transpose_b else ((1,), (0,)), ((), ()))
    return lax.dot_general(a, b, contract, precision=precision, preferred_element_type=jnp.float32)


def rotation_inputs(head_dim: int, dtype):
    """The rotation as kernel inputs: (M [D, D] in `dtype`, entries +-1 / 0, exact in any float
    dtype; col_scale f32[D]). `pallas_kernels.rotation` defines them."""
    m, col_scale = rotation(head_dim)
    return jnp.asarray(m, dtype), jnp.asarray(col_scale, jnp.float32)


def part_width(tile_d: int, itemsize: int) -> int:
    """Lanes per part of a rotated 8-bit row: the [tile_d, width] block of M stays within 32 KiB
    of shared memory (bf16 tile 128: one part; 256: four of 64; f32 256: eight of 32)."""
    return max(16, min(tile_d, 32768 // (tile_d * itemsize)))


def lane_parts(head_dim: int, tile_d: int, *, int4: bool, width: int | None = None) -> list[tuple[int, int]]:
    """The lanes of a row's parts as (first lane, width), each a contiguous range: int4, the two
    16-lane halves of each group of 32 (lo, hi, lo, hi, ...); otherwise blocks of `width` lanes
    over the tile (lanes >= head_dim are masked wherever a part is loaded or stored)."""
    if int4:
        return [(g * GROUP + h * HALF, HALF) for g in range(head_dim // GROUP) for h in (0, 1)]
    return [(start, width) for start in range(0, tile_d, width)]


def part_lanes(part: tuple[int, int]):
    """i32[width]: the lanes of a part (built from an iota: kernels capture no array constants)."""
    start, width = part
    return start + jnp.arange(width, dtype=jnp.int32)


def rotated_part(x, m_ref, cs_ref, part: tuple[int, int], head_dim: int, tile_d: int):
    """x [rows, tile_d] (lanes >= head_dim zero) -> the part's lanes of the rotated rows, float32
    [rows, width]: `(x @ M[:, lanes]) * col_scale[lanes]` (the dot in x's dtype: M's +-1
    entries make the products exact; sums in f32)."""
    i = jnp.arange(tile_d, dtype=jnp.int32)[:, None]
    j = part_lanes(part)
    col_live = j < head_dim
    m = masked_load(m_ref.at[index_of(i, j[None, :])], mask=(i < head_dim) & col_live[None, :], other=0)
    scale = masked_load(cs_ref.at[j], mask=col_live, other=0.0)
    return dot(x, m.astype(x.dtype)) * scale[None, :]
