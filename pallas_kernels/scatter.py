"""`set_at`: `x.at[index].set(values, mode="drop")` for the arena's in-place writes, with a
workaround for XLA CPU in jaxlib 0.10.

XLA's CPU backend in jaxlib 0.10 has no bfloat16 (nor 8-bit float) scatter or
dynamic-update-slice: its float normalization converts the WHOLE operand to float32, updates
and converts back, so a one-token append to a bf16 arena costs the arena's size (measured,
8 layers x 1 token of 8 rows into a 64k-token bf16 arena: 801 ms per step, float16 0.12 ms;
int4's bf16 scales alike). jaxlib 0.11's CPU backend updates bf16 in place (0.07 ms).

Where the backend upcasts (`upcasts(dtype)`: probed once per dtype by compiling a tiny
scatter and looking for the float32 copy in its HLO, not by version), a set, which does no
arithmetic, goes through the unsigned integers of the same width (`lax.bitcast_convert_type`)
and comes back bit for bit. XLA CPU materializes those bitcasts as copies, so the cost still
follows the arena's size, 7x less (111 ms in the case above): on jaxlib 0.10 a bf16 arena on
CPU pays it (float32 / float16 arenas do not; benchmarks/RESULTS.md). Elsewhere (GPU, TPU,
jaxlib >= 0.11 on CPU) it is the plain scatter.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["set_at", "upcasts"]

_BITS = {1: jnp.uint8, 2: jnp.uint16}


def upcasts(dtype, platform: str | None = None) -> bool:
    """Whether the backend lowered for scatters into a `dtype` array by converting all of it
    (bf16 to float32, the 8-bit floats to float16 on jaxlib 0.10's CPU backend). The backend
    lowered for is `platform`, by default the default device's (`tpu.common.target_platform`: a
    deviceless TPU compile on a CPU host names a TPU device), so a TPU program never takes the
    CPU's workaround."""
    from pallas_kernels.tpu.common import target_platform

    return _upcasts(jnp.dtype(dtype), platform or target_platform())


@functools.lru_cache(maxsize=None)
def _upcasts(dtype, platform: str) -> bool:
    if platform != "cpu" or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize not in _BITS:
        return False
    sds = jax.ShapeDtypeStruct
    probe = jax.jit(lambda a, i, v: a.at[i].set(v, mode="drop"))
    hlo = probe.lower(sds((64, 8), dtype), sds((1,), jnp.int32), sds((1, 8), dtype)).compile().as_text()
    return re.search(r"= \w+\[64,8\]\S* convert\(", hlo) is not None  # the operand converted whole


def set_at(x, index, values):
    """`x.at[index].set(values.astype(x.dtype), mode="drop")`, bit for bit, through same-width
    unsigned integers where the backend would upcast the whole of `x` (module docstring)."""
    dtype = jnp.dtype(x.dtype)
    values = jnp.asarray(values).astype(dtype)
    if not upcasts(dtype):
        return x.at[index].set(values, mode="drop")
    bits = _BITS[dtype.itemsize]
    out = lax.bitcast_convert_type(x, bits).at[index].set(lax.bitcast_convert_type(values, bits), mode="drop")
    return lax.bitcast_convert_type(out, dtype)
