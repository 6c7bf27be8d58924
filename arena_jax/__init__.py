"""arena-jax: a functional, paged KV cache for JAX.

    import arena_jax as aj
    cache = aj.create(aj.KVLayout(...))          # or aj.create(layout, mesh=mesh): see arena_jax.sharding
    cache, ok = aj.reserve(cache, slots, num_tokens)
    cache = aj.append(cache, layer, slots, k, v)
    out = aj.attend(q, cache, layer, slots)
"""
from arena_jax.api import BACKEND_ENV, BACKENDS, append, attend, default_backend, fork, release, reserve, truncate
from arena_jax.health import health
from arena_jax.layout import KVLayout
from arena_jax.sharding import CacheSharding
from arena_jax.state import PAD_SLOT, CacheStats, KVCache, PageTable, create

__all__ = [
    "KVLayout",
    "KVCache",
    "PageTable",
    "CacheStats",
    "CacheSharding",
    "PAD_SLOT",
    "create",
    "reserve",
    "append",
    "attend",
    "release",
    "fork",
    "truncate",
    "health",
    "default_backend",
    "BACKENDS",
    "BACKEND_ENV",
]
__version__ = "0.1.0"
