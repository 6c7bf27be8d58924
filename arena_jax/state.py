"""Creating the cache: `create` allocates the arena (zeros, every page free) on one device or
on a mesh, with its fixed key factors, and refuses an int4 arena on a TPU, where XLA would copy
the whole arena around every step. Where only appends copy it (bf16 / 8-bit floats on XLA CPU) the
first append traced warns (`arena_ops.warn_if_appends_copy`), not `create`: an arena that is
only sized, or whose pages are only reserved and released, is never copied.

The pytrees it returns (`KVCache`, `PageTable`, `CacheStats`) and the sentinels `PAD_SLOT` /
`PAD_PAGE` live in `arena_jax.kv_cache`, near the bottom of the package; they are re-exported here.
This module sits above `arena_jax.sharding` (a mesh's arena is built by `create_sharded`), so
nothing below it imports it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from arena_jax import key_factors as factors_lib
from arena_jax.arena_ops import _WRITE_COPY_WARNED, warn_if_appends_copy  # noqa: F401 - the set: tests reset it
from arena_jax.kv_cache import PAD_PAGE, PAD_SLOT, CacheStats, KVCache, PageTable, new_arena_id  # noqa: F401 - re-exported
from arena_jax.layout import KVLayout
from arena_jax.sharding import create_sharded

__all__ = ["PageTable", "CacheStats", "KVCache", "PAD_SLOT", "PAD_PAGE", "create"]


ALLOW_INT4_ON_TPU_ENV = "ARENA_JAX_ALLOW_INT4_ON_TPU"  # "1": create one anyway (measuring the copies), with a warning


def warn_if_writes_copy(layout: KVLayout, platform: str | None = None) -> None:
    """Once per dtype: `arena_ops.warn_if_appends_copy` for the layout's storage and scale dtypes
    (appends copy the arena: the first append traced warns by itself), then
    `refuse_int4_on_tpu`."""
    warn_if_appends_copy((layout.storage_dtype, layout.scale_dtype if layout.quantized else None), platform)
    refuse_int4_on_tpu(layout, platform)


def _int4_on_tpu_reason(layout: KVLayout) -> str:
    return (f"an int4 arena's packed rows (head_dim / 2 = {layout.head_dim // 2} bytes) and group scales "
            f"({layout.head_dim // 32} per token) are narrower than the TPU's 128 lanes, so XLA relayouts (copies) the "
            "whole arena and its scales around every step: a Llama-3-8B-shaped decode step compiled for a TPU v6e 2x4 "
            "mesh holds 13.3 GB of temp memory per device against 1.1 GB of arena (8.5 MB with a bfloat16 arena) and "
            "reads 8x the bytes it must (benchmarks/RESULTS.md, 'int4 arenas on a TPU'), so int4 saves no memory "
            "there and costs bandwidth")


def refuse_int4_on_tpu(layout: KVLayout, platform: str | None = None) -> None:
    """A ValueError when an int4 arena would live on a TPU (`platform`, e.g. a mesh's; default:
    the one being lowered for), naming the reason; with $ARENA_JAX_ALLOW_INT4_ON_TPU=1, a
    RuntimeWarning instead (once), for measuring it."""
    import os

    from pallas_kernels.tpu.common import target_platform

    platform = platform or target_platform()
    if platform != "tpu" or not layout.int4:
        return
    reason = _int4_on_tpu_reason(layout)
    if os.environ.get(ALLOW_INT4_ON_TPU_ENV) != "1":
        raise ValueError(f"dtype='int4' is refused on a TPU: {reason}. Use dtype='int8' (page_size 128 or 256) or "
                         f"'bfloat16' there ({ALLOW_INT4_ON_TPU_ENV}=1 creates it anyway, with a warning)")
    if "int4 on tpu" not in _WRITE_COPY_WARNED:
        _WRITE_COPY_WARNED.add("int4 on tpu")
        import warnings

        warnings.warn(f"arena_jax: an int4 arena on a TPU ({ALLOW_INT4_ON_TPU_ENV}=1): {reason}.", RuntimeWarning,
                      stacklevel=3)


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
        if hasattr(mesh, "devices"):  # (a wrong mesh is create_sharded's to name)
            refuse_int4_on_tpu(layout, mesh.devices.flat[0].platform)  # the backend the arena lives on
        return create_sharded(layout, mesh, tensor_axis=tensor_axis, data_axis=data_axis, key_factors=factors)
    refuse_int4_on_tpu(layout)
    scales = {}
    if layout.quantized:
        from pallas_kernels.tpu.common import target_platform

        # On a TPU, 8-bit pages under 128 keep their scales as rows of 128 lanes (`KVCache.scale_rows`).
        shape = layout.scale_rows_shape() if layout.stores_scale_rows(target_platform()) else layout.scale_shape
        scales = dict(k_scale=jnp.zeros(shape, layout.scale_dtype), v_scale=jnp.zeros(shape, layout.scale_dtype))
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
    return jnp.asarray(factors_lib.check(key_factors, layout.key_factors_shape))
