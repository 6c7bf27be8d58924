"""`reserve`'s table work as one Triton kernel over the page table's packed array.

`reserve_pages` does what `arena_jax.allocator.reserve_impl` does with XLA's ops, in one program
and with no conditional:
- it classifies the rows (padding, a slot named twice, a count past the slot's room);
- it serves them first come first served, with copy-on-write of a shared, partly filled last page
  (the first holder in the batch keeps it when every holder is here);
- it pops pages off the free stack's top and writes the page map, refcounts, `num_free`, the
  served rows' lengths and flags, and the counters, in place;
- given a float arena, it also copies the pages copy-on-write needs.

Those jnp ops are its reference: `tests/test_kernels_allocate.py` compares the two on random
tables (interpret mode on a CPU; compiled on an H200 by `scripts/gpu_check.sh reserve`, session
61). `arena_jax.allocator.RESERVE_KERNEL` dispatches it on a GPU (default "auto"); on a CPU its
sibling `pallas_kernels.cpu.allocate` does the same work as a native call.

Why: on a GPU, XLA compiles `reserve` into about 29 kernels, most of what the cache adds to a decode
step's compile. As one kernel, the H100 step compiles in 1.27-1.57x the dense step's time
instead of 1.63-1.97x (benchmarks/RESULTS.md, "`reserve` as one Pallas kernel on the H100 target").

Layout of the work:
- Every row is a lane of a [BP] vector (BP: the batch padded to a power of two, at most
  `MAX_ROWS`). The batch's pairwise rules are [BP, BP] masks, its prefix sums masked row sums.
- A row's new pages are mapped `PAGE_LANES` logical pages a loop trip, over the trips some row
  grows into (a decode step: one).
- A masked lane's store aims at the arena-id word of the table (the copies: the source page).
  No lane writes those, and interpret mode writes masked lanes back.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import compiler_params, index_of, masked_load, masked_store, next_pow2, resolve_interpret

__all__ = ["reserve_pages", "MAX_ROWS"]

MAX_ROWS = 64  # [BP, BP] masks in one program's registers
PAGE_LANES = 32  # logical pages a row maps per loop trip ([BP, PAGE_LANES] lanes)


def _copy_pages(k_ref, v_ref, copies, src, dst, b):
    """Page dst[b] := page src[b] of every layer and head of both arenas, for the rows `copies`
    (bool[BP]), one copy after another (none: no trip). Destinations are new pages, never a
    source. A masked lane (past the page or head_dim) aims at the source page, which no lane
    writes (interpret mode writes masked lanes back)."""
    num_layers, num_heads, _, page_size, head_dim = k_ref.shape
    s = jnp.arange(next_pow2(page_size), dtype=jnp.int32)[:, None]
    d = jnp.arange(next_pow2(head_dim), dtype=jnp.int32)[None, :]
    inside = (s < page_size) & (d < head_dim)  # [S, D] padded to powers of two
    s_in, d_in = jnp.minimum(s, page_size - 1), jnp.minimum(d, head_dim - 1)
    done = jnp.sum(jnp.where(b[None, :] <= b[:, None], copies[None, :].astype(jnp.int32), 0), axis=1)  # copies up to b

    def one_copy(i, carry):  # the i-th copying row's page, every layer and head
        row = copies & (done == i + 1)
        src_i, dst_i = jnp.sum(jnp.where(row, src, 0)), jnp.sum(jnp.where(row, dst, 0))

        def one_page(lh, carry):
            layer, head = lax.div(lh, num_heads), lax.rem(lh, num_heads)  # (jnp's % on a loop index fails to lower)
            for ref in (k_ref, v_ref):
                tile = masked_load(ref.at[index_of(layer, head, src_i, s_in, d_in)], mask=inside, other=0)
                target = index_of(layer, head, jnp.where(inside, dst_i, src_i), s_in, d_in)
                masked_store(ref.at[target], tile, mask=inside)
            return carry

        return lax.fori_loop(0, num_layers * num_heads, one_page, carry)

    lax.fori_loop(0, jnp.sum(copies.astype(jnp.int32)), one_copy, 0)


def _kernel(*refs, batch, rows_p, max_seqs, max_pages, page_lanes, num_layers, num_pages, page_size, page_map_at,
            slot_words_at, page_words_at, words_at, pad_slot, counters, copy_arena):
    if copy_arena:
        slots_ref, asked_ref, _, _, _, _, packed_ref, counts_ref, k_ref, v_ref, served_ref, cow_src_ref, cow_dst_ref = refs
    else:
        slots_ref, asked_ref, _, _, packed_ref, counts_ref, served_ref, cow_src_ref, cow_dst_ref = refs  # (inputs aliased)
    S, M, P = max_seqs, max_pages, num_pages
    b = jnp.arange(rows_p, dtype=jnp.int32)
    real = b < batch
    slots = masked_load(slots_ref.at[jnp.where(real, b, 0)], mask=real, other=pad_slot)
    asked = masked_load(asked_ref.at[jnp.where(real, b, 0)], mask=real, other=0)
    num_free = packed_ref[words_at]
    refcount_at, spare = page_words_at + P, words_at + 2  # spare: the arena id, never written
    before = b[None, :] < b[:, None]  # [row, other]: other comes first

    def count(mask):  # i32[BP]: the true lanes of each row of a [BP, BP] mask
        return jnp.sum(jnp.where(mask, 1, 0), axis=1)

    # The rows, classified (`reserve_impl`, `slot_rows`, `_reserve_rows`): a slot named twice
    # is served at its first row; a count past the slot's room is refused.
    in_range = real & (slots >= 0) & (slots < S)
    idx = jnp.where(in_range, slots, 0)
    named_before = in_range[None, :] & (slots[None, :] == slots[:, None]) & before
    length_at = slot_words_at + idx * (2 + num_layers)
    first_named = in_range & (count(named_before) == 0)
    length = masked_load(packed_ref.at[jnp.where(first_named, length_at, spare)], mask=first_named, other=0)
    live = first_named & (asked >= 0) & (asked <= M * page_size - length)  # room, not a sum that overflows
    n = jnp.where(live, asked, 0)
    last_lp = jnp.minimum(length // page_size, M - 1)
    last_page = masked_load(packed_ref.at[jnp.where(real, page_map_at + idx * M + last_lp, spare)], mask=real, other=-1)
    last_at = refcount_at + jnp.clip(last_page, 0, P - 1)
    last_refs = masked_load(packed_ref.at[jnp.where(real, last_at, spare)], mask=real, other=0)
    have = (length + page_size - 1) // page_size
    need = (length + n + page_size - 1) // page_size
    wants_cow = live & (n > 0) & (length % page_size != 0) & (last_refs > 1)

    # `_allocate`: who keeps a shared page, first come first served, pops counted from the top.
    same = wants_cow[:, None] & wants_cow[None, :] & (last_page[:, None] == last_page[None, :])
    keeper = (count(same & before) == 0) & (count(same) == last_refs)
    cow = wants_cow & ~keeper
    cap = P + 1  # any demand above num_free fails alike
    demand = jnp.minimum(jnp.where(live, need - have + cow.astype(jnp.int32), 0), cap)
    upto = jnp.minimum(jnp.sum(jnp.where(b[None, :] <= b[:, None], demand[None, :], 0), axis=1), cap)  # inclusive
    ok = live & ((demand == 0) | (upto <= num_free))
    refused = cow & ~ok
    ok &= ~(wants_cow & keeper & (count(same & refused[None, :]) > 0))
    granted = jnp.where(ok, demand, 0)
    first = jnp.sum(jnp.where(before, granted[None, :], 0), axis=1)
    do_cow = ok & cow

    def popped(i):  # the i-th page popped from the stack top
        return masked_load(packed_ref.at[page_words_at + jnp.clip(num_free - 1 - i, 0, P - 1)],
                           mask=jnp.ones(i.shape, bool), other=0)  # fmt: skip

    def store(mask, address, value):
        masked_store(packed_ref.at[jnp.where(mask, address, spare)], value, mask=mask)

    # Refcounts: -k once for a shared page k rows of the batch copy away from, 1 for each popped
    # page; the page map: the private copy over the shared last page, new pages past the held ones.
    cow_page = jnp.where(do_cow, popped(first), P)
    leaving = do_cow[:, None] & do_cow[None, :] & (last_page[:, None] == last_page[None, :])
    drops = jnp.where(count(leaving & before) == 0, count(leaving), 0)
    dropped = do_cow & (drops > 0)
    store(dropped, last_at, last_refs - drops)
    store(do_cow, refcount_at + jnp.clip(cow_page, 0, P - 1), jnp.ones(cow_page.shape, jnp.int32))
    store(do_cow, page_map_at + idx * M + last_lp, cow_page)

    def new_pages(chunk, carry):  # logical pages [chunk * lanes, (chunk + 1) * lanes) of every row
        lp = chunk * page_lanes + jnp.arange(page_lanes, dtype=jnp.int32)[None, :]
        is_new = ok[:, None] & (lp >= have[:, None]) & (lp < need[:, None]) & (lp < M)  # [BP, lanes]
        new_page = popped(first[:, None] + cow.astype(jnp.int32)[:, None] + lp - have[:, None])
        store(is_new, refcount_at + jnp.clip(new_page, 0, P - 1), jnp.ones(new_page.shape, jnp.int32))
        store(is_new, page_map_at + idx[:, None] * M + lp, new_page)
        return carry

    # Only the chunks some row grows into (a decode step's rows: one page at most).
    grows = ok & (need > have)
    lowest, highest = jnp.min(jnp.where(grows, have, M)), jnp.max(jnp.where(grows, need, 0))
    lax.fori_loop(lowest // page_lanes, (highest + page_lanes - 1) // page_lanes, new_pages, 0)
    # The served rows' lengths and flags (`set_slots`), then num_free.
    store(ok, length_at, length + n)
    store(ok, length_at + 1, jnp.ones(length.shape, jnp.int32))
    packed_ref[words_at] = num_free - jnp.sum(granted)
    # The counters (`CacheStats.bump`): pages popped, copies, reservations that moved no data,
    # rows refused for want of pages, rows rejected (padding is neither).
    pad = slots == pad_slot
    for at, events in zip(counters, (granted, do_cow, ok & (n > 0) & (demand == 0), live & ~ok, real & ~pad & ~live)):
        counts_ref[at] = counts_ref[at] + jnp.sum(jnp.where(real, events.astype(jnp.int32), 0))
    served_ref[...] = (ok | pad).astype(jnp.int32)
    cow_src_ref[...] = jnp.where(do_cow, last_page, 0)
    cow_dst_ref[...] = cow_page
    if copy_arena:
        _copy_pages(k_ref, v_ref, do_cow & real, jnp.where(do_cow, last_page, 0), cow_page, b)


@functools.partial(jax.jit, static_argnames=("page_size", "geometry", "offsets", "pad_slot", "counters", "interpret"))
def _reserve_call(slots, num_tokens, packed, counts, arenas, *, page_size, geometry, offsets, pad_slot, counters,
                  interpret):
    max_seqs, max_pages, num_layers, num_pages = geometry
    batch = slots.shape[0]
    rows_p = max(2, next_pow2(batch))
    kernel = functools.partial(
        _kernel, batch=batch, rows_p=rows_p, max_seqs=max_seqs, max_pages=max_pages,
        page_lanes=min(PAGE_LANES, max(2, next_pow2(max_pages))), num_layers=num_layers, num_pages=num_pages,
        page_size=page_size, page_map_at=offsets[0], slot_words_at=offsets[1], page_words_at=offsets[2],
        words_at=offsets[3], pad_slot=pad_slot, counters=counters, copy_arena=bool(arenas))  # fmt: skip
    row = jax.ShapeDtypeStruct((rows_p,), jnp.int32)
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (packed, counts, *arenas)]
    outs = pl.pallas_call(
        kernel,
        grid=(1,),
        out_shape=(*shapes, row, row, row),
        input_output_aliases={2 + i: i for i in range(len(shapes))},
        compiler_params=None if interpret else compiler_params(8 if rows_p >= 64 else 4, 1),  # 64 rows: [64, 64] masks
        interpret=interpret,
        name=f"reserve_pages_b{rows_p}" + ("_copy" if arenas else ""),
    )(slots, num_tokens, packed, counts, *arenas)
    served, cow_src, cow_dst = (x[:batch] for x in outs[-3:])
    return outs[0], outs[1], tuple(outs[2:-3]), served != 0, cow_src, cow_dst


def reserve_pages(slots, num_tokens, packed, counts, *, page_size: int, geometry: tuple[int, int, int, int],
                  offsets: tuple[int, int, int, int], pad_slot: int, counters: tuple[int, ...], arenas=(),
                  interpret: bool | None = None):
    """`reserve`'s table work and counting over a page table's packed array, in place.

    slots, num_tokens: i32[B], B <= `MAX_ROWS` (`pad_slot`: padding; any other out-of-range
    slot: rejected). packed: the table's i32[W] (one data shard); geometry: its (max_seqs,
    max_pages_per_seq, num_layers, num_pages); offsets: where its regions start in `packed`
    (page map, slot words, page words, words). counts: the cache's counters i32[N]; counters:
    the places in it of pages_allocated, cow_copies, metadata_ops, failed_reservations and
    rejected_rows. arenas: () or a float arena's (k, v) [L, H, P, S, D]: copy-on-write's page
    copies made here too. Returns (packed, counts, arenas, ok bool[B] (served or padding),
    copy-on-write source i32[B] (0: none) and target (num_pages: none): what the caller must
    still copy when it passed no arenas).
    """
    if slots.ndim != 1 or not 0 < slots.shape[0] <= MAX_ROWS or num_tokens.shape != slots.shape:
        raise ValueError(f"slots and num_tokens must be i32[B] with 0 < B <= {MAX_ROWS}, got shapes "
                         f"{slots.shape} and {num_tokens.shape}")  # fmt: skip
    if packed.ndim != 1 or counts.ndim != 1:
        raise ValueError(f"packed and counts must be one table row i32[W] and its counters i32[N] (one data shard), "
                         f"got shapes {packed.shape} and {counts.shape}")  # fmt: skip
    if len(arenas) not in (0, 2) or any(a.ndim != 5 or a.shape[2] != geometry[3] for a in arenas):
        raise ValueError(f"arenas must be () or (k, v) [L, H, num_pages={geometry[3]}, S, D], got "
                         f"{[getattr(a, 'shape', a) for a in arenas]}")  # fmt: skip
    return _reserve_call(slots.astype(jnp.int32), num_tokens.astype(jnp.int32), packed, counts, tuple(arenas),
                         page_size=page_size, geometry=tuple(geometry), offsets=tuple(offsets), pad_slot=pad_slot,
                         counters=tuple(counters), interpret=resolve_interpret(interpret))  # fmt: skip
