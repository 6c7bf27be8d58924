"""`fingerprint(model)`: a short id of what a model computes, for binding a prefix index to it.

A prefix index (`arena_jax.PrefixCache`) maps token ids to pages of K/V; those K/V are only
valid for the model that wrote them. `models.generate` tags each index with this fingerprint
and refuses to continue an index under another one.

What it hashes: the model's class, config (a frozen dataclass: its repr) and compute dtype,
and per weight its path, shape, dtype and 64 values sampled evenly across it, bit for bit.
Sampling keeps it cheap (one small jitted gather and one transfer, whatever the model's size)
and exact (no float reductions whose rounding could differ across meshes). Two models whose
weights differ everywhere (another checkpoint, a fine-tune) get different fingerprints; two
that differ only between the sampled positions would not, so a user who patches single
weights should give the index a tag of their own (`PrefixCache(layout, tag=...)`).
"""
from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arena_jax.models.scheduler.readback import fetch  # gathers from every process of a multi-host mesh

__all__ = ["fingerprint"]

SAMPLES = 64  # values sampled per weight


@jax.jit
def _samples(leaves):
    out = []
    for x in leaves:
        flat = x.reshape(-1)
        idx = jnp.linspace(0, flat.shape[0] - 1, min(SAMPLES, flat.shape[0])).astype(jnp.int32)
        out.append(flat[idx])
    return out


def fingerprint(model) -> str:
    """A hex digest of the model's class, config, dtype and sampled weights (module docstring)."""
    state = nnx.state(model, nnx.Param)
    paths_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    h = hashlib.sha256()
    h.update(f"{type(model).__qualname__}|{getattr(model, 'config', None)!r}|{getattr(model, 'dtype', None)}".encode())
    leaves = [leaf for _, leaf in paths_leaves]
    sampled = fetch(*_samples(leaves)) if leaves else []
    for (path, leaf), values in zip(paths_leaves, sampled):
        h.update(f"{jax.tree_util.keystr(path)}|{tuple(leaf.shape)}|{leaf.dtype}".encode())
        h.update(np.ascontiguousarray(values).tobytes())
    return h.hexdigest()[:16]
