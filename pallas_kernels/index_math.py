"""Integer division for page arithmetic on non-negative values.

`jnp`'s `//` and `%` on signed integers round toward minus infinity: XLA emits a division plus
a sign fix-up (compares, negates, selects), and fuses a copy of that into every fusion that
reads the result. Positions and lengths are never negative (callers clamp what could be), so
dividing them as unsigned integers gives the same values with one instruction, a shift and a
mask when the page size is a power of two. That removed about a fifth of `aj.reserve`'s HLO
instructions (2,731 -> 2,203 at batch 4; docs/design.md, "Compile time").
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = ["div_nonneg", "rem_nonneg", "ceil_div_nonneg"]


def _unsigned(a):
    a = jnp.asarray(a)
    return lax.convert_element_type(a, jnp.uint32), a.dtype


def div_nonneg(a, b: int):
    """a // b for integer arrays a >= 0 and a static int b > 0 (a negative a gives garbage: clamp it first)."""
    u, dtype = _unsigned(a)
    return lax.convert_element_type(lax.div(u, jnp.uint32(b)), dtype)


def rem_nonneg(a, b: int):
    """a % b for integer arrays a >= 0 and a static int b > 0."""
    u, dtype = _unsigned(a)
    return lax.convert_element_type(lax.rem(u, jnp.uint32(b)), dtype)


def ceil_div_nonneg(a, b: int):
    """ceil(a / b) for integer arrays 0 <= a <= 2**31 - b and a static int b > 0."""
    return div_nonneg(jnp.asarray(a) + (b - 1), b)
