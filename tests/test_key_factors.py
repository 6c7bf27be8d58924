"""Smoothed keys (`KVLayout(smooth_keys=...)`, `arena_jax.key_factors`): the layout's rules and
defaults, the calibration against an independent numpy implementation (`cache_model`), the
factors given to `aj.create` (checked, then fixed: no write changes them), that a hostile first
tenant changes nothing for the next (issue 37), and that smoothing changes nothing where there
is nothing to smooth. The stored bytes through every page op: test_allocator_model.py (int8 and
int4 with smoothed keys); on a data-parallel mesh: sharded_checks.py; the accuracy it buys:
test_bench.py and `arena-bench accuracy`."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from arena_jax import key_factors
from cache_model import numpy_key_factors

LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_size=4, num_pages=8, max_seqs=2, max_pages_per_seq=4,
                     dtype="int8")  # fmt: skip


def test_layout_defaults_and_refusals():
    for dtype in ("int8", "int4", "float8_e4m3fn", "float8_e5m2"):
        layout = dataclasses.replace(LAYOUT, dtype=dtype, smooth_keys=None, rotate_keys=None)
        fp8 = dtype.startswith("float8")  # plain keys by default (they measured better; pallas_kernels/README.md)
        assert layout.smooth_keys == layout.rotate_keys == (not fp8), dtype
        smoothed = dataclasses.replace(layout, smooth_keys=True, rotate_keys=None)
        assert smoothed.rotate_keys, dtype  # smoothed keys are rotated by default in every format
        cache = jax.eval_shape(lambda layout=smoothed: aj.create(layout))
        assert cache.key_factors.shape == (2, 2, 32) and cache.key_factors.dtype == jnp.float32
        assert cache.layout == smoothed
        assert (jax.eval_shape(lambda layout=layout: aj.create(layout)).key_factors is None) == fp8
    fp8 = dataclasses.replace(LAYOUT, dtype="float8_e4m3fn", smooth_keys=False, rotate_keys=None)
    assert not fp8.rotate_keys  # fp8 keys that are not smoothed: rotation off (it raises their error)
    assert jax.eval_shape(lambda: aj.create(fp8)).key_factors is None
    assert dataclasses.replace(LAYOUT, dtype="int8", smooth_keys=False, rotate_keys=None).rotate_keys
    bf16 = dataclasses.replace(LAYOUT, dtype="bfloat16", scale_dtype=None, smooth_keys=None, rotate_keys=None)
    assert not bf16.smooth_keys and jax.eval_shape(lambda: aj.create(bf16)).key_factors is None
    with pytest.raises(ValueError, match="smooth_keys=True applies to quantized"):
        dataclasses.replace(LAYOUT, dtype="bfloat16", scale_dtype=None, smooth_keys=True)
    with pytest.raises(ValueError, match="smooth_keys must be True, False or None"):
        dataclasses.replace(LAYOUT, smooth_keys="yes")
    cache = aj.create(dataclasses.replace(LAYOUT, smooth_keys=True))
    with pytest.raises(ValueError, match="cache.key_factors"):
        aj.append(cache.replace(key_factors=jnp.zeros((2, 2, 16))), 0, jnp.asarray([0]), jnp.zeros((1, 1, 2, 32)),
                  jnp.zeros((1, 1, 2, 32)))  # fmt: skip


def test_calibration_equals_numpy():
    """Thresholds hit exactly (ratios 2, 8, 32 and just below), outliers past the cap, NaN and
    inf lanes (ignored), sparse keys (median 0: factors 1), a head of zeros and one of zeros and
    NaN / inf (0: nothing to calibrate on), and random heads."""
    rng = np.random.default_rng(1)
    k = rng.standard_normal((9, 8, 32)).astype(np.float32)
    k[:, 0] = 1.0
    k[0, 0, :4] = [2.0, 8.0, 32.0, np.nextafter(np.float32(8), np.float32(0))]  # median amax 1: exact thresholds
    k[1, 1, 3] = np.inf
    k[2, 1, 4] = np.nan
    k[:, 2, 16:] = 0.0  # median 0 (the lower one): every factor 1, whatever the other channels hold
    k[:, 3, 7] *= 1e6  # capped at 2 ** MAX_EXPONENT
    k[:, 4, [1, 9, 30]] *= [5.0, 20.0, 50.0]
    k[:, 6] = 0.0
    k[:, 7] = 0.0
    k[0, 7, 1], k[3, 7, 5] = np.nan, -np.inf
    amax = np.where(np.isfinite(k), np.abs(k), 0).max(0)
    got = np.asarray(key_factors.calibrate(jnp.asarray(amax)))
    want = numpy_key_factors(k)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(key_factors.from_keys(k[None]))[0], want)  # [L=1, T, H, D]
    assert want[0, :4].tolist() == [2, 4, 8, 2] and (want[2] == 1).all() and want[3, 7] == 2**key_factors.MAX_EXPONENT
    assert want[4, [1, 9, 30]].tolist() == [2, 4, 8] and not want[6:].any() and (want[:6] >= 1).all()


def test_create_takes_factors_and_refuses_bad_ones():
    """`aj.create(layout, key_factors=)`: the given factors are the cache's, as float32; a
    layout without smoothing, another shape, a factor that is not 0 or a power of two in
    [1, 64], NaN, bools: refused naming key_factors; without them every head is 0 (not
    calibrated, applied as 1)."""
    rng = np.random.default_rng(5)
    k = rng.standard_normal((2, 7, 2, 32)).astype(np.float32)
    k[..., 3] *= 30.0
    given = key_factors.from_keys(k)
    np.testing.assert_array_equal(np.asarray(given)[1], numpy_key_factors(k[1]))
    assert (np.asarray(given)[:, :, 3] >= 4).all()
    cache = aj.create(LAYOUT, key_factors=np.asarray(given, np.float64))
    assert cache.key_factors.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(cache.key_factors), np.asarray(given))
    assert not np.asarray(aj.create(LAYOUT).key_factors).any()
    plain = dataclasses.replace(LAYOUT, smooth_keys=False)
    with pytest.raises(ValueError, match="key_factors given for a layout without smooth_keys"):
        aj.create(plain, key_factors=given)
    bad = np.asarray(given).copy()
    for value, match in ((3.0, "power of two"), (128.0, "power of two"), (0.5, "power of two"), (np.nan, "power of two")):
        bad[1, 0, 7] = value
        with pytest.raises(ValueError, match=rf"key_factors\[1, 0, 7\].*{match}"):
            aj.create(LAYOUT, key_factors=bad)
    with pytest.raises(ValueError, match=r"key_factors must have shape \(2, 2, 32\)"):
        aj.create(LAYOUT, key_factors=np.ones((2, 2, 16), np.float32))
    with pytest.raises(ValueError, match="key_factors must be a float array"):
        aj.create(LAYOUT, key_factors=np.ones((2, 2, 32), bool))
    traced = jax.jit(lambda f: aj.create(LAYOUT, key_factors=f).key_factors)(given)  # inside a user's jit
    np.testing.assert_array_equal(np.asarray(traced), np.asarray(given))


@jax.jit
def _tenants(cache, hostile_k, k, v, q, bad_layer):
    """A hostile first tenant (outlier channels, 3e38 rows, NaN / inf, a rejected write at a
    traced bad layer) writes both layers of slot 0 and is released; the second tenant then
    writes slot 1 and attends. Returns (cache, factors after the first tenant, attention)."""
    slot0, slot1 = jnp.asarray([0], jnp.int32), jnp.asarray([1], jnp.int32)
    cache, _ = aj.reserve(cache, slot0, jnp.asarray([5]))
    for layer in (0, 1):
        cache = aj.append(cache, layer, slot0, hostile_k, hostile_k)
    cache = aj.append(cache, bad_layer, slot0, hostile_k, hostile_k)
    after_first = cache.key_factors
    cache = aj.release(cache, slot0)
    cache, _ = aj.reserve(cache, slot1, jnp.asarray([5]))
    outs = []
    for layer in (0, 1):
        cache = aj.append(cache, layer, slot1, k, v)
        outs.append(aj.attend(q, cache, layer, slot1))
    return cache, after_first, jnp.stack(outs)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_hostile_first_tenant_changes_nothing_for_the_next(dtype):
    """Issue 37: the factors are fixed at create, so a first tenant with outlier keys and 3e38
    rows sets nothing: the next tenant's stored bytes and attention equal a fresh arena's, bit
    for bit, with calibrated factors and without; and the factors never change."""
    rng = np.random.default_rng(6)
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    k = rng.standard_normal((1, 5, 2, 32)).astype(np.float32)
    k[..., 9] *= 20.0
    v = rng.standard_normal((1, 5, 2, 32)).astype(np.float32)
    q = rng.standard_normal((1, 1, 4, 32)).astype(np.float32)
    hostile = rng.standard_normal((1, 5, 2, 32)).astype(np.float32)
    hostile[..., 2] *= 1e4
    hostile[0, 1] = 3e38
    hostile[0, 3, 0, 5], hostile[0, 4, 1, 6] = np.nan, -np.inf
    calibrated = key_factors.from_keys(np.stack([k, k]))  # [2, 2, 32]: channel 9's factor > 1
    assert (np.asarray(calibrated)[:, :, 9] > 1).all()
    for factors in (None, calibrated):
        used, after_first, out = _tenants(aj.create(layout, key_factors=factors), *map(jnp.asarray, (hostile, k, v, q)),
                                          jnp.asarray(7))  # fmt: skip
        want_factors = np.zeros((2, 2, 32), np.float32) if factors is None else np.asarray(factors)
        np.testing.assert_array_equal(np.asarray(after_first), want_factors)
        np.testing.assert_array_equal(np.asarray(used.key_factors), want_factors)
        fresh = aj.create(layout, key_factors=factors)
        fresh, _ = aj.reserve(fresh, jnp.asarray([1]), jnp.asarray([5]))
        want = []
        for layer in (0, 1):
            fresh = aj.append(fresh, layer, jnp.asarray([1]), jnp.asarray(k), jnp.asarray(v))
            want.append(aj.attend(jnp.asarray(q), fresh, layer, jnp.asarray([1])))
        np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.stack(want)))
        page_u, page_f = int(used.table.page_map[1, 0]), int(fresh.table.page_map[1, 0])
        for name in ("k", "v", "k_scale", "v_scale"):
            np.testing.assert_array_equal(np.asarray(getattr(used, name))[:, :, page_u],
                                          np.asarray(getattr(fresh, name))[:, :, page_f], err_msg=name)  # fmt: skip
        assert np.isfinite(np.asarray(out)).all() and np.abs(np.asarray(out)).sum() > 0


def test_health_reports_the_factors():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((2, 5, 2, 32)).astype(np.float32)
    k[1, :, :, 6] *= 12.0  # layer 1: an outlier channel
    k[0] = 0.0  # layer 0: nothing to calibrate on (0)
    given = np.asarray(key_factors.from_keys(k))
    assert (given[1, :, 6] >= 2).all() and given.max() >= 4 and not given[0].any()
    report = aj.health(aj.create(LAYOUT, key_factors=given))
    assert report["key_factor_layers_calibrated"] == 1 and report["key_factor_max"] == given.max()
    assert report["key_channels_smoothed"] == int(np.count_nonzero(given > 1))
    assert aj.health(aj.create(LAYOUT))["key_factor_layers_calibrated"] == 0
    assert "key_factor_max" not in aj.health(aj.create(dataclasses.replace(LAYOUT, smooth_keys=False)))


def test_smoothing_changes_nothing_without_outliers():
    """Keys whose calibrated factors are all 1 (uniform channels), and a cache without factors
    (0: applied as 1): a smoothed int8 arena stores the same bytes and attends to the same
    outputs as one without smoothing, on both backends."""
    rng = np.random.default_rng(3)
    k = rng.uniform(-1, 1, (2, 5, 2, 32)).astype(np.float32)
    k[:, :, :, 0] = 1.0  # every channel's amax is ~1: ratio < 2
    v = rng.standard_normal((2, 5, 2, 32)).astype(np.float32)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float32)
    slots = jnp.asarray([0, 1], jnp.int32)
    outs = {}
    ones = key_factors.from_keys(np.stack([k, k]))
    assert (np.asarray(ones) == 1).all()
    for smooth in (False, True, None):
        for backend in ("reference", "pallas"):
            given = ones if smooth else None
            cache = aj.create(dataclasses.replace(LAYOUT, smooth_keys=smooth is not False), key_factors=given)
            cache, _ = aj.reserve(cache, slots, jnp.asarray([5, 5]))
            cache = aj.append(cache, 0, slots, jnp.asarray(k), jnp.asarray(v), backend=backend)
            outs[smooth, backend] = (np.asarray(cache.k), np.asarray(aj.attend(jnp.asarray(q), cache, 0, slots, backend=backend)))
    for backend in ("reference", "pallas"):
        for smooth in (True, None):
            for a, b in zip(outs[False, backend], outs[smooth, backend]):
                np.testing.assert_array_equal(a, b)


def test_smooth_cost_benchmark_runs(capsys):
    """benchmarks/studies/smooth_cost.py on tiny sizes: both arenas step and the table prints (its
    figures are the benchmark's business, not this test's)."""
    from arena_jax.benchmarks.studies import smooth_cost

    assert smooth_cost.main(["--layers", "1", "--rows", "2", "--context", "16", "--rounds", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "| off |" in out and "| on |" in out and "on / off:" in out
