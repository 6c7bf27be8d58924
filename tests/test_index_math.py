"""`pallas_kernels.index_math` (unsigned page arithmetic) == jnp's `//` and `%` on fresh random
non-negative values, every page size kind (1, powers of two, others), int32 extremes included."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.index_math import ceil_div_nonneg, div_nonneg, rem_nonneg


@pytest.mark.parametrize("b", [1, 3, 8, 16, 48, 256, 1000])
def test_equal_to_floor_division_on_non_negative_values(b):
    rng = np.random.default_rng(b)
    a = np.concatenate([rng.integers(0, 2**31 - b, 500), [0, 1, b - 1, b, b + 1, 2**31 - b]]).astype(np.int32)
    got_div, got_rem, got_ceil = jax.jit(lambda x: (div_nonneg(x, b), rem_nonneg(x, b), ceil_div_nonneg(x, b)))(a)
    np.testing.assert_array_equal(got_div, a // b)
    np.testing.assert_array_equal(got_rem, a % b)
    np.testing.assert_array_equal(got_ceil, -(-a.astype(np.int64) // b))
    assert got_div.dtype == got_rem.dtype == got_ceil.dtype == jnp.int32
