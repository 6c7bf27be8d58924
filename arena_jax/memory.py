"""Memory kinds: the one place that knows how JAX names host memory and moves arrays there.

Every JAX device carries memories of several kinds (`device.addressable_memories()`): a GPU
has `device` (HBM) and `pinned_host` (page-locked host RAM the GPU reaches by DMA), a CPU
device has `device`, `pinned_host` and `unpinned_host` (all the same DRAM). The host tier
(`arena_jax.host`) keeps its pages in `pinned_host`: DMA-able, so a copy to or from the device
needs no bounce buffer.

Inside `jit` an array moves between kinds with `jax.device_put(x, jax.memory.Space.Host)` (or
`.Device`): JAX 0.10 and 0.11 both take it, inside `shard_map` bodies too (checked on CPU by
tests/test_host_tier.py on both lines). Older JAX spelled it `TransferToMemoryKind`; `_space`
falls back to it. Outside jit, host arrays are placed from numpy with a
`memory_kind="pinned_host"` sharding, so a host tier bigger than device memory never passes
through the device.
"""
from __future__ import annotations

import jax
import numpy as np

__all__ = ["HOST_KIND", "host_memory_kind", "to_host", "to_device", "host_zeros"]

HOST_KIND = "pinned_host"


def host_memory_kind(devices) -> str:
    """`pinned_host` if every device in `devices` has it, else a ValueError naming what they have."""
    for device in devices:
        kinds = sorted({m.kind for m in device.addressable_memories()})
        if HOST_KIND not in kinds:
            raise ValueError(
                f"device {device} has no {HOST_KIND!r} memory (its memories: {kinds}): this backend cannot hold a "
                "host tier"
            )
    return HOST_KIND


def _space(name: str):
    memory = getattr(jax, "memory", None)
    if memory is not None and hasattr(memory, "Space"):
        return getattr(memory.Space, name)
    from jax._src.sharding_impls import TransferToMemoryKind  # JAX before jax.memory.Space

    return TransferToMemoryKind({"Host": HOST_KIND, "Device": "device"}[name])


def to_host(x):
    """Inside jit: `x` moved to host memory (a device -> host copy)."""
    return jax.device_put(x, _space("Host"))


def to_device(x):
    """Inside jit: `x` moved to device memory (a host -> device copy)."""
    return jax.device_put(x, _space("Device"))


def host_zeros(shape: tuple[int, ...], dtype, sharding) -> jax.Array:
    """Zeros placed from numpy straight into the sharding's (host) memory. `np.zeros` is
    allocated lazily by the OS, so the host copy costs nothing until written. (Not
    `jax.make_array_from_callback`: in JAX 0.10 its arrays lose the host memory space in their
    type, and jit then treats them as device arrays.)"""
    return jax.device_put(np.zeros(shape, dtype), sharding)
