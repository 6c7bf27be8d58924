"""The page allocator as pure functions of the cache (the jitted bodies; `api.py` validates).

Every function takes a batch of slots `i32[B]` (PAD_SLOT rows do nothing) and does its
work for all rows at once with vectorized gathers/scatters: no loop over pages or rows.
Scatters aimed at "nothing" use an explicit out-of-range index plus `mode="drop"`.
"""
from __future__ import annotations

import jax.numpy as jnp

from arena_jax.state import PAD_SLOT, KVCache, PageTable

__all__ = ["reserve_impl", "release_impl", "fork_impl", "truncate_impl", "valid_rows"]


def _ceil_div(a, b):
    return (a + b - 1) // b


def valid_rows(table: PageTable, slots):
    """(valid bool[B], safe gather index i32[B]): PAD_SLOT and out-of-range rows are not valid."""
    max_seqs = table.page_map.shape[0]
    valid = (slots >= 0) & (slots < max_seqs)
    return valid, jnp.where(valid, slots, 0)


def _drop_refs(table: PageTable, pages):
    """Decrement `refcount` once per entry of `pages` (any shape; out-of-range = no page) and
    push pages that reach 0 onto the free stack. Returns (table, number of pages freed)."""
    num_pages = table.refcount.shape[0]
    flat = pages.reshape(-1)
    refcount = table.refcount.at[flat].add(-1, mode="drop")
    freed = (refcount == 0) & (table.refcount > 0)  # bool[P]: each freed page exactly once
    freed_i = freed.astype(jnp.int32)
    slot_in_stack = table.num_free + jnp.cumsum(freed_i) - freed_i
    free_stack = table.free_stack.at[jnp.where(freed, slot_in_stack, num_pages)].set(
        jnp.arange(num_pages, dtype=jnp.int32), mode="drop"
    )
    count = jnp.sum(freed_i)
    return table.replace(refcount=refcount, free_stack=free_stack, num_free=table.num_free + count), count


def reserve_impl(cache: KVCache, slots, num_tokens):
    """Grow each slot by num_tokens[b]; see `arena_jax.reserve`. Returns (cache, ok bool[B])."""
    table = cache.table
    max_seqs, max_pages = table.page_map.shape
    num_pages, page_size = cache.k.shape[2], cache.k.shape[3]
    valid, idx = valid_rows(table, slots)

    n = jnp.where(valid, num_tokens, 0)
    length = jnp.where(valid, table.lengths[idx], 0)
    new_length = length + n
    fits = (n >= 0) & (new_length <= max_pages * page_size)
    have = _ceil_div(length, page_size)  # mapped pages
    need = _ceil_div(new_length, page_size)
    row = table.page_map[idx]  # [B, M]

    # Copy-on-write: the last page is partly filled, shared, and this row will write into it.
    last_lp = jnp.minimum(length // page_size, max_pages - 1)
    last_page = jnp.take_along_axis(row, last_lp[:, None], axis=1)[:, 0]
    wants_cow = valid & (n > 0) & (length % page_size != 0) & (table.refcount[jnp.maximum(last_page, 0)] > 1)
    # When every holder of that page is in this batch and wants to write, the first one keeps it.
    same = wants_cow[:, None] & wants_cow[None, :] & (last_page[:, None] == last_page[None, :])  # [B, B]
    rank = jnp.sum(jnp.tril(same, k=-1), axis=1)
    holders_here = jnp.sum(same, axis=1)
    keeper = (rank == 0) & (holders_here == table.refcount[jnp.maximum(last_page, 0)])
    cow = wants_cow & ~keeper

    # First come, first served in batch order: a row is served if its demand, plus the demand of
    # every earlier row, fits in the free pages. Rows that need no page are always served.
    demand = jnp.where(valid & fits, need - have + cow, 0)
    ok_pages = (demand == 0) | (jnp.cumsum(demand) <= table.num_free)
    ok = valid & fits & ok_pages
    # The keeper writes into a page its co-holders hold until they get their copies: it is
    # served only if every co-holder in the batch is (else it would write into a shared page).
    copier_refused = cow & ~ok
    ok &= ~(wants_cow & keeper & jnp.any(same & copier_refused[None, :], axis=1))
    granted = jnp.where(ok, demand, 0)
    first = jnp.cumsum(granted) - granted  # this row's first pop, counted from the stack top
    total = jnp.sum(granted)

    def popped(i):  # the i-th page popped from the stack top
        return table.free_stack[jnp.clip(table.num_free - 1 - i, 0, num_pages - 1)]

    do_cow = ok & cow
    cow_page = jnp.where(do_cow, popped(first), num_pages)  # [B]
    lp = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    is_new = ok[:, None] & (lp >= have[:, None]) & (lp < need[:, None])  # [B, M]
    new_page = popped(first[:, None] + cow[:, None] + lp - have[:, None])
    new_row = jnp.where(is_new, new_page, row)
    new_row = jnp.where(do_cow[:, None] & (lp == last_lp[:, None]), cow_page[:, None], new_row)

    target = jnp.where(ok, slots, max_seqs)  # only served rows change
    refcount = table.refcount.at[jnp.where(is_new, new_page, num_pages)].set(1, mode="drop")
    refcount = refcount.at[cow_page].set(1, mode="drop")
    refcount = refcount.at[jnp.where(do_cow, last_page, num_pages)].add(-1, mode="drop")
    table = table.replace(
        page_map=table.page_map.at[target].set(new_row, mode="drop"),
        lengths=table.lengths.at[target].set(new_length, mode="drop"),
        active=table.active.at[target].set(True, mode="drop"),
        num_free=table.num_free - total,
        refcount=refcount,
    )

    # The private copy of a shared page, all layers and heads: [L, H, B, S, D].
    src = jnp.where(do_cow, last_page, 0)
    k = cache.k.at[:, :, cow_page].set(cache.k[:, :, src], mode="drop")
    v = cache.v.at[:, :, cow_page].set(cache.v[:, :, src], mode="drop")

    stats = cache.stats.bump(
        pages_allocated=total,
        cow_copies=jnp.sum(do_cow),
        metadata_ops=jnp.sum(ok & (n > 0) & (demand == 0)),
        failed_reservations=jnp.sum(valid & ~ok),
    )
    return cache.replace(k=k, v=v, table=table, stats=stats), ok | (slots == PAD_SLOT)


def _unmap_tail(cache: KVCache, slots, keep_tokens):
    """Drop each valid row's pages beyond ceil(keep_tokens / page_size). Returns (cache, pages freed)."""
    table = cache.table
    max_seqs, max_pages = table.page_map.shape
    num_pages, page_size = cache.k.shape[2], cache.k.shape[3]
    valid, idx = valid_rows(table, slots)
    row = table.page_map[idx]
    keep_pages = _ceil_div(keep_tokens, page_size)
    lp = jnp.arange(max_pages, dtype=jnp.int32)[None, :]
    drop = valid[:, None] & (lp >= keep_pages[:, None]) & (row >= 0)  # [B, M]
    table, freed = _drop_refs(table, jnp.where(drop, row, num_pages))
    target = jnp.where(valid, slots, max_seqs)
    table = table.replace(page_map=table.page_map.at[target].set(jnp.where(drop, -1, row), mode="drop"))
    return cache.replace(table=table), freed


def release_impl(cache: KVCache, slots):
    """Drop the slots; pages whose refcount reaches 0 go back on the free stack."""
    cache, freed = _unmap_tail(cache, slots, jnp.zeros_like(slots))
    table = cache.table
    valid, _ = valid_rows(table, slots)
    target = jnp.where(valid, slots, table.page_map.shape[0])
    table = table.replace(
        lengths=table.lengths.at[target].set(0, mode="drop"),
        active=table.active.at[target].set(False, mode="drop"),
    )
    return cache.replace(table=table, stats=cache.stats.bump(pages_recycled=freed))


def truncate_impl(cache: KVCache, slots, lengths):
    """Roll each slot back to min(lengths[b], its length); whole pages past the end are released."""
    valid, idx = valid_rows(cache.table, slots)
    new_length = jnp.clip(lengths, 0, cache.table.lengths[idx])
    cache, freed = _unmap_tail(cache, slots, new_length)
    table = cache.table
    target = jnp.where(valid, slots, table.page_map.shape[0])
    table = table.replace(lengths=table.lengths.at[target].set(new_length, mode="drop"))
    stats = cache.stats.bump(pages_recycled=freed, metadata_ops=jnp.sum(valid))
    return cache.replace(table=table, stats=stats)


def fork_impl(cache: KVCache, src, dst):
    """dst[b] (released first if in use) shares src[b]'s pages: refcount + 1, no data moved."""
    cache = release_impl(cache, dst)
    table = cache.table
    max_seqs = table.page_map.shape[0]
    num_pages = cache.k.shape[2]
    src_ok, src_idx = valid_rows(table, src)
    dst_ok, _ = valid_rows(table, dst)
    both = src_ok & dst_ok
    row = table.page_map[src_idx]  # [B, M]
    shared = both[:, None] & (row >= 0)
    refcount = table.refcount.at[jnp.where(shared, row, num_pages)].add(1, mode="drop")
    target = jnp.where(both, dst, max_seqs)
    table = table.replace(
        page_map=table.page_map.at[target].set(row, mode="drop"),
        lengths=table.lengths.at[target].set(table.lengths[src_idx], mode="drop"),
        active=table.active.at[target].set(table.active[src_idx], mode="drop"),
        refcount=refcount,
    )
    return cache.replace(table=table, stats=cache.stats.bump(metadata_ops=jnp.sum(both)))

