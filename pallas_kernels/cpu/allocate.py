"""`reserve`'s table work as one native call on a CPU (`allocate.cc`, through XLA's FFI).

`reserve_pages` takes and returns what `pallas_kernels.gpu.allocate.reserve_pages` does: the
rows' classification, both branches with no conditional, lengths and flags, the counters and a
float arena's copy-on-write copies, in place on the packed table, the counters and the arena.
Its reference is `arena_jax.allocator.reserve_impl`'s jnp ops; `tests/test_kernels_allocate.py`
compares them on random tables. `arena_jax.allocator.RESERVE_KERNEL` dispatches it.

Why: XLA's CPU backend compiles `reserve` into about 46 distinct kernels (~10 ms of compile
each), as many as a tiny model's whole dense step; one custom call compiles as one
(benchmarks/RESULTS.md, "`reserve` as one native call on a CPU").

The library is built on first use (`pallas_kernels.cpu._build`: once per source and jaxlib
version, about 5 s, cached under `~/.cache/arena_jax/native`). Without a C++ compiler
`native_problem()` says why, and the dispatch keeps XLA's ops.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import _build

__all__ = ["reserve_pages", "native_problem", "MAX_ROWS"]

MAX_ROWS = 4096  # its rules are pairwise: O(B^2) compares a call
_TARGETS = {False: "arena_reserve_pages", True: "arena_reserve_pages_copy"}  # with a float arena's copies


def native_problem() -> str | None:
    """Why the native reserve cannot run here (no compiler, a failed build), or None."""
    return _build.native_problem()


def reserve_pages(slots, num_tokens, packed, counts, *, page_size: int, geometry: tuple[int, int, int, int],
                  offsets: tuple[int, int, int, int], pad_slot: int, counters: tuple[int, ...], arenas=()):
    """`reserve`'s table work and counting over a page table's packed array, in place (on a CPU).

    The arguments and results are `pallas_kernels.gpu.allocate.reserve_pages`'s: slots,
    num_tokens i32[B] (B <= `MAX_ROWS`); packed i32[W] (one data shard) with its geometry
    (max_seqs, max_pages_per_seq, num_layers, num_pages) and region offsets (page map, slot
    words, page words, words); counts i32[N] and the five counters' places; arenas () or a
    float arena's (k, v) [L, H, P, S, D], whose copy-on-write copies are made here too. Returns
    (packed, counts, arenas, ok bool[B], copy-on-write source i32[B] (0: none), target i32[B]
    (num_pages: none)).
    """
    if slots.ndim != 1 or not 0 < slots.shape[0] <= MAX_ROWS or num_tokens.shape != slots.shape:
        raise ValueError(f"slots and num_tokens must be i32[B] with 0 < B <= {MAX_ROWS}, got shapes "
                         f"{slots.shape} and {num_tokens.shape}")  # fmt: skip
    if packed.ndim != 1 or counts.ndim != 1 or packed.dtype != jnp.int32 or counts.dtype != jnp.int32:
        raise ValueError(f"packed and counts must be one table row i32[W] and its counters i32[N] (one data shard), "
                         f"got {packed.dtype}{list(packed.shape)} and {counts.dtype}{list(counts.shape)}")  # fmt: skip
    if len(arenas) not in (0, 2) or any(a.ndim != 5 or a.shape[2] != geometry[3] for a in arenas):
        raise ValueError(f"arenas must be () or (k, v) [L, H, num_pages={geometry[3]}, S, D], got "
                         f"{[getattr(a, 'shape', a) for a in arenas]}")  # fmt: skip
    if len(counters) != 5:
        raise ValueError(f"counters must name 5 places in counts, got {counters!r}")
    problem = native_problem()
    if problem is not None:
        raise RuntimeError(f"the native reserve is not available: {problem}")
    batch = slots.shape[0]
    row = jax.ShapeDtypeStruct((batch,), jnp.int32)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (packed, counts, *arenas)]
    outs = jax.ffi.ffi_call(_TARGETS[bool(arenas)], (*shapes, row, row, row),
                            input_output_aliases={2 + i: i for i in range(len(shapes))})(
        slots.astype(jnp.int32), num_tokens.astype(jnp.int32), packed, counts, *arenas,
        **_build.table_attrs(geometry, offsets, page_size, pad_slot), counters=np.asarray(counters, np.int64))
    served, cow_src, cow_dst = outs[-3:]
    return outs[0], outs[1], tuple(outs[2:-3]), served != 0, cow_src, cow_dst
