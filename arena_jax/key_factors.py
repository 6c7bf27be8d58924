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

* `key_factors: f32[num_layers, num_kv_heads, head_dim]`, one per layer, KV head and channel,
  **fixed when the cache is created** (`aj.create(layout, key_factors=...)`) and never changed
  by any op: what a key is stored as depends only on that key, never on which requests came
  first (an earlier design calibrated each head on its first write, so a first tenant's keys,
  or the order a scheduler wrote rows in, set every later tenant's quantization: issue 37).
  A cache created without factors holds 0 (not calibrated), applied as 1: no smoothing.
* Where factors come from: `from_keys(keys)` calibrates on sample keys a caller gives (a
  calibration pass before serving); `models.calibrate_key_factors(model)` runs the model over
  a fixed built-in sample (or the caller's tokens), which `models.generate` does when it
  creates a smoothed arena. Per layer and KV head: `amax[c] = max |k[..., c]|` over the
  sample's finite values and `f[c] = 2 ** e`, e the number of thresholds 2, 8, 32, ...,
  2 ** (2 MAX_EXPONENT - 1) that `amax[c] / median amax` reaches (sqrt of the ratio, rounded
  half up to a power of two, in [1, 2 ** MAX_EXPONENT]; the median is the lower one). A head
  whose median amax is 0 but not every amax (sparse keys) gets f = 1; a head whose sample
  keys are all zero (or not finite) gets 0 (not calibrated: 1).
* Every stored key of a head was divided by the same factors, so pages can be shared, forked,
  swapped to the host and back without knowing them (a host tier records its cache's factors
  and is refused by another cache).
* Powers of two: dividing a key and multiplying a query by one is exact in every float dtype
  (outside the subnormal range), so smoothing adds no rounding of its own and scores are
  unchanged. `MAX_EXPONENT` = 6 (f <= 64) keeps an fp16 query finite up to |q| <= 1023.
* Values are not smoothed (attention's output is linear in them: their scale is per token).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_EXPONENT", "calibrate", "from_keys", "check", "usable", "smooth_keys", "smooth_queries"]

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


def from_keys(keys):
    """Sample keys [num_layers, ..., num_kv_heads, head_dim] (any tokens, rows and batches in
    between; as the model computes them, before smoothing or rotation) -> f32[num_layers,
    num_kv_heads, head_dim] factors for `aj.create(layout, key_factors=...)`. NaN / inf values
    are ignored; a head with no nonzero finite key gets 0 (not calibrated: no smoothing)."""
    keys = jnp.asarray(keys)
    if keys.ndim < 3:
        raise ValueError(f"keys must be [num_layers, ..., num_kv_heads, head_dim], got shape {keys.shape}")
    k = keys.astype(jnp.float32).reshape(keys.shape[0], -1, *keys.shape[-2:])
    amax = jnp.max(jnp.where(jnp.isfinite(k), jnp.abs(k), 0.0), axis=1)  # [L, H, D]
    return calibrate(amax)


def check(factors, shape: tuple[int, ...]) -> np.ndarray:
    """Host check of factors given to `aj.create`: f32 `shape` ([num_layers, num_kv_heads,
    head_dim]), each 0 (not calibrated) or a power of two in [1, 2 ** MAX_EXPONENT]. Returns
    them as a float32 numpy array; a ValueError names `key_factors` and the rule otherwise."""
    try:
        f = np.asarray(factors)
    except Exception as e:  # a donated / deleted array, or not array-like
        raise ValueError(f"key_factors must be an array of shape {shape}: {e}") from None
    if f.dtype == np.bool_ or not (np.issubdtype(f.dtype, np.floating) or np.issubdtype(f.dtype, np.integer)):
        raise ValueError(f"key_factors must be a float array of shape {shape}, got dtype {f.dtype}")
    if tuple(f.shape) != tuple(shape):
        raise ValueError(f"key_factors must have shape {tuple(shape)} [num_layers, num_kv_heads, head_dim], got {f.shape}")
    f = f.astype(np.float32)
    allowed = np.asarray([0.0] + [2.0 ** e for e in range(MAX_EXPONENT + 1)], np.float32)
    bad = ~np.isin(f, allowed)
    if bad.any():
        at = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"key_factors{list(at)}={f[at]!r}: each factor must be 0 (not calibrated) or a power of two "
                         f"in [1, {2 ** MAX_EXPONENT}] (arena_jax.key_factors.from_keys makes them)")
    return f


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
