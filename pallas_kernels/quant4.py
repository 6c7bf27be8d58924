"""4-bit KV rows: symmetric int4 codes with one scale per group of 32 lanes, two codes a byte.

A row (one token of one KV head, `head_dim` lanes, head_dim a multiple of 32) is stored as
`head_dim / 2` bytes (uint8) plus `head_dim / 32` scales (bfloat16 by default, or float32),
so that lane d ~= code[d] * scale[d // 32]. The rules, identical in the Pallas append
kernel and the jnp reference (both call `quantize_halves`):

    absmax = max |x| over the group's 32 lanes (x upcast to float32)
    scale  = absmax * fl32(1 / 7), rounded to the scale dtype
    y      = x * fl32(1 / scale)       (the *stored* scale)
    code   = clip(round_half_to_even(y), -7, 7)        (symmetric: -8 is never used)
    dequantized lane = float32(code) * float32(scale)

Packing (`GROUP` = 32 lanes = 16 bytes): byte 16 g + j holds lane 32 g + j in its low nibble
and lane 32 g + 16 + j in its high nibble (two's complement). So each group is one 16-byte
vector whose low nibbles are the group's first 16 lanes and whose high nibbles are the next
16: the kernels read a group with one contiguous load and get two 16-lane halves without any
lane shuffle (an interleaved packing, lanes 2j / 2j + 1, would need one).

- Zero groups (absmax 0, or < 2**-64 where 1 / scale could overflow) store codes 0, scale 0:
  exact zeros back.
- A non-finite value (NaN, +-inf) anywhere in the *row* stores codes 0 and scale NaN in every
  group of the row: the whole row dequantizes to NaN (as an 8-bit row's single scale does),
  so every query that attends to that token (at that head) gets NaN in its whole output row.
- Error bound (finite rows): half a step, `scale / 2` = absmax_group / 14, plus float32 and
  scale-dtype rounding (`error_bound`): about 7% of the group's absmax at worst.
- Saturation: the clip; finite inputs never give anything but codes in [-7, 7].
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant import QUANTIZED_DTYPES, TINY_ABSMAX, _round_half_to_even

__all__ = ["GROUP", "HALF", "QMAX4", "PACKED_DTYPE", "INT4", "arena_format", "quantize_halves", "quantize_groups", "unpack_codes",
           "dequantize_groups", "error_bound", "num_groups"]

GROUP = 32  # lanes per scale
HALF = GROUP // 2  # lanes per nibble half of a group (= bytes per group)
QMAX4 = 7.0
PACKED_DTYPE = jnp.dtype(jnp.uint8)  # what an int4 arena stores: two codes a byte
INT4 = jnp.dtype(jnp.int4)  # a layout's name for it
_F32_MAX = float(np.finfo(np.float32).max)


def arena_format(dtype) -> str:
    """"float", "8bit" or "int4" for an arena array's dtype (uint8: packed int4) or a layout's (int4)."""
    dtype = jnp.dtype(dtype)
    if dtype in (PACKED_DTYPE, INT4):
        return "int4"
    return "8bit" if dtype in QUANTIZED_DTYPES else "float"


def num_groups(head_dim: int) -> int:
    return head_dim // GROUP


def finite_flags(*parts):
    """bool[...]: every lane of every part [..., n] is finite (max of 0 / 1 flags: no NaN in a max)."""
    flags = [jnp.max(jnp.where(jnp.abs(p.astype(jnp.float32)) <= _F32_MAX, 0.0, 1.0), axis=-1) for p in parts]
    out = flags[0]
    for f in flags[1:]:
        out = jnp.maximum(out, f)
    return out == 0.0


def quantize_halves(lo, hi, finite, scale_dtype):
    """One group of every row: lo, hi [..., 16] (lanes 32 g + j and 32 g + 16 + j; any float
    dtype), finite bool[...] (the whole row's flag) -> (bytes uint8 [..., 16], scale [...]).

    Padding lanes must be zero; they change neither the absmax nor the flag."""
    lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
    absmax = jnp.maximum(jnp.max(jnp.abs(lo), axis=-1), jnp.max(jnp.abs(hi), axis=-1))
    live = finite & (absmax >= TINY_ABSMAX)  # NaN >= tiny is False; a finite row has a finite absmax
    scale = jnp.where(live, absmax * np.float32(1.0 / QMAX4), 0.0)
    scale = jnp.where(finite, scale, jnp.nan).astype(scale_dtype)
    stored = scale.astype(jnp.float32)
    inv = jnp.where(live, 1.0 / jnp.where(live, stored, 1.0), 0.0)[..., None]
    codes = []
    for half in (lo, hi):
        y = jnp.where(live[..., None], jnp.clip(half * inv, -QMAX4, QMAX4), 0.0)  # NaN * 0 is NaN: select
        codes.append(_round_half_to_even(y).astype(jnp.int32) & 15)  # two's complement nibble
    packed = codes[0] | (codes[1] << 4)
    return packed.astype(PACKED_DTYPE), scale


def _split(x):
    """x [..., D] -> (lo, hi) [..., G, 16]: each group's first and second 16 lanes."""
    g = x.reshape(*x.shape[:-1], x.shape[-1] // GROUP, 2, HALF)
    return g[..., 0, :], g[..., 1, :]


def quantize_groups(x, scale_dtype=jnp.bfloat16, finite=None):
    """x [..., D] (D a multiple of 32) -> (packed uint8 [..., D / 2], scales [..., D / 32] scale_dtype).

    `finite` (bool[...], default: every lane of x finite) is the row's flag: False stores the
    whole row as NaN scales (the rotated path passes the flag of the rotated row)."""
    x = x.astype(jnp.float32)
    if finite is None:
        finite = finite_flags(x)
    lo, hi = _split(x)
    packed, scale = quantize_halves(lo, hi, finite[..., None], jnp.dtype(scale_dtype))
    return packed.reshape(*x.shape[:-1], x.shape[-1] // 2), scale


def nibbles(packed):
    """uint8 bytes [...] -> (low codes, high codes) int32 [...] in [-8, 7] (stored codes: [-7, 7])."""
    b = packed.astype(jnp.int32)
    lo, hi = b & 15, (b >> 4) & 15
    return (lo ^ 8) - 8, (hi ^ 8) - 8


def unpack_codes(packed):
    """packed uint8 [..., D / 2] -> codes int32 [..., D] (lane order)."""
    lo, hi = nibbles(packed.reshape(*packed.shape[:-1], packed.shape[-1] // HALF, HALF))  # [..., G, 16] each
    return jnp.stack([lo, hi], axis=-2).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_groups(packed, scales):
    """packed uint8 [..., D / 2], scales [..., D / 32] -> float32 [..., D]."""
    codes = unpack_codes(packed).astype(jnp.float32)
    codes = codes.reshape(*codes.shape[:-1], -1, GROUP) * scales.astype(jnp.float32)[..., None]
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def error_bound(x, scale_dtype=jnp.bfloat16):
    """Per-element bound on |dequantize(quantize(x)) - x| for finite rows x [..., D] (numpy
    float64): half a step of the lane's group (absmax / 14), plus the scale's rounding (a bf16
    scale is within 2**-8 of absmax / 7, which moves a code's value by at most 7 * 2**-8 of
    a step... bounded by 2**-8 |x| + a step's float32 ulps) and float32 rounding."""
    x = np.asarray(x, np.float64)
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    absmax = np.max(np.abs(g), axis=-1, keepdims=True)
    step = absmax / QMAX4
    rel = 2.0**-8 if jnp.dtype(scale_dtype) == jnp.dtype(jnp.bfloat16) else 2.0**-20
    bound = step / 2 * (1 + 2.0**-7) + rel * (np.abs(g) + absmax) + 2.0**-22 * absmax
    return np.broadcast_to(bound, g.shape).reshape(x.shape)
