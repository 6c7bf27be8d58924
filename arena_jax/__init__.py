"""arena-jax: a functional, paged KV cache for JAX.

The question it answers: where does each sequence's K/V live, and how does a model write and
read it inside jit, on one device or a mesh, without copying the arena?

    import arena_jax as aj
    cache = aj.create(aj.KVLayout(...))          # or aj.create(layout, mesh=mesh): see arena_jax.sharding
    cache, ok = aj.reserve(cache, slots, num_tokens)
    cache = aj.append(cache, layer, slots, k, v)
    out = aj.attend(q, cache, layer, slots)
    host = aj.create_host(cache, num_pages=N)   # a host-memory tier: swap_out / swap_in (arena_jax.host)

What is where (each module's docstring has its design), from the bottom up:

    layout.py       `KVLayout`: the static geometry of an arena (hf/ reads it from a config.json)
    kv_cache.py     the state: `KVCache`, `PageTable`, `CacheStats` pytrees, `PAD_SLOT` / `PAD_PAGE`
    validate.py     host-side argument checks (a ValueError naming the argument and the limit)
    key_factors.py  smoothed keys' static per-channel factors
    memory.py       memory kinds: how JAX names host memory, moving arrays there
    allocator.py    the page allocator's jitted bodies (reserve, release, fork, truncate)
    arena_ops.py    the data path's jitted bodies (append, attend) over the Pallas kernels
    sharding.py     many devices: the arena on a mesh, every op per shard
    state.py        `create`: allocating the arena (one device or a mesh)
    api.py          the public ops: checks on the host, then one jitted pure function each
    step.py         a model's forward pass in three calls (`begin_step`, `CacheStep.attend`)
    health.py       `health(cache)`: a host-side report of how the arena is used
    hf/             Hugging Face config files, read as transformers reads them
    prefix/         the prefix cache: an index of held pages and the ops that share them
    host/           the host tier: pages in pinned host memory, swap out / swap in

Former module paths (`arena_jax.host_api`, `arena_jax.hf_config`, ...) name the moved modules
(`arena_jax._moved`). The models and the benchmark CLI are `arena_jax.models` and
`arena_jax.benchmarks` (the repository's models/ and benchmarks/ folders: `arena_jax._subpackages`);
importing them is not part of `import arena_jax`.
"""
import sys as _sys

from arena_jax import _moved, _subpackages
from arena_jax.api import (
    BACKEND_ENV,
    BACKENDS,
    append,
    attend,
    attend_mixed,
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
from arena_jax.host import (
    HostArena,
    create_host,
    drop_host_pages,
    free_host_pages,
    host_pages_view,
    offload_pages,
    swap_in,
    swap_out,
)
from arena_jax.kv_cache import PAD_PAGE, PAD_SLOT, CacheStats, KVCache, PageTable
from arena_jax.layout import KVLayout
from arena_jax.plan import StepPlan, plan_step
from arena_jax.prefix import PrefixCache, PrefixHit
from arena_jax.sharding import CacheSharding
from arena_jax.state import create
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
    "attend_mixed",
    "append_attend",
    "positions",
    "begin_step",
    "CacheStep",
    "plan_step",
    "StepPlan",
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

_moved.register(_sys.modules[__name__])  # arena_jax.host_api is arena_jax.host.api, ...
_subpackages.register()  # arena_jax.models, arena_jax.benchmarks: the models/ and benchmarks/ folders
