"""`health(cache)`: a host-side report of how the arena is used (reads the state back once)."""
from __future__ import annotations


import numpy as np

from arena_jax.kv_cache import KVCache

__all__ = ["health"]


def _host(x) -> np.ndarray:
    """The whole array on this host (gathered from the other processes of a multi-host mesh)."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def health(cache: KVCache, prefix=None, host=None) -> dict:
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
    exactly the cache's held pages, with the same token counts); an index with a host tier adds
    its hits per tier (prefix_device_hit_tokens, prefix_host_hit_tokens), its host pages and the
    pages it brought back or spilled.

    Data moved between the tiers: bytes_to_host / bytes_to_device (the `pages_to_host` /
    `pages_to_device` counters times `layout.page_bytes`: values and scales of every layer and KV
    head). With `host` (the cache's `arena_jax.HostArena`): host_pages, host_pages_held,
    host_tokens_held, host_bytes (and, with `prefix` too, prefix_host_index_matches: the
    index's host pages are exactly the host tier's held pages).

    Speculative decoding (a verify step on this cache, `models.speculative`): proposed_tokens,
    accepted_tokens and acceptance_rate (accepted / proposed; 0.0 before any proposal).

    Smoothed keys (`smooth_keys`): key_factor_layers_calibrated (layers given factors at any
    KV head by `create`), key_channels_smoothed (factors > 1, over layers, stored heads and
    channels) and key_factor_max (0: created without factors, no smoothing).

    A sharded cache adds its mesh degrees and the bytes each device holds
    (`arena_bytes_per_device`, `bytes_per_token_per_device`, replicated KV heads counted);
    counters are summed over data shards.
    """
    from arena_jax.prefix.cache import PrefixCache
    from arena_jax.validate import check_cache_arrays

    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache (from arena_jax.create), got {type(cache).__name__}")
    if prefix is not None and not isinstance(prefix, PrefixCache):
        raise ValueError(f"prefix must be an arena_jax.PrefixCache or None, got {type(prefix).__name__}")
    from arena_jax.host.arena import HostArena, check_pair

    if host is not None and not isinstance(host, HostArena):
        raise ValueError(f"host must be an arena_jax.HostArena or None, got {type(host).__name__}")
    layout = check_cache_arrays(cache)
    if host is not None:
        check_pair(cache, host)  # the cache's own host tier (its arena, geometry, key factors), not donated
    t = cache.table
    page_map, lengths, active = _host(t.page_map), _host(t.lengths), _host(t.active)
    refcount, num_free = _host(t.refcount), int(np.sum(_host(t.num_free)))  # a [dp] array when data-parallel
    held = _host(t.held)
    size = layout.page_size
    sh = cache.sharding
    dp = 1 if sh is None else sh.dp
    # page_map holds page ids local to the slot's data shard (one shard: the global ids)
    shard_base = (np.arange(layout.max_seqs) // (layout.max_seqs // dp)) * (layout.num_pages // dp)

    filled = np.zeros(layout.num_pages, np.int64)  # positions of each physical page holding a token
    for s in np.flatnonzero(active):
        n_pages = -(-int(lengths[s]) // size)
        pages = page_map[s, :n_pages] + shard_base[s]
        fill = np.minimum(size, int(lengths[s]) - np.arange(n_pages) * size)
        np.maximum.at(filled, pages, fill)
    filled = np.maximum(filled, held)
    pages_in_use = int(np.count_nonzero(refcount))
    capacity = pages_in_use * size
    tokens_held = int(filled.sum())
    written = _host(t.written)[:, active]  # [L, active slots]
    written_tokens = int(written.min(axis=0).sum()) if written.size else 0
    counters = {name: int(np.sum(_host(value))) for name, value in cache.stats.as_dict().items()}
    placement = {}
    if sh is not None:
        placement = dict(
            devices=int(sh.mesh.size),
            tensor_parallel=sh.tp,
            data_parallel=sh.dp,
            kv_replicas=sh.kv_replicas,
            arena_bytes_per_device=sh.arena_bytes_per_device(layout),
            bytes_per_token_per_device=sh.bytes_per_token_per_device(layout),
        )
    extra = {"bytes_to_host": counters["pages_to_host"] * layout.page_bytes,
             "bytes_to_device": counters["pages_to_device"] * layout.page_bytes,
             "acceptance_rate": counters["accepted_tokens"] / max(counters["proposed_tokens"], 1)}  # fmt: skip
    if cache.key_factors is not None:  # smoothed keys: the factors the cache was created with
        factors = _host(cache.key_factors)  # [L, H (replicas included), D]; 0: not calibrated (1)
        calibrated = factors.reshape(factors.shape[0], -1).max(axis=1) > 0
        extra.update(key_factor_layers_calibrated=int(calibrated.sum()),
                     key_channels_smoothed=int(np.count_nonzero(factors > 1)),
                     key_factor_max=float(factors.max()) if calibrated.any() else 0.0)  # fmt: skip
    if prefix is not None:
        device = {int(p): int(held[p]) for p in np.flatnonzero(held)}
        extra.update(prefix.metrics(), prefix_index_matches=device == prefix.pages())
    if host is not None:
        host_held = _host(host.held)
        extra.update(host_pages=int(host_held.shape[0]), host_pages_held=int(np.count_nonzero(host_held)),
                     host_tokens_held=int(host_held.sum()), host_bytes=int(host_held.shape[0]) * layout.page_bytes)  # fmt: skip
        if prefix is not None:
            on_host = {int(p): int(host_held[p]) for p in np.flatnonzero(host_held)}
            extra["prefix_host_index_matches"] = on_host == prefix.host_pages()
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
        **placement,
        **extra,
    }
