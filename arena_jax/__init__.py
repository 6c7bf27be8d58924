"""arena-jax: a functional, paged KV cache for JAX.

    import arena_jax as aj
    cache = aj.create(aj.KVLayout(...))          # or aj.create(layout, mesh=mesh): see arena_jax.sharding
    cache, ok = aj.reserve(cache, slots, num_tokens)
    cache = aj.append(cache, layer, slots, k, v)
    out = aj.attend(q, cache, layer, slots)
    host = aj.create_host(cache, num_pages=N)   # a host-memory tier: swap_out / swap_in (arena_jax.host)
"""
from arena_jax.api import (
    BACKEND_ENV,
    BACKENDS,
    append,
    attend,
    default_backend,
    drop_pages,
    fork,
    fork_pages,
    hold_pages,
    release,
    reserve,
    truncate,
)
from arena_jax.health import health
from arena_jax.host import HostArena, create_host, free_host_pages, host_pages_view
from arena_jax.host_api import drop_host_pages, offload_pages, swap_in, swap_out
from arena_jax.layout import KVLayout
from arena_jax.prefix import PrefixCache, PrefixHit
from arena_jax.sharding import CacheSharding
from arena_jax.state import PAD_PAGE, PAD_SLOT, CacheStats, KVCache, PageTable, create
from arena_jax.step import CacheStep, append_attend, begin_step, positions

__all__ = [
    "KVLayout",
    "KVCache",
    "PageTable",
    "CacheStats",
    "CacheSharding",
    "PAD_SLOT",
    "PAD_PAGE",
    "create",
    "reserve",
    "append",
    "attend",
    "append_attend",
    "positions",
    "begin_step",
    "CacheStep",
    "release",
    "fork",
    "truncate",
    "fork_pages",
    "hold_pages",
    "drop_pages",
    "HostArena",
    "create_host",
    "free_host_pages",
    "host_pages_view",
    "swap_out",
    "swap_in",
    "offload_pages",
    "drop_host_pages",
    "PrefixCache",
    "PrefixHit",
    "health",
    "default_backend",
    "BACKENDS",
    "BACKEND_ENV",
]
__version__ = "0.1.0"
