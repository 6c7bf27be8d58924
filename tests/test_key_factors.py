"""Smoothed keys (`KVLayout(smooth_keys=...)`, `arena_jax.key_factors`): the layout's rules and
defaults, the calibration against an independent numpy implementation (`cache_model`), that a
layer's factors are fixed by its first stored tokens (and by nothing else: rejected rows, dead
positions, other layers, traced bad layers), that a warm-up of zero keys leaves them to the
first real keys, and that smoothing changes nothing where there is nothing to smooth. The stored bytes through every page op: test_allocator_model.py (int8 and
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
    assert want[0, :4].tolist() == [2, 4, 8, 2] and (want[2] == 1).all() and want[3, 7] == 2**key_factors.MAX_EXPONENT
    assert want[4, [1, 9, 30]].tolist() == [2, 4, 8] and not want[6:].any() and (want[:6] >= 1).all()


@jax.jit
def _writes(cache, k, bad_layer):
    """Layer 1: a write dropped (its slots have no reservation), one with a traced out-of-range
    layer (rejected), then the first stored tokens (row 0: 3 of 5 tokens; the rest carry 1e6), then
    another write whose outlier channel must change nothing."""
    slots = jnp.asarray([0, 1], jnp.int32)
    cache = aj.append(cache, 1, slots, k, k, num_tokens=jnp.asarray([5, 5]))  # nothing reserved: dropped
    before = cache.key_factors
    cache, _ = aj.reserve(cache, slots, jnp.asarray([8, 0]))
    cache = aj.append(cache, bad_layer, slots, k, k, num_tokens=jnp.asarray([5, 0]))  # rejected row
    cache = aj.append(cache, 1, slots, k, k, num_tokens=jnp.asarray([3, 0]))
    first = cache.key_factors
    cache = aj.append(cache, 1, slots, 100 * k, k, num_tokens=jnp.asarray([5, 0]))
    return cache, before, first


def test_factors_are_fixed_by_the_first_stored_tokens():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((2, 5, 2, 32)).astype(np.float32)
    k[0, :3, :, 6] *= 12.0  # an outlier channel in the stored tokens
    k[0, 3:] = 1e6  # dead positions of row 0, and row 1 (num_tokens 0), must not count
    k[1] = -1e6
    cache = aj.create(LAYOUT)
    cache, before, first = _writes(cache, jnp.asarray(k), jnp.asarray(7))
    assert not np.asarray(before).any(), "a refused write calibrated"
    want = numpy_key_factors(k[0, :3])
    assert want[:, 6].tolist() == [4, 4] and (want == 1).mean() > 0.8
    np.testing.assert_array_equal(np.asarray(first)[1], want)
    np.testing.assert_array_equal(np.asarray(cache.key_factors)[1], want)  # later writes keep them
    assert not np.asarray(cache.key_factors)[0].any()  # layer 0: never written, not calibrated
    assert int(cache.stats.dropped_writes) == 2 and int(cache.stats.rejected_rows) == 2  # the bad layer: both rows
    assert int(cache.table.written[1, 0]) == 8
    report = aj.health(cache)
    assert report["key_factor_layers_calibrated"] == 1 and report["key_factor_max"] == 4.0
    assert report["key_channels_smoothed"] == int(np.count_nonzero(want > 1))
    assert "key_factor_max" not in aj.health(aj.create(dataclasses.replace(LAYOUT, smooth_keys=False)))


@jax.jit
def _warm_up_then_serve(cache, zeros, k, v, q):
    """Slot 0 writes zero keys at layer 0 (a warm-up; head 1 also gets a NaN row), is released;
    slot 1 then writes real keys and attends."""
    slots = jnp.asarray([0], jnp.int32)
    cache, _ = aj.reserve(cache, slots, jnp.asarray([5]))
    cache = aj.append(cache, 0, slots, zeros, zeros)
    after_warm_up = cache.key_factors
    cache = aj.release(cache, slots)
    slots = jnp.asarray([1], jnp.int32)
    cache, _ = aj.reserve(cache, slots, jnp.asarray([5]))
    cache = aj.append(cache, 0, slots, k, v)
    return cache, after_warm_up, aj.attend(q, cache, 0, slots)


def test_a_warm_up_with_zero_keys_leaves_the_factors_to_the_first_real_keys():
    """Zero keys (NaN / inf rows too) tell nothing about a head's channels and are stored the
    same whatever the factors: a warm-up that writes them leaves the heads uncalibrated, and
    the first real keys calibrate them as on a fresh cache, with the same stored bytes and
    attention (a head calibrated once keeps its factors: test above)."""
    rng = np.random.default_rng(4)
    k = rng.standard_normal((1, 5, 2, 32)).astype(np.float32)
    k[..., 9] *= 20.0
    v = rng.standard_normal((1, 5, 2, 32)).astype(np.float32)
    q = rng.standard_normal((1, 1, 4, 32)).astype(np.float32)
    zeros = np.zeros_like(k)
    zeros[0, 2, 1, 3] = np.nan  # head 1: zeros and a NaN row
    warm, after_warm_up, out = _warm_up_then_serve(aj.create(LAYOUT), *map(jnp.asarray, (zeros, k, v, q)))
    assert not np.asarray(after_warm_up).any(), "a warm-up of zero keys calibrated a head"
    want = numpy_key_factors(k[0])
    assert (want[:, 9] >= 4).all() and (want == 1).mean() > 0.5
    np.testing.assert_array_equal(np.asarray(warm.key_factors)[0], want)
    fresh = aj.create(LAYOUT)
    fresh, _ = aj.reserve(fresh, jnp.asarray([1]), jnp.asarray([5]))
    fresh = aj.append(fresh, 0, jnp.asarray([1]), jnp.asarray(k), jnp.asarray(v))
    page_w, page_f = int(warm.table.page_map[1, 0]), int(fresh.table.page_map[1, 0])
    np.testing.assert_array_equal(np.asarray(warm.k)[0, :, page_w], np.asarray(fresh.k)[0, :, page_f])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(aj.attend(jnp.asarray(q), fresh, 0, jnp.asarray([1]))))


def test_smoothing_changes_nothing_without_outliers():
    """Keys whose calibrated factors are all 1 (uniform channels): a smoothed int8 arena stores
    the same bytes and attends to the same outputs as one without smoothing, on both backends."""
    rng = np.random.default_rng(3)
    k = rng.uniform(-1, 1, (2, 5, 2, 32)).astype(np.float32)
    k[:, :, :, 0] = 1.0  # every channel's amax is ~1: ratio < 2
    v = rng.standard_normal((2, 5, 2, 32)).astype(np.float32)
    q = rng.standard_normal((2, 1, 4, 32)).astype(np.float32)
    slots = jnp.asarray([0, 1], jnp.int32)
    outs = {}
    for smooth in (False, True):
        for backend in ("reference", "pallas"):
            cache = aj.create(dataclasses.replace(LAYOUT, smooth_keys=smooth))
            cache, _ = aj.reserve(cache, slots, jnp.asarray([5, 5]))
            cache = aj.append(cache, 0, slots, jnp.asarray(k), jnp.asarray(v), backend=backend)
            outs[smooth, backend] = (np.asarray(cache.k), np.asarray(aj.attend(jnp.asarray(q), cache, 0, slots, backend=backend)))
            if smooth:
                assert (np.asarray(cache.key_factors)[0] == 1).all()
    for backend in ("reference", "pallas"):
        for a, b in zip(outs[False, backend], outs[True, backend]):
            np.testing.assert_array_equal(a, b)


def test_smooth_cost_benchmark_runs(capsys):
    """benchmarks/smooth_cost.py on tiny sizes: both arenas step and the table prints (its
    figures are the benchmark's business, not this test's)."""
    from benchmarks import smooth_cost

    assert smooth_cost.main(["--layers", "1", "--rows", "2", "--context", "16", "--rounds", "2", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "| off |" in out and "| on |" in out and "on / off:" in out
