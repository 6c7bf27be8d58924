"""benchmarks/studies/code_bounds.py: the bounds behind issue 20's int4 goal are computed right (Max's
1960 table, the high-rate formula, the arena's own code), and its tables run."""
from __future__ import annotations

import numpy as np
import pytest

from arena_jax.benchmarks.studies import code_bounds as cb
from pallas_kernels import quant4

# J. Max, "Quantizing for minimum distortion" (1960), Table I: mean squared error of the
# optimum N-level quantizer for a unit-variance Gaussian. Its figures are 1960 numerics: exact
# integrals give 0.009501 (16 levels) and 0.002505 (32), 0.04% and 0.23% above its table.
MAX_1960 = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497, 5: 0.002499}


@pytest.mark.parametrize("bits", sorted(MAX_1960))
def test_lloyd_max_matches_max_1960(bits):
    levels, thresholds = cb.lloyd_max(bits)
    assert len(levels) == 2**bits and np.all(np.diff(levels) > 0)
    np.testing.assert_allclose(cb.lloyd_max_mse(levels, thresholds), MAX_1960[bits], rtol=3e-3)
    np.testing.assert_allclose(levels, -levels[::-1], atol=1e-12)  # symmetric


@pytest.mark.parametrize("bits", [3, 5])
def test_lloyd_max_mse_is_the_integral_and_the_code_is_a_fixed_point(bits):
    from scipy.integrate import quad
    levels, thresholds = cb.lloyd_max(bits)
    edges = np.concatenate([[-np.inf], thresholds, [np.inf]])
    pdf = lambda x: np.exp(-x * x / 2) / np.sqrt(2 * np.pi)  # noqa: E731
    integral = sum(quad(lambda x, c=c: (x - c) ** 2 * pdf(x), a, b, epsabs=1e-14)[0]
                   for a, b, c in zip(edges[:-1], edges[1:], levels))
    np.testing.assert_allclose(cb.lloyd_max_mse(levels, thresholds), integral, rtol=1e-9)
    centroids = [quad(lambda x: x * pdf(x), a, b)[0] / quad(pdf, a, b)[0] for a, b in zip(edges[:-1], edges[1:])]
    np.testing.assert_allclose(levels, centroids, atol=1e-9)


def test_one_bit_code_is_the_closed_form():
    levels, thresholds = cb.lloyd_max(1)
    np.testing.assert_allclose(levels, [-np.sqrt(2 / np.pi), np.sqrt(2 / np.pi)], rtol=1e-10)
    np.testing.assert_allclose(cb.lloyd_max_mse(levels, thresholds), 1 - 2 / np.pi, rtol=1e-10)


def test_codes_rank_between_shannon_and_lloyd_max_and_meet_the_high_rate_formula():
    for bits in (3, 4, 5):
        levels, thresholds = cb.lloyd_max(bits)
        shannon, entropy, lloyd = cb.shannon_rms(bits), cb.entropy_coded_rms(bits), np.sqrt(cb.lloyd_max_mse(levels, thresholds))
        assert shannon < entropy < lloyd
    # high rate: an entropy-coded uniform code is sqrt(pi e / 6) (1.53 dB) off Shannon
    np.testing.assert_allclose(cb.entropy_coded_rms(8) / cb.shannon_rms(8), np.sqrt(np.pi * np.e / 6), rtol=5e-3)


def test_measured_codes_agree_with_exact_figures_on_fresh_draws():
    rng = np.random.default_rng()
    x = rng.standard_normal(400_000)
    levels, thresholds = cb.lloyd_max(4)
    measured = np.sqrt(np.mean((cb.quantize_to_levels(x, levels) - x) ** 2))
    np.testing.assert_allclose(measured, np.sqrt(cb.lloyd_max_mse(levels, thresholds)), rtol=0.02)
    rows = rng.standard_normal((2000, 64)) * rng.uniform(0.1, 10, (2000, 1))
    arena = cb.arena_int4(rows)
    assert np.all(np.abs(arena - rows) <= quant4.error_bound(rows))
    # the arena's layout written out in numpy (in the arena's float32 arithmetic) is the arena's code
    # (in float64, a value halfway between two codes once rounded the other way: a CI run saw it)
    np.testing.assert_array_equal(cb.group_absmax(rows, 4), arena)


def test_attention_passes_the_values_error_through():
    rng = np.random.default_rng()
    levels, thresholds = cb.lloyd_max(4)
    values_rms = np.sqrt(cb.lloyd_max_mse(levels, thresholds))
    error = cb.attention_error(rng, lambda v: cb.quantize_to_levels(v, levels), trials=40)
    assert 0.85 * values_rms < error < 1.15 * values_rms, (error, values_rms)


def test_bits_per_element_and_the_capacity_arithmetic():
    assert cb.bits_per_element(4) == 4.5  # 4-bit codes + a bf16 scale per 32 lanes
    assert 32 / (2 * cb.bits_per_element(4)) >= cb.CAPACITY_GOAL > 32 / (cb.bits_per_element(4) + cb.bits_per_element(5))


def test_main_prints_every_table(capsys):
    cb.main(["--draws", "20000", "--trials", "3", "--seed", "1"])
    out = capsys.readouterr().out
    for part in ("1. codes for N(0, 1)", "arena int4", "N(0,1) codebook", "5-bit absmax", "3.56x bf16's tokens", "4.57"):
        assert part in out


def test_main_refuses_bad_counts(capsys):
    with pytest.raises(SystemExit):
        cb.main(["--draws", "0"])
    assert "--draws must be >= 1" in capsys.readouterr().err
