"""Whole-page copies inside the arena for TPU (Mosaic): HBM -> HBM DMA, in place.

`aj.reserve`'s copy-on-write gives a row its own copy of a shared, partly written last page:
every layer's and KV head's `[S, D]` slab of page `src[b]` (and an 8-bit arena's `[S]` scale
rows) copied to page `dst[b]`. As an XLA gather + dynamic-update-slice on the arena, XLA's TPU
layout assignment may relayout the arena for it (RESULTS, "TPU compile report": a deep int8
arena's step showed arena-shaped copies there); here the copies are DMAs between pages of the
aliased arena, one program per KV head walking the live rows x layers, so the arena's layout
is never XLA's question. Contract: `arena.at[:, :, dst].set(arena[:, :, src], mode="drop")`
for every array (rows with `dst` out of [0, P) copy nothing), bit for bit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu.append import _compact, _stream
from pallas_kernels.tpu.common import resolve_tpu_interpret

__all__ = ["tpu_copy_pages"]


def _copy_kernel(meta_ref, src_ref, dst_ref, *refs, n: int, num_layers: int):
    """refs: the n arenas in (aliased), the n arenas out, one DMA semaphore per array.
    Arrays [L, Hkv, P, ...]: page slabs [S, D] (values) or [S] (scale rows, copied as [1, S])."""
    arenas_in, arenas_out, sems = refs[:n], refs[n: 2 * n], refs[2 * n:]
    h = pl.program_id(0)

    def copies(j):
        i, layer = j // num_layers, j % num_layers
        return [pltpu.make_async_copy(a.at[layer, h, pl.ds(src_ref[i], 1)], o.at[layer, h, pl.ds(dst_ref[i], 1)], s)
                for a, o, s in zip(arenas_in, arenas_out, sems)]

    _stream(meta_ref[0] * num_layers, copies)


def tpu_copy_pages(arrays, src, dst, *, interpret=None):
    """arrays: [L, Hkv, P, ...] arenas (and scales) sharing their first three dims; src, dst:
    i32[B] pages. Returns the arrays with page dst[b] := page src[b] for every b whose dst is in
    [0, P) (the others copy nothing). The arrays are aliased in place: donate them."""
    arrays = tuple(arrays)
    num_layers, num_kv_heads, num_pages = arrays[0].shape[:3]
    src, dst = jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32)
    live = (dst >= 0) & (dst < num_pages) & (src >= 0) & (src < num_pages)
    count, src_c, dst_c = _compact(live, src, dst)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    n = len(arrays)
    return tuple(pl.pallas_call(
        functools.partial(_copy_kernel, n=n, num_layers=num_layers),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(num_kv_heads,),
            in_specs=[hbm] * n,
            out_specs=[hbm] * n,
            scratch_shapes=[pltpu.SemaphoreType.DMA(())] * n,
        ),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        input_output_aliases={3 + i: i for i in range(n)},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",), has_side_effects=True),
        interpret=resolve_tpu_interpret(interpret),
        name="tpu_copy_pages",
    )(jnp.reshape(count, (1,)), src_c, dst_c, *arrays))
