"""JAX's persistent compilation cache for `arena-bench`: only the capacity simulation is cached.

The capacity simulation's jitted loop takes seconds to compile on a CPU and is plumbing, not a
reported figure, so it is written to (and read from) `$ARENA_BENCH_CACHE_DIR` (default
`~/.cache/arena-bench/jax`; an empty value turns the cache off). Everything else compiles
below the write threshold: decode's compile time is reported and always measured cold.
"""
from __future__ import annotations

import os

__all__ = ["CACHE_ENV", "init_compile_cache", "cached_compiles"]

CACHE_ENV = "ARENA_BENCH_CACHE_DIR"
_NEVER = 1e9  # seconds: a compile-time threshold nothing reaches, i.e. write no cache entry


def _cache_dir() -> str | None:
    """$ARENA_BENCH_CACHE_DIR (empty: off), else ~/.cache/arena-bench/jax."""
    path = os.environ.get(CACHE_ENV)
    if path is None:
        path = os.path.join(os.path.expanduser("~"), ".cache", "arena-bench", "jax")
    return path or None


def init_compile_cache() -> str | None:
    """Point JAX's persistent compilation cache at our folder, writing nothing by default.

    Only the capacity simulation's functions are written (see `cached_compiles`): they are
    plumbing, not a reported figure. Decode's compile time is reported, so it is never cached.
    """
    import jax

    path = _cache_dir()
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", _NEVER)
    return path


class cached_compiles:
    """Within this block, compilations taking over half a second are written to the cache."""

    def __enter__(self):
        import jax

        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    def __exit__(self, *exc):
        import jax

        jax.config.update("jax_persistent_cache_min_compile_time_secs", _NEVER)
        return False
