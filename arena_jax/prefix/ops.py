"""Device ops of the prefix cache as pure functions of the cache (the jitted bodies of
`aj.fork_pages`, `aj.hold_pages`, `aj.drop_pages`; `api.py` validates on the host).

The cache itself is one more holder of a page: `PageTable.held[p]` is the number of tokens of
page p it holds (0: no hold), and a hold counts once in `refcount`, so a page in use always has
`refcount == mappings + (held > 0)`. Sharing, copy-on-write and freeing need nothing new:

  hold_pages   take the cache's hold on the first `num_tokens` tokens of pages that slots have
               written (refcount + 1). The page is frozen from then on: any slot mapping it
               shares it, and `append` writes only private pages.
  fork_pages   make a slot from held pages and a token count (a fork from pages rather than
               from a slot): the slot is settled at that count (`lengths = written[l] = n` at
               every layer) and shares the pages (refcount + 1 each). A partly filled last page
               is copied by the slot's next `reserve` (copy-on-write, as after `fork`).
  drop_pages   give the hold back (refcount - 1); a page no slot maps is freed (an eviction).

Totality follows `arena_jax.allocator`: rows are pad, rejected (counted in
`stats.rejected_rows`, nothing changed) or served, whatever the traced inputs.
  hold_pages   rejected: a page out of range, named by an earlier row, already held, with a
               count outside [1, fill] where fill is the most tokens any slot mapping the page has
               written there at every layer (so a free or unwritten page cannot be held), or a
               page holding a slot's reserved-but-unwritten positions (holding it would make a
               pending write land in a shared page).
  fork_pages   rejected: dst out of range or named by an earlier row, a count outside
               [0, pages' width * page_size], a used entry (logical page < ceil(n / page_size))
               that is out of range or whose hold covers fewer tokens than the slot takes from
               it, or a page used twice in the row.
  drop_pages   rejected: a page out of range, named by an earlier row, or not held.
"""
from __future__ import annotations

import jax.numpy as jnp

from arena_jax.allocator import _drop_refs, _page_rows, _release_rows, slot_rows
from arena_jax.kv_cache import PAD_PAGE, PAD_SLOT, KVCache, PageTable

__all__ = ["fork_pages_impl", "hold_pages_impl", "drop_pages_impl", "page_fill"]


def page_fill(table: PageTable, page_size: int):
    """(fill i32[P], pending bool[P]): fill[p] is the most tokens of page p that a slot mapping it
    has written at every layer; pending[p] says a slot has reserved-but-unwritten positions in p."""
    num_pages = table.refcount.shape[0]
    max_pages = table.page_map.shape[1]
    base = jnp.arange(max_pages, dtype=jnp.int32)[None, :] * page_size  # [1, M] first position of each logical page
    settled = jnp.min(table.written, axis=0)[:, None]  # [S, 1] written at every layer
    mapped = table.page_map >= 0  # [S, M]
    where = jnp.where(mapped, table.page_map, num_pages)
    fill = jnp.zeros((num_pages,), jnp.int32).at[where].max(jnp.clip(settled - base, 0, page_size), mode="drop")
    pend = jnp.maximum(settled, base) < jnp.minimum(table.lengths[:, None], base + page_size)  # [settled, length) meets the page
    pending = jnp.zeros((num_pages,), bool).at[jnp.where(mapped & pend, table.page_map, num_pages)].set(True, mode="drop")
    return fill, pending


def hold_pages_impl(cache: KVCache, pages, num_tokens):
    """The cache holds the first num_tokens[k] tokens of pages[k] (see the module docstring)."""
    table = cache.table
    num_pages, page_size = cache.k.shape[2], cache.k.shape[3]
    pad = pages == PAD_PAGE
    _, first, idx = _page_rows(num_pages, pages)
    fill, pending = page_fill(table, page_size)
    ok = first & (table.held[idx] == 0) & ~pending[idx] & (num_tokens >= 1) & (num_tokens <= fill[idx])
    target = jnp.where(ok, pages, num_pages)
    table = table.replace(
        held=table.held.at[target].set(num_tokens, mode="drop"),
        refcount=table.refcount.at[target].add(1, mode="drop"),
    )
    stats = cache.stats.bump(pages_held=ok, rejected_rows=~pad & ~ok)
    return cache.replace(table=table.advanced(ok), stats=stats)


def drop_pages_impl(cache: KVCache, pages):
    """The cache gives back its hold on pages; those no slot maps return to the free stack."""
    table = cache.table
    num_pages = cache.k.shape[2]
    pad = pages == PAD_PAGE
    _, first, idx = _page_rows(num_pages, pages)
    ok = first & (table.held[idx] > 0)
    target = jnp.where(ok, pages, num_pages)
    table, freed = _drop_refs(table.replace(held=table.held.at[target].set(0, mode="drop")), target)
    stats = cache.stats.bump(
        holds_dropped=ok, pages_evicted=freed, pages_recycled=freed, rejected_rows=~pad & ~ok
    )
    return cache.replace(table=table, stats=stats)


def fork_pages_impl(cache: KVCache, pages, num_tokens, dst):
    """dst[b] (released first if in use) becomes a settled slot of num_tokens[b] tokens whose
    logical pages are pages[b, :ceil(num_tokens[b] / page_size)] (see the module docstring)."""
    table = cache.table
    max_seqs, max_pages = table.page_map.shape
    num_pages, page_size = cache.k.shape[2], cache.k.shape[3]
    width = pages.shape[1]  # <= max_pages (a static shape, checked by the caller)
    dst_pad = dst == PAD_SLOT
    live, _ = slot_rows(table, dst)
    n_ok = (num_tokens >= 0) & (num_tokens <= width * page_size)
    n = jnp.where(n_ok, num_tokens, 0)
    lp = jnp.arange(width, dtype=jnp.int32)[None, :]
    take = jnp.clip(n[:, None] - lp * page_size, 0, page_size)  # [B, W] tokens taken from each page
    use = take > 0
    in_range = (pages >= 0) & (pages < num_pages)
    covered = in_range & (table.held[jnp.clip(pages, 0, num_pages - 1)] >= take)
    distinct = jnp.sort(jnp.where(use & in_range, pages, num_pages + lp), axis=1)  # unused entries never collide
    dup = jnp.any(distinct[:, 1:] == distinct[:, :-1], axis=1)
    ok = live & n_ok & jnp.all(covered | ~use, axis=1) & ~dup

    # Releasing a destination never frees a page a row maps: those are held (refcount >= 1 after).
    cache, freed = _release_rows(cache, dst, ok)
    table = cache.table
    mapped = ok[:, None] & use
    # Padded, not `full(...).at[:, :width].set(...)`: at width == max_pages that is a scatter with an
    # empty index vector, a zero-sized constant that jaxlib 0.11 crashes on inside a shard_map
    # (tests/test_jax_bug_shardy_empty_operand.py).
    row = jnp.pad(jnp.where(mapped, pages, -1).astype(jnp.int32), ((0, 0), (0, max_pages - width)), constant_values=-1)
    target = jnp.where(ok, dst, max_seqs)
    table = table.replace(
        page_map=table.page_map.at[target].set(row, mode="drop"),
        lengths=table.lengths.at[target].set(n, mode="drop"),
        active=table.active.at[target].set(True, mode="drop"),
        written=table.written.at[:, target].set(n[None, :], mode="drop"),
        refcount=table.refcount.at[jnp.where(mapped, pages, num_pages)].add(1, mode="drop"),
    )
    stats = cache.stats.bump(
        metadata_ops=ok,
        prefix_forks=ok,
        prefix_tokens=jnp.where(ok, n, 0),
        pages_recycled=freed,
        rejected_rows=~dst_pad & ~ok,
    )
    return cache.replace(table=table.advanced(ok), stats=stats)
