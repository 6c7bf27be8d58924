"""int4 arenas and rotated keys outside the kernels: the int4 quantization rules and their
bounds (against the independent numpy implementation in cache_model), the zero / tiny / NaN /
inf / saturation rules, the rotation's properties (orthogonal, scores unchanged, fixed signs,
outliers spread), and the cache API moving group scales with their values (fork, copy-on-write,
truncate, prefix pages). Kernels vs references: test_kernels_int4.py; the whole cache at random:
test_allocator_model.py (it draws int4 and rotated arenas)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from cache_model import numpy_dequantize4, numpy_quantize4
from test_quantized import forked_copy_on_write, page_rows
from pallas_kernels.quant import dequantize_rows
from pallas_kernels.quant import quantize_rows as _quantize_rows
from pallas_kernels.quant4 import dequantize_groups, error_bound
from pallas_kernels.quant4 import quantize_groups as _quantize_groups
from pallas_kernels.rotation import block_sizes, rotate_rows, rotation, sign_vector

quantize_groups = jax.jit(_quantize_groups, static_argnums=(1,))
quantize_rows = jax.jit(_quantize_rows, static_argnums=(1, 2))


def rows(seed, n=128, d=96):
    """Rows of every magnitude (1e-6 .. 1e6), outlier lanes x50 in some, groups of different ranges."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)) * np.exp(rng.uniform(-14, 14, (n, 1)))
    x[::7, :3] *= 50
    x[::5, 32:64] *= 1e-3  # a quiet group beside loud ones: its own scale keeps its precision
    return x.astype(np.float32)


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float32"])
def test_int4_round_trip_within_bound_and_equal_to_an_independent_implementation(scale_dtype):
    x = rows(1)
    packed, scale = quantize_groups(jnp.asarray(x), scale_dtype)
    want_packed, want_scale = numpy_quantize4(x, scale_dtype)
    np.testing.assert_array_equal(np.asarray(packed), want_packed)
    np.testing.assert_array_equal(np.asarray(scale, np.float32), np.asarray(want_scale, np.float32))
    back = np.asarray(dequantize_groups(packed, scale), np.float64)
    np.testing.assert_allclose(back, numpy_dequantize4(want_packed, want_scale), rtol=2**-23)  # f32 vs f64 product
    err, bound = np.abs(back - x), error_bound(x, scale_dtype)
    assert (err <= bound).all(), f"worst error / bound = {(err / bound).max():.3f}"
    assert (err / bound).max() > 0.5  # the bound is tight to within a factor 2 somewhere
    # Group scales: a quiet group keeps a step set by its own range, not by its loud neighbours.
    quiet = back[::5, 32:64] - x[::5, 32:64]
    assert (np.abs(quiet) <= np.abs(x[::5, 32:64]).max(axis=1, keepdims=True) / 14 * 1.01).all()


def test_int4_zero_tiny_non_finite_and_extreme_rows():
    big = float(np.finfo(np.float32).max)
    x = np.zeros((6, 64), np.float32)
    x[1, :4] = (1e-30, -2e-30, 0.0, 3e-25)  # below 2**-64: stored as zeros, scale 0
    x[2], x[2, 40] = 1.0, np.nan  # NaN in the second group: every group's scale NaN
    x[3], x[3, 0] = 1.0, -np.inf
    x[4, :2], x[4, 32:] = (big, -big), 1.0  # finite extremes: saturate, no inf / NaN
    x[5] = np.linspace(-3, 3, 64)  # an ordinary row, unaffected by its neighbours
    for scale_dtype in ("bfloat16", "float32"):
        packed, scale = quantize_groups(jnp.asarray(x), scale_dtype)
        p, s = np.asarray(packed), np.asarray(scale, np.float32)
        back = np.asarray(dequantize_groups(packed, scale))
        assert (s[:2] == 0).all() and (p[:2] == 0).all() and (back[:2] == 0).all()  # zeros back, exactly
        assert np.isnan(s[2:4]).all() and (p[2:4] == 0).all() and np.isnan(back[2:4]).all()  # the whole row
        assert np.isfinite(s[4:]).all() and np.isfinite(back[4:]).all()
        np.testing.assert_allclose(back[4, :2], [big, -big], rtol=2**-7)
        np.testing.assert_allclose(back[4, 32:], 1.0, rtol=2**-7)
        assert (np.abs(back[5] - x[5]) <= 3 / 14 * 1.01).all()
        codes = np.stack([p & 15, p >> 4], -1)
        assert not ((codes == 8).any())  # -8 is never used (symmetric codes, [-7, 7])


@pytest.mark.parametrize("head_dim", [32, 64, 96, 128, 184, 256])
def test_rotation_is_orthogonal_and_keeps_scores(head_dim):
    m, col_scale = rotation(head_dim)
    r = np.asarray(m, np.float64) * np.asarray(col_scale, np.float64)[None, :]
    np.testing.assert_allclose(r @ r.T, np.eye(head_dim), atol=1e-6)
    assert set(np.unique(m)) <= {-1.0, 0.0, 1.0}
    assert sum(block_sizes(head_dim)) == head_dim and (len(block_sizes(head_dim)) == 1) == (head_dim != 184)
    rng = np.random.default_rng(head_dim)
    q, k = (rng.standard_normal((8, head_dim)).astype(np.float32) for _ in range(2))
    qr, kr = (np.asarray(rotate_rows(jnp.asarray(x)), np.float64) for x in (q, k))
    np.testing.assert_allclose(qr @ kr.T, q.astype(np.float64) @ k.T.astype(np.float64), atol=1e-4)


@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_rotated_keys_quantize_to_the_same_codes_in_one_program(head_dim):
    """Rotation and quantization compiled together (as in an append) give the codes of the
    documented arithmetic: (x @ M) * col_scale rounded to float32, then rint(y * (1 / scale)).
    Keys are multiples of 1/16, so the rotation's sums are exact and a code can only move where
    XLA reorders the scalings: it turned (y * c) * inv into y * (c * inv) in some programs (a
    code off by one at a near-tie, found by the model-based test's soak)."""
    from cache_model import numpy_quantize, numpy_rotation

    x = (np.random.default_rng(head_dim).integers(-32, 33, (8192, 2, head_dim)) / 16).astype(np.float32)
    m, col_scale, _ = numpy_rotation(head_dim)
    rotated = ((x @ m) * col_scale).astype(np.float32)  # exact sums: one rounding, by the column scale
    want_codes, want_scales = numpy_quantize(rotated, "int8")
    codes, scales = jax.jit(lambda k: _quantize_rows(rotate_rows(k), jnp.int8))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(np.asarray(codes), want_codes)


def test_rotation_signs_are_fixed():
    """Arenas store rotated keys: the rotation must mean the same in every process and release
    (pinned values: a change of seed or generator fails here)."""
    assert sign_vector(16).tolist() == [1, -1, -1, -1, -1, -1, 1, -1, -1, -1, -1, -1, 1, -1, -1, -1]
    np.testing.assert_array_equal(sign_vector(8), sign_vector(64)[:8])
    m, _ = rotation(8)
    np.testing.assert_array_equal(m[:, 0], sign_vector(8))  # diag(s) H, H's first column all ones


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_rotation_spreads_outlier_channels(dtype):
    """Keys with 4 outlier channels x20: rotated, quantized, rotated back, they err several
    times less than quantized as they are (the outliers no longer set every other lane's step)."""
    rng = np.random.default_rng(0)
    k = rng.standard_normal((256, 128)).astype(np.float32)
    k[:, [3, 40, 77, 101]] *= 20

    def round_trip(x):
        if dtype == "int4":
            return np.asarray(dequantize_groups(*quantize_groups(jnp.asarray(x), "bfloat16")), np.float64)
        return np.asarray(dequantize_rows(*quantize_rows(jnp.asarray(x), "int8", "float32")), np.float64)

    m, cs = rotation(128)
    inverse = (np.asarray(m, np.float64) * np.asarray(cs, np.float64)[None, :]).T
    plain = np.linalg.norm(round_trip(k) - k)
    rotated = np.linalg.norm(round_trip(np.asarray(rotate_rows(jnp.asarray(k)))) @ inverse - k)
    assert rotated < plain / 2, (rotated, plain)


# ---- the cache API: group scales move with their values ------------------------------------------

LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=1, head_dim=64, page_size=4, num_pages=10, max_seqs=3,
                     max_pages_per_seq=4, dtype="int4")


def test_int4_fork_copy_on_write_truncate_and_prefix_pages_move_group_scales():
    assert LAYOUT.rotate_keys and LAYOUT.scale_shape[-1] == 2  # int4's default: rotated keys; 2 groups
    rng = np.random.default_rng(0)
    cache, v0, s0 = forked_copy_on_write(LAYOUT, rng)  # the copy-on-write moves codes and both groups' scales
    # Truncate slot 1 to 5 tokens, then write 2 new ones there: slot 0's page (shared up to
    # the fork) keeps its codes and scales; slot 1 reads its new token 5 with its own scales.
    cache = aj.truncate(cache, [1], [5])
    new = jnp.asarray(rng.standard_normal((1, 2, 1, 64)), jnp.float32)
    cache, ok = aj.reserve(cache, [1], 2)
    for layer in (0, 1):
        cache = aj.append(cache, layer, [1], new, new)
    np.testing.assert_array_equal(page_rows(cache, 0)[1], s0)
    _, s1 = page_rows(cache, 1)
    np.testing.assert_array_equal(s1[:5], s0[:5])
    assert np.isfinite(s1).all() and not np.array_equal(s1[5], s0[5])
    # Prefix pages: slot 2 made of slot 0's first page (4 tokens) reads exactly slot 0's prefix.
    pages = np.asarray(cache.table.page_map[0])[:1][None, :]
    cache = aj.hold_pages(cache, pages[0], 4)
    cache = aj.fork_pages(cache, jnp.asarray(pages, jnp.int32), jnp.asarray([4], jnp.int32), [2])
    v2, s2 = page_rows(cache, 2)
    np.testing.assert_array_equal(v2, v0[:4])
    np.testing.assert_array_equal(s2, s0[:4])


def test_tpu_kernels_take_rotated_keys_and_refuse_int4():
    """The TPU kernels take an int8 arena rotated (its default; the rotation runs in XLA around
    them: tests/test_kernels_tpu.py compares them with the reference) or not; an int4 arena,
    which they cannot read, is a ValueError naming the dtype when asked for."""
    base = dict(num_layers=1, num_kv_heads=1, head_dim=128, page_size=128, num_pages=2, max_seqs=1, max_pages_per_seq=1)
    from arena_jax.api import _resolve_backend

    for rotate in (None, True, False):
        layout = aj.KVLayout(**base, dtype="int8", rotate_keys=rotate)
        assert _resolve_backend("pallas_tpu", layout, group=1, q_dtype=jnp.float32) == "pallas_tpu"
    q = jnp.zeros((1, 1, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match="backend='pallas_tpu' cannot take this layout: .*int4"):
        aj.attend(q, aj.create(aj.KVLayout(**base, dtype="int4")), 0, [0], backend="pallas_tpu")
