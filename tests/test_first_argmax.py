"""models.sampling.first_argmax (the greedy choice of every step and of the dense baseline) ==
jnp.argmax on fresh random logits: ties, NaN, +-inf, rows all -inf, float32 / bfloat16, 2-D and
3-D, jitted."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arena_jax.models.sampling import first_argmax


def _logits(rng, shape, dtype, kind):
    x = rng.normal(size=shape).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    rows = rng.choice(flat.shape[0], size=max(1, flat.shape[0] // 2), replace=False)
    cols = rng.integers(0, shape[-1], size=(rows.size, 3))
    if kind == "ties":  # several entries equal to the row's largest value
        for r, c in zip(rows, cols):
            flat[r, c] = flat[r].max() + 1.0
    elif kind == "nan":
        for r, c in zip(rows, cols):
            flat[r, c[:2]] = np.nan
    elif kind == "inf":
        for r, c in zip(rows, cols):
            flat[r, c[0]], flat[r, c[1]], flat[r, c[2]] = np.inf, -np.inf, np.inf
    elif kind == "all -inf":
        flat[rows] = -np.inf
    elif kind == "nan and inf":
        for r, c in zip(rows, cols):
            flat[r, c[0]], flat[r, c[1]] = np.inf, np.nan
    return jnp.asarray(x).astype(dtype)  # bf16 rounding makes more ties still


@pytest.mark.parametrize("kind", ["plain", "ties", "nan", "inf", "all -inf", "nan and inf"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(8, 1000), (3, 4, 257), (1, 7)])
def test_first_argmax_is_argmax(kind, dtype, shape):
    rng = np.random.default_rng([len(kind), len(shape), shape[-1]])
    x = _logits(rng, shape, dtype, kind)
    got = jax.jit(first_argmax)(x)
    assert got.dtype == jnp.int32 and got.shape == shape[:-1]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
