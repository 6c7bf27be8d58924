"""Static per-channel key factors ("smoothed keys", `KVLayout(smooth_keys=True)`).

A few channels of real keys are 10-50x the rest. With one scale per token (int8) or per group
of 32 lanes (int4), those channels set the scale and every other channel gets coarse steps;
the rotation (`pallas_kernels.rotation`) spreads them over the row but keeps their energy.
Dividing each key channel c by a factor f[c] and multiplying the queries' channel c by the
same f[c] leaves every score q . k unchanged and moves the outliers' weight from the stored
keys (quantized) to the queries (never quantized). With f[c] = sqrt(channel amax / median
amax) the product of the two norms, which sets the scores' error, is smallest (SmoothQuant's
alpha = 0.5). `arena-bench accuracy`, 4 key channels x20: int8 + rotation 1.69% -> 0.99% with
smoothing, int4 29% -> 15% (pallas_kernels/README.md, "Smoothed keys").

Rules (the same on every backend: applied in XLA around the kernels and the references):

* `key_factors: f32[num_layers, num_kv_heads, head_dim]`, one per layer, KV head and channel;
  0 = not calibrated (a new cache).
* Calibration, per layer and KV head: the first `append` that stores a nonzero finite key at
  a head sets that head's factors from the tokens it stores (every row and token of that call,
  finite values only; on a data-parallel mesh, all data shards' rows): `amax[c] = max
  |k[..., c]|` and `f[c] = 2 ** e`, e the number of thresholds 2, 8, 32, ...,
  2 ** (2 MAX_EXPONENT - 1) that `amax[c] / median amax` reaches (sqrt of the ratio, rounded
  half up to a power of two, in [1, 2 ** MAX_EXPONENT]; the median is the lower one). A head
  whose median amax is 0 but not every amax (sparse keys) gets f = 1. A write that stores no
  token at a head, or only zeros (a warm-up with zero keys), or only NaN / inf, leaves it
  uncalibrated: such keys are stored as zeros / NaN rows whatever the factors, so a later
  write may still calibrate the head (a warm-up must not switch smoothing off for good).
  Once set, later appends, at any slot, never change them: every stored key of a head was
  divided by the same factors, so pages can be shared, forked, swapped to the host and back
  without knowing them.
* Powers of two: dividing a key and multiplying a query by one is exact in every float dtype
  (outside the subnormal range), so smoothing adds no rounding of its own and scores are
  unchanged. `MAX_EXPONENT` = 6 (f <= 64) keeps an fp16 query finite up to |q| <= 1023.
* Values are not smoothed (attention's output is linear in them: their scale is per token).
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

__all__ = ["MAX_EXPONENT", "calibrate", "update", "usable", "smooth_keys", "smooth_queries"]

MAX_EXPONENT = 6


def calibrate(amax):
    """f32[..., D] channel absmax (finite, >= 0) -> f32[..., D] factors: 2**e, e = how many of
    the thresholds 2, 8, 32, ... 2**(2 MAX_EXPONENT - 1) the ratio amax / median reaches
    (sqrt(ratio) rounded half up to a power of two, by exact comparisons); 0 (not calibrated)
    where every amax of the row is 0. The median is the lower one (element (D - 1) // 2 of the
    sorted amax: no arithmetic, so any implementation finds the same)."""
    amax = amax.astype(jnp.float32)
    median = jnp.sort(amax, axis=-1)[..., (amax.shape[-1] - 1) // 2][..., None]
    ok = jnp.isfinite(median) & (median > 0)
    ratio = jnp.where(ok, amax / jnp.where(ok, median, 1.0), 1.0)
    thresholds = 2.0 ** (2 * jnp.arange(1, MAX_EXPONENT + 1, dtype=jnp.float32) - 1)  # 2, 8, 32, ...
    exponent = jnp.sum(ratio[..., None] >= thresholds, axis=-1)
    seen = jnp.any(amax > 0, axis=-1, keepdims=True)  # a nonzero finite key: something to calibrate on
    return jnp.where(seen, jnp.left_shift(1, exponent).astype(jnp.float32), 0.0)


def update(factors, layer_ok, layer, k, stored, reduce_max: Callable | None = None):
    """The cache's factors after an append at `layer` (clipped into range; `layer_ok` False:
    unchanged) of k [B, T, H, D], of which `stored` bool[B, T] are written. A calibrated head
    keeps its factors; an uncalibrated one takes them from the stored tokens (still 0 if they
    hold no nonzero finite key). `reduce_max`: combines the per-shard absmax [H, D] over data
    shards."""
    current = factors[layer]  # [H, D]
    finite = jnp.isfinite(k) & stored[:, :, None, None]
    amax = jnp.max(jnp.where(finite, jnp.abs(k.astype(jnp.float32)), 0.0), axis=(0, 1))  # [H, D]
    if reduce_max is not None:
        amax = reduce_max(amax)
    keep = ~layer_ok | jnp.any(current > 0, axis=-1, keepdims=True)  # [H, 1]
    return factors.at[layer].set(jnp.where(keep, current, calibrate(amax)))


def usable(layer_factors):
    """[H, D] stored factors -> the ones to apply (1 where the layer is not calibrated yet)."""
    return jnp.where(layer_factors > 0, layer_factors, 1.0)


def smooth_keys(k, layer_factors):
    """k [B, T, H, D] / factors [H, D], exact, in k's dtype."""
    return k * (1.0 / usable(layer_factors)).astype(k.dtype)


def smooth_queries(q, layer_factors):
    """q [B, T, Hq, D] * factors of each query head's KV head (GQA: Hq / H per group), exact."""
    f = usable(layer_factors)
    return q * jnp.repeat(f, q.shape[2] // f.shape[0], axis=0).astype(q.dtype)
