"""`generate`'s options as objects: what to sample (`Sampling`, in `models.sampling`), how to
serve the batch on the arena (`Serving`) and where to run it (`Parallelism`). Each is a
frozen, hashable dataclass checked once when it is made: a bad field is a ValueError naming the
field and its limit (the checks of `models.checks`).

    sampling = models.Sampling(temperature=0.8, top_p=0.95, seed=1)
    serving = models.Serving(batch_size=16, chunk_size=64, prefix_cache=True)
    result = models.generate(model, prompts, 64, sampling=sampling, serving=serving)

They gather the keywords `generate` took one by one (still accepted, same behaviour:
`options_from_keywords` builds the objects from them); a CLI or a server builds them once and
passes them to every call. Like vLLM's `SamplingParams` / `SchedulerConfig` + `CacheConfig` /
`ParallelConfig`: `Sampling` is per request, `Serving` and `Parallelism` per engine.

What is not an option stays a keyword of `generate`: the state a call continues (`cache`,
`host`, an earlier call's `prefix_cache=<PrefixCache>`) and the workload (`arrivals`).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax

import arena_jax as aj
from arena_jax.models.argtypes import MAX_DECODE_BLOCK
from arena_jax.models.checks import check_int
from arena_jax.models.host_tier import SwapPolicy
from arena_jax.models.sampling import Sampling

__all__ = ["Sampling", "Serving", "Parallelism", "SAMPLING_KEYS", "SERVING_KEYS", "PARALLEL_KEYS", "options_from_keywords"]


@dataclasses.dataclass(frozen=True)
class Serving:
    """How `generate` runs the batch on the paged arena: rows, chunks, the arena's size and
    dtype, the prefix cache, the host tier, mixed steps and decode blocks (generate's docstring
    and `models.scheduler` say what each does). vLLM's SchedulerConfig + CacheConfig."""

    batch_size: int = 4
    """Rows run at once (row r uses cache slot r); at most the layout's max_seqs. vLLM: max_num_seqs."""
    chunk_size: int | None = None
    """Prompt tokens a row feeds per prefill call (chunked prefill: one compiled prefill); None:
    `default_chunk_size` (the longest prompt rounded up to a power of two, 32 to 128; 32 with
    arrivals or mixed steps)."""
    layout: aj.KVLayout | None = None
    """The arena's layout; None: generate sizes it (every row at full length, `length_bucket`)."""
    kv_dtype: Any = None
    """The arena's dtype when generate sizes it ("int8", "float8_e4m3fn", "float8_e5m2" for an
    8-bit arena); None: the model's. Not with a `layout` (it brings its own)."""
    prefix_cache: bool = False
    """Reuse the K/V of cached prefixes (vLLM: enable_prefix_caching). To continue an earlier
    call's index, pass its `PrefixCache` as generate's `prefix_cache=` with this True."""
    host_pages: int = 0
    """Pages of a host-memory tier (swap preemption, or the prefix cache's spill tier); 0: none."""
    swap_policy: SwapPolicy | None = None
    """The host tier's swap-or-recompute cost model; None: `SwapPolicy()`."""
    mixed_steps: bool = False
    """Decode rows and prompt chunks in one `mixed_step` per iteration (lower latency under arrivals)."""
    token_budget: int | None = None
    """Tokens per mixed step (vLLM: max_num_batched_tokens); None: batch_size + chunk_size per
    data shard. Only with mixed_steps."""
    decode_block: int | None = None
    """Decode steps per device call while nothing waits, in [1, MAX_DECODE_BLOCK]; None:
    `default_decode_block` (8; 1 with arrivals or on a TPU)."""

    def __post_init__(self):
        object.__setattr__(self, "batch_size", check_int("batch_size", self.batch_size, low=1))
        if self.chunk_size is not None:
            object.__setattr__(self, "chunk_size", check_int("chunk_size", self.chunk_size, low=1))
        object.__setattr__(self, "host_pages", check_int("host_pages", self.host_pages, low=0))
        if self.decode_block is not None:
            object.__setattr__(self, "decode_block", check_int("decode_block", self.decode_block, low=1, high=MAX_DECODE_BLOCK))
        for name in ("mixed_steps", "prefix_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.token_budget is not None:
            if not self.mixed_steps:
                raise ValueError("token_budget is the mixed steps' size: give it with mixed_steps=True")
            object.__setattr__(self, "token_budget", check_int("token_budget", self.token_budget, low=1))
        if self.swap_policy is not None and not isinstance(self.swap_policy, SwapPolicy):
            raise ValueError(f"swap_policy must be a models.SwapPolicy, got {type(self.swap_policy).__name__}")
        if self.layout is not None and not isinstance(self.layout, aj.KVLayout):
            raise ValueError(f"layout must be an arena_jax.KVLayout, got {type(self.layout).__name__}")
        if self.kv_dtype is not None and self.layout is not None:
            raise ValueError("give kv_dtype only when generate sizes the arena: a layout or cache brings its own dtype")


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """Where `generate` runs: one device (mesh None), or a mesh whose `tensor_axis` splits the
    heads (Megatron style, `models.parallel`) and whose `data_axis` splits the rows into one
    block per data shard. vLLM's ParallelConfig."""

    mesh: jax.sharding.Mesh | None = None
    """The devices; None: one device (or the mesh of a sharded cache or model given)."""
    tensor_axis: str | None = "tensor"
    """The mesh axis the heads are split over (None: none)."""
    data_axis: str | None = None
    """The mesh axis the batch rows are split over (None: none); batch_size a multiple of its size."""

    def __post_init__(self):
        if self.mesh is not None and not isinstance(self.mesh, jax.sharding.Mesh):
            raise ValueError(f"mesh must be a jax.sharding.Mesh or None, got {type(self.mesh).__name__}")
        for name in ("tensor_axis", "data_axis"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a mesh axis name (a str) or None, got {value!r}")

    @property
    def on_mesh(self) -> dict:
        """`aj.create`'s keywords for a cache on this mesh ({} on one device)."""
        return {} if self.mesh is None else dict(mesh=self.mesh, tensor_axis=self.tensor_axis, data_axis=self.data_axis)


def _fields(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


SAMPLING_KEYS = _fields(Sampling)
SERVING_KEYS = _fields(Serving)
PARALLEL_KEYS = _fields(Parallelism)


def options_from_keywords(sampling, serving, parallel, keywords: dict):
    """(Sampling, Serving, Parallelism, PrefixCache or None) for `generate`: each object given,
    or built from its old keywords (an object and one of its keywords together is a TypeError;
    an unknown keyword too, as Python's own). `prefix_cache=<PrefixCache>` is the state of an
    earlier call, not an option: it comes back fourth (and needs `Serving.prefix_cache` True
    when a Serving is given)."""
    keywords = dict(keywords)
    index = keywords.get("prefix_cache")
    if isinstance(index, aj.PrefixCache):
        if serving is not None:
            del keywords["prefix_cache"]
            if isinstance(serving, Serving) and not serving.prefix_cache:
                raise ValueError("prefix_cache=<PrefixCache> continues a prefix cache: give it with Serving(prefix_cache=True)")
        else:
            keywords["prefix_cache"] = True
    else:
        index = None
        if "prefix_cache" in keywords and not isinstance(keywords["prefix_cache"], bool):
            got = type(keywords["prefix_cache"]).__name__
            raise ValueError(f"prefix_cache must be a bool or an arena_jax.PrefixCache, got {got}")
    unknown = sorted(set(keywords) - set(SAMPLING_KEYS + SERVING_KEYS + PARALLEL_KEYS))
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    built = []
    for name, given, cls, keys in (("sampling", sampling, Sampling, SAMPLING_KEYS), ("serving", serving, Serving, SERVING_KEYS),
                                   ("parallel", parallel, Parallelism, PARALLEL_KEYS)):  # fmt: skip
        mine = {k: keywords[k] for k in keys if k in keywords}
        if given is None:
            built.append(cls(**mine))
            continue
        if not isinstance(given, cls):
            raise ValueError(f"{name} must be a models.{cls.__name__}, got {type(given).__name__}")
        if mine:
            both = ", ".join(f"{k}=" for k in mine)
            raise TypeError(f"generate() got {name}= and {both}: give {', '.join(mine)} in the {cls.__name__} only, not both")
        built.append(given)
    return (*built, index)
