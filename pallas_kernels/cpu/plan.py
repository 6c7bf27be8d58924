"""A forward pass's plan as one native call on a CPU (`plan.cc`, through XLA's FFI).

`plan_rows` gives what `arena_jax.plan._plan`'s jnp ops give (`arena_ops.append_rows` and
`attend_rows` for every layer and the layer past the last, from the packed page table): the
rows' page-table rows, each new token's place, each row's watermark, appended tokens, keys read
and query tokens, and each layer's counters. `arena_jax.plan.PLAN_KERNEL` dispatches it; its
reference is those jnp ops (tests/test_plan_native.py compares them on random tables).

Why: XLA's CPU backend compiles the plan into about 10 distinct kernels, the largest part of a
decode step's cache compile once `reserve` is one call (benchmarks/RESULTS.md, session 62). With
the cache's counters (`stats_counts`: `arena_jax.plan.plan_and_commit`) the call also gives what
a deferred plan's `StepPlan.commit` makes of the table and counters: its scatter, index kernels
and add were about 4 kernels of a decode step (session 64).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import _build

__all__ = ["plan_rows", "native_problem"]


def native_problem() -> str | None:
    """Why the native plan cannot run here (no compiler, a failed build), or None."""
    return _build.native_problem()


def plan_rows(slots, num_tokens, packed, *, page_size: int, geometry: tuple[int, int, int, int],
              offsets: tuple[int, int, int, int], pad_slot: int, width: int, counters: tuple[int, int, int],
              num_counts: int, stats_counts=None):
    """The plan's arrays for slots, num_tokens i32[B] over a page table's packed i32[W] (one data
    shard; geometry (max_seqs, max_pages_per_seq, num_layers L, num_pages), offsets of its page
    map, slot words, page words and words). `counters`: the places of tokens_written,
    dropped_writes and rejected_rows among `num_counts` counters. Returns (rows i32[B, M],
    tokens i32[L + 1, B, width], rows4 i32[L + 1, B, 4], counts i32[L + 1, num_counts], epoch i32[])
    as `arena_jax.plan.StepPlan` holds them. With `stats_counts` (the cache's counters,
    i32[num_counts]), also what a deferred plan's `StepPlan.commit` makes of that table and those
    counters when every layer appends once: (packed i32[W] with every layer's watermark set,
    counters i32[num_counts] plus every layer's)."""
    if slots.ndim != 1 or num_tokens.shape != slots.shape or packed.ndim != 1 or packed.dtype != jnp.int32:
        raise ValueError(f"slots, num_tokens must be i32[B] and packed one table row i32[W], got shapes {slots.shape}, "
                         f"{num_tokens.shape} and {packed.dtype}{list(packed.shape)}")  # fmt: skip
    problem = native_problem()
    if problem is not None:
        raise RuntimeError(f"the native plan is not available: {problem}")
    max_pages, num_layers = int(geometry[1]), int(geometry[2])
    batch, i32 = slots.shape[0], jnp.int32
    shapes = (jax.ShapeDtypeStruct((batch, max_pages), i32), jax.ShapeDtypeStruct((num_layers + 1, batch, width), i32),
              jax.ShapeDtypeStruct((num_layers + 1, batch, 4), i32),
              jax.ShapeDtypeStruct((num_layers + 1, num_counts), i32), jax.ShapeDtypeStruct((), i32))  # fmt: skip
    attrs = dict(_build.table_attrs(geometry, offsets, page_size, pad_slot), width=np.int64(width),
                 counters=np.asarray(counters, np.int64))  # fmt: skip
    if stats_counts is None:
        return jax.ffi.ffi_call("arena_plan_rows", shapes)(slots.astype(i32), num_tokens.astype(i32), packed, **attrs)
    if stats_counts.shape != (num_counts,) or stats_counts.dtype != jnp.int32:
        raise ValueError(f"stats_counts must be i32[{num_counts}], got {stats_counts.dtype}{list(stats_counts.shape)}")
    shapes += (jax.ShapeDtypeStruct(packed.shape, i32), jax.ShapeDtypeStruct((num_counts,), i32))
    # The counters updated in place (one kernel fewer: XLA copied the result into the donated
    # counters' buffer); the table not (XLA then copies `reserve`'s table, which more kernels read)
    return jax.ffi.ffi_call("arena_plan_rows_commit", shapes, input_output_aliases={3: 6})(
        slots.astype(i32), num_tokens.astype(i32), packed, stats_counts, **attrs)
