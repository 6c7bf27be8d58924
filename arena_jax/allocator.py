"""The page allocator as pure functions of the cache (the jitted bodies; `api.py` validates).

Every function takes a batch of slots `i32[B]` and does its work for all rows at once with
vectorized gathers/scatters: no loop over pages or rows. Scatters aimed at "nothing" use an
explicit out-of-range index plus `mode="drop"`.

Totality. Inside a user's jit these bodies see traced inputs the host checks never saw, so
each classifies its rows before acting:

  pad       the slot is PAD_SLOT: the row asks for nothing and is not counted;
  rejected  invalid input: a slot out of range, a slot already named by an earlier row of the
            batch (the first occurrence wins), a negative count or one past the per-sequence
            limit, a fork from an idle slot or onto its own source, ...: the row changes
            nothing and is counted in `stats.rejected_rows`;
  live      served by the op's own rules (free pages for `reserve`).

Whatever the inputs, the page table keeps its invariants (every page is free exactly once
or held by exactly `refcount` holders: its mappings plus, if `held[p] > 0`, the prefix cache's
own hold (`arena_jax.prefix.ops`); reserved-but-unwritten positions lie in pages their slot
holds alone) and no other sequence's pages or data change. A page the cache holds is shared
like a forked one: `reserve` copies it before a slot writes into it, `release` and `truncate`
leave it to the cache. Sums that inputs could push
past int32 are computed so that they cannot overflow.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax import lax

from pallas_kernels.index_math import ceil_div_nonneg, div_nonneg, rem_nonneg
from arena_jax.kv_cache import PAD_SLOT, CacheStats, KVCache, PageTable
from arena_jax.unrolled import small_all, small_cumsum, small_min, small_sum

__all__ = ["reserve_impl", "release_impl", "fork_impl", "truncate_impl", "slot_rows", "in_range_rows", "first_rows"]

# Which arenas' reservations keep each slot's pages consecutive (`_run_pages`): None, those
# whose 8-bit scales are rows (`KVCache.scale_rows`, a TPU's 8-bit pages under 128, whose decode
# kernel reads a run of pages one DMA a buffer); True / False: every arena / none (tests and
# studies; read when `reserve` is traced: clear JAX's caches after changing it).
RUN_PAGES: bool | None = None
# Whether `reserve`'s table work (the rows' classification, both branches with no conditional,
# the lengths and flags, the counters, a float arena's copy-on-write copies) runs as one kernel
# (`_reserve_by_kernel`) where it applies: one data shard (not inside the sharded ops), no
# run-keeping, up to the kernel's MAX_ROWS rows. On a GPU the Triton kernel
# `pallas_kernels.gpu.allocate` (with the Pallas Triton lowering), on a CPU the native call
# `pallas_kernels.cpu.allocate` (built on first use; without a C++ compiler, XLA's ops).
# "auto" (default): the GPU's kernel on a GPU, the CPU's on a CPU, XLA's ops on a TPU. "gpu" /
# "cpu": that platform's kernel only. True: the Triton kernel on any platform but a TPU
# (interpreted off a GPU: tests). False: XLA's ops. They take a decode step's compile from
# 1.63-1.97x the dense step's to 1.27-1.57x on an H100 (session 61) and from ~2.5x to ~1.7x on a
# CPU (1.25-1.31x with the plan native too, `arena_jax.plan.PLAN_KERNEL`; benchmarks/RESULTS.md,
# session 62); an H200 ran the Triton one compiled
# (`scripts/gpu_check.sh reserve`: the jnp ops' results, the 8B step 1-2% faster). `aj.reserve`
# reads it on each call (a static argument of its jitted body); a step compiled before a change
# keeps what it traced.
RESERVE_KERNEL: bool | str = "auto"
RESERVE_KERNEL_VALUES = (True, False, "auto", "gpu", "cpu")
# The keys of a block whose pages `_run_pages` makes a run: the TPU decode kernel's block
# (`pallas_kernels.tpu.attention.DEFAULT_BLOCK_K`; a test keeps them equal).
RUN_BLOCK_KEYS = 512


def in_range_rows(table: PageTable, slots):
    """(in range bool[B], gather index i32[B]): the index is 0 where the slot is out of range."""
    max_seqs = table.page_map.shape[0]
    ok = (slots >= 0) & (slots < max_seqs)
    return ok, jnp.where(ok, slots, 0)


def slot_rows(table: PageTable, slots):
    """(live bool[B], gather index i32[B]): live rows name an in-range slot that no earlier
    row of the batch names (the first occurrence of a duplicate wins)."""
    ok, idx, first = first_rows(table, slots)
    return ok & (first == jnp.arange(slots.shape[0], dtype=jnp.int32)), idx


# Batches up to this many rows find each row's first occurrence by comparing every pair of rows
# (one fused kernel, B^2 compares); larger ones by a scatter-min over the slots (a few kernels,
# linear in B and max_seqs). Static: B is a shape. Both give the same `first_rows`.
PAIRWISE_ROWS = 64


def first_rows(table: PageTable, slots):
    """(in range bool[B], gather index i32[B], first i32[B]): first[b] is the first row of the
    batch naming row b's slot (b itself for a live row; B where the slot is out of range)."""
    max_seqs = table.page_map.shape[0]
    ok, idx = in_range_rows(table, slots)
    batch = slots.shape[0]
    row = jnp.arange(batch, dtype=jnp.int32)
    if batch <= PAIRWISE_ROWS:
        same = slots[:, None] == slots[None, :]  # [B, B]: row j names row b's slot (in range if b is)
        return ok, idx, jnp.where(ok, small_min(jnp.where(same, row[None, :], batch), axis=1), batch)
    first = jnp.full((max_seqs,), batch, jnp.int32).at[jnp.where(ok, slots, max_seqs)].min(row, mode="drop")
    return ok, idx, jnp.where(ok, first[idx], batch)


def _page_rows(num_pages: int, pages):
    """(in range bool[K], first occurrence bool[K], gather index i32[K]) for a 1-D list of pages
    (as `slot_rows` for slots: the first occurrence of a duplicate wins; used by the prefix and
    host tier ops)."""
    ok = (pages >= 0) & (pages < num_pages)
    idx = jnp.where(ok, pages, 0)
    row = jnp.arange(pages.shape[0], dtype=jnp.int32)
    first = jnp.full((num_pages,), pages.shape[0], jnp.int32).at[jnp.where(ok, pages, num_pages)].min(row, mode="drop")
    return ok, ok & (first[idx] == row), idx


def _saturating_cumsum(x, cap: int):
    """Inclusive prefix sums of x (values in [0, cap]) that stop at `cap` instead of overflowing:
    min(prefix sum, cap). When no prefix sum can pass int32 (len(x) * cap < 2**31, static), a
    plain cumsum (one XLA op) clipped at cap; else a scan whose every step saturates."""
    if x.shape[0] * cap < 2**31:
        return jnp.minimum(jnp.cumsum(x, dtype=jnp.int32), cap)
    return lax.associative_scan(lambda a, b: jnp.minimum(a, cap - b) + b, x)


def _drop_refs(table: PageTable, pages):
    """Decrement `refcount` once per entry of `pages` (any shape; out-of-range = no page) and
    push pages that reach 0 onto the free stack. Returns (table, number of pages freed)."""
    num_pages = table.refcount.shape[0]
    flat = pages.reshape(-1)
    valid = (flat >= 0) & (flat < num_pages)  # a negative entry is no page too (`.at` would wrap it)
    if table.packed.ndim != 1:  # data shards (outside the sharded ops): through the regions
        refcount = table.refcount.at[jnp.where(valid, flat, num_pages)].add(-1, mode="drop")
        freed = (refcount == 0) & (table.refcount > 0)
        freed_i = freed.astype(jnp.int32)
        slot_in_stack = table.num_free + jnp.cumsum(freed_i) - freed_i
        free_stack = table.free_stack.at[jnp.where(freed, slot_in_stack, num_pages)].set(
            jnp.arange(num_pages, dtype=jnp.int32), mode="drop")
        count = jnp.sum(freed_i)
        return table.replace(refcount=refcount, free_stack=free_stack, num_free=table.num_free + count), count
    # Scatters into the table's one array: the refcounts, the freed pages pushed on the stack, num_free.
    before = table.refcount
    table = table.scatter_region("page_words", jnp.where(valid, 1, 3), jnp.clip(flat, 0, num_pages - 1),
                                 jnp.full(flat.shape, -1, jnp.int32), add=True)  # fmt: skip
    freed = (table.refcount == 0) & (before > 0)  # bool[P]: each freed page exactly once
    freed_i = freed.astype(jnp.int32)
    slot_in_stack = table.num_free + jnp.cumsum(freed_i) - freed_i
    count = jnp.sum(freed_i)
    table = table.scatter_region("page_words", jnp.where(freed, 0, 3), jnp.where(freed, slot_in_stack, 0),
                                 jnp.arange(num_pages, dtype=jnp.int32))  # fmt: skip
    return table.scatter_region("words", 0, 0, count, add=True), count


def reserve_impl(cache: KVCache, slots, num_tokens, *, run_pages: bool | None = None, kernel: bool | str | None = None):
    """Grow each slot by num_tokens[b]; see `arena_jax.reserve`. Returns (cache, ok bool[B]).
    `run_pages`: keep each slot's pages consecutive (`_run_pages`); None: as `RUN_PAGES` says.
    `kernel`: the table work as one Pallas kernel (`_reserve_by_kernel`) where it applies;
    None: as `RESERVE_KERNEL` says.

    Most calls pop no page: a decode step's rows cross a page boundary once every page_size
    tokens. When every served row grows inside the last page it holds alone, a conditional
    takes the short branch (`_grow_in_place`: the table as it is, every live row served); the
    allocator (`_allocate_and_map`: first come first served, copy-on-write, the free stack, then
    the page map's and refcounts' scatters) runs otherwise. Both branches give the same result
    on such calls. The rows are classified before them (slot, length, served or not); what only
    the allocator needs (pages mapped and needed, the last page's holders) it works out in its
    own branch, so the short one pays nothing for it (XLA's CPU backend runs a kernel per array
    passed into or out of a branch: the branches return their rows' results packed in one).
    What both branches would write, the served rows' lengths and flags and the counters, is
    written after the conditional, once; so are the page copies of copy-on-write."""
    if run_pages is None:
        run_pages = cache.scale_rows if RUN_PAGES is None else RUN_PAGES
    which = _reserves_by_kernel(cache, slots, run_pages, RESERVE_KERNEL if kernel is None else kernel)
    if which is not None:
        return _reserve_by_kernel(cache, slots, num_tokens, native=which == "native")
    table = cache.table
    max_seqs, max_pages = table.page_map.shape
    num_pages, page_size = table.refcount.shape[0], cache.k.shape[3]
    pad = slots == PAD_SLOT
    live, idx = slot_rows(table, slots)
    length = jnp.where(live, table.lengths[idx], 0)
    # `n <= room`, never `length + n <= limit`: an arbitrary traced n would overflow the sum.
    live &= (num_tokens >= 0) & (num_tokens <= max_pages * page_size - length)
    n = jnp.where(live, num_tokens, 0)
    rows = _reserve_rows(table, page_size, idx, live, n, length)
    in_place = small_all(~live | ((rows.need == rows.have) & ~rows.wants_cow))
    # The table goes through the conditional, the arena does not (`_copy_pages`).
    grow = functools.partial(_grow_in_place, page_size)
    allocate = functools.partial(_allocate_and_map, page_size, runs=run_pages)  # (`_run_pages`)
    table, served = lax.cond(in_place, grow, allocate, table, slots, idx, live, n, length)
    ok, no_page, granted, cow_src, cow_dst = served[0] != 0, served[1] != 0, served[2], served[3], served[4]
    table = table.set_slots(jnp.where(ok, slots, max_seqs), lengths=length + n, active=1)  # only served rows change
    stats = CacheStats(counts=cache.stats.counts).bump(
        pages_allocated=granted,
        cow_copies=cow_dst < num_pages,
        metadata_ops=ok & (n > 0) & no_page,
        failed_reservations=live & ~ok,
        rejected_rows=~pad & ~live,
    )
    # The private copy of a shared page, all layers and heads: [L, H, B, S, D] (and an 8-bit
    # arena's scales, [L, H, B, S]: a page's values mean nothing without them).
    k, v, scales = _copy_pages(cache, cow_src, cow_dst)
    return cache.replace(k=k, v=v, table=table, stats=stats, **scales), ok | pad


def _reserves_by_kernel(cache: KVCache, slots, run_pages: bool, kernel: bool | str) -> str | None:
    """Which kernel this `reserve` runs as (`_reserve_by_kernel`): "triton", "native" or None
    (XLA's ops). `kernel`: a `RESERVE_KERNEL` value."""
    if not any(kernel is v or (isinstance(v, str) and kernel == v) for v in RESERVE_KERNEL_VALUES):
        raise ValueError(f"RESERVE_KERNEL must be one of {RESERVE_KERNEL_VALUES}, got {kernel!r}")
    if run_pages or cache.table.packed.ndim != 1 or kernel is False:
        return None
    from pallas_kernels.tpu.common import target_platform

    platform = target_platform()
    if kernel is True:
        if platform == "tpu":
            raise ValueError("RESERVE_KERNEL=True: the reserve kernel is a Triton (GPU) kernel; on a TPU set it to "
                             "'auto' (XLA's ops there) or False")  # fmt: skip
        which = "triton"
    elif platform == "gpu" and kernel in ("auto", "gpu"):
        from pallas_kernels import triton_lowering_problem

        which = "triton" if triton_lowering_problem() is None else None
    elif platform == "cpu" and kernel in ("auto", "cpu"):
        from pallas_kernels.cpu.allocate import native_problem

        which = "native" if native_problem() is None else None
    else:
        return None
    if which == "triton":
        from pallas_kernels.gpu.allocate import MAX_ROWS
    else:
        from pallas_kernels.cpu.allocate import MAX_ROWS
    return which if which is not None and slots.shape[0] <= MAX_ROWS else None


def _reserve_by_kernel(cache: KVCache, slots, num_tokens, *, native: bool = False):
    """`reserve_impl` with its table work, counting and (a float arena's) copy-on-write page copies
    in one kernel (`pallas_kernels.gpu.allocate.reserve_pages`, the Triton one, or with `native`
    `pallas_kernels.cpu.allocate.reserve_pages`: the same rules, tests/test_kernels_allocate.py);
    an 8-bit or int4 arena's copies by `_copy_pages` after it. Returns (cache, ok bool[B])."""
    from arena_jax.kv_cache import _STAT_INDEX, _regions

    if native:
        from pallas_kernels.cpu.allocate import reserve_pages
    else:
        from pallas_kernels.gpu.allocate import reserve_pages

    table = cache.table
    at = _regions(table.geometry)
    counters = ("pages_allocated", "cow_copies", "metadata_ops", "failed_reservations", "rejected_rows")
    float_arena = cache.k_scale is None  # the kernel copies its pages too; scales: `_copy_pages` after it
    packed, counts, arenas, ok, cow_src, cow_dst = reserve_pages(
        slots, num_tokens, table.packed, cache.stats.counts, page_size=cache.k.shape[3], geometry=table.geometry,
        offsets=tuple(at[r][0] for r in ("page_map", "slot_words", "page_words", "words")), pad_slot=PAD_SLOT,
        counters=tuple(_STAT_INDEX[c] for c in counters), arenas=(cache.k, cache.v) if float_arena else ())  # fmt: skip
    cache = cache.replace(table=table.replace(packed=packed), stats=CacheStats(counts=counts))
    if float_arena:
        return cache.replace(k=arenas[0], v=arenas[1]), ok
    k, v, scales = _copy_pages(cache, cow_src, cow_dst)
    return cache.replace(k=k, v=v, **scales), ok


def _served(ok, no_page, granted, cow_src, cow_dst):
    """A branch's rows, packed i32[5, B] (one array out of the conditional): served, popped no
    page, pages popped, copy-on-write source and target (num_pages: none)."""
    return jnp.stack([ok.astype(jnp.int32), no_page.astype(jnp.int32), granted, cow_src, cow_dst])


@struct.dataclass
class _ReserveRows:
    """A reserve call's rows, classified (bool / i32 [B])."""

    live: jax.Array  # served by the allocator's rules (pages permitting)
    n: jax.Array  # tokens asked (0 unless live)
    new_length: jax.Array
    have: jax.Array  # pages mapped
    need: jax.Array  # pages mapped once grown
    last_lp: jax.Array  # the logical page the row's next token goes to (its last, partly filled one)
    last_page: jax.Array  # its physical page (-1: none)
    last_refs: jax.Array  # that page's holders
    wants_cow: jax.Array  # the last page is partly filled, shared, and this row will write into it


def _reserve_rows(table: PageTable, page_size: int, idx, live, n, length) -> _ReserveRows:
    max_pages = table.page_map.shape[1]
    num_pages = table.refcount.shape[0]
    last_lp = jnp.minimum(div_nonneg(length, page_size), max_pages - 1)
    last_page = table.page_map[idx, last_lp]
    last_refs = table.refcount[jnp.clip(last_page, 0, num_pages - 1)]
    return _ReserveRows(live=live, n=n, new_length=length + n,
                        have=ceil_div_nonneg(length, page_size),  # lengths are never negative
                        need=ceil_div_nonneg(length + n, page_size), last_lp=last_lp, last_page=last_page,
                        last_refs=last_refs,
                        wants_cow=live & (n > 0) & (rem_nonneg(length, page_size) != 0) & (last_refs > 1))  # fmt: skip


def _grow_in_place(page_size: int, table: PageTable, slots, idx, live, n, length):
    """`reserve`'s branch when no live row needs a page (nor a copy): the table as it is, every
    live row served, no page popped (`reserve` sets the lengths and flags). Returns what
    `_allocate_and_map` does: (table, `_served` rows)."""
    del page_size, slots, idx, length
    zeros = _like_rows(n, 0, n.shape)
    return table, _served(live, zeros == 0, zeros, zeros, zeros + table.refcount.shape[0])


def _allocate_and_map(page_size: int, table: PageTable, slots, idx, live, n, length, *, runs: bool = False):
    """`reserve`'s allocator branch: `_allocate`, then the page map's, refcounts' and free
    stack's updates (`reserve` sets the lengths and flags). Returns (table, `_served` rows).
    `runs` (static): pages chosen to keep each slot's pages consecutive (`_run_pages`)."""
    num_pages = table.refcount.shape[0]
    rows = _reserve_rows(table, page_size, idx, live, n, length)
    row = table.page_map[idx]  # [B, M]
    free = table.refcount == 0 if runs else None
    ok, new_row, cow_page, granted, no_page, ref_pages, ref_delta, stack = _allocate(
        table.free_stack, table.num_free, rows, row, page_size, free)
    if stack is not None:  # the pages left free, the lowest on top
        table = table.replace(page_words=table.page_words.at[0].set(stack))
    # One scatter: +1 for each popped page (new pages and COW copies: free, so refcount 0 -> 1),
    # -1 for the shared page a COW row leaves (its other holders keep it). The regions are
    # rebuilt (`replace`), not scattered into in place as release's are: scattered into in place
    # here, in a branch of the conditional, the table was copied before the conditional every
    # step, and that kernel at the step's start handed the tiny batch-4 step to XLA's thread
    # pool (0.93x -> 0.81-0.83x the dense step's tokens/s; benchmarks/RESULTS.md, session 32).
    target = jnp.where(ok, slots, table.page_map.shape[0])  # only served rows change
    table = table.replace(
        page_map=table.page_map.at[target].set(new_row, mode="drop"),
        page_words=table.page_words.at[1, ref_pages].add(ref_delta, mode="drop"),  # refcount
        words=table.words.at[0].add(-jnp.sum(granted)),  # num_free
    )
    return table, _served(ok, no_page, granted, jnp.where(cow_page < num_pages, rows.last_page, 0), cow_page)


def _like_rows(rows_value, value, shape):
    """`value` in `shape`, computed from a per-row array: inside shard_map it then varies per
    shard as `_allocate`'s outputs do (lax.cond needs the branches' types equal; a constant
    would not vary)."""
    return jnp.broadcast_to(jnp.where(jnp.any(rows_value == rows_value), value, value), shape)


def _allocate(free_stack, num_free, rows: _ReserveRows, row, page_size: int, free=None):
    """The allocator: pages popped first come first served, copy-on-write of shared last pages.
    row i32[B, M]: the slots' page-table rows. `free` bool[P] (the pages of refcount 0): which
    rows are served is the same, their pages are chosen by `_run_pages` (its blocks counted in
    pages of `page_size`), and the free stack comes back rebuilt (else None: pages popped from
    the stack's top)."""
    num_pages, max_pages = free_stack.shape[0], row.shape[1]
    live, have, need = rows.live, rows.have, rows.need
    last_lp, last_page, last_refs, wants_cow = rows.last_lp, rows.last_page, rows.last_refs, rows.wants_cow
    # When every holder of that page is in this batch and wants to write, the first one keeps it.
    same = wants_cow[:, None] & wants_cow[None, :] & (last_page[:, None] == last_page[None, :])  # [B, B]
    before = np.tril(np.ones(same.shape, bool), k=-1)  # [B, B]: row j comes before row b
    rank, holders_here = jnp.sum(jnp.stack([same & before, same]), axis=2, dtype=jnp.int32)  # one reduction
    keeper = (rank == 0) & (holders_here == last_refs)
    cow = wants_cow & ~keeper

    # First come, first served in batch order: a row is served if its demand, plus the demand of
    # every earlier row, fits in the free pages. Rows that need no page are always served.
    cap = num_pages + 1  # any demand above num_free fails alike
    demand = jnp.minimum(jnp.where(live, need - have + cow, 0), cap)
    ok_pages = (demand == 0) | (_saturating_cumsum(demand, cap) <= num_free)
    ok = live & ok_pages
    # The keeper writes into a page its co-holders hold until they get their copies: it is
    # served only if every co-holder in the batch is (else it would write into a shared page).
    copier_refused = cow & ~ok
    ok &= ~(wants_cow & keeper & jnp.any(same & copier_refused[None, :], axis=1))
    granted = jnp.where(ok, demand, 0)  # served rows' demands sum to at most num_free
    first = jnp.cumsum(granted) - granted  # this row's first pop, counted from the stack top
    total = jnp.sum(granted)

    def popped(i):  # the i-th page popped from the stack top
        return free_stack[jnp.clip(num_free - 1 - i, 0, num_pages - 1)]

    do_cow = ok & cow
    lp = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    is_new = ok[:, None] & (lp >= have[:, None]) & (lp < need[:, None])  # [B, M]
    stack = None
    if free is None:
        cow_page = jnp.where(do_cow, popped(first), num_pages)  # [B]
        new_page = popped(first[:, None] + cow[:, None] + lp - have[:, None])
    else:
        cow_page, new_page, stack = _run_pages(free, num_free - total, granted, do_cow, have, row, page_size)
        cow_page = jnp.where(do_cow, cow_page, num_pages)
    new_row = jnp.where(is_new, new_page, row)
    new_row = jnp.where(do_cow[:, None] & (lp == last_lp[:, None]), cow_page[:, None], new_row)

    ref_pages = jnp.concatenate([jnp.where(is_new, new_page, num_pages).reshape(-1), cow_page,
                                 jnp.where(do_cow, last_page, num_pages)])  # fmt: skip
    ref_delta = jnp.concatenate([jnp.ones(is_new.size + cow_page.size, jnp.int32), jnp.full(cow_page.shape, -1, jnp.int32)])
    return ok, new_row, cow_page, granted, demand == 0, ref_pages, ref_delta, stack


def _run_pages(free, num_left, granted, do_cow, have, row, page_size: int):
    """Pages for served rows that make each block of a slot's pages a run where they can (the
    TPU decode kernel reads a block of `RUN_BLOCK_KEYS` keys whose pages are consecutive in one
    DMA a buffer: scale-row arenas, `KVCache.scale_rows`). free bool[P]: the free pages; granted
    i32[B]: pages row b takes (its copy-on-write page first, `do_cow`); have i32[B]: pages it
    maps; row i32[B, M]: its page-table row; num_left: the pages free after the call. A block is
    ppb = RUN_BLOCK_KEYS / page_size logical pages. In batch order:

    - a row taking one page inside a block (a decode step's) takes the page after its last mapped
      one when that page is free and no earlier row takes it;
    - a row taking more, without copy-on-write (a prefill), takes its pages block by block (a
      loop over those rows' blocks only): the part of a block it continues, the pages after its
      last when free; a whole block, the first free run that holds it, at that run's end (so
      that the pages after a partly filled block stay free for its row's decode; not where the
      run ends the arena: the kernel's run needs a scale row past it); a block's first part
      that does not fill it (a prompt's last), a block from the end of the first free run of two
      blocks or more (the block's rest stays free after it for the row's decode), else the first
      free run that holds it; where no run holds a part, the lowest free pages;
    - every other row takes the lowest free pages left, in batch order.

    Returns (copy-on-write page [B], page for each logical page [B, M] from `have` on (the
    caller keeps those of its new pages), the free stack i32[P]: the pages left free, the lowest
    on top)."""
    num_pages, batch = free.shape[0], granted.shape[0]
    max_pages = row.shape[1]
    ppb = max(1, RUN_BLOCK_KEYS // page_size)
    page_ids = jnp.arange(num_pages, dtype=jnp.int32)
    b_ids = jnp.arange(batch, dtype=jnp.int32)
    # A decode row inside a block: the page after its last, when free and claimed by no earlier row.
    last = row[b_ids, jnp.clip(have - 1, 0, max_pages - 1)]
    after = last + 1
    wants = (granted == 1) & ~do_cow & (rem_nonneg(have, ppb) != 0) & (last >= 0) & (after < num_pages)
    wants &= free[jnp.clip(after, 0, num_pages - 1)]
    claim = jnp.full((num_pages,), batch, jnp.int32).at[jnp.where(wants, after, num_pages)].min(b_ids, mode="drop")
    takes_after = wants & (claim[jnp.clip(after, 0, num_pages - 1)] == b_ids)
    free = free.at[jnp.where(takes_after, after, num_pages)].set(False, mode="drop")

    # A prefill row: block by block, rows in turn (the loop runs only over their blocks: none in
    # a decode step). Carry: (i: the i-th prefill row, a: its next logical page, free, placed
    # i32[B, M]: the prefill rows' new pages).
    prefill = (granted >= 2) & ~do_cow
    order = jnp.argsort(~prefill, stable=True).astype(jnp.int32)  # the prefill rows first, in batch order
    end = have + granted  # [B]: logical pages mapped once grown
    j = jnp.arange(ppb, dtype=jnp.int32)

    def one_block(carry):
        i, a, free, placed = carry
        b = order[i]
        k = jnp.minimum(end[b], (div_nonneg(a, ppb) + 1) * ppb) - a  # this block's new pages, >= 1
        next_used = lax.cummin(jnp.where(free, num_pages, page_ids), reverse=True)  # [P]
        room = next_used - page_ids  # [P]: free pages from here on (0 at a used page)
        cont = (rem_nonneg(a, ppb) != 0) & (last[b] >= 0) & (last[b] + 1 < num_pages)  # (only a row's first block)
        cont &= room[jnp.clip(last[b] + 1, 0, num_pages - 1)] >= k
        fits = room >= k
        fit = jnp.argmax(fits).astype(jnp.int32)  # the first free run that holds the part
        at = jnp.where((k == ppb) & (next_used[fit] < num_pages), next_used[fit] - k, fit)
        roomy = room >= 2 * ppb
        wide = jnp.argmax(roomy).astype(jnp.int32)  # the first free run of two blocks or more
        tail = (rem_nonneg(a, ppb) == 0) & (k < ppb) & roomy[wide]  # a block's first part, the block's room after it
        at = jnp.where(tail, next_used[wide] - ppb, at)
        at = jnp.where(cont, last[b] + 1, at)
        lowest = jnp.searchsorted(jnp.cumsum(free.astype(jnp.int32)), j + 1).astype(jnp.int32)  # [ppb]
        pages = jnp.where(cont | fits[fit], at + j, lowest)
        take = j < k
        free = free.at[jnp.where(take, pages, num_pages)].set(False, mode="drop")
        placed = placed.at[b, jnp.where(take, a + j, max_pages)].set(pages, mode="drop")
        row_done = a + k >= end[b]
        i = jnp.where(row_done, i + 1, i)
        a = jnp.where(row_done, have[order[jnp.minimum(i, batch - 1)]], a + k)
        return i, a, free, placed

    _, _, free, placed = lax.while_loop(lambda c: c[0] < jnp.sum(prefill), one_block,
                                        (jnp.int32(0), have[order[0]], free, jnp.full(row.shape, -1, jnp.int32)))
    # Every other row: the lowest free pages left, in batch order.
    rest = jnp.where(takes_after | prefill, 0, granted)
    first = jnp.cumsum(rest) - rest
    rank = jnp.cumsum(free.astype(jnp.int32)) - 1
    lowest = jnp.zeros((num_pages,), jnp.int32).at[jnp.where(free, rank, num_pages)].set(page_ids, mode="drop")

    def lowest_at(i):
        return lowest[jnp.clip(i, 0, num_pages - 1)]

    lp = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    k = lp - have[:, None]  # [B, M]: the row's k-th new page
    cow_page = lowest_at(first)
    new_page = jnp.where(takes_after[:, None], after[:, None],
                         jnp.where(prefill[:, None], placed, lowest_at(first[:, None] + do_cow[:, None] + k)))
    # The free stack, every page once: the pages still free (those past the rest's) below
    # num_left, the lowest on top, then the others.
    left = free & (rank >= jnp.sum(rest))
    left_rank = jnp.cumsum(left.astype(jnp.int32)) - 1
    used_rank = page_ids - 1 - left_rank
    stack = jnp.zeros((num_pages,), jnp.int32).at[jnp.where(left, num_left - 1 - left_rank, num_left + used_rank)].set(
        page_ids, mode="drop")
    return cow_page, new_page, stack


def _unmap_tail(cache: KVCache, slots, rows, keep_tokens):
    """Drop the pages of each row in `rows` (bool[B]; its slots distinct and in range) beyond
    ceil(keep_tokens / page_size). Returns (cache, pages freed)."""
    table = cache.table
    max_seqs, max_pages = table.page_map.shape
    num_pages, page_size = cache.k.shape[2], cache.k.shape[3]
    _, idx = in_range_rows(table, slots)
    row = table.page_map[idx]
    keep_pages = ceil_div_nonneg(keep_tokens, page_size)
    lp = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    drop = rows[:, None] & (lp >= keep_pages[:, None]) & (row >= 0)  # [B, M]
    table, freed = _drop_refs(table, jnp.where(drop, row, num_pages))
    table = table.scatter_rows("page_map", jnp.where(rows, slots, max_seqs), jnp.where(drop, -1, row))
    return cache.replace(table=table), freed


def _release_rows(cache: KVCache, slots, rows):
    """Release the slots of `rows` (bool[B]; distinct, in range). Returns (cache, pages freed)."""
    cache, freed = _unmap_tail(cache, slots, rows, jnp.zeros_like(slots))
    table = cache.table
    words = jnp.zeros((slots.shape[0], table.slot_words.shape[1]), jnp.int32)  # lengths, active, written: all 0
    return cache.replace(table=table.scatter_rows("slot_words", jnp.where(rows, slots, table.page_map.shape[0]), words)), freed


def release_impl(cache: KVCache, slots):
    """Drop the slots; pages whose refcount reaches 0 go back on the free stack. Releasing an
    idle slot does nothing."""
    live, idx = slot_rows(cache.table, slots)
    changed = live & cache.table.active[idx]  # releasing an idle slot changes nothing
    cache, freed = _release_rows(cache, slots, live)
    rejected = (slots != PAD_SLOT) & ~live
    return cache.replace(table=cache.table.advanced(changed),
                         stats=cache.stats.bump(pages_recycled=freed, rejected_rows=rejected))


def truncate_impl(cache: KVCache, slots, lengths):
    """Roll each slot back to lengths[b] (0 <= lengths[b] <= its length, else the row is
    rejected); whole pages past the end are released and written watermarks cut to match.
    Only rows that shorten their slot count as metadata operations."""
    table = cache.table
    live, idx = slot_rows(table, slots)
    held = jnp.where(live, table.lengths[idx], 0)
    ok = live & (lengths >= 0) & (lengths <= held)
    new_length = jnp.where(ok, lengths, 0)
    cache, freed = _unmap_tail(cache, slots, ok, new_length)
    table = cache.table
    # One scatter into the slots' words: the length, and every layer's watermark cut to it.
    words = table.slot_words[idx]  # [B, 2 + L]: lengths, active, written per layer
    values = jnp.concatenate([new_length[:, None], words[:, 1:2], jnp.minimum(words[:, 2:], new_length[:, None])], axis=1)
    table = table.scatter_rows("slot_words", jnp.where(ok, slots, table.page_map.shape[0]), values)
    rejected = (slots != PAD_SLOT) & ~ok
    # A truncate that shortens nothing (an idle slot, or the slot's own length) is no operation.
    changed = ok & (new_length < held)
    stats = cache.stats.bump(pages_recycled=freed, metadata_ops=changed, rejected_rows=rejected)
    return cache.replace(table=table.advanced(changed), stats=stats)


def fork_impl(cache: KVCache, src, dst):
    """dst[b] (released first if in use) shares src[b]'s pages: refcount + 1, no data moved.

    A row is served when dst[b] is in range and named once, src[b] is an active slot whose
    reservation is fully written at every layer (no pending tokens to share), and no slot is
    both a source and a destination in this call. A row whose dst is PAD_SLOT is padding;
    any other row not served is rejected and its dst left unchanged.
    """
    table = cache.table
    max_seqs = table.page_map.shape[0]
    num_pages = cache.k.shape[2]
    dst_pad = dst == PAD_SLOT
    dst_live, dst_idx = slot_rows(table, dst)
    src_in, src_idx = in_range_rows(table, src)
    is_dst = jnp.zeros((max_seqs,), bool).at[jnp.where(dst_live, dst, max_seqs)].set(True, mode="drop")
    is_src = jnp.zeros((max_seqs,), bool).at[jnp.where(src_in & ~dst_pad, src, max_seqs)].set(True, mode="drop")
    settled = jnp.all(table.written[:, src_idx] == table.lengths[src_idx][None, :], axis=0)
    ok = dst_live & src_in & table.active[src_idx] & settled & ~is_dst[src_idx] & ~is_src[dst_idx]

    cache, freed = _release_rows(cache, dst, ok)
    table = cache.table  # no source was released: sources are never destinations
    row = table.page_map[src_idx]  # [B, M]
    shared = ok[:, None] & (row >= 0)
    # Scatters into the table's one array: the source's page-table row, its pages' refcounts + 1,
    # and its words (length, written per layer; active) copied to the destination.
    target = jnp.where(ok, dst, max_seqs)
    table = table.scatter_rows("page_map", target, row)
    table = table.scatter_region("page_words", jnp.where(shared, 1, 3), jnp.clip(row, 0, num_pages - 1),
                                 jnp.ones(row.shape, jnp.int32), add=True)  # fmt: skip
    table = table.scatter_rows("slot_words", target, table.slot_words[src_idx].at[:, 1].set(1))  # [B, 2 + L]
    stats = cache.stats.bump(
        metadata_ops=ok, pages_recycled=freed, rejected_rows=~dst_pad & ~ok
    )
    return cache.replace(table=table.advanced(ok), stats=stats)


def copies_pages_by_dma(cache) -> bool:
    """Whether `reserve`'s copy-on-write runs the TPU page-copy kernel: lowering for a TPU whose
    kernels take the arena's layout (`_copy_pages`)."""
    from pallas_kernels.tpu.common import target_platform, tpu_unsupported_reason

    return target_platform() == "tpu" and tpu_unsupported_reason(
        head_dim=cache.k.shape[-1], page_size=cache.k.shape[3], dtype=cache.k.dtype,
        scale_dtype=None if cache.k_scale is None else cache.k_scale.dtype, scale_rows=cache.scale_rows) is None


def _copy_pages(cache, src, dst):
    """Page dst[b] := page src[b] (dst == num_pages: nothing) in every layer and head of the
    arena and an 8-bit arena's scales: (k, v, {scale name: array}). On a TPU whose kernels take
    the layout, by DMA (`pallas_kernels.tpu.copy_pages`: XLA's TPU layout assignment may
    relayout the arena for a gather + scatter); elsewhere a loop over the rows that copy, one
    page of every layer and head per trip (a slice and an in-place update)."""
    # Scale rows (`KVCache.scale_rows`) hold 128 / S pages a row: a page's scales are lanes of a
    # row, copied on their own below.
    arrays = [cache.k, cache.v] + ([] if cache.k_scale is None or cache.scale_rows else [cache.k_scale, cache.v_scale])
    if copies_pages_by_dma(cache):
        from pallas_kernels.tpu.copy_pages import tpu_copy_pages

        arrays = list(tpu_copy_pages(arrays, src, dst))
    else:
        # Most reservations copy no page (a decode step's rows rarely write into a shared page):
        # the loop then runs no trip. Not a `lax.cond` around a gather + scatter: the arena passed
        # through a conditional is copied whole (both branches, and again at the step's end) by
        # XLA's GPU compiler in jaxlib 0.10 (benchmarks/studies/sm90_steps.py showed 6 copies of
        # k / v per step); a while loop's carry stays in place. Destinations are new pages, never
        # another row's source, so the order of the copies does not matter.
        copies = dst < cache.k.shape[2]

        def copy_one(i, arrays):
            row = _copying_row(copies, i)
            s, d = src[row], dst[row]
            return [lax.dynamic_update_slice_in_dim(x, lax.dynamic_slice_in_dim(x, s, 1, axis=2), d, axis=2)
                    for x in arrays]  # fmt: skip

        arrays = lax.fori_loop(0, small_sum(copies), copy_one, arrays)
    if cache.scale_rows:
        return arrays[0], arrays[1], _copy_scale_lanes(cache, src, dst)
    scales = {} if cache.k_scale is None else {"k_scale": arrays[2], "v_scale": arrays[3]}
    return arrays[0], arrays[1], scales


def _copying_row(copies, i):
    """The i-th row whose `copies` (bool[B]) is set: a copy loop's trip i (no sort before the loop;
    i < the rows set). A min over the rows, not an argmax: XLA's CPU runtime makes a buffer entry
    per execution for every value of a reduction's computation, taken or not, and an argmax's
    (value, index) pairs are 11 of them against a min's 3 (benchmarks/RESULTS.md, session 53)."""
    rows = jnp.arange(copies.shape[0], dtype=jnp.int32)
    return small_min(jnp.where(small_cumsum(copies) > i, rows, copies.shape[0] - 1))


def _copy_scale_lanes(cache, src, dst) -> dict:
    """`_copy_pages` for scale rows: page dst[b]'s S lanes of its row := page src[b]'s, every layer
    and head (XLA dynamic slices of the rows, which are row-major on a TPU too: no relayout), one
    row that copies a trip. Returns {"k_scale": ..., "v_scale": ...}."""
    num_layers, num_heads, num_pages, page_size = cache.k.shape[:4]
    per_row = 128 // page_size
    copies = dst < num_pages

    def copy_one(i, scales):
        row = _copying_row(copies, i)
        s, d = src[row], dst[row]
        size = (num_layers, num_heads, 1, page_size)
        return [lax.dynamic_update_slice(x, lax.dynamic_slice(x, (0, 0, s // per_row, s % per_row * page_size), size),
                                         (0, 0, d // per_row, d % per_row * page_size)) for x in scales]  # fmt: skip

    k_scale, v_scale = lax.fori_loop(0, jnp.sum(copies), copy_one, [cache.k_scale, cache.v_scale])
    return {"k_scale": k_scale, "v_scale": v_scale}
