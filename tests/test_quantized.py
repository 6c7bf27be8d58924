"""8-bit arenas outside the kernels: the quantization rules and their bounds (against an
independent numpy/ml_dtypes implementation), the geometry and byte counts, and the cache API
(what append accepts, copy-on-write moving scales, stale NaN scales never reaching attention).
Kernels vs references: test_kernels_quantized.py; the whole cache at random:
test_allocator_model.py (it draws 8-bit arenas too)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from cache_model import numpy_quantize
from pallas_kernels.quant import QMAX, dequantize_rows, error_bound
from pallas_kernels.quant import quantize_rows as _quantize_rows

quantize_rows = jax.jit(_quantize_rows, static_argnums=(1, 2))  # one compile per format, not per op

DTYPES = ["int8", "float8_e4m3fn", "float8_e5m2"]
GIB = 2**30


def rows(seed, n=256, d=64):
    """Rows of every magnitude (1e-6 .. 1e6), some with outlier lanes x50, and ties for int8."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * np.exp(rng.uniform(-14, 14, (n, 1)))
    x[::7, :3] *= 50
    return x.astype(np.float32)


@pytest.mark.parametrize("scale_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_within_bound_and_equal_to_an_independent_implementation(dtype, scale_dtype):
    x = rows(1)
    values, scale = quantize_rows(jnp.asarray(x), dtype, scale_dtype)
    want_values, want_scale = numpy_quantize(x, dtype, scale_dtype)
    np.testing.assert_array_equal(np.asarray(values, np.float32), want_values.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(scale, np.float32), want_scale.astype(np.float32))
    back = np.asarray(dequantize_rows(values, scale), np.float64)
    err, bound = np.abs(back - x), error_bound(x, dtype, scale_dtype)
    assert (err <= bound).all(), f"worst error / bound = {(err / bound).max():.3f}"
    # The bound is tight to within a factor 2 somewhere (not vacuous).
    assert (err / bound).max() > 0.5
    stored = np.abs(np.asarray(values, np.float32))
    assert np.isfinite(stored).all() and stored.max() == QMAX[jnp.dtype(dtype)]  # absmax maps to +-QMAX


def test_int8_rounds_half_to_even_and_never_uses_minus_128():
    x = jnp.asarray([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, -127.0, 3.5, 126.5]])  # scale exactly 1
    values, scale = quantize_rows(x, "int8", "float32")
    assert float(scale[0]) == 1.0
    np.testing.assert_array_equal(np.asarray(values[0]), [127, 0, 2, 2, 0, -2, -2, -127, 4, 126])


@pytest.mark.parametrize("dtype", DTYPES)
def test_saturation_zero_rows_and_non_finite_rows(dtype):
    qmax = QMAX[jnp.dtype(dtype)]
    big = float(np.finfo(np.float32).max)
    x = jnp.asarray([
        [0.0, 0.0, -0.0, 0.0],  # zero row: scale 0, exact zeros back
        [1e-30, -2e-30, 0.0, 0.0],  # below 2**-64: stored as zeros, scale 0
        [1.0, np.nan, 2.0, 3.0],  # NaN: scale NaN, the row dequantizes to NaN
        [1.0, -np.inf, 2.0, 3.0],  # inf: the same
        [big, -big, 1.0, 0.0],  # finite extremes: saturate, no inf / NaN
        [3.0, -1.0, 0.25, 2.0],  # an ordinary row, unaffected by its neighbours
    ], jnp.float32)
    for scale_dtype in ("float32", "bfloat16"):  # a bf16 scale rounded down puts |y| past QMAX: clipped
        values, scale = quantize_rows(x, dtype, scale_dtype)
        v, s = np.asarray(values, np.float32), np.asarray(scale, np.float32)
        back = np.asarray(dequantize_rows(values, scale))
        assert (s[:2] == 0).all() and (back[:2] == 0).all() and not np.isnan(back[:2]).any()
        assert np.isnan(s[2:4]).all() and (v[2:4] == 0).all() and np.isnan(back[2:4]).all()
        assert np.isfinite(v).all() and np.abs(v).max() <= qmax and np.isfinite(back[4:]).all()
        np.testing.assert_allclose(back[4, :2], [big, -big], rtol=2**-3)
        np.testing.assert_allclose(back[5], [3.0, -1.0, 0.25, 2.0], rtol=2**-3, atol=3.0 / 254)
    # What the clip prevents: a bare cast past the format's range is NaN (e4m3fn) or inf (e5m2).
    if dtype != "int8":
        assert not np.isfinite(np.float32(jnp.asarray(qmax * 1.2, jnp.float32).astype(dtype)))


# ---- geometry ----------------------------------------------------------------------------------------


MISTRAL_7B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
              "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("dtype,scale_dtype,per_token", [
    ("bfloat16", None, 2 * 32 * 8 * 128 * 2),  # 131,072
    ("int8", None, 2 * 32 * 8 * (128 + 4)),  # 67,584: float32 scales counted
    ("float8_e4m3fn", "bfloat16", 2 * 32 * 8 * (128 + 2)),  # 66,560
    ("float8_e5m2", "float32", 2 * 32 * 8 * (128 + 4)),
])
def test_bytes_per_token_count_the_scales(dtype, scale_dtype, per_token):
    layout = aj.KVLayout.from_hf_config(MISTRAL_7B, budget_bytes=40 * GIB, dtype=dtype, scale_dtype=scale_dtype)
    assert layout.bytes_per_token == per_token
    assert layout.page_bytes == per_token * 16 and layout.num_pages == 40 * GIB // (per_token * 16)
    shapes = jax.eval_shape(lambda: aj.create(layout))  # never allocated
    leaves = [shapes.k, shapes.v] + ([shapes.k_scale, shapes.v_scale] if layout.quantized else [])
    assert sum(x.size * x.dtype.itemsize for x in leaves) == layout.arena_bytes <= 40 * GIB
    assert shapes.layout == layout  # dtype and scale dtype read back from the arrays
    if layout.quantized:
        assert shapes.k_scale.shape == layout.scale_shape == (32, 8, layout.num_pages, 16)
    else:
        assert shapes.k_scale is None and layout.scale_dtype is None


def test_layout_errors():
    base = dict(num_layers=1, num_kv_heads=1, page_size=16, num_pages=4, max_seqs=1, max_pages_per_seq=4)
    with pytest.raises(ValueError, match=r"head_dim \* itemsize = 8\*1 = 8 bytes .* 8-bit arenas need head_dim a multiple of 16"):
        aj.KVLayout(head_dim=8, dtype="int8", **base)
    with pytest.raises(ValueError, match=r"scale_dtype=.float32. applies to quantized \(8-bit, int4\) arenas only"):
        aj.KVLayout(head_dim=16, dtype="bfloat16", scale_dtype="float32", **base)
    with pytest.raises(ValueError, match="scale_dtype=float16 is not supported"):
        aj.KVLayout(head_dim=16, dtype="int8", scale_dtype="float16", **base)
    with pytest.raises(ValueError, match="dtype=uint8 is not supported"):
        aj.KVLayout(head_dim=16, dtype="uint8", **base)
    assert aj.KVLayout(head_dim=16, dtype="int8", **base).scale_dtype == np.dtype("float32")


# ---- the cache API -------------------------------------------------------------------------------------

LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=1, head_dim=16, page_size=4, num_pages=8, max_seqs=3,
                     max_pages_per_seq=4, dtype="int8")


def test_append_refuses_8bit_inputs_and_caches_without_scales():
    cache = aj.create(LAYOUT)  # (the checks run on the host, before anything compiles)
    x = jnp.ones((1, 2, 1, 16), jnp.float32)
    with pytest.raises(ValueError, match="the int8 arena quantizes on write: give k and v in bfloat16, float16 or float32"):
        aj.append(cache, 0, [0], x.astype(jnp.int8), x.astype(jnp.int8))
    with pytest.raises(ValueError, match="k and v dtypes differ"):
        aj.append(cache, 0, [0], x, x.astype(jnp.bfloat16))
    broken = cache.replace(v_scale=None)
    with pytest.raises(ValueError, match="k_scale / v_scale must be present exactly for 8-bit arenas"):
        aj.append(broken, 0, [0], x, x)


def page_rows(cache, slot, layer=0):
    """(values, scales as float32) of a slot's reserved positions at a layer, through its page
    table (8-bit values, or int4 codes with their group scales)."""
    size = cache.layout.page_size
    n = int(cache.table.lengths[slot])
    pos = np.arange(n)
    pages = np.asarray(cache.table.page_map[slot])[pos // size]
    at = (layer, 0, pages, pos % size)
    return np.asarray(cache.k)[at], np.asarray(cache.k_scale, np.float32)[at]


def forked_copy_on_write(layout, rng):
    """Over stale NaN scales, slot 0 writes 6 tokens at both layers; slot 1 forks it and reserves
    3 more (copy-on-write of the half page). Checks that the copy took values and scales and that
    slot 1 reads its 6 written tokens, not the NaN-scaled 3. Returns (cache, v0, s0): slot 0's rows."""
    head_dim = layout.head_dim
    cache = aj.create(layout)
    cache = cache.replace(k_scale=jnp.full_like(cache.k_scale, jnp.nan), v_scale=jnp.full_like(cache.v_scale, jnp.nan))
    kv = jnp.asarray(rng.standard_normal((1, 6, 1, head_dim)) * 3, jnp.float32)
    cache, _ = aj.reserve(cache, [0], 6)
    for layer in (0, 1):
        cache = aj.append(cache, layer, [0], kv, kv)
    cache = aj.fork(cache, [0], [1])  # slot 1 shares both pages, the second half full
    cache, ok = aj.reserve(cache, [1], 3)  # copy-on-write of the half page (scales included)
    assert bool(ok[0]) and aj.health(cache)["cow_copies"] == 1
    v0, s0 = page_rows(cache, 0)
    v1, s1 = page_rows(cache, 1)
    np.testing.assert_array_equal(v1[:6], v0)
    np.testing.assert_array_equal(s1[:6], s0)  # without the copy these would be the stale NaN
    assert np.isfinite(s0).all() and np.isnan(s1[6:]).all()  # reserved, unwritten: still stale
    q = jnp.asarray(rng.standard_normal((2, 1, 2, head_dim)), jnp.float32)
    out = aj.attend(q, cache, 0, [0, 1])  # slot 1 reads its 6 written tokens, not the NaN-scaled 3
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out[1]), np.asarray(aj.attend(q[1:], cache, 0, [0])[0]), rtol=1e-6)
    return cache, v0, s0


def test_copy_on_write_copies_scales_and_stale_nan_scales_are_never_read():
    """`forked_copy_on_write` checks the copy's values, scales and reads; here, that it was a copy:
    slot 1 shares slot 0's full page and got a page of its own for the half one."""
    cache, _, _ = forked_copy_on_write(LAYOUT, np.random.default_rng(0))
    page_map = np.asarray(cache.table.page_map)
    assert page_map[1, 0] == page_map[0, 0] and page_map[1, 1] != page_map[0, 1] and page_map[1, 1] >= 0
