"""Host-side checks run before anything enters jit: a ValueError naming the argument and the limit.

Integers are checked as the caller gave them (Python ints, numpy or JAX arrays) before any
cast to int32, so `2**32 + 2` is an error, never slot 2. Values are checked only when they
are concrete: inside a user's jit, shapes and dtypes are still checked, and the jitted ops
are total (see `arena_jax.allocator`): they refuse what is invalid and count it.
"""
from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from arena_jax.kv_cache import PAD_PAGE, PAD_SLOT
from arena_jax.layout import EIGHT_BIT_DTYPES, KVLayout

__all__ = [
    "concrete",
    "check_ints",
    "check_slots",
    "check_pages",
    "check_counts",
    "check_width",
    "check_reserved",
    "check_layer",
    "check_kv",
    "check_cache_arrays",
    "donated",
    "check_q",
    "check_sliding_window",
    "check_sm_scale",
    "check_logits_soft_cap",
]

INT32 = np.iinfo(np.int32)
QUANTIZED = tuple(jnp.dtype(d) for d in EIGHT_BIT_DTYPES) + (jnp.dtype(jnp.uint8),)  # uint8: packed int4
# What k, v (float arenas: exactly the arena's dtype; 8-bit arenas: any of these, quantized on
# write) and q (any arena; with an 8-bit arena the attention dots run in q's dtype) may be.
COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def concrete(x) -> np.ndarray | None:
    """A numpy copy of `x`, or None while tracing (or when other processes hold part of it)."""
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array) and not x.is_fully_addressable:  # a multi-host array: not all here
        return None
    return np.asarray(x)


def _is_int(value) -> bool:
    """A Python or numpy integer, or a 0-d integer array; never a bool."""
    if isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, jax.core.Tracer) and value.ndim == 0:
        return value.dtype != np.bool_ and np.issubdtype(value.dtype, np.integer)
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_ints(x, name: str):
    """`x` (int, list, numpy or JAX array of integers) as an i32 JAX array, range-checked first.

    Concrete values outside int32 raise; a traced wider integer is saturated into int32, where
    the ops reject it as out of range instead of letting it wrap onto a valid value.
    """
    if isinstance(x, jax.core.Tracer):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must hold integers, got dtype {x.dtype}")
        if jnp.dtype(x.dtype).itemsize < 4 or x.dtype == jnp.int32:
            return x.astype(jnp.int32)
        if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
            return jnp.minimum(x, INT32.max).astype(jnp.int32)
        return jnp.clip(x, INT32.min, INT32.max).astype(jnp.int32)
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        values = np.asarray(x)
        if values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.integer):
            raise ValueError(f"{name} must hold integers, got dtype {values.dtype}")
        if values.size and (values.min() < INT32.min or values.max() > INT32.max):
            worst = values.min() if values.min() < INT32.min else values.max()
            raise ValueError(f"{name} has {int(worst)}, outside int32 [{INT32.min}, {INT32.max}]")
        return jnp.asarray(values.astype(np.int32))
    try:  # Python ints (of any size) in nested lists
        objects = np.asarray(x, dtype=object)
    except ValueError:  # ragged nesting
        raise ValueError(f"{name} must be an integer or a flat list of integers, got {x!r}") from None
    flat = objects.reshape(-1)
    bad = [v for v in flat if not _is_int(v)]
    if bad:
        raise ValueError(f"{name} must hold integers, got {bad[0]!r} ({type(bad[0]).__name__})")
    outside = [int(v) for v in flat if not INT32.min <= int(v) <= INT32.max]
    if outside:
        raise ValueError(f"{name} has {outside[0]}, outside int32 [{INT32.min}, {INT32.max}]")
    return jnp.asarray(np.asarray([int(v) for v in flat], np.int32).reshape(objects.shape))


def check_slots(layout: KVLayout, slots, name: str = "slots", *, allow_pad: bool = True, unique: bool = True):
    """Slots as i32[B]. Each is PAD_SLOT (if allowed) or in [0, max_seqs); no duplicates."""
    arr = check_ints(slots, name)
    if arr.ndim == 0:
        arr = arr[None]
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of slot ids, got shape {arr.shape}")
    values = concrete(arr)
    if values is not None:
        live = values[values != PAD_SLOT] if allow_pad else values
        bad = live[(live < 0) | (live >= layout.max_seqs)]
        if bad.size:
            pad = f" or PAD_SLOT ({PAD_SLOT})" if allow_pad else ""
            raise ValueError(f"{name} has {bad.tolist()}: slots must be in [0, max_seqs={layout.max_seqs}){pad}")
        if unique and np.unique(live).size != live.size:
            raise ValueError(f"{name} has duplicate slots {values.tolist()}: each slot may appear once per call")
    return arr


def check_pages(layout: KVLayout, pages, name: str = "pages", *, ndim: int = 1, unique: bool = True):
    """Page ids as an i32 array of `ndim` dimensions (a scalar is one page). Each is PAD_PAGE
    (-1: no page) or in [0, num_pages); with `unique`, no page twice (per row for ndim=2)."""
    arr = check_ints(pages, name)
    if arr.ndim == 0 and ndim == 1:
        arr = arr[None]
    if arr.ndim != ndim:
        what = "a 1-D array of page ids" if ndim == 1 else "a 2-D array of page ids [batch, pages]"
        raise ValueError(f"{name} must be {what} (PAD_PAGE={PAD_PAGE} for none), got shape {arr.shape}")
    values = concrete(arr)
    if values is not None:
        bad = values[(values != PAD_PAGE) & ((values < 0) | (values >= layout.num_pages))]
        if bad.size:
            raise ValueError(f"{name} has {bad.tolist()}: pages must be in [0, num_pages={layout.num_pages}) or PAD_PAGE ({PAD_PAGE})")
        if unique:
            for row in values.reshape(-1, values.shape[-1]) if values.size else ():
                live = row[row != PAD_PAGE]
                if np.unique(live).size != live.size:
                    raise ValueError(f"{name} names a page twice ({row.tolist()}): each page may appear once per call")
    return arr


def check_counts(layout: KVLayout, counts, batch: int, name: str):
    """Token counts as i32[B], each in [0, max_seq_len]."""
    arr = check_ints(counts, name)
    if arr.ndim == 0:
        arr = jnp.broadcast_to(arr, (batch,))
    if arr.shape != (batch,):
        raise ValueError(f"{name} must be a scalar or shape ({batch},) to match slots, got {arr.shape}")
    values = concrete(arr)
    if values is not None and values.size:
        if values.min() < 0:
            raise ValueError(f"{name} must be >= 0, got {values.tolist()}")
        if values.max() > layout.max_seq_len:
            raise ValueError(
                f"{name}={int(values.max())} exceeds the per-sequence limit max_pages_per_seq * page_size = "
                f"{layout.max_pages_per_seq} * {layout.page_size} = {layout.max_seq_len} tokens"
            )
    return arr


def check_width(slots, num_tokens, width: int, name: str = "num_tokens") -> None:
    """Each row's new tokens fit the step's tokens axis: num_tokens[b] <= width (PAD_SLOT rows
    are not checked). Concrete values only: inside jit the caller refuses such rows instead."""
    slot_values, values = concrete(slots), concrete(num_tokens)
    if slot_values is None or values is None:
        return
    over = np.flatnonzero((slot_values != PAD_SLOT) & (values > width))
    if over.size:
        b = int(over[0])
        raise ValueError(
            f"{name}[{b}]={int(values[b])} exceeds width={width}, the step's tokens axis T: a row has at most T new tokens"
        )


def check_reserved(cache, slots, num_tokens, name: str = "num_tokens") -> None:
    """Each live row's slot is in use and has reserved at least num_tokens[b] tokens (its newest
    ones are the row's). Concrete values only (the cache's table included)."""
    slot_values, values = concrete(slots), concrete(num_tokens)
    if slot_values is None or values is None:
        return
    active, lengths = concrete(cache.table.active), concrete(cache.table.lengths)
    if active is None or lengths is None:
        return
    for b in np.flatnonzero(slot_values != PAD_SLOT):
        slot, n = int(slot_values[b]), int(values[b])
        if not active[slot]:
            raise ValueError(
                f"slots[{b}]={slot} is idle (no sequence holds it): reserve its tokens first (aj.reserve), "
                f"or pass PAD_SLOT ({PAD_SLOT}) for a row without one"
            )
        if n > lengths[slot]:
            raise ValueError(
                f"{name}[{b}]={n} is more than the {int(lengths[slot])} tokens slot {slot} holds: the row's tokens "
                "must be reserved first (aj.reserve)"
            )


def check_layer(layout: KVLayout, layer):
    if isinstance(layer, (bool, np.bool_)):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    arr = check_ints(layer, "layer")
    if arr.ndim != 0:
        raise ValueError(f"layer must be an integer scalar, got shape {arr.shape}")
    value = concrete(arr)
    if value is not None and not 0 <= int(value) < layout.num_layers:
        raise ValueError(f"layer={int(value)} is out of range [0, num_layers={layout.num_layers})")
    return arr


def _check_array(x, name: str, axes: str):
    if not isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer)):
        raise ValueError(f"{name} must be a JAX or numpy array {axes}, got {type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name} must be {axes}, got shape {x.shape}")


def check_kv(layout: KVLayout, k, v, batch: int):
    for name, x in (("k", k), ("v", v)):
        _check_array(x, name, "[batch, tokens, num_kv_heads, head_dim]")
        b, t, h, d = x.shape
        if b != batch:
            raise ValueError(f"{name} has batch {b} but slots has {batch} rows")
        if h != layout.num_kv_heads:
            raise ValueError(f"{name} has {h} heads; the cache stores num_kv_heads={layout.num_kv_heads}")
        if d != layout.head_dim:
            raise ValueError(f"{name} has head_dim {d}; the cache has head_dim={layout.head_dim}")
        if t > layout.max_seq_len:
            raise ValueError(f"{name} has {t} tokens, more than max_seq_len={layout.max_seq_len}")
        if layout.quantized:
            if jnp.dtype(x.dtype) not in COMPUTE_DTYPES:
                raise ValueError(
                    f"{name} has dtype {x.dtype}; the {layout.dtype} arena quantizes on write: give k and v in "
                    "bfloat16, float16 or float32 (quantized values without their scales cannot be stored)"
                )
        elif x.dtype != layout.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}; the cache stores {layout.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v dtypes differ: {k.dtype} vs {v.dtype}")


def donated(tree) -> bool:
    """Whether an array of `tree` (a cache, a host tier) was donated to a later call: deleted,
    so every op on it must be refused (its pytree still looks whole)."""
    return any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and x.is_deleted()
               for x in jax.tree.leaves(tree))  # fmt: skip


def check_cache_arrays(cache) -> KVLayout:
    """The cache's layout, after checking its arrays agree with each other: k and v alike, and
    scales (8-bit: [L, H, P, S]; int4, a uint8 arena: [L, H, P, S, head_dim / 32]; float32 /
    bfloat16) present exactly when the arena is quantized."""
    if donated(cache):
        raise ValueError(
            "cache: its arrays were donated to a later call and are deleted; every op that changes the cache "
            "returns a new one: continue from the newest result (the cache that call returned)"
        )
    k, v, ks, vs = cache.k, cache.v, cache.k_scale, cache.v_scale
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(f"cache.k {k.shape} {k.dtype} and cache.v {v.shape} {v.dtype} must match")
    quantized = jnp.dtype(k.dtype) in QUANTIZED
    if quantized != (ks is not None) or quantized != (vs is not None):
        raise ValueError(
            f"cache.k_scale / v_scale must be present exactly for 8-bit arenas (and int4 ones): the arena is {k.dtype}, "
            f"k_scale {'present' if ks is not None else 'None'}, v_scale {'present' if vs is not None else 'None'} "
            "(build caches with arena_jax.create)"
        )
    if quantized:
        want = tuple(k.shape[:4]) + ((2 * k.shape[4] // 32,) if k.dtype == jnp.uint8 else ())
        if cache.scale_rows:  # rows of 128 lanes (a TPU's 8-bit pages under 128: KVCache.scale_rows)
            want = tuple(k.shape[:2]) + (k.shape[2] * k.shape[3] // 128, 128)
        for name, x in (("k_scale", ks), ("v_scale", vs)):
            if tuple(x.shape) != want or x.dtype != ks.dtype:
                raise ValueError(f"cache.{name} must be {want} {ks.dtype}, got {x.shape} {x.dtype}")
    _check_table(cache)
    factors = cache.key_factors
    if factors is not None:
        want = tuple(k.shape[:2]) + (cache.layout.head_dim,)  # [layers, stored heads, head_dim]
        if not quantized or tuple(factors.shape) != want or factors.dtype != jnp.float32:
            raise ValueError(f"cache.key_factors (smooth_keys) must be {want} float32 and only on quantized arenas, got "
                             f"{factors.shape} {factors.dtype} on a {k.dtype} arena (build caches with arena_jax.create)")
    if not isinstance(cache.rotate_keys, (bool, np.bool_)) or (cache.rotate_keys and not quantized):
        raise ValueError(f"cache.rotate_keys={cache.rotate_keys!r}: True or False, and True only for quantized arenas "
                         "(build caches with arena_jax.create)")
    return cache.layout


def _check_table(cache) -> None:
    """The page table's one array: int32, a row ([W]; [dp, W] with data shards) of the width its
    static geometry gives, for as many layers as the arena and its pages in total."""
    from arena_jax.kv_cache import PageTable, packed_width

    table = cache.table
    if not isinstance(table, PageTable):
        raise ValueError(f"cache.table must be a PageTable (build caches with arena_jax.create), got {type(table).__name__}")
    packed, geometry = table.packed, table.geometry
    shards = packed.shape[0] if packed.ndim == 2 else 1
    if (packed.dtype != jnp.int32 or packed.ndim not in (1, 2) or packed.shape[-1] != packed_width(geometry)
            or geometry[2] != cache.k.shape[0] or geometry[3] * shards != cache.k.shape[2]):  # fmt: skip
        raise ValueError(
            f"cache.table.packed {tuple(packed.shape)} {packed.dtype} does not hold the table of its geometry "
            f"(max_seqs, max_pages_per_seq, num_layers, num_pages) = {geometry} for an arena {tuple(cache.k.shape)}: "
            f"want int32 [{packed_width(geometry)}] (or [dp, {packed_width(geometry)}] with data shards), the layers and "
            "pages of the arena (build caches with arena_jax.create)")


def check_q(layout: KVLayout, q, batch: int):
    _check_array(q, "q", "[batch, tokens, num_q_heads, head_dim]")
    b, t, h, d = q.shape
    if b != batch:
        raise ValueError(f"q has batch {b} but slots has {batch} rows")
    if h % layout.num_kv_heads:
        raise ValueError(f"q has {h} heads, not a multiple of num_kv_heads={layout.num_kv_heads}")
    if d != layout.head_dim:
        raise ValueError(f"q has head_dim {d}; the cache has head_dim={layout.head_dim}")
    if t > layout.max_seq_len:
        raise ValueError(f"q has {t} tokens, more than max_seq_len={layout.max_seq_len}")
    if jnp.dtype(q.dtype) not in COMPUTE_DTYPES:
        raise ValueError(f"q must be bfloat16, float16 or float32, got {q.dtype}")


def check_sliding_window(layout: KVLayout, sliding_window):
    """None, a positive int, or a traced integer scalar.

    Concrete values (Python / NumPy integers, concrete 0-d integer arrays) must be >= 1; a
    window of max_seq_len or more can never exclude a key and is returned as None (the same
    attention), which keeps huge windows out of int32 arithmetic. A traced integer scalar
    (e.g. a per-layer window inside `lax.scan`) is returned as is: the backends take it as
    data, and a traced value <= 0 admits no key (those queries give zeros); >= max_seq_len is
    no window.
    """
    if sliding_window is None:
        return None
    if isinstance(sliding_window, jax.core.Tracer):
        dtype = sliding_window.dtype
        if sliding_window.shape != () or dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"sliding_window must be a positive int, None or a traced integer scalar, got a traced "
                             f"{dtype} of shape {sliding_window.shape}")
        return sliding_window
    if not _is_int(sliding_window) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int, None or a traced integer scalar, got {sliding_window!r}")
    return None if sliding_window >= layout.max_seq_len else int(sliding_window)


def _check_static_positive(value, name: str) -> float | None:
    """None or a finite positive number known on the host (it is compiled into the kernel)."""
    if value is None:
        return None
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} must be a concrete number (it is compiled into the kernel), got a traced value")
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    try:
        number = float(np.asarray(value).item()) if np.ndim(value) == 0 else None
    except (TypeError, ValueError):
        number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a finite positive number, got {value!r}")
    return number


def check_sm_scale(sm_scale) -> float | None:
    """None or a finite positive number known on the host (it is compiled into the kernel)."""
    return _check_static_positive(sm_scale, "sm_scale")


def check_logits_soft_cap(logits_soft_cap) -> float | None:
    """None or a finite positive number known on the host (it is compiled into the kernel)."""
    return _check_static_positive(logits_soft_cap, "logits_soft_cap")
