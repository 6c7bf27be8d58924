"""The data path as pure functions of the cache (jitted bodies of `aj.append` / `aj.attend`).

Both turn cache slots into the kernels' per-row contract (`pallas_kernels.reference`):
page_map i32[B, M], lengths i32[B] and num_tokens i32[B], where a row's new tokens are its
last num_tokens positions of lengths. Here `lengths` is the *written* watermark of the layer,
never the reservation: attention reads only tokens stored at that layer, so reserved but
unwritten positions (an earlier tenant's bytes) can never be read.

Quantized arenas (8-bit, int4) pass their scales along: append quantizes the new rows (values
and scales are written by the same kernel, under the same masks), attention dequantizes what
it reads. A cache with `rotate_keys` has its keys rotated before quantization and q rotated the
same way in attention (both inside the kernels / references). A cache with `key_factors`
(`smooth_keys`) has its keys divided by them before all of that and q multiplied by them
(`arena_jax.key_factors`, here, in XLA, for every backend); the factors are fixed when the
cache is created, so how a key is stored never depends on which rows were written first.

Backends: "pallas" / "pallas_tpu" (the kernels), "mosaic" (a GPU decode kernel), "xla"
(`pallas_kernels.blockwise`: attention in blocks of pages, its cost following the written
context) and "reference" (the dense jnp oracle); append is the jnp scatter on "xla",
"reference" and "mosaic".

Rows follow the totality rules of `arena_jax.allocator`: pad, rejected (counted by append in
`stats.rejected_rows`; attention gives zeros) or live. A traced layer outside
[0, num_layers) rejects every row on both backends.
"""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import struct

from arena_jax import key_factors as factors_lib
from arena_jax.allocator import in_range_rows, slot_rows
from arena_jax.kv_cache import PAD_SLOT, CacheStats, KVCache
from pallas_kernels.blockwise import paged_attention_blockwise
from pallas_kernels.index_math import div_nonneg
from pallas_kernels.rotation import rotate_rows
from pallas_kernels.reference import paged_attention_reference, write_tokens
from pallas_kernels.scatter import upcasts
from pallas_kernels.tpu.common import target_platform

__all__ = ["append_impl", "attend_impl", "attends_natively", "warn_if_appends_copy", "ATTEND_KERNEL"]

# Whether the "xla" backend's decode attention (one query a row, a float32 or bfloat16 arena read
# by queries of its dtype) runs as one native call a layer on a CPU (`pallas_kernels.cpu.attention`,
# built on first use; without a C++ compiler, the blockwise jnp path): "auto" (default): the native
# call on a CPU where it is the faster per call (`attention.worthwhile`: short rows, small batches);
# "cpu": on a CPU always; False: the blockwise path, `paged_attention_blockwise` (the native call's
# reference). Read as `aj.attend` is traced (a static argument of its jitted body): set it before a
# step's first call (benchmarks/RESULTS.md, sessions 63-64).
ATTEND_KERNEL: bool | str = "auto"

_WRITE_COPY_WARNED: set = set()  # the dtypes (and "int4 on tpu", `state`'s) warned about, once each


def warn_if_appends_copy(dtypes, platform: str | None = None) -> None:
    """Once per dtype: a RuntimeWarning when the backend (`platform`; default: the one being
    lowered for, `tpu.common.target_platform`) cannot update arrays of one of `dtypes` (an
    arena's storage and scale dtypes) in place (`pallas_kernels.scatter.upcasts`: XLA CPU
    converts whole bf16 arrays in jaxlib 0.10, whole 8-bit float arrays in 0.10 and 0.11), so
    every append copies the arena. `append_impl` calls it as an append is traced: an arena
    that is only sized, or only reserved and released, is never copied and never warned about."""
    platform = platform or target_platform()
    for dtype in dtypes:
        if dtype is None or jnp.dtype(dtype) in _WRITE_COPY_WARNED or not upcasts(dtype, platform):
            continue
        _WRITE_COPY_WARNED.add(jnp.dtype(dtype))
        warnings.warn(
            f"arena_jax: this backend ({platform}, jax {jax.__version__}) cannot update {jnp.dtype(dtype).name} "
            f"arrays in place: each append copies the arena's {jnp.dtype(dtype).name} arrays, so a step's cost follows the "
            "arena's capacity, not the context (pallas_kernels/scatter.py). On CPU, float32 / float16 / int8 arenas "
            "(and bfloat16 from jax 0.11) are written in place.", RuntimeWarning, stacklevel=3)


def _layer(table, layer):
    """(layer in range bool[], layer clipped into range i32[]: safe to index with)."""
    num_layers = table.written.shape[0]
    return (layer >= 0) & (layer < num_layers), jnp.clip(layer, 0, num_layers - 1)


@struct.dataclass
class AppendRows:
    """One layer's append, classified row by row: what `append_impl` writes and counts."""

    page: jax.Array  # i32[B, T] physical page of each new token (where `ok`)
    pos: jax.Array  # i32[B, T] its position in the slot (only pos % page_size is read)
    ok: jax.Array  # bool[B, T] the token is written
    writable: jax.Array  # bool[B] the row writes (all its tokens)
    accepted: jax.Array  # i32[B] tokens the row writes
    end: jax.Array  # i32[B] the watermark once written (the kernels' lengths)
    target: jax.Array  # i32[B] the slot whose watermark advances (max_seqs: none)
    counts: jax.Array  # i32[N] what the append adds to `stats.counts`


@struct.dataclass
class AttendRows:
    """One layer's attention rows: a row that is not `good` reads nothing (-1 pages, length 0)."""

    good: jax.Array  # bool[B]
    lengths: jax.Array  # i32[B] tokens written at the layer (0 unless good)
    num_tokens: jax.Array  # i32[B] query tokens (0 unless good)


def page_rows(table, slots):
    """page_map rows i32[B, M] of the slots (row 0's where a slot is out of range): what every
    layer's append and attend of a call look the pages up in."""
    return table.page_map[in_range_rows(table, slots)[1]]


def append_rows(table, page_size: int, layer, slots, num_tokens, tokens: int, rows, words=None,
                written=None) -> AppendRows:  # fmt: skip
    """`append_impl`'s classification at `layer` (the rules in its docstring; rows: `page_rows`).
    words i32[B, 2 + L], written i32[B]: the rows' slot words (`PageTable.slot_words` at their
    gather index) and watermarks at `layer`, where the caller has them (default: read here)."""
    max_seqs, max_pages = table.page_map.shape
    num_pages = table.refcount.shape[0]
    layer_ok, layer_c = _layer(table, layer)
    live, idx = slot_rows(table, slots)
    good = live & layer_ok & (num_tokens >= 0) & (num_tokens <= tokens)
    n = jnp.where(good, num_tokens, 0)
    words = table.slot_words[idx] if words is None else words
    start = jnp.where(good, table.written[layer_c, idx] if written is None else written, 0)
    reserved = jnp.where(good, words[:, 0], 0)
    fits = (words[:, 1] != 0) & (n <= reserved - start)  # start <= reserved: no overflow

    t = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    pos = start[:, None] + t  # [B, T]
    in_use = t < n[:, None]
    page = jnp.take_along_axis(rows, jnp.minimum(div_nonneg(pos, page_size), max_pages - 1), axis=1)
    private = (page >= 0) & (table.refcount[jnp.clip(page, 0, num_pages - 1)] == 1)
    writable = good & fits & jnp.all(private | ~in_use, axis=1)
    accepted = jnp.where(writable, n, 0)
    counts = CacheStats.zeros().bump(tokens_written=jnp.where(layer_ok & (layer_c == 0), accepted, 0),
                                     dropped_writes=good & (n > 0) & ~writable,
                                     rejected_rows=(slots != PAD_SLOT) & ~good).counts  # fmt: skip
    return AppendRows(page=page, pos=pos, ok=writable[:, None] & in_use & (page >= 0) & (pos < max_pages * page_size),
                      writable=writable, accepted=accepted, end=start + accepted,
                      target=jnp.where(writable, slots, max_seqs), counts=counts)  # fmt: skip


def waits_for(index, x):
    """`index` (i32[]) unchanged, but computed from `x`'s first element on XLA's CPU backend, so
    that what a layer reads by its index (its plan entry, its key factors) waits for the layer's
    own keys or queries, or for the arena its keys were written to.

    Why: inside the model's layer loop, everything that depends only on the loop counter is
    ready when an iteration starts: the layer's weight slices, and, without this, each of the
    half dozen small kernels XLA fuses from a plan entry (scatter and gather indices, masks,
    counters) or from the layer's key factors. XLA's CPU executor hands half of its ready
    queue to its thread pool when more than 8 kernels are ready at once: measured, that took
    the tiny model's step from 0.81-0.84x to 0.70-0.73x of the dense step's tokens/s
    (benchmarks/RESULTS.md, "The layer loop on one thread"). The dependency is a clamp of
    `x`'s bits to [0, 0], which XLA does not fold: always 0 (NaN and inf included). Other
    platforms' programs are left as they were."""
    if x is None or x.size == 0 or target_platform() != "cpu":
        return index
    first = jnp.ravel(x)[0]
    as_int = {1: jnp.int8, 2: jnp.int16, 4: jnp.int32, 8: jnp.int64}[first.dtype.itemsize]
    return index + jnp.clip(jax.lax.bitcast_convert_type(first, as_int), 0, 0).astype(index.dtype)


def append_impl(cache: KVCache, layer, slots, k, v, num_tokens, backend: str, plan=None) -> KVCache:
    """Write row b's first num_tokens[b] tokens of k, v [B, T, Hkv, D] at its slot's written
    watermark for `layer` and advance it. A row whose tokens would pass the slot's reservation
    or land in a page it shares writes nothing (counted in `dropped_writes`). `plan`: an
    `arena_jax.plan.StepPlan` made for these slots and counts, whose rows this call takes
    instead of classifying them again."""
    layer_c = _layer(cache.table, layer)[1]
    if plan is None:
        rows = page_rows(cache.table, slots)
        r = append_rows(cache.table, cache.k.shape[3], layer, slots, num_tokens, k.shape[1], rows)
    else:
        rows, r = plan.rows, plan.append_at(layer, cache.table, after=k)
    kernel_rows = (jnp.where(r.writable[:, None], rows, -1), r.end, r.accepted)
    if cache.key_factors is not None:  # smoothed keys: divided by the cache's fixed factors
        k = factors_lib.smooth_keys(k, cache.key_factors[waits_for(layer_c, k)])
    scales = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)  # None for float arenas
    if backend != "pallas_tpu":  # scale rows (a TPU's): the other backends write them as [L, H, P, S]
        scales = dict(zip(("k_scale", "v_scale"), cache.page_scales()))
    if backend == "pallas_tpu":
        from pallas_kernels.tpu.append import tpu_paged_append

        # Rotated keys: rotated here as the reference does it (float32), then quantized by the kernel.
        k_in = rotate_rows(k) if cache.rotate_keys else k
        arenas = tpu_paged_append(cache.k, cache.v, layer_c, k_in, v, *kernel_rows, **scales)
    elif backend == "pallas":  # "mosaic" has no append kernel: the reference scatter (XLA's)
        from pallas_kernels.gpu.append import paged_append

        arenas = paged_append(cache.k, cache.v, layer_c, k, v, *kernel_rows, rotate_keys=cache.rotate_keys, **scales)
    else:  # the jnp scatter (`pallas_kernels.scatter.set_at`): a copy of the arena where the backend upcasts
        warn_if_appends_copy((cache.k.dtype, None if cache.k_scale is None else cache.k_scale.dtype))
        # The reference's writes at the pages looked up above (its own lookup would repeat them):
        # the same tokens, pages and offsets as `append_reference(..., *kernel_rows)`.
        arenas = write_tokens(cache.k, cache.v, layer_c, k, v, r.page, r.pos, r.ok, rotate_keys=cache.rotate_keys,
                              **scales)  # fmt: skip
    k_arena, v_arena = arenas[:2]
    if cache.k_scale is not None:  # a quantized arena: values and scales written together (in the cache's form)
        scales = dict(k_scale=arenas[2].reshape(cache.k_scale.shape), v_scale=arenas[3].reshape(cache.v_scale.shape))
    if plan is not None and plan.deferred:  # the watermark and counters: `StepPlan.commit`, once for every layer
        return cache.replace(k=k_arena, v=v_arena, **scales)
    # set, not add: a row's slot is unique among the writing rows (`slot_rows`), and a planned
    # layer appended twice leaves the watermark where one append does (`arena_jax.plan`).
    table = cache.table.set_slots(r.target, written_at=(layer_c, r.end))
    return cache.replace(k=k_arena, v=v_arena, table=table, stats=cache.stats.replace(counts=cache.stats.counts + r.counts),
                         **scales)  # fmt: skip


def attend_rows(table, layer, slots, num_tokens, tokens: int, written=None) -> AttendRows:
    """`attend_impl`'s rows at `layer`: a row whose slot is out of range, or that asks for more
    query tokens than `tokens` or than the slot has written at `layer`, reads nothing.
    `written` i32[B]: each row's slot's watermark at `layer` (default: the table's)."""
    layer_ok, layer_c = _layer(table, layer)
    in_range, idx = in_range_rows(table, slots)
    written = table.written[layer_c, idx] if written is None else written
    written = jnp.where(in_range & layer_ok, written, 0)
    good = in_range & layer_ok & (num_tokens >= 0) & (num_tokens <= tokens) & (num_tokens <= written)
    return AttendRows(good=good, lengths=jnp.where(good, written, 0), num_tokens=jnp.where(good, num_tokens, 0))


def _attend_rows(cache: KVCache, layer, slots, num_tokens, tokens: int, plan=None):
    """(layer clipped, page_map [B, M], lengths [B], num_tokens [B]) as the kernels take them
    (`attend_rows`, or the plan's, read once the arena is written: after the layer's append)."""
    if plan is None:
        rows, r = page_rows(cache.table, slots), attend_rows(cache.table, layer, slots, num_tokens, tokens)
    else:
        rows, r = plan.rows, plan.attend_at(layer, cache.table, after=cache.k)
    return _layer(cache.table, layer)[1], jnp.where(r.good[:, None], rows, -1), r.lengths, r.num_tokens


def _kernel_q(q, cache: KVCache, layer_c, backend: str):
    """q as the backend's kernel takes it: smoothed keys' factors applied; rotated for the
    TPU kernels and the blockwise path (the GPU kernels and the reference rotate it themselves)."""
    if cache.key_factors is not None:  # smoothed keys: q times the factors keeps q . k as it was
        q = factors_lib.smooth_queries(q, cache.key_factors[waits_for(layer_c, q)])
    if backend in ("pallas_tpu", "xla") and cache.rotate_keys:
        q = rotate_rows(q, q.dtype)
    return q


def attends_natively(kernel, backend: str, q, cache: KVCache) -> bool:
    """Whether `attend_impl` runs q over `cache` as the native call (`kernel`: an `ATTEND_KERNEL`
    value): the "xla" backend on a CPU, an unsharded cache, operands `decode_attention` takes."""
    if kernel not in (False, "auto", "cpu") or kernel is True:
        raise ValueError(f"ATTEND_KERNEL must be 'auto', 'cpu' or False, got {kernel!r}")
    if kernel is False or backend != "xla" or cache.sharding is not None or target_platform() != "cpu":
        return False
    from pallas_kernels.cpu import attention

    capacity = cache.table.geometry[1] * cache.k.shape[3]  # max_pages_per_seq * page_size
    return (attention.supports(q, cache.k, cache.v, cache.k_scale) and (kernel == "cpu" or attention.worthwhile(
        q.shape[0], cache.k.shape[1], capacity, cache.k.shape[4])) and attention.native_problem() is None)  # fmt: skip


def attend_impl(q, cache: KVCache, layer, slots, num_tokens, backend: str, sliding_window, sm_scale,
                logits_soft_cap=None, plan=None, native: bool = False):
    """Attention of q [B, T, Hq, D], the last num_tokens[b] tokens written at `layer` in row b's
    slot, over that slot's tokens written at `layer`. Rows whose slot is out of range, or that
    ask for more query tokens than T or than the slot has written, give zeros. `sliding_window`:
    None, a static int, or a traced integer scalar (a value <= 0 admits no key: zeros). `native`
    (static; `attends_natively`): the "xla" backend's decode as one native call."""
    if native and plan is not None:  # the plan's rows read inside the call (`decode_attention_rows`)
        from pallas_kernels.cpu.attention import decode_attention_rows

        # The layer goes in unclipped (the call clips it); it and a traced window wait for q
        # (`waits_for`): as the scan's own slices of its layers each would be one more kernel ready
        # as an iteration starts, past 8 of them XLA's CPU executor runs the loop's body on its
        # thread pool, a thread hop a layer that cost the tiny decode step 15-20% (benchmarks/RESULTS.md,
        # session 64).
        q = _kernel_q(q, cache, _layer(cache.table, layer)[1] if cache.key_factors is not None else layer, backend)
        if isinstance(sliding_window, jax.Array):
            sliding_window = waits_for(sliding_window, q)
        return decode_attention_rows(q, cache.k, cache.v, waits_for(layer, q), plan.rows,
                                     plan.rows4, plan._index(layer, cache.table, after=cache.k), sm_scale=sm_scale,
                                     sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)  # fmt: skip
    layer_c, page_map, lengths, n = _attend_rows(cache, layer, slots, num_tokens, q.shape[1], plan)
    k_scale, v_scale = (cache.k_scale, cache.v_scale) if backend == "pallas_tpu" else cache.page_scales()
    kwargs = dict(sm_scale=sm_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                  k_scale=k_scale, v_scale=v_scale)
    q = _kernel_q(q, cache, layer_c, backend)
    if backend == "pallas_tpu":
        from pallas_kernels.tpu.attention import tpu_paged_attention

        return tpu_paged_attention(q, cache.k, cache.v, layer_c, page_map, lengths, n, **kwargs)
    if native:  # reads the arena in place, after the layer's append (its operand)
        from pallas_kernels.cpu.attention import decode_attention

        return decode_attention(q, cache.k, cache.v, layer_c, page_map, lengths, n, sm_scale=sm_scale,
                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    if backend == "xla":  # blocks of pages up to the longest written context
        # The barrier makes the gathers read the arena as the append left it. Without it, XLA CPU
        # can fuse an append's update into the gather that follows (the gather then reads the old
        # arena, the update is applied after it) and copy the whole arena twice to do so (mid
        # model, rows of 9 pages: two arena-sized copies a layer; benchmarks/RESULTS.md).
        k_arena, v_arena = jax.lax.optimization_barrier((cache.k, cache.v))
        return paged_attention_blockwise(q, k_arena, v_arena, layer_c, page_map, lengths, n, **kwargs)
    kwargs["rotate_keys"] = cache.rotate_keys  # the GPU kernels and the reference rotate q themselves
    if backend == "pallas":
        from pallas_kernels.gpu.attention import paged_attention

        return paged_attention(q, cache.k, cache.v, layer_c, page_map, lengths, n, **kwargs)
    if backend == "mosaic":  # decode only, no window (checked by the caller: api._resolve_backend)
        from pallas_kernels.gpu.mosaic_decode import mosaic_paged_decode

        return mosaic_paged_decode(q, cache.k, cache.v, layer_c, page_map, lengths, n, sm_scale=sm_scale)
    return paged_attention_reference(q, cache.k, cache.v, layer_c, page_map, lengths, n, **kwargs)


def attend_mixed_impl(q_dec, slots_dec, n_dec, q_pre, slots_pre, n_pre, cache: KVCache, layer, sliding_window,
                      sm_scale, logits_soft_cap=None):
    """`attend_impl` of a decode part (q_dec [B, 1, Hq, D]) and a chunk part (q_pre [P, T, Hq, D])
    through the TPU kernels in ONE call (`pallas_kernels.tpu.mixed`); returns (out_dec, out_pre)."""
    from pallas_kernels.tpu.mixed import tpu_paged_attention_mixed

    layer_c, pm_dec, len_dec, n_dec = _attend_rows(cache, layer, slots_dec, n_dec, q_dec.shape[1])
    _, pm_pre, len_pre, n_pre = _attend_rows(cache, layer, slots_pre, n_pre, q_pre.shape[1])
    return tpu_paged_attention_mixed(
        _kernel_q(q_dec, cache, layer_c, "pallas_tpu"), _kernel_q(q_pre, cache, layer_c, "pallas_tpu"), cache.k, cache.v,
        layer_c, pm_dec, len_dec, n_dec, pm_pre, len_pre, n_pre, k_scale=cache.k_scale, v_scale=cache.v_scale,
        sm_scale=sm_scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
