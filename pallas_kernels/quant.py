"""8-bit KV rows: absmax quantization per token and KV head, and its inverse.

One row is one token of one KV head (`head_dim` values); it is stored as `head_dim` 8-bit
values plus one scale (float32 or bfloat16), so that `row ~= values * scale`. The rules,
identical in the Pallas append kernel and the jnp reference (both call `quantize_rows`):

    absmax = max |x| over the row (x upcast to float32)
    scale  = absmax * fl32(1 / QMAX), rounded to the scale dtype    QMAX: int8 127,
                                                                    float8_e4m3fn 448,
                                                                    float8_e5m2 57344
    y      = x * fl32(1 / scale)       (the *stored* scale: dequantizing inverts what was stored)
    int8   values = clip(round_half_to_even(y), -127, 127)          (-128 is never used: symmetric)
    fp8    values = cast(clip(y, -QMAX, QMAX)), round to nearest even; the clip saturates, so
           finite inputs never give inf or NaN (a bare cast to e4m3fn turns 449 into NaN)
    dequantized row = float32(values) * float32(scale)

- Zero rows (absmax 0), and rows so small that 1 / scale could overflow (absmax < 2**-64,
  about 5.4e-20), store zeros with scale 0: they dequantize to exact zeros, never NaN.
- A non-finite value (NaN, +-inf) anywhere in a row stores zeros with scale NaN: the whole row
  dequantizes to NaN, so every query that sees that token (at that head) gets NaN, on both
  paths, as the float arena's NaN would reach it. (Stricter than a float arena, where a NaN
  in one V lane reaches one output lane and a -inf key can vanish in the softmax: a quantized
  row has one scale, so it is poisoned whole.)
- Error bounds (|dequantized - x|, per element, for finite rows): int8 <= scale / 2 (= absmax
  / 254) plus float32 rounding; fp8 <= 2**-4 (e4m3) / 2**-3 (e5m2) of |x| in the normal range,
  and at most half the smallest subnormal step times the scale below it (`error_bound`).

Division: the kernel computes one reciprocal per row and multiplies; on a GPU Triton's f32
division (`div.full.f32`) may differ from XLA's by an ulp, so compiled and reference values
can differ by one code at an exact rounding tie. Interpret mode is bit-equal.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["QUANTIZED_DTYPES", "SCALE_DTYPES", "QMAX", "is_quantized", "quantize_rows", "quantize_chunks", "dequantize_rows",
           "error_bound"]

QUANTIZED_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
SCALE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
QMAX = {jnp.dtype(jnp.int8): 127.0, jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float8_e5m2): 57344.0}
TINY_ABSMAX = 2.0**-64  # below this a row is stored as zeros (1 / scale stays finite for every dtype)
_F32_MAX = float(np.finfo(np.float32).max)


def is_quantized(dtype) -> bool:
    return dtype is not None and jnp.dtype(dtype) in QUANTIZED_DTYPES


def _round_half_to_even(y):
    """Round float32 y (|y| < 2**22) to the nearest integer, ties to even, with floor only
    (Triton has no round op; the same ops run in XLA, so both paths agree bit for bit)."""
    f = jnp.floor(y)
    d = y - f  # exact for |y| < 2**23
    odd = (f - 2.0 * jnp.floor(f * 0.5)) != 0.0
    return f + jnp.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


def row_scale(absmax, finite, dtype, scale_dtype):
    """(scale [...] scale_dtype, 1 / stored scale f32 [...], live bool[...]) of rows with this
    absmax and finiteness flag (the rules above)."""
    qmax = QMAX[jnp.dtype(dtype)]
    live = finite & (absmax >= TINY_ABSMAX)
    scale = jnp.where(live, absmax * np.float32(1.0 / qmax), 0.0)
    scale = jnp.where(finite, scale, jnp.nan).astype(scale_dtype)
    stored = scale.astype(jnp.float32)
    inv = jnp.where(live, 1.0 / jnp.where(live, stored, 1.0), 0.0)
    return scale, inv, live


def quantize_values(x, inv, live, dtype):
    """x f32 [..., n] (lanes of rows whose `row_scale` gave inv, live [...]) -> values [..., n] dtype."""
    dtype = jnp.dtype(dtype)
    qmax = QMAX[dtype]
    y = jnp.where(live[..., None], jnp.clip(x * inv[..., None], -qmax, qmax), 0.0)  # NaN * 0 is NaN: select
    if dtype == jnp.dtype(jnp.int8):
        y = _round_half_to_even(y)
    return y.astype(dtype)


def _absmax_finite(x):
    mag = jnp.abs(x)
    # NaN compares False: a row is finite iff every |x| <= FLT_MAX (max of 0/1 flags: no NaN in a max).
    return jnp.max(mag, axis=-1), jnp.max(jnp.where(mag <= _F32_MAX, 0.0, 1.0), axis=-1)


def quantize_rows(x, dtype, scale_dtype=jnp.float32):
    """x [..., D] (any float dtype; the last axis is one row) -> (values [..., D] dtype, scale [...] scale_dtype).

    Padding lanes must be zero (the kernel's masked loads give 0): they change neither the
    absmax nor the finiteness of a row.
    """
    (values,), scale = quantize_chunks([x], dtype, scale_dtype)
    return values, scale


def quantize_chunks(chunks, dtype, scale_dtype=jnp.float32):
    """A row given as lane chunks [..., n_i] (e.g. the column blocks of a rotated row): one scale
    over all of them -> ([values [..., n_i] dtype], scale [...]). Same rules as `quantize_rows`."""
    dtype, scale_dtype = jnp.dtype(dtype), jnp.dtype(scale_dtype)
    chunks = [c.astype(jnp.float32) for c in chunks]
    absmax, bad = _absmax_finite(chunks[0])
    for c in chunks[1:]:
        a, b = _absmax_finite(c)
        absmax, bad = jnp.maximum(absmax, a), jnp.maximum(bad, b)
    scale, inv, live = row_scale(absmax, bad == 0.0, dtype, scale_dtype)
    return [quantize_values(c, inv, live, dtype) for c in chunks], scale


def dequantize_rows(values, scale):
    """values [..., D] 8-bit, scale [...] -> float32 [..., D]."""
    return values.astype(jnp.float32) * scale.astype(jnp.float32)[..., None]


def error_bound(x, dtype, scale_dtype=jnp.float32):
    """Per-element bound on |dequantize(quantize(x)) - x| for finite rows x [..., D] (numpy float64).

    int8: half a step (scale / 2). fp8: half an ulp of the scaled value, i.e. 2**-(m+1) of |x|
    with m mantissa bits (3 for e4m3, 2 for e5m2) in the normal range, and half the subnormal
    step (2**(min_exp - m - 1) of the scale) below it. Both plus a few float32 ulps of the row's
    absmax for the scale's own rounding and the reciprocal (bf16 scales: 2**-8).
    """
    dtype = jnp.dtype(dtype)
    x = np.asarray(x, np.float64)
    absmax = np.max(np.abs(x), axis=-1, keepdims=True)
    scale = absmax / QMAX[dtype]
    slack = (2.0**-8 if jnp.dtype(scale_dtype) == jnp.dtype(jnp.bfloat16) else 2.0**-20) * np.abs(x) + 2.0**-22 * absmax
    if dtype == jnp.dtype(jnp.int8):
        return scale / 2 * (1 + 2.0**-7) + slack
    info = jnp.finfo(dtype)
    mant = int(info.nmant)
    subnormal_step = 2.0 ** (int(info.minexp) - mant)  # in scaled units
    return np.maximum(np.abs(x) * 2.0 ** -(mant + 1), scale * subnormal_step / 2) + slack
