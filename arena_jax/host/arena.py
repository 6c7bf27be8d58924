"""The host tier: a second arena of pages in host memory, and its page table.

    host = aj.create_host(cache, num_pages=1024)                   # pages in pinned_host memory
    cache, host, ok = aj.swap_out(cache, host, slots, host_pages)  # a slot's written pages -> host pages; slot released
    cache, host, ok = aj.swap_in(cache, host, host_pages, num_tokens, dst)  # host pages -> fresh device pages
    cache, host = aj.offload_pages(cache, host, pages, host_pages)  # held pages -> host pages; holds dropped
    cache, host = aj.drop_host_pages(cache, host, host_pages)       # host pages freed

Design, and why.

* A separate pytree (`HostArena`), not new fields of `KVCache`. Every existing op keeps its
  signature, its jit cache and its donation; a cache without a host tier is exactly the cache
  it was (same leaves, same StableHLO); the host tier can be created, replaced or dropped
  without touching the arena; and the ops that move pages take both, donated, and return both.
  A `aj.create(layout, host_pages=N)` returning a pair would have changed `create`'s return
  type for everyone.
* Generic over the cache's per-page arrays. `HostArena.pages` is a dict with one host array for
  every per-page array of the cache (`page_arrays`: `k`, `v` and, for 8-bit arenas, `k_scale`,
  `v_scale`; any future field shaped `[layers, heads, pages, ...]`, e.g. an int4 format's group
  scales, is picked up by name), each `[layers, heads, host_pages, ...]` with the cache's dtype
  (on a TPU, 8-bit pages as words: below).
  The moves copy every one of them, so values never travel without their scales.
* The caller names the host pages (`host_pages` arguments), as `hold_pages` names device
  pages. The host page table is one array, `held i32[host_pages]`: how many tokens host page p
  holds (0: free). A scheduler or a prefix index knows which host pages are free the moment
  it decides a move (no device read-back, no free stack to mirror), and inside jit a named page
  that is not free (or not held for the tokens asked) is refused like any invalid input.
  Host pages are exclusive: one holder each (a swapped-out sequence, a prefix index node), no
  refcount. Moves copy: `swap_in` leaves the host pages held (drop them with
  `drop_host_pages`, or keep them as a second copy, as a prefix index does: a page back on the
  device that is evicted again needs no new copy).
* Where the bytes live. `pages` are in `pinned_host` memory (page-locked, DMA-able), placed
  shard by shard from numpy at creation (never through device memory); `held` is a small
  integer array in device memory beside the page table (the ops validate against it inside
  jit). `arena_jax.memory` is the one shim that knows how JAX spells the transfers.
* How a page moves (`arena_jax.host.ops`). Inside one jitted op: a loop over the moves (compacted to the
  front, a dynamic trip count), each a `dynamic_slice` of one page from the source arena, a
  memory-kind transfer, and a `dynamic_update_slice` into the destination arena. A slice of a
  device buffer moved to host and written into a host buffer by `dynamic_update_slice` (and the
  reverse) is the pattern XLA's host offloader turns into asynchronous copies (the one scan
  activation offloading uses); a scatter at computed indices into host memory is not (it
  would be host compute). Verified on CPU (JAX 0.10 and 0.11), where host and device share
  DRAM; on a GPU it is unverified here (no GPU in these sessions).
* On a TPU, 8-bit pages are kept on the host as 32-bit words (`host_page_format`,
  `packs_as_words`): `[host_pages * layers, heads, S * D / 512, 128]` uint32, page-major, moved
  one layer of one page at a time and converted on the device side. In the arena's own int8
  form XLA's TPU layout assignment relayouted the whole host tier on the device for every move
  (1 GiB of temp per `swap_in` at the Llama-3-8B geometry); words of 128 lanes slice in their
  own tiling, and page-major rows keep every host slice in one dimension (the only kind XLA's
  host offloading takes). Compiled for a v5e without a TPU (`benchmarks/studies/tpu_host_tier.py`,
  RESULTS "The host tier's page moves on a TPU"); `host_pages_view` reads either form back as
  pages.
* Bound to its cache, as a prefix index is to its arena. Host pages mean something only with
  the cache they came from: another arena, other key factors (`smooth_keys`: keys stored
  divided by them) or another geometry would read them wrong (issue 37: attention over pages
  swapped out of one int8 or int4 cache into another with other factors erred by 80-96%, with
  no error raised). So a host tier records, at `create_host`, its cache's random arena id
  (`table.arena_id`), its layout and a copy of its key factors (fixed when the cache is
  created, never changed by an op), and `check_pair` refuses a host tier of any other cache,
  or one donated to an earlier call, with a ValueError naming `host` and what differs: every
  op taking a host, and every reader (`aj.health(cache, host=)`, `host_pages_view`,
  `PrefixCache.bind(cache, host=)`; `free_host_pages`, which has no cache, refuses a donated
  one). Inside a user's jit, where the ids cannot be read on the host, the ops stay total: a
  host tier of another arena gets every row refused (`stats.rejected_rows`), so its pages
  never reach the cache.
* On a mesh the host tier is split like the arena: `P(None, tensor, None, ...)` in host
  memory, KV heads over the tensor axis (each device's host memory holds its own heads: a move
  never crosses devices), `held` replicated. A cache with a data axis (dp > 1) is refused: a host
  tier per data shard (local host page ids, as `page_map` has local device ids) is not built.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding, SingleDeviceSharding

from arena_jax.kv_cache import KVCache
from arena_jax.layout import KVLayout
from arena_jax.memory import host_memory_kind, host_zeros
from arena_jax.validate import concrete, donated

__all__ = ["HostArena", "create_host", "page_arrays", "free_host_pages", "host_pages_view"]

# Fields of KVCache that are not per-page arrays (`key_factors`: one per layer, head, channel).
_NOT_PAGES = ("table", "stats", "sharding", "key_factors")


def page_arrays(cache: KVCache) -> dict[str, jax.Array]:
    """The cache's per-page arrays by field name (`[layers, heads, pages, ...]`): k, v and an
    8-bit arena's scales; whatever per-page field a future format adds."""
    out = {}
    for f in dataclasses.fields(cache):
        value = getattr(cache, f.name)
        if f.name not in _NOT_PAGES and f.metadata.get("pytree_node", True) and value is not None:
            out[f.name] = value
    return out


@struct.dataclass
class HostArena:
    """Pages in host memory, one array per per-page array of the cache, and which are held."""

    pages: dict  # name -> [layers, heads, host_pages, page_size, ...] in pinned_host memory (the cache's dtypes)
    held: jax.Array  # i32[host_pages], tokens each host page holds (0: free); device memory
    # i32[], a random id drawn at creation: a prefix index that keeps pages here binds to it.
    host_id: jax.Array
    sharding: Any = struct.field(pytree_node=False, default=None)  # the cache's CacheSharding, or None
    # The cache it belongs to, recorded by `create_host` (module docstring, "Bound to its cache"):
    arena_id: jax.Array | None = None  # i32[], the cache's `table.arena_id`: the ops refuse every row of another arena
    key_factors: jax.Array | None = None  # a copy of the cache's `key_factors` (smooth_keys), else None
    layout: KVLayout | None = struct.field(pytree_node=False, default=None)  # the cache's geometry

    @property
    def num_pages(self) -> int:
        return self.held.shape[0]


WORD_LANES = 128  # a word-packed host page's rows: 128 uint32 words (one TPU vector row)


def words_fit(shape) -> bool:
    """Whether a per-page array of `shape` ([L, H, P, S, D], 8-bit) packs into rows of
    `WORD_LANES` 32-bit words page by page (S * D a multiple of 4 * WORD_LANES)."""
    return len(shape) == 5 and (shape[3] * shape[4]) % (4 * WORD_LANES) == 0


def packs_as_words(x, platform: str) -> bool:
    """Whether the host tier keeps this per-page array as 32-bit words: an 8-bit array of an arena
    on a TPU. XLA's TPU layout assignment wants one-page slices of an 8-bit array in another
    tiling than the array's own, which for an array in host memory means a copy of all of it to
    the device and back on every move (RESULTS, "The host tier's page moves on a TPU"); 32-bit
    words in rows of 128 slice in their own tiling."""
    return platform == "tpu" and jnp.dtype(x.dtype).itemsize == 1 and words_fit(x.shape)


def host_page_format(x, num_pages: int, words: bool) -> tuple[tuple, Any]:
    """(shape, dtype) of the host array for the cache's per-page array `x` ([L, H, P, ...]):
    `[L, H, num_pages, ...]` in x's dtype, or with `words`, `[num_pages * L, H, S * D / 512, 128]`
    uint32: page p of layer l is row p * L + l, its [H, S, D] bytes as words (page-major, so one
    layer's page is a slice in one dimension, the only slices XLA's host offloading takes). Scale
    rows (`KVCache.scale_rows`, x `[L, H, P * S / 128, 128]`) give `[L, H, num_pages, 128]`: a
    whole row a host page, its first S lanes used (`host.ops._move_scale_lanes`)."""
    if not words:
        return x.shape[:2] + (num_pages,) + x.shape[3:], jnp.dtype(x.dtype)
    layers, heads, _, size, dim = x.shape
    return (num_pages * layers, heads, size * dim // (4 * WORD_LANES), WORD_LANES), jnp.dtype(jnp.uint32)


def is_words(host_array, cache_array) -> bool:
    """Whether `host_array` holds `cache_array`'s pages as words (`host_page_format`)."""
    return jnp.dtype(host_array.dtype) == jnp.uint32 and jnp.dtype(cache_array.dtype).itemsize == 1


def words_as_pages(words: np.ndarray, like) -> np.ndarray:
    """numpy: host words `[HP * L, H, rows, 128]` uint32 -> pages `[L, H, HP, S, D]` in the
    dtype of `like` (the cache's per-page array), the inverse of `host_page_format`'s packing."""
    layers, heads, _, size, dim = like.shape
    return np.asarray(words).view(np.dtype(like.dtype)).reshape(-1, layers, heads, size, dim).transpose(1, 2, 0, 3, 4)


def host_pages_view(host: "HostArena", cache: KVCache) -> dict[str, np.ndarray]:
    """The host tier's pages as numpy `[L, H, host_pages, ...]` arrays in the cache's dtypes,
    whichever format holds them (reads them back: for tests and inspection). `host` must be
    `cache`'s (`check_pair`)."""
    check_pair(cache, host)
    out = {}
    for name, x in page_arrays(cache).items():
        h = np.asarray(host.pages[name])
        out[name] = words_as_pages(h, x) if is_words(h, x) else h
        if cache.scale_rows and name in ("k_scale", "v_scale"):  # a row a host page, its first S lanes used
            out[name] = h[..., :cache.k.shape[3]]
    return out


def _check_live(host) -> None:
    """ValueError unless `host` is a HostArena none of whose arrays was donated to a later call."""
    if not isinstance(host, HostArena):
        raise ValueError(f"host must be a HostArena (from arena_jax.create_host), got {type(host).__name__}")
    if donated(host):
        raise ValueError("host: its arrays were donated to a later call: continue from the newest HostArena returned")


def check_pair(cache: KVCache, host) -> None:
    """ValueError unless `host` is this cache's host tier: a HostArena made by
    `create_host(cache, ...)` (or returned by an op on the two), none of its arrays donated, its
    pages matching the cache's per-page arrays, on the cache's mesh, and bound to the cache's
    arena id, layout and key factors (module docstring, "Bound to its cache"). The ids and
    factors are compared where both are concrete (inside a user's jit the ops refuse another
    arena's rows instead). A HostArena recording no cache is refused."""
    _check_live(host)
    arrays = page_arrays(cache)
    have = {name: (tuple(x.shape), jnp.dtype(x.dtype)) for name, x in host.pages.items()}
    want = {name: host_page_format(x, host.num_pages, name in host.pages and is_words(host.pages[name], x))
            for name, x in arrays.items()}  # fmt: skip
    if want != have:
        raise ValueError(
            f"host: its pages {have} do not match the cache's per-page arrays {want} (make it with "
            "aj.create_host(cache, ...))"
        )
    if host.sharding != cache.sharding:
        raise ValueError("host: it is placed on another mesh than the cache (make it with aj.create_host(cache, ...))")
    if host.arena_id is None or host.layout is None:
        raise ValueError("host: it records no cache (arena id, layout): make it with aj.create_host(cache, ...)")
    if host.layout != cache.layout:
        differ = ", ".join(f"{f.name}={getattr(host.layout, f.name)!r} (the cache's {getattr(cache.layout, f.name)!r})"
                           for f in dataclasses.fields(KVLayout)
                           if getattr(host.layout, f.name) != getattr(cache.layout, f.name))  # fmt: skip
        raise ValueError(f"host: it was made for a cache of another geometry ({differ}): its pages are not this cache's")
    mine, theirs = concrete(host.arena_id), concrete(cache.table.arena_id)
    if mine is not None and theirs is not None and int(mine) != int(theirs):
        raise ValueError(
            f"host: it belongs to arena {int(mine)}, not to this cache's arena {int(theirs)}: a host tier holds pages of "
            "the one cache it was made with (aj.create_host(cache, ...)); another cache would read them wrong"
        )
    if host.key_factors is not None and cache.key_factors is not None:
        mine, theirs = concrete(host.key_factors), concrete(cache.key_factors)
        if mine is not None and theirs is not None and not np.array_equal(mine, theirs):
            at = tuple(int(i) for i in np.argwhere(mine != theirs)[0])  # (layer, stored KV head, channel)
            raise ValueError(
                f"host: its pages were stored with other key factors (smooth_keys) than this cache's (layer {at[0]}, KV "
                f"head {at[1]}, channel {at[2]}: {float(mine[at])} vs the cache's {float(theirs[at])}; "
                f"{int(np.count_nonzero(mine != theirs))} differ): another cache would read its keys wrong"
            )


def create_host(cache: KVCache, num_pages: int) -> HostArena:
    """A host tier of `num_pages` free pages for `cache`: its per-page arrays' geometry and
    dtypes, in `pinned_host` memory, placed on the cache's devices (split over the tensor axis
    like the arena on a mesh; a data axis is refused)."""
    from arena_jax.validate import check_cache_arrays

    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache (from arena_jax.create), got {type(cache).__name__}")
    check_cache_arrays(cache)
    if isinstance(num_pages, (bool, np.bool_)) or not isinstance(num_pages, (int, np.integer)) or not 1 <= num_pages < 2**31:
        raise ValueError(f"num_pages must be an integer in [1, 2**31), got {num_pages!r}")
    num_pages = int(num_pages)
    sh = cache.sharding
    if sh is not None and sh.dp > 1:
        raise ValueError(
            f"a host tier on a cache split over the data axis {sh.data_axis!r} ({sh.dp} shards) is not supported (a "
            "host tier per data shard is not built): use a mesh without a data axis (tensor-parallel only)"
        )
    devices = list(sh.mesh.devices.flat) if sh is not None else [_device_of(cache)]
    kind = host_memory_kind(devices)
    pages = {}
    for name, x in page_arrays(cache).items():
        shape, dtype = host_page_format(x, num_pages, packs_as_words(x, devices[0].platform))
        if sh is None:
            where = SingleDeviceSharding(devices[0], memory_kind=kind)
        else:
            where = NamedSharding(sh.mesh, sh.arena_spec, memory_kind=kind)
        pages[name] = host_zeros(shape, np.dtype(dtype), where)
    small = SingleDeviceSharding(devices[0]) if sh is None else sh.named(jax.sharding.PartitionSpec())
    held = jax.device_put(np.zeros((num_pages,), np.int32), small)
    host_id = jax.device_put(np.asarray(int.from_bytes(os.urandom(4), "little") % (2**31 - 1) + 1, np.int32), small)
    # The cache it belongs to: copies (an op donating the cache must not delete the host tier's),
    # committed where the cache's are, as every leaf here is: an op's first call then compiles the
    # program its later calls run (an uncommitted leaf is another jit signature).
    copy = lambda x: jax.device_put(jnp.copy(x), x.sharding)  # noqa: E731
    factors = None if cache.key_factors is None else copy(cache.key_factors)
    return HostArena(pages=pages, held=held, host_id=host_id, sharding=sh, arena_id=copy(cache.table.arena_id),
                     key_factors=factors, layout=cache.layout)  # fmt: skip


def _device_of(cache: KVCache):
    devices = getattr(cache.k, "devices", None)
    return next(iter(devices())) if callable(devices) else jax.devices()[0]


def free_host_pages(host: HostArena) -> list[int]:
    """The host pages no one holds (reads `held` back: a host-side helper, not for a hot path).
    A host tier donated to a later call is refused (there is no cache here to bind it to)."""
    _check_live(host)
    return np.flatnonzero(np.asarray(host.held) == 0).tolist()


def host_layout_bytes(layout: KVLayout, num_pages: int) -> int:
    """Bytes a host tier of `num_pages` holds (values and scales, all layers, unreplicated heads)."""
    return layout.page_bytes * num_pages
