"""How much memory a run needs, checked before anything is allocated.

    limit = memory_limit()                      # Limit(bytes, where) or None
    check_fits({"KV arena": cache_bytes(layout), "weights": weight_bytes(config, dtype)}, hint="...")

The limit is the device's `bytes_limit` (GPU/TPU memory stats) or, on a CPU device (which
has none), the host's physical RAM. `check_fits` refuses a run that needs more than
`FRACTION` of it with a `TooLarge` (a ValueError) giving the bytes needed, per part, and
the bytes available, so the CLIs can print it as a usage error instead of allocating
terabytes and dying with RESOURCE_EXHAUSTED.
"""
from __future__ import annotations

import os
from typing import Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj

__all__ = ["FRACTION", "HOST_BYTES_PER_TOKEN", "Limit", "TooLarge", "memory_limit", "cache_bytes", "weight_bytes",
           "check_fits", "fmt_bytes"]

FRACTION = 0.9  # of the limit a run may plan to use (the rest: activations, XLA scratch, the runtime)
HOST_BYTES_PER_TOKEN = 64  # a token id held in the host's Python lists (list slot + int object), rounded up


class TooLarge(ValueError):
    """A run would need more memory than the device has."""


class Limit(NamedTuple):
    bytes: int
    where: str  # e.g. "this gpu device (NVIDIA H100)", "this cpu device (host RAM)"


def memory_limit(device=None) -> Limit | None:
    device = jax.devices()[0] if device is None else device
    try:
        stats = device.memory_stats() or {}
    except (AttributeError, NotImplementedError, RuntimeError):  # backends without memory stats
        stats = {}
    if stats.get("bytes_limit"):
        return Limit(int(stats["bytes_limit"]), f"this {device.platform} device ({device.device_kind})")
    try:
        return Limit(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), f"this {device.platform} device (host RAM)")
    except (ValueError, OSError, AttributeError):
        return None


def cache_bytes(layout: aj.KVLayout) -> int:
    """Bytes of `aj.create(layout)`: the arena and its page table (traced abstractly, nothing allocated)."""
    shapes = jax.eval_shape(lambda: aj.create(layout))
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))


def weight_bytes(config, dtype) -> int:
    """Parameters of a `models.LlamaConfig` model stored in `dtype`."""
    return config.num_params() * jnp.dtype(dtype).itemsize


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def check_fits(parts: Mapping[str, int], *, hint: str = "", limit: Limit | None = None) -> None:
    """TooLarge when the parts together exceed FRACTION of the memory limit (no limit known: no check)."""
    limit = memory_limit() if limit is None else limit
    if limit is None:
        return
    need = sum(parts.values())
    if need > FRACTION * limit.bytes:
        detail = " + ".join(f"{name} {fmt_bytes(n)}" for name, n in parts.items())
        raise TooLarge(
            f"needs {fmt_bytes(need)} ({need:,} bytes: {detail}), more than {FRACTION:.0%} of the "
            f"{fmt_bytes(limit.bytes)} ({limit.bytes:,} bytes) {limit.where} has{'; ' + hint if hint else ''}"
        )


def host_memory_limit() -> Limit | None:
    """The host's physical RAM (for Python-side lists, whatever the device)."""
    try:
        return Limit(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host (RAM)")
    except (ValueError, OSError, AttributeError):
        return None
