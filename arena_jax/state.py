"""Cache state: immutable pytrees, all arrays, updated with `.replace` inside jit."""
from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from arena_jax.layout import KVLayout

__all__ = ["PageTable", "CacheStats", "KVCache", "PAD_SLOT", "PAD_PAGE", "create"]

# A batch row whose slot is PAD_SLOT asks for nothing, writes nothing and attends to nothing.
# It is an explicit sentinel: it is never used as an index (no -1 wrap-around into the last slot).
PAD_SLOT = -1
# A PAD_PAGE entry of `hold_pages` / `drop_pages` is padding: it names no page and is not counted.
PAD_PAGE = -1


@struct.dataclass
class PageTable:
    """Which pages belong to which slot, and how far each slot is reserved and written.

    `lengths[s]` is what slot s has *reserved*; `written[l, s]` what layer l has *stored*.
    Positions in [written[l, s], lengths[s]) are reserved but unwritten: attention never reads
    them, so a page's previous tenant stays invisible without scrubbing. They always lie in
    pages the slot holds alone (refcount 1), so `append` never writes a shared page.

    `held[p]` is how many tokens of page p the cache itself holds for its prefix index
    (`hold_pages`; 0: no hold). A hold is one more reference: every page in use has
    `refcount == (page_map entries naming it) + (held > 0)`. A held page is never written (a
    mapping slot shares it, and `append` writes only private pages), so its first `held[p]`
    tokens stay as they were when the hold was taken, at every layer.
    """

    page_map: jax.Array  # i32[max_seqs, max_pages_per_seq], physical page per logical page, -1 unmapped
    lengths: jax.Array  # i32[max_seqs], tokens reserved per slot
    active: jax.Array  # bool[max_seqs], slot in use
    free_stack: jax.Array  # i32[num_pages], entries [0, num_free) are free; top = num_free - 1 (LIFO)
    num_free: jax.Array  # i32[]
    refcount: jax.Array  # i32[num_pages], 0 free, 1 owned, >1 shared; = mappings + (held > 0)
    written: jax.Array  # i32[num_layers, max_seqs], tokens whose K/V are stored at each layer (<= lengths)
    held: jax.Array  # i32[num_pages], tokens of the page the cache itself holds (prefix cache), 0 = no hold
    # i32[], a random id drawn when the arena is created and never changed by any op: page ids
    # mean something only in their own arena, so a prefix index bound to one arena can tell
    # another apart (`PrefixCache.check`). Data, not a static field: a new arena must not recompile.
    arena_id: jax.Array

    @classmethod
    def empty(cls, layout: KVLayout, arena_id: int | None = None) -> "PageTable":
        # The stack's top is reused first; page 0 on top gives a fresh arena pages 0, 1, 2, ...
        return cls(
            page_map=jnp.full((layout.max_seqs, layout.max_pages_per_seq), -1, jnp.int32),
            lengths=jnp.zeros((layout.max_seqs,), jnp.int32),
            active=jnp.zeros((layout.max_seqs,), bool),
            free_stack=jnp.arange(layout.num_pages - 1, -1, -1, dtype=jnp.int32),
            num_free=jnp.asarray(layout.num_pages, jnp.int32),
            refcount=jnp.zeros((layout.num_pages,), jnp.int32),
            written=jnp.zeros((layout.num_layers, layout.max_seqs), jnp.int32),
            held=jnp.zeros((layout.num_pages,), jnp.int32),
            arena_id=jnp.asarray(new_arena_id() if arena_id is None else arena_id, jnp.int32),
        )


def new_arena_id() -> int:
    """A random positive int32 (os.urandom: independent of any seeded generator)."""
    return int.from_bytes(os.urandom(4), "little") % (2**31 - 1) + 1


@struct.dataclass
class CacheStats:
    """Counters updated inside the jitted ops (int32: they wrap after 2**31 events)."""

    tokens_written: jax.Array  # tokens appended (counted once, at layer 0)
    pages_allocated: jax.Array  # pages popped from the free stack (new pages and copy-on-write targets)
    pages_recycled: jax.Array  # pages returned to the free stack by release / truncate / fork-over
    metadata_ops: jax.Array  # forks, truncations and reservations served without a new page
    cow_copies: jax.Array  # copy-on-write page copies (the only data-moving allocator operation)
    failed_reservations: jax.Array  # reservation rows refused for lack of pages
    dropped_writes: jax.Array  # append rows refused: their tokens would pass the reservation or land in a shared page
    rejected_rows: jax.Array  # rows refused as invalid input inside jit (duplicate / out-of-range slots, bad counts, ...)
    prefix_forks: jax.Array  # slots made from cached pages (`fork_pages` rows served)
    prefix_tokens: jax.Array  # tokens those slots received without computing them
    pages_held: jax.Array  # holds the cache took on pages (`hold_pages` rows served)
    holds_dropped: jax.Array  # holds the cache gave back (`drop_pages` rows served)
    pages_evicted: jax.Array  # of those, pages the drop freed (no slot mapped them): evictions
    # The host tier (`arena_jax.host`): pages, not bytes (int32 bytes would wrap after 2 GiB);
    # `aj.health` turns them into bytes (`layout.page_bytes` each: values and scales, all layers).
    pages_to_host: jax.Array  # pages copied device -> host (`swap_out`, `offload_pages`)
    pages_to_device: jax.Array  # pages copied host -> device (`swap_in`)
    swap_outs: jax.Array  # slots swapped out (`swap_out` rows served)
    swap_ins: jax.Array  # slots swapped in (`swap_in` rows served)
    failed_swaps: jax.Array  # `swap_in` rows refused for lack of device pages
    host_pages_dropped: jax.Array  # host pages freed (`drop_host_pages`)

    @classmethod
    def zeros(cls) -> "CacheStats":
        return cls(**{f.name: jnp.zeros((), jnp.int32) for f in cls.__dataclass_fields__.values()})

    def bump(self, **deltas) -> "CacheStats":
        return self.replace(**{k: getattr(self, k) + jnp.asarray(v, jnp.int32) for k, v in deltas.items()})


@struct.dataclass
class KVCache:
    """The arena (K/V values, and the scales of a quantized arena), its page table and counters.

    8-bit arenas (int8, float8_e4m3fn, float8_e5m2) carry `k_scale`, `v_scale`:
    `[num_layers, num_kv_heads, num_pages, page_size]` (float32 or bfloat16), one scale per
    token and KV head, so that a stored row is `values * scale` (`pallas_kernels.quant`). int4
    arenas store `k`, `v` as uint8 `[..., head_dim / 2]` (two codes a byte) with one scale per
    group of 32 lanes, `[num_layers, num_kv_heads, num_pages, page_size, head_dim / 32]`
    (`pallas_kernels.quant4`). Float arenas have `k_scale = v_scale = None`. Why this
    representation:
    - Same paged geometry as the values (indexed by the same physical page and offset): fork,
      truncate, release and prefix sharing move page *ids*, so they move scales with values
      and need nothing new; the one op that copies page data (copy-on-write in `reserve`)
      copies the scales with it.
    - None is an empty pytree node: a float arena's cache has exactly the leaves it had before
      (same jit signatures, same donation, same `tree_map`s); an 8-bit arena's scales are
      ordinary leaves, donated and updated in place with the values.
    - `layout` stays derivable from shapes and dtypes alone (the scale dtype from `k_scale`; a
      uint8 arena is int4, head_dim twice its last axis), plus one static field:
    - `rotate_keys` (static, like `sharding`): the keys were rotated before quantization
      (`pallas_kernels.rotation`), so attention rotates q the same way. A property of how the
      bytes were written, not of any page: every op that moves pages stays oblivious, and a
      static field costs nothing in a jit and travels with the cache through every op.
    - `key_factors` (`smooth_keys`): f32[num_layers, num_kv_heads, head_dim], the static
      per-channel factors every stored key of a layer was divided by (`arena_jax.key_factors`;
      0: not calibrated, applied as 1). Not per page: fixed by `create` for the cache's life,
      read by every write and attention; no op changes it. None when off.
    """

    k: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    v: jax.Array  # [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    table: PageTable
    stats: CacheStats
    k_scale: jax.Array | None = None  # [num_layers, num_kv_heads, num_pages, page_size(, head_dim / 32 for int4)]
    v_scale: jax.Array | None = None  # the same; None for float arenas
    # None: one device. A sharded cache (`create(layout, mesh=...)`) carries its static
    # `arena_jax.sharding.CacheSharding` here; the ops then run per shard (see that module).
    sharding: Any = struct.field(pytree_node=False, default=None)
    rotate_keys: bool = struct.field(pytree_node=False, default=False)  # keys stored rotated (quantized arenas)
    key_factors: jax.Array | None = None  # f32[num_layers, num_kv_heads, head_dim] (smooth_keys), else None

    @property
    def layout(self) -> KVLayout:
        """The geometry, read back from the shapes (works on tracers and ShapeDtypeStructs)."""
        num_layers, num_kv_heads, num_pages, page_size, head_dim = self.k.shape
        int4 = self.k.dtype == jnp.uint8  # two codes a byte
        if self.sharding is not None:  # heads replicated over the tensor axis are stored kv_replicas times
            num_kv_heads //= self.sharding.kv_replicas
        max_seqs, max_pages_per_seq = self.table.page_map.shape
        return KVLayout(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=2 * head_dim if int4 else head_dim,
            page_size=page_size,
            num_pages=num_pages,
            max_seqs=max_seqs,
            max_pages_per_seq=max_pages_per_seq,
            dtype="int4" if int4 else self.k.dtype,
            scale_dtype=None if self.k_scale is None else self.k_scale.dtype,
            rotate_keys=self.rotate_keys,
            smooth_keys=self.key_factors is not None,
        )

    @property
    def quantized(self) -> bool:
        """8-bit or int4 (values plus scales)."""
        return self.k_scale is not None


_WRITE_COPY_WARNED: set = set()


def warn_if_writes_copy(layout: KVLayout, platform: str | None = None) -> None:
    """Once per dtype: a RuntimeWarning when the backend the arena lives on (`platform`, e.g. a
    mesh's; default: the one being lowered for, `tpu.common.target_platform`) cannot update the
    arena's storage (or scale) dtype in place (`pallas_kernels.scatter.upcasts`: XLA CPU converts
    whole bf16 arrays in jaxlib 0.10, whole 8-bit float arrays in 0.10 and 0.11), so every append
    copies the arena."""
    from pallas_kernels.scatter import upcasts
    from pallas_kernels.tpu.common import target_platform

    platform = platform or target_platform()
    for dtype in (layout.storage_dtype, layout.scale_dtype if layout.quantized else None):
        if dtype is None or jnp.dtype(dtype) in _WRITE_COPY_WARNED or not upcasts(dtype, platform):
            continue
        _WRITE_COPY_WARNED.add(jnp.dtype(dtype))
        import warnings

        warnings.warn(
            f"arena_jax: this backend ({platform}, jax {jax.__version__}) cannot update {jnp.dtype(dtype).name} "
            f"arrays in place: each append copies the arena's {jnp.dtype(dtype).name} arrays, so a step's cost follows the "
            "arena's capacity, not the context (pallas_kernels/scatter.py). On CPU, float32 / float16 / int8 arenas "
            "(and bfloat16 from jax 0.11) are written in place.", RuntimeWarning, stacklevel=3)
    if platform == "tpu" and layout.int4 and "int4 on tpu" not in _WRITE_COPY_WARNED:
        _WRITE_COPY_WARNED.add("int4 on tpu")
        import warnings

        warnings.warn(
            f"arena_jax: an int4 arena on a TPU: its packed rows (head_dim / 2 = {layout.head_dim // 2} bytes) and its "
            f"group scales ({layout.head_dim // 32} per token) are narrower than the TPU's 128 lanes, so XLA relayouts "
            "(copies) the whole arena and its scales around every step (a Llama-3-8B-shaped decode step compiled for a "
            "TPU v6e 2x4 mesh: 13.3 GB of temp memory per device against 1.1 GB of arena, 8.5 MB with a bfloat16 arena; "
            "benchmarks/RESULTS.md, 'int4 arenas on a TPU'). On a TPU use int8 (pages of 128 tokens) or bfloat16.",
            RuntimeWarning, stacklevel=3)


def create(layout: KVLayout, *, mesh=None, tensor_axis: str | None = "tensor", data_axis: str | None = None,
           key_factors=None) -> KVCache:
    """Allocate the arena once (zeros; a quantized arena's scales too) with every page free.

    Jittable; size a layout without allocating with `jax.eval_shape(lambda: aj.create(layout))`.
    With a `jax.sharding.Mesh`, the arena is split over KV heads on `tensor_axis` and, if
    `data_axis` is given, over pages and slots per data shard (`arena_jax.sharding`).

    `key_factors` (a `smooth_keys` layout only): f32[num_layers, num_kv_heads, head_dim], the
    static per-channel factors every key is divided by, fixed for the cache's life
    (`arena_jax.key_factors.from_keys` on sample keys, or `models.calibrate_key_factors(model)`).
    None: 0, not calibrated, applied as 1 (no smoothing).
    """
    if not isinstance(layout, KVLayout):
        raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
    factors = _initial_key_factors(layout, key_factors)
    if mesh is not None:
        from arena_jax.sharding import create_sharded

        cache = create_sharded(layout, mesh, tensor_axis=tensor_axis, data_axis=data_axis,
                               key_factors=factors)  # checks the mesh first
        warn_if_writes_copy(layout, mesh.devices.flat[0].platform)  # the backend the arena lives on
        return cache
    warn_if_writes_copy(layout)
    scales = {}
    if layout.quantized:
        scales = dict(k_scale=jnp.zeros(layout.scale_shape, layout.scale_dtype),
                      v_scale=jnp.zeros(layout.scale_shape, layout.scale_dtype))
    return KVCache(
        k=jnp.zeros(layout.arena_shape, layout.storage_dtype),
        v=jnp.zeros(layout.arena_shape, layout.storage_dtype),
        table=PageTable.empty(layout),
        stats=CacheStats.zeros(),
        rotate_keys=layout.rotate_keys,
        key_factors=factors,
        **scales,
    )


def _initial_key_factors(layout: KVLayout, key_factors):
    """The cache's fixed key factors: the given ones, checked on the host (traced ones inside a
    user's jit taken as they are, cast to float32), zeros for a smoothed layout without them."""
    if key_factors is None:
        return jnp.zeros(layout.key_factors_shape, jnp.float32) if layout.smooth_keys else None
    if not layout.smooth_keys:
        raise ValueError(f"key_factors given for a layout without smooth_keys (dtype {layout.dtype.name}): "
                         "only smoothed quantized arenas take them (KVLayout(smooth_keys=True))")
    if isinstance(key_factors, jax.core.Tracer):
        if tuple(key_factors.shape) != layout.key_factors_shape:
            raise ValueError(f"key_factors must have shape {layout.key_factors_shape}, got {key_factors.shape}")
        return key_factors.astype(jnp.float32)
    from arena_jax import key_factors as factors_lib

    return jnp.asarray(factors_lib.check(key_factors, layout.key_factors_shape))
