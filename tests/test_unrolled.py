"""arena_jax.unrolled: short integer / flag reductions folded by elementwise ops equal jnp's, bit for
bit, on fresh random data; long or empty axes take XLA's reduction; the decode step's in-place
bookkeeping holds no reducer computation (issue 39, item 3)."""
from __future__ import annotations

import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arena_jax import unrolled

# (shape, axis): short axes (folded), a tuple of axes, None, a long axis (alone or beside a short one)
# and an empty one (those two: XLA's reductions).
CASES = [((5,), 0), ((4, 6), 1), ((4, 6), 0), ((3, 1, 4, 21), (0, 2)), ((2, 3), None), ((2, 40), 1), ((20, 3, 4), (0, 2)), ((0, 3), 0),
         ((3, 0), 1), ((7,), -1)]  # fmt: skip


def _rng():
    seed = int(np.random.SeedSequence().entropy % 2**32)
    return seed, np.random.default_rng(seed)


@pytest.mark.parametrize("shape,axis", CASES)
def test_each_fold_equals_jnps_reduction_on_random_data(shape, axis):
    seed, rng = _rng()
    ints = jnp.asarray(rng.integers(-(2**31), 2**31 - 1, size=shape, dtype=np.int64).astype(np.int32))  # sums wrap alike
    flags = jnp.asarray(rng.random(shape) < rng.random())
    small = jnp.asarray(rng.integers(-100, 100, size=shape).astype(np.int8))
    pairs = [
        (unrolled.small_sum(ints, axis), jnp.sum(ints, axis)),
        (unrolled.small_sum(flags, axis), jnp.sum(flags, axis)),
        (unrolled.small_sum(small, axis), jnp.sum(small, axis, dtype=jnp.int32)),
        (unrolled.small_sum(flags, axis, dtype=jnp.int32), jnp.sum(flags, axis, dtype=jnp.int32)),
        (unrolled.small_all(flags, axis), jnp.all(flags, axis)),
    ]
    if 0 not in shape:  # the min of nothing is an error in jnp too
        pairs.append((unrolled.small_min(ints, axis), jnp.min(ints, axis)))
    if isinstance(axis, int):
        pairs += [(unrolled.small_cumsum(ints, axis), jnp.cumsum(ints, axis)),
                  (unrolled.small_cumsum(flags, axis), jnp.cumsum(flags, axis, dtype=jnp.int32))]  # fmt: skip
    for i, (got, want) in enumerate(pairs):
        assert got.dtype == want.dtype and got.shape == want.shape, f"seed {seed}, case {i}: {got.dtype}{got.shape}"
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}, case {i}")


def test_floats_are_refused_by_the_sums():
    with pytest.raises(TypeError, match="integer or bool"):
        unrolled.small_sum(jnp.ones(4))
    with pytest.raises(TypeError, match="integer or bool"):
        unrolled.small_cumsum(jnp.ones(4))


def _reductions(fn, x) -> int:
    return len(re.findall(r"stablehlo\.reduce(_window)?\b", jax.jit(fn).lower(x).as_text()))


def test_short_axes_fold_and_long_ones_reduce():
    short, long = jnp.ones((4, 8), jnp.int32), jnp.ones((4, unrolled.UNROLL_LIMIT + 1), jnp.int32)
    for fn in (lambda x: unrolled.small_sum(x, 1), lambda x: unrolled.small_min(x, 1),
               lambda x: unrolled.small_all(x > 0, 1), lambda x: unrolled.small_cumsum(x, 1)):  # fmt: skip
        assert _reductions(fn, short) == 0
        assert _reductions(fn, long) == 1


def test_the_decode_steps_in_place_bookkeeping_has_no_reducer_computation():
    """Outside `reserve`'s allocator branch, the tiny decode step's `reserve`, plan and counters
    run no XLA reduction (each would be a kernel a step and buffer entries a call): every
    `to_apply` left in the compiled step is the model's, attention's, append's scatters or the
    allocator branch's."""
    from flax import nnx

    import arena_jax as aj
    from arena_jax import allocator, models

    model = models.init_random(models.LlamaConfig.tiny(), seed=0)
    graphdef, state = nnx.split(model)
    cache = aj.create(models.default_layout(model, 4, 64, page_size=8))
    tokens, slots = jnp.zeros((4,), jnp.int32), jnp.arange(4, dtype=jnp.int32)
    jax.clear_caches()
    with mock.patch.object(allocator, "RESERVE_KERNEL", False):  # reserve as XLA's ops (a TPU's; the kernels' reference)
        text = models.decode_step.lower(graphdef, state, cache, tokens, slots).compile().as_text()
    jax.clear_caches()
    names = [re.search(r'op_name="([^"]*)"', line) for line in text.splitlines() if "to_apply=" in line]
    bookkeeping = [m.group(1) for m in names if m and ("jit(_plan)" in m.group(1) or "jit(_reserve)" in m.group(1))
                   and "cond/branch" not in m.group(1) and not m.group(1).endswith("scatter")]  # fmt: skip
    assert bookkeeping == []
    assert any("cond/branch" in m.group(1) for m in names if m)  # the allocator branch keeps its reductions
