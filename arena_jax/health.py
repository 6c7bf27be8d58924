"""`health(cache)`: a host-side report of how the arena is used (reads the state back once)."""
from __future__ import annotations

import dataclasses

import numpy as np

from arena_jax.state import KVCache

__all__ = ["health"]


def health(cache: KVCache, prefix=None) -> dict:
    """Utilization, waste, free pages and the counters, as plain Python numbers.

    utilization = token positions reserved in allocated pages / their capacity (a shared page's
    positions count once; a page the cache holds counts its held tokens); logical_tokens counts
    each sequence's reserved tokens (shared ones per holder); written_tokens those whose K/V
    every layer has stored, and reserved_unwritten_tokens the rest (reserved, not yet appended
    at some layer). cached_pages / cached_tokens: what the cache itself holds (`hold_pages`),
    of which cached_only_pages no slot maps (what eviction can free).

    With `prefix` (an `arena_jax.PrefixCache`), its metrics too: prefix_lookups,
    prefix_lookup_tokens, prefix_hit_tokens, prefix_hit_rate (hit / looked-up tokens),
    prefix_cached_pages, prefix_evicted_pages, ..., and prefix_index_matches (its pages are
    exactly the cache's held pages, with the same token counts).
    """
    layout = cache.layout
    t = cache.table
    page_map, lengths, active = np.asarray(t.page_map), np.asarray(t.lengths), np.asarray(t.active)
    refcount, num_free = np.asarray(t.refcount), int(t.num_free)
    held = np.asarray(t.held)
    size = layout.page_size

    filled = np.zeros(layout.num_pages, np.int64)  # positions of each physical page holding a token
    for s in np.flatnonzero(active):
        n_pages = -(-int(lengths[s]) // size)
        pages = page_map[s, :n_pages]
        fill = np.minimum(size, int(lengths[s]) - np.arange(n_pages) * size)
        np.maximum.at(filled, pages, fill)
    filled = np.maximum(filled, held)
    pages_in_use = int(np.count_nonzero(refcount))
    capacity = pages_in_use * size
    tokens_held = int(filled.sum())
    written = np.asarray(t.written)[:, active]  # [L, active slots]
    written_tokens = int(written.min(axis=0).sum()) if written.size else 0
    counters = {f.name: int(getattr(cache.stats, f.name)) for f in dataclasses.fields(cache.stats)}
    extra = {}
    if prefix is not None:
        device = {int(p): int(held[p]) for p in np.flatnonzero(held)}
        extra = {**prefix.metrics(), "prefix_index_matches": device == prefix.pages()}
    return {
        "active_sequences": int(active.sum()),
        "logical_tokens": int(lengths[active].sum()),
        "written_tokens": written_tokens,
        "reserved_unwritten_tokens": int(lengths[active].sum()) - written_tokens,
        "tokens_held": tokens_held,
        "pages_in_use": pages_in_use,
        "shared_pages": int(np.count_nonzero(refcount > 1)),
        "cached_pages": int(np.count_nonzero(held)),
        "cached_tokens": int(held.sum()),
        "cached_only_pages": int(np.count_nonzero((held > 0) & (refcount == 1))),
        "free_pages": num_free,
        "num_pages": layout.num_pages,
        "utilization": tokens_held / capacity if capacity else 1.0,
        "internal_waste_tokens": capacity - tokens_held,
        "bytes_in_use": pages_in_use * layout.page_bytes,
        "arena_bytes": layout.arena_bytes,
        **counters,
        **extra,
    }
