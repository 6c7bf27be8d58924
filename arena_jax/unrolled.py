"""Reductions over short static axes as chains of elementwise ops (integers and flags only).

The cache's bookkeeping reduces over a batch's rows or a few counters: axes of a handful of
entries, known when the step is traced. (Never over a model's layers: a folded sum over them
makes the step's program grow with depth, which the layer loop exists to prevent.) As an XLA
reduction each is a kernel of its own, launched every step, and XLA's CPU runtime makes a
buffer entry at every execution for each value of its reducer computation, run or not. Folded
over static slices instead, the reduction is elementwise work that fuses into the kernels that
read it: same values, bit for bit (integer and boolean folds are exact in any order), no
reducer computation. The tiny decode step's in-place path (`reserve` outside its allocator
branch, the plan's rows, the counters) has no reduction left but the plan's sum over layers:
8 fewer reducer computations (37 -> 29), a one-step call 9-29 us faster on a CPU (0.82-0.89x
-> 0.93x the dense step's call), compile within the machine's spread (the folds are copied into
each kernel that reads them; benchmarks/RESULTS.md, "Short reductions folded"). The allocator
branch keeps XLA's reductions: folded too, its kernels grew and the step compiled ~20% slower,
for a branch that runs once every page_size steps.

A reduction over an axis longer than `UNROLL_LIMIT`, or an empty one, is XLA's as before: the
folded form grows with the axis, the reduction does not (folded, a batch of 32 rows compiled its
decode step ~25% slower).
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

__all__ = ["UNROLL_LIMIT", "small_sum", "small_all", "small_min", "small_cumsum"]

# The longest axis folded by elementwise ops (each reduced axis; a reduction over a longer one
# is XLA's). Static: shapes are.
UNROLL_LIMIT = 16


def _axes(x, axis) -> tuple[int, ...]:
    axes = range(x.ndim) if axis is None else (axis if isinstance(axis, (tuple, list)) else (axis,))
    return tuple(sorted({a % x.ndim for a in axes}))


def _fold(x, axis, combine, reduction):
    axes = _axes(x, axis)
    if not axes or any(x.shape[a] == 0 or x.shape[a] > UNROLL_LIMIT for a in axes):
        return reduction(x, axis=axes)
    for a in reversed(axes):  # the highest first: the lower axes keep their numbers
        x = functools.reduce(combine, [lax.index_in_dim(x, i, a, keepdims=False) for i in range(x.shape[a])])
    return x


def _integers(x, dtype):
    x = jnp.asarray(x)
    if dtype is not None:
        return x.astype(dtype)
    if x.dtype == jnp.bool_ or jnp.issubdtype(x.dtype, jnp.integer) and jnp.iinfo(x.dtype).bits < 32:
        return x.astype(jnp.int32)  # as jnp.sum promotes them
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"small_sum / small_cumsum take integer or bool arrays (exact in any order), got {x.dtype}")
    return x


def small_sum(x, axis=None, dtype=None):
    """`jnp.sum(x, axis, dtype)` for an integer or bool x (bools and narrow ints summed as int32)."""
    return _fold(_integers(x, dtype), axis, lax.add, jnp.sum)


def small_all(x, axis=None):
    """`jnp.all(x, axis)` for a bool x."""
    return _fold(jnp.asarray(x, jnp.bool_), axis, lax.bitwise_and, jnp.all)


def small_min(x, axis=None):
    """`jnp.min(x, axis)` for an integer x."""
    return _fold(jnp.asarray(x), axis, lax.min, jnp.min)


def small_cumsum(x, axis: int = 0, dtype=None):
    """`jnp.cumsum(x, axis, dtype)` (inclusive) for an integer or bool x."""
    x = _integers(x, dtype)
    axis %= x.ndim
    n = x.shape[axis]
    if n == 0 or n > UNROLL_LIMIT:
        return jnp.cumsum(x, axis=axis)
    parts = [lax.index_in_dim(x, 0, axis, keepdims=True)]
    for i in range(1, n):
        parts.append(parts[-1] + lax.index_in_dim(x, i, axis, keepdims=True))
    return lax.concatenate(parts, axis)
