"""Host-side checks run before anything enters jit: a ValueError naming the argument and the limit.

Values are checked only when they are concrete (not tracers): inside a user's jit the
shapes and dtypes are still checked, and the jitted ops report what they refuse through
`ok` and the stats counters rather than clipping.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from arena_jax.layout import KVLayout
from arena_jax.state import PAD_SLOT

__all__ = ["concrete", "check_slots", "check_counts", "check_layer", "check_kv", "check_q"]


def concrete(x) -> np.ndarray | None:
    """A numpy copy of `x`, or None while tracing."""
    if isinstance(x, jax.core.Tracer):
        return None
    return np.asarray(x)


def check_slots(layout: KVLayout, slots, name: str = "slots", *, allow_pad: bool = True, unique: bool = True):
    """Slots as i32[B]. Each is PAD_SLOT (if allowed) or in [0, max_seqs); no duplicates."""
    arr = jnp.asarray(slots)
    if arr.ndim == 0:
        arr = arr[None]
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of slot ids, got shape {arr.shape}")
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    values = concrete(arr)
    if values is not None:
        live = values[values != PAD_SLOT] if allow_pad else values
        bad = live[(live < 0) | (live >= layout.max_seqs)]
        if bad.size:
            pad = f" or PAD_SLOT ({PAD_SLOT})" if allow_pad else ""
            raise ValueError(f"{name} has {bad.tolist()}: slots must be in [0, max_seqs={layout.max_seqs}){pad}")
        if unique and np.unique(live).size != live.size:
            raise ValueError(f"{name} has duplicate slots {values.tolist()}: each slot may appear once per call")
    return arr.astype(jnp.int32)


def check_counts(layout: KVLayout, counts, batch: int, name: str):
    """Token counts as i32[B], each in [0, max_seq_len]."""
    arr = jnp.asarray(counts)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
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
    return arr.astype(jnp.int32)


def check_layer(layout: KVLayout, layer):
    arr = jnp.asarray(layer)
    if arr.ndim != 0 or not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    value = concrete(arr)
    if value is not None and not 0 <= int(value) < layout.num_layers:
        raise ValueError(f"layer={int(value)} is out of range [0, num_layers={layout.num_layers})")
    return arr.astype(jnp.int32)


def check_kv(layout: KVLayout, k, v, batch: int):
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [batch, tokens, num_kv_heads, head_dim], got shape {x.shape}")
        b, t, h, d = x.shape
        if b != batch:
            raise ValueError(f"{name} has batch {b} but slots has {batch} rows")
        if h != layout.num_kv_heads:
            raise ValueError(f"{name} has {h} heads; the cache stores num_kv_heads={layout.num_kv_heads}")
        if d != layout.head_dim:
            raise ValueError(f"{name} has head_dim {d}; the cache has head_dim={layout.head_dim}")
        if t > layout.max_seq_len:
            raise ValueError(f"{name} has {t} tokens, more than max_seq_len={layout.max_seq_len}")
        if x.dtype != layout.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}; the cache stores {layout.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {k.shape} vs {v.shape}")


def check_q(layout: KVLayout, q, batch: int):
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, tokens, num_q_heads, head_dim], got shape {q.shape}")
    b, t, h, d = q.shape
    if b != batch:
        raise ValueError(f"q has batch {b} but slots has {batch} rows")
    if h % layout.num_kv_heads:
        raise ValueError(f"q has {h} heads, not a multiple of num_kv_heads={layout.num_kv_heads}")
    if d != layout.head_dim:
        raise ValueError(f"q has head_dim {d}; the cache has head_dim={layout.head_dim}")
    if t > layout.max_seq_len:
        raise ValueError(f"q has {t} tokens, more than max_seq_len={layout.max_seq_len}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
