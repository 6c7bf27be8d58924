"""The public operations: validate on the host, then one jitted pure function each.

Ops that change the cache take it donated: its arena is updated in place, and the cache
passed in must not be used again (keep the returned one). Called inside your own jitted
step they simply inline, and the step's donation is what keeps the arena in place.
"""
from __future__ import annotations

import functools
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from arena_jax import allocator, arena_ops, sharding
from arena_jax.kv_cache import PAD_PAGE, PAD_SLOT, KVCache
from arena_jax.plan import StepPlan
from arena_jax.prefix import ops as prefix_ops
from arena_jax.validate import (
    check_cache_arrays,
    check_counts,
    check_ints,
    check_kv,
    check_layer,
    check_logits_soft_cap,
    check_pages,
    check_q,
    check_sliding_window,
    check_slots,
    check_sm_scale,
    concrete,
)

__all__ = [
    "reserve",
    "append",
    "attend",
    "attend_mixed",
    "release",
    "fork",
    "truncate",
    "fork_pages",
    "hold_pages",
    "drop_pages",
    "default_backend",
    "BACKENDS",
    "BACKEND_ENV",
]

# "pallas": the Pallas kernels of the platform (Triton on a GPU, Mosaic on a TPU); "pallas_tpu":
# the Mosaic TPU kernels anywhere (TPU interpret mode on CPU); "xla": jnp attention in blocks of
# pages, cost following the context (`pallas_kernels.blockwise`); "reference": the dense jnp
# oracle (gathers every row's whole page list; differentiable); "mosaic": the Mosaic GPU decode
# kernel, experimental and opt-in (pallas_kernels/README.md). "xla", "reference" and "mosaic"
# append with the same jnp scatter.
BACKENDS = ("pallas", "reference", "mosaic", "pallas_tpu", "xla")
BACKEND_ENV = "ARENA_JAX_BACKEND"


def default_backend() -> str:
    """`$ARENA_JAX_BACKEND` if set, else Pallas on a GPU or TPU and the blockwise jnp path ("xla") elsewhere."""
    chosen = os.environ.get(BACKEND_ENV, "").strip().lower()
    if chosen:
        if chosen not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV}={chosen!r}; expected one of {BACKENDS}")
        return chosen
    from pallas_kernels.tpu.common import target_platform

    return "pallas" if target_platform() in ("gpu", "tpu") else "xla"


_FALLBACK_WARNED: set[str] = set()


def _resolve_backend(backend: str | None, layout, group: int | None = None, scale_rows: bool = False, **attend) -> str:
    """The backend for one call, decided on the host before jit.

    "pallas" is the platform's kernels: on a TPU (the default device's platform) the Mosaic TPU
    ones, "pallas_tpu". Pallas asked for (per call, or `$ARENA_JAX_BACKEND`) on a geometry the
    kernels cannot take (`pallas_kernels.unsupported_reason`, `tpu_unsupported_reason`), or for
    the GPU kernels on a JAX without the Pallas Triton lowering: ValueError naming the field and
    the limit (or the backend to use). Pallas by default (on a GPU or TPU): the blockwise jnp path
    ("xla") instead, with a warning naming the reason, once. Mosaic GPU (never a default) refuses what
    its decode kernel cannot take (`attend`: tokens=, q_dtype=, sharded= and the attention
    options) with a ValueError naming the backend to use; `aj.append` with it writes through the
    reference scatter (XLA's; no Triton needed).
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {BACKENDS}")
    asked = backend or os.environ.get(BACKEND_ENV, "").strip().lower() or None
    chosen = backend or default_backend()
    if chosen == "mosaic":
        return _resolve_mosaic(layout, group, attend)
    if chosen in ("reference", "xla"):
        return chosen
    from pallas_kernels import triton_lowering_problem, unsupported_reason
    from pallas_kernels.tpu.common import target_platform, tpu_unsupported_reason

    if chosen == "pallas" and target_platform() == "tpu":
        chosen = "pallas_tpu"
    if chosen == "pallas_tpu":
        reason = tpu_unsupported_reason(head_dim=layout.head_dim, page_size=layout.page_size, group=group,
                                        dtype=layout.dtype, scale_dtype=layout.scale_dtype,
                                        q_dtype=attend.get("q_dtype"), scale_rows=scale_rows)  # fmt: skip
    else:
        reason = (triton_lowering_problem()
                  or unsupported_reason(head_dim=layout.head_dim, page_size=layout.page_size, group=group, dtype=layout.dtype))
    if reason is None:
        return chosen
    if asked in ("pallas", "pallas_tpu"):
        raise ValueError(f"backend={asked!r} cannot take this layout: {reason}")
    fallback = "xla"
    if reason not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(reason)
        warnings.warn(f"arena_jax: the Pallas kernels cannot take this layout ({reason}); using the jnp "
                      f"path (backend {fallback!r})", RuntimeWarning, stacklevel=3)
    return fallback


def _resolve_mosaic(layout, group, attend: dict) -> str:
    if group is None:  # append: the reference scatter
        return "mosaic"
    from pallas_kernels.gpu.mosaic_decode import mosaic_unsupported_reason
    from pallas_kernels.quant import is_quantized

    reason = mosaic_unsupported_reason(head_dim=layout.head_dim, page_size=layout.page_size, group=group,
                                       dtype=layout.dtype, quantized=is_quantized(layout.dtype), **attend)
    if reason is not None:
        raise ValueError(reason)
    return "mosaic"


def _check_cache(cache):
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache (from arena_jax.create), got {type(cache).__name__}")
    return check_cache_arrays(cache)


def _check_prefix_shards(cache, op: str) -> None:
    """The prefix ops need one data shard: refused before any other check names a page."""
    if cache.sharding is not None:
        sharding.one_data_shard(cache, op)


def _check_shards(cache, num_q_heads=None, **rows):
    """A sharded cache's own limits (rows per data shard, query heads per tensor shard)."""
    if cache.sharding is None:
        return
    for name, slots in rows.items():
        sharding.check_rows(cache, slots, name)
    if num_q_heads is not None:
        sharding.check_heads(cache, num_q_heads)


# ---- allocator ---------------------------------------------------------------------------


@functools.partial(jax.jit, donate_argnames=("cache",), static_argnames=("kernel",))
def _reserve(cache, slots, num_tokens, kernel=False):
    if cache.sharding is not None:
        return sharding.reserve(cache, slots, num_tokens)
    return allocator.reserve_impl(cache, slots, num_tokens, kernel=kernel)


def reserve(cache: KVCache, slots, num_tokens) -> tuple[KVCache, jax.Array]:
    """Grow each slot's reservation by `num_tokens` (scalar or i32[B]), popping pages as needed.

    A slot whose last page is partly filled and shared first gets a private copy of it
    (copy-on-write, all layers), so `append` never allocates. Rows are served first come,
    first served in batch order; a row that cannot be served (pages, or its copy-on-write
    page) is left unchanged and its `ok` is False. PAD_SLOT rows are ignored (ok True).
    Returns (cache, ok bool[B]).
    """
    layout = _check_cache(cache)
    slots = check_slots(layout, slots)
    _check_shards(cache, slots=slots)
    num_tokens = check_counts(layout, num_tokens, slots.shape[0], "num_tokens")
    slot_values, token_values = concrete(slots), concrete(num_tokens)
    lengths = concrete(cache.table.lengths) if slot_values is not None and token_values is not None else None
    if lengths is not None:
        live = slot_values >= 0
        grown = lengths[slot_values[live]] + token_values[live]
        if grown.size and grown.max() > layout.max_seq_len:
            raise ValueError(
                f"num_tokens would grow slot {int(slot_values[live][grown.argmax()])} to {int(grown.max())} tokens, "
                f"beyond max_pages_per_seq * page_size = {layout.max_seq_len}"
            )
    return _reserve(cache, slots, num_tokens, kernel=allocator.RESERVE_KERNEL)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _release(cache, slots):
    if cache.sharding is not None:
        return sharding.release(cache, slots)
    return allocator.release_impl(cache, slots)


def release(cache: KVCache, slots) -> KVCache:
    """Drop the slots; pages whose refcount reaches 0 return to the free stack."""
    layout = _check_cache(cache)
    slots = check_slots(layout, slots)
    _check_shards(cache, slots=slots)
    return _release(cache, slots)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _fork(cache, src, dst):
    if cache.sharding is not None:
        return sharding.fork(cache, src, dst)
    return allocator.fork_impl(cache, src, dst)


def fork(cache: KVCache, src, dst) -> KVCache:
    """Each dst[b] shares src[b]'s pages (refcount + 1, no data moved); a dst in use is released
    first. dst[b] = PAD_SLOT makes a padding row. A source must be in use with its reservation
    written at every layer (a pending reservation is private to its slot: append or truncate
    it first), and no slot may be both a source and a destination in one call."""
    layout = _check_cache(cache)
    src = check_slots(layout, src, "src", unique=False)
    dst = check_slots(layout, dst, "dst")
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must have the same length, got {src.shape[0]} and {dst.shape[0]}")
    _check_shards(cache, src=src, dst=dst)
    s, d = concrete(src), concrete(dst)
    if s is not None and d is not None:
        rows = d != PAD_SLOT
        if (s[rows] == PAD_SLOT).any():
            raise ValueError(f"src is PAD_SLOT where dst is a slot (src={s.tolist()}, dst={d.tolist()}): nothing to fork")
        clash = set(s[rows].tolist()) & set(d[rows].tolist())
        if clash:
            raise ValueError(f"slots {sorted(clash)} are both a source and a destination: a slot cannot be forked onto itself")
        table = cache.table
        active, lengths, written = concrete(table.active), concrete(table.lengths), concrete(table.written)
        idle = [int(x) for x in s[rows] if not active[x]]
        if idle:
            raise ValueError(f"src slots {idle} are not in use: nothing to fork")
        pending = [int(x) for x in s[rows] if (written[:, x] != lengths[x]).any()]
        if pending:
            x = pending[0]
            raise ValueError(
                f"src slot {x} has reserved tokens not yet written (reserved {int(lengths[x])}, written per layer "
                f"{written[:, x].tolist()}): append them, or truncate to the written length, before forking"
            )
    return _fork(cache, src, dst)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _truncate(cache, slots, lengths):
    if cache.sharding is not None:
        return sharding.truncate(cache, slots, lengths)
    return allocator.truncate_impl(cache, slots, lengths)


def truncate(cache: KVCache, slots, lengths) -> KVCache:
    """Roll slots back to `lengths` (scalar or i32[B]); whole pages past the end are released and
    each layer's written watermark is cut to the new length."""
    layout = _check_cache(cache)
    slots = check_slots(layout, slots)
    lengths = check_counts(layout, lengths, slots.shape[0], "lengths")
    _check_shards(cache, slots=slots)
    s, n = concrete(slots), concrete(lengths)
    if s is not None and n is not None:
        held = concrete(cache.table.lengths)
        live = s >= 0
        longer = n[live] > held[s[live]]
        if longer.any():
            i = int(np.argmax(longer))
            raise ValueError(
                f"lengths[{i}]={int(n[live][i])} is longer than slot {int(s[live][i])}'s {int(held[s[live][i]])} tokens: "
                "truncate only shortens (use reserve to grow)"
            )
    return _truncate(cache, slots, lengths)


# ---- the prefix cache's holds -------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("page_size",))
def _page_fill(table, page_size):
    return prefix_ops.page_fill(table, page_size)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _hold_pages(cache, pages, num_tokens):
    if cache.sharding is not None:
        return sharding.hold_pages(cache, pages, num_tokens)
    return prefix_ops.hold_pages_impl(cache, pages, num_tokens)


def hold_pages(cache: KVCache, pages, num_tokens) -> KVCache:
    """The cache itself holds the first `num_tokens` (scalar or i32[K]) tokens of each of `pages`
    (i32[K]; PAD_PAGE entries are padding): refcount + 1, `table.held[p] = num_tokens`. A page
    must be in use, not held yet, its tokens written at every layer by a slot that maps it, and
    hold no slot's reserved-but-unwritten positions. From then on the page is never written:
    the slots that map it share it (their next `reserve` copies a partly filled one)."""
    layout = _check_cache(cache)
    _check_prefix_shards(cache, "hold_pages")
    pages = check_pages(layout, pages)
    counts = check_ints(num_tokens, "num_tokens")
    if counts.ndim == 0:
        counts = jnp.broadcast_to(counts, pages.shape)
    if counts.shape != pages.shape:
        raise ValueError(f"num_tokens must be a scalar or shape {pages.shape} to match pages, got {counts.shape}")
    p, n = concrete(pages), concrete(counts)
    if p is not None and n is not None:
        rows = p != PAD_PAGE
        bad = n[rows][(n[rows] < 1) | (n[rows] > layout.page_size)]
        if bad.size:
            raise ValueError(f"num_tokens has {bad.tolist()}: a hold covers 1 to page_size={layout.page_size} tokens")
        held, refcount = concrete(cache.table.held), concrete(cache.table.refcount)
        fill, pending = (np.asarray(x) for x in _page_fill(cache.table, layout.page_size))
        for page, k in zip(p[rows].tolist(), n[rows].tolist()):
            if not refcount[page]:
                raise ValueError(f"pages: page {page} is free: only pages a slot has written can be held")
            if held[page]:
                raise ValueError(f"pages: page {page} is already held ({int(held[page])} tokens): drop_pages it first")
            if pending[page]:
                raise ValueError(f"pages: page {page} holds reserved tokens not yet written: append them first")
            if k > fill[page]:
                raise ValueError(
                    f"num_tokens={k} for page {page}, but the slots that map it have written {int(fill[page])} of its "
                    "tokens at every layer: only written tokens can be held"
                )
    return _hold_pages(cache, pages, counts)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _drop_pages(cache, pages):
    if cache.sharding is not None:
        return sharding.drop_pages(cache, pages)
    return prefix_ops.drop_pages_impl(cache, pages)


def drop_pages(cache: KVCache, pages) -> KVCache:
    """The cache gives back its hold on each of `pages` (i32[K]; PAD_PAGE entries are padding):
    refcount - 1; a page that no slot maps returns to the free stack (an eviction). Pages that
    slots map stay theirs."""
    layout = _check_cache(cache)
    _check_prefix_shards(cache, "drop_pages")
    pages = check_pages(layout, pages)
    p = concrete(pages)
    if p is not None:
        held = concrete(cache.table.held)
        idle = [int(x) for x in p[p != PAD_PAGE] if not held[x]]
        if idle:
            raise ValueError(f"pages {idle} are not held by the cache: nothing to drop")
    return _drop_pages(cache, pages)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _fork_pages(cache, pages, num_tokens, dst):
    if cache.sharding is not None:
        return sharding.fork_pages(cache, pages, num_tokens, dst)
    return prefix_ops.fork_pages_impl(cache, pages, num_tokens, dst)


def fork_pages(cache: KVCache, pages, num_tokens, dst) -> KVCache:
    """Each dst[b] (released first if in use) becomes a slot of `num_tokens[b]` tokens made of
    held pages: logical page j is pages[b, j] for j < ceil(num_tokens[b] / page_size)
    (`pages`: i32[B, W], W <= max_pages_per_seq; later entries are ignored, PAD_PAGE or not).
    Each page must be held by the cache for at least the tokens the slot takes from it. The
    slot is settled (written = reserved = num_tokens at every layer) and shares the pages
    (refcount + 1); its next `reserve` copies a partly filled last page (copy-on-write).
    dst[b] = PAD_SLOT makes a padding row."""
    layout = _check_cache(cache)
    _check_prefix_shards(cache, "fork_pages")
    dst = check_slots(layout, dst, "dst")
    pages = check_pages(layout, pages, ndim=2, unique=False)
    if pages.shape[0] != dst.shape[0]:
        raise ValueError(f"pages has {pages.shape[0]} rows but dst has {dst.shape[0]}")
    if pages.shape[1] > layout.max_pages_per_seq:
        raise ValueError(f"pages has {pages.shape[1]} columns, more than max_pages_per_seq={layout.max_pages_per_seq}")
    num_tokens = check_counts(layout, num_tokens, dst.shape[0], "num_tokens")
    p, n, d = concrete(pages), concrete(num_tokens), concrete(dst)
    if p is not None and n is not None and d is not None:
        held = concrete(cache.table.held)
        size = layout.page_size
        for b in np.flatnonzero(d != PAD_SLOT):
            if n[b] > p.shape[1] * size:
                raise ValueError(f"num_tokens[{b}]={int(n[b])} needs more than the {p.shape[1]} pages a row of pages has")
            used = p[b, : -(-int(n[b]) // size)]
            for j, page in enumerate(used.tolist()):
                take = min(size, int(n[b]) - j * size)
                if page == PAD_PAGE or held[page] < take:
                    have = "no page" if page == PAD_PAGE else f"page {page}, held for {int(held[page])} tokens"
                    raise ValueError(
                        f"pages[{b}, {j}]: num_tokens[{b}]={int(n[b])} takes {take} tokens from logical page {j}, "
                        f"which has {have}: only tokens the cache holds can be mapped (hold_pages)"
                    )
            if np.unique(used).size != used.size:
                raise ValueError(f"pages[{b}] uses a page twice ({used.tolist()})")
    return _fork_pages(cache, pages, num_tokens, dst)


# ---- data path -----------------------------------------------------------------------------


def _check_reserved(cache, slots, n, layer) -> None:
    """On the host: every row's tokens must fit its reservation (else append would drop them)."""
    s, lay = concrete(slots), concrete(layer)
    if s is None or n is None or lay is None:
        return
    table = cache.table
    lengths, active, written = concrete(table.lengths), concrete(table.active), concrete(table.written)[int(lay)]
    for b in np.flatnonzero((s != PAD_SLOT) & (n > 0)):
        slot, want = int(s[b]), int(n[b])
        if not active[slot]:
            raise ValueError(
                f"slots[{b}]={slot} has no reservation (the slot is not in use): call aj.reserve(cache, slots, "
                f"num_tokens) for the new tokens before aj.append (an unreserved append writes nothing)"
            )
        if int(written[slot]) + want > int(lengths[slot]):
            raise ValueError(
                f"slots[{b}]={slot}: appending {want} tokens at layer {int(lay)} would pass its reservation "
                f"({int(written[slot])} written of {int(lengths[slot])} reserved): aj.reserve them first (an append "
                "past the reservation writes nothing and counts in stats.dropped_writes)"
            )


def _opaque_layer(cache: KVCache, given, layer):
    """`layer` as the ops take it; a constant layer inside a caller's jit goes behind an
    optimization barrier, so XLA does not fold it into the op's kernels.

    A model whose layers are a Python loop passes each layer's index as a constant. Folded in,
    it made every layer's append and attention kernels differ, and XLA's CPU backend compiles
    each distinct kernel once (identical ones are compiled once for all): behind the barrier
    every layer's cache kernels are the same, compiled once (benchmarks/RESULTS.md, "One compile
    for every layer's cache ops"). A traced layer (a layer scan's) and a call outside jit (the
    op's own jit takes the layer as an argument) are left as they are. XLA CPU of JAX 0.10
    expands the barrier before it folds constants, so there it changes nothing. `given`: the
    layer as the caller passed it; `layer`: as `check_layer` returned it."""
    if not isinstance(given, jax.core.Tracer) and isinstance(cache.k, jax.core.Tracer):
        return jax.lax.optimization_barrier(layer)
    return layer


@functools.partial(jax.jit, static_argnames=("backend",), donate_argnames=("cache",))
def _append(cache, layer, slots, k, v, num_tokens, backend, plan=None):
    if cache.sharding is not None:
        return sharding.append(cache, layer, slots, k, v, num_tokens, backend)
    return arena_ops.append_impl(cache, layer, slots, k, v, num_tokens, backend, plan)


def _check_plan(cache, plan, slots, num_tokens, tokens: int) -> None:
    """A `StepPlan` passed to append / attend: made for this call's rows (on the host, when
    concrete) and width, on a cache with one data shard."""
    if plan is None:
        return
    if not isinstance(plan, StepPlan):
        raise ValueError(f"plan must be a StepPlan (from aj.plan_step) or None, got {type(plan).__name__}")
    if cache.sharding is not None:
        raise ValueError("plan: a sharded cache takes no plan (aj.plan_step returns None for it)")
    if tokens != plan.width:
        raise ValueError(f"plan was made for {plan.width} tokens a row, this call has {tokens}")
    for name, given, planned in (("slots", slots, plan.slots), ("num_tokens", num_tokens, plan.num_tokens)):
        g, p = concrete(given), concrete(planned)
        if g is not None and p is not None and not np.array_equal(g, p):
            raise ValueError(f"{name}={g.tolist()} differs from the plan's {p.tolist()}: a plan answers for the rows "
                             "it was made for (aj.plan_step after the step's reserve)")


def append(cache: KVCache, layer, slots, k, v, *, num_tokens=None, backend: str | None = None, plan=None) -> KVCache:
    """Write `k, v: [batch, tokens, num_kv_heads, head_dim]` at each slot's written watermark for `layer`.

    Row b's first `num_tokens[b]` tokens (default: all `tokens`) go to positions
    `written[layer, slot] ...` of its slot, and the watermark advances by that many. A row whose
    tokens would pass the slot's reserved length (no or a failed `reserve`) or land in a page
    it shares writes nothing and is counted in `stats.dropped_writes`.

    dtype: a float arena takes k, v in exactly its dtype. An 8-bit arena (int8, float8_e4m3fn,
    float8_e5m2) takes them in bfloat16, float16 or float32 (both alike) and quantizes each
    token of each KV head (absmax per row, one scale each; `pallas_kernels.quant` has the
    rounding, saturation, zero and NaN rules).

    `plan`: the step's `aj.plan_step(cache, slots, num_tokens, width)`, made after its reserve
    for these slots and counts: the rows are classified once for every layer instead of per
    call (`arena_jax.plan`). A plan made before a later reserve / release / fork / truncate (a
    table at another epoch) writes nothing and counts every row in `stats.rejected_rows`.
    """
    layout = _check_cache(cache)
    slots = check_slots(layout, slots)
    given_layer, layer = layer, check_layer(layout, layer)
    check_kv(layout, k, v, slots.shape[0])
    _check_shards(cache, slots=slots)
    tokens = k.shape[1]
    num_tokens = check_counts(layout, tokens if num_tokens is None else num_tokens, slots.shape[0], "num_tokens")
    n = concrete(num_tokens)
    if n is not None and n.size and n.max() > tokens:
        raise ValueError(f"num_tokens={int(n.max())} exceeds the {tokens} tokens given in k and v")
    _check_reserved(cache, slots, n, layer)
    _check_plan(cache, plan, slots, num_tokens, tokens)
    if plan is not None and plan.attend_only:
        raise ValueError("plan: made by StepPlan.last_query, for aj.attend only (append under the step's own plan)")
    layer = _opaque_layer(cache, given_layer, layer)
    backend = _resolve_backend(backend, layout, scale_rows=cache.scale_rows)
    return _append(cache, layer, slots, jnp.asarray(k), jnp.asarray(v), num_tokens, backend, plan)


@functools.partial(jax.jit, static_argnames=("backend", "sliding_window", "sm_scale", "logits_soft_cap", "native"))
def _attend(q, cache, layer, slots, num_tokens, window, backend, sliding_window, sm_scale, logits_soft_cap, plan=None,
            native=False):
    """`sliding_window`: a static window or None; `window`: a traced one (i32[]) or None;
    `native`: `arena_ops.attends_natively`."""
    sliding_window = sliding_window if window is None else window
    if cache.sharding is not None:
        return sharding.attend(q, cache, layer, slots, num_tokens, backend, sliding_window, sm_scale, logits_soft_cap)
    return arena_ops.attend_impl(q, cache, layer, slots, num_tokens, backend, sliding_window, sm_scale,
                                 logits_soft_cap, plan, native)


def _native(args) -> bool:
    """Whether `_attend(*args)` runs the native decode attention (`arena_ops.ATTEND_KERNEL`)."""
    return arena_ops.attends_natively(arena_ops.ATTEND_KERNEL, args[6], args[0], args[1])


def attend(
    q,
    cache: KVCache,
    layer,
    slots,
    *,
    num_tokens=None,
    sliding_window=None,
    sm_scale: float | None = None,
    logits_soft_cap: float | None = None,
    backend: str | None = None,
    plan=None,
):
    """Attention of `q: [batch, q_tokens, num_q_heads, head_dim]` over the tokens written at `layer`.

    Row b's q tokens are the last `num_tokens[b]` (default `q_tokens`) tokens written at
    `layer` in its slot; they attend causally to every token written before them (within
    `sliding_window` tokens, counting themselves, if given; a window of `max_seq_len` or more
    is no window). Reserved but unwritten positions are never read. Padded rows and tokens
    give zeros. Returns q's shape and dtype.

    `sliding_window`: None, a positive int, or a traced integer scalar (e.g. a per-layer
    window inside `lax.scan`; mark global layers with any value >= max_seq_len): the same
    results as the static form; a traced value <= 0 admits no key, so those queries give
    zeros (nothing is counted: attend returns no cache). `sm_scale` (default head_dim**-0.5)
    and `logits_soft_cap` (Gemma 2: scores `s = q.k * sm_scale` become `cap * tanh(s / cap)`
    before masking) are concrete numbers > 0, compiled in.

    Dtypes, on both backends: the dots run in q's dtype (bfloat16, float16 or float32; K/V of
    another dtype, 8-bit included, are converted to it), with float32 accumulation and a
    float32 softmax. A key a query does not attend to contributes nothing, NaN and inf
    included; a NaN / inf in a key or value it attends to makes its whole output row NaN
    (`pallas_kernels.reference.paged_attention_reference` states the rules).

    `plan`: the step's `aj.plan_step` (see `aj.append`): the rows as they stand after this
    layer's append, classified once for every layer. A plan of another epoch reads nothing (zeros).
    """
    args = _attend_args(q, cache, layer, slots, num_tokens, sliding_window, sm_scale, logits_soft_cap, backend)
    _check_plan(cache, plan, args[3], args[4], q.shape[1])
    return _attend(*args, plan, native=_native(args))


def _attend_args(q, cache, layer, slots, num_tokens, sliding_window, sm_scale, logits_soft_cap, backend):
    """`attend`'s checks; returns `_attend`'s arguments."""
    layout = _check_cache(cache)
    slots = check_slots(layout, slots)
    given_layer, layer = layer, check_layer(layout, layer)
    check_q(layout, q, slots.shape[0])
    _check_shards(cache, slots=slots, num_q_heads=q.shape[2])
    tokens = q.shape[1]
    num_tokens = check_counts(layout, tokens if num_tokens is None else num_tokens, slots.shape[0], "num_tokens")
    sliding_window = check_sliding_window(layout, sliding_window)
    sm_scale = check_sm_scale(sm_scale)
    logits_soft_cap = check_logits_soft_cap(logits_soft_cap)
    backend = _resolve_backend(backend, layout, group=q.shape[2] // layout.num_kv_heads, scale_rows=cache.scale_rows,
                               tokens=tokens, q_dtype=q.dtype,
                               sharded=cache.sharding is not None, sliding_window=sliding_window,
                               logits_soft_cap=logits_soft_cap)
    s, n, lay = concrete(slots), concrete(num_tokens), concrete(layer)
    if n is not None and n.size and n.max() > tokens:
        raise ValueError(f"num_tokens={int(n.max())} exceeds the {tokens} query tokens given in q")
    if s is not None and n is not None and lay is not None:
        written = concrete(cache.table.written)[int(lay)]
        for b in np.flatnonzero(s != PAD_SLOT):
            if n[b] > written[s[b]]:
                raise ValueError(
                    f"num_tokens[{b}]={int(n[b])} exceeds the {int(written[s[b]])} tokens written at layer {int(lay)} "
                    f"for slot {int(s[b])}: attend reads only appended tokens (append them first; an append the "
                    f"slot had not reserved with aj.reserve writes nothing: stats.dropped_writes = "
                    f"{int(concrete(cache.stats.dropped_writes).sum())})"
                )
    window = sliding_window if isinstance(sliding_window, jax.core.Tracer) else None
    static_window = None if window is not None else sliding_window
    layer = _opaque_layer(cache, given_layer, layer)
    return (jnp.asarray(q), cache, layer, slots, num_tokens, window, backend, static_window, sm_scale,
            logits_soft_cap)


def attend_mixed(parts, cache: KVCache, layer, *, sliding_window=None, sm_scale: float | None = None,
                 logits_soft_cap: float | None = None, backend: str | None = None) -> list:
    """`attend` of a mixed step's row groups at one layer: `parts` is a list of (q [R_i, T_i, Hq,
    D], slots i32[R_i], num_tokens i32[R_i] or None), each checked and answered as `attend` would
    (the same options for all). Returns the outputs, one per part. On the TPU kernels
    ("pallas_tpu"; on a mesh, per shard), a decode part (T = 1) followed by a chunk part (T > 1)
    runs in ONE kernel call (`pallas_kernels.tpu.mixed`), equal to the two calls; any other
    combination runs `attend` per part."""
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, (list, tuple)) and len(p) == 3 for p in parts):
        raise ValueError(f"parts must be a list of (q, slots, num_tokens) triples, got {type(parts).__name__} "
                         f"{[type(p).__name__ for p in parts] if isinstance(parts, (list, tuple)) else ''}")
    args = [_attend_args(q, cache, layer, slots, n, sliding_window, sm_scale, logits_soft_cap, backend)
            for q, slots, n in parts]
    one_call = (len(args) == 2 and all(a[6] == "pallas_tpu" for a in args) and args[0][0].shape[1] == 1
                and args[1][0].shape[1] > 1)
    if not one_call:
        return [_attend(*a, native=_native(a)) for a in args]
    (q_dec, _, _, slots_dec, n_dec, window, _, static_window, _, _), (q_pre, _, _, slots_pre, n_pre, *_) = args
    mixed = sharding.attend_mixed if cache.sharding is not None else arena_ops.attend_mixed_impl
    return list(mixed(q_dec, slots_dec, n_dec, q_pre, slots_pre, n_pre, cache, args[0][2],
                      static_window if window is None else window, args[0][8], args[0][9]))
