"""benchmarks/studies/key_scales_sim.py: its quantizers keep their error bounds, its rotation is
orthogonal, and the ordering pallas_kernels/README.md quotes from it holds on fresh draws."""
from __future__ import annotations

import numpy as np

from arena_jax.benchmarks.studies import key_scales_sim as sim


def test_quantizers_err_at_most_half_a_step_and_the_rotation_is_orthogonal():
    rng = np.random.default_rng()
    x = rng.standard_normal((40, sim.HEAD_DIM)) * rng.uniform(0.1, 30, (1, sim.HEAD_DIM))
    step = np.abs(x).max(1, keepdims=True) / 127
    assert np.all(np.abs(sim.per_token(x) - x) <= step / 2 * (1 + 1e-9))
    pages = [np.abs(x[i:i + sim.PAGE]).max(0) / 127 for i in range(0, 40, sim.PAGE)]
    chan_step = np.concatenate([np.broadcast_to(p, x[i * sim.PAGE:(i + 1) * sim.PAGE].shape) for i, p in enumerate(pages)])
    assert np.all(np.abs(sim.per_channel(x) - x) <= chan_step / 2 * (1 + 1e-9))
    kept = sim.dense_and_sparse(x, 2)
    top = np.argsort(-np.abs(x), 1)[:, :2]
    np.testing.assert_array_equal(np.take_along_axis(kept, top, 1), np.take_along_axis(x, top, 1).astype(np.float16))
    rot = sim.hadamard_rotation(rng, sim.HEAD_DIM)
    np.testing.assert_allclose(rot @ rot.T, np.eye(sim.HEAD_DIM), atol=1e-12)


def _mean_errors(rng, trials: int) -> dict[str, float]:
    """Each layout's mean attention error over `trials` draws of 90 tokens, one key channel x20."""
    run = sim.layouts(sim.hadamard_rotation(rng, sim.HEAD_DIM), outliers=1)
    errors = {name: [] for name in run}
    for _ in range(trials):
        q, k, v = (rng.standard_normal((m, sim.HEAD_DIM)) for m in (sim.QUERY_HEADS, 90, 90))
        k[:, rng.integers(sim.HEAD_DIM)] *= 20
        ref = sim.attention(q, k, v)
        for name, f in run.items():
            errors[name].append(np.linalg.norm(f(q, k, v) - ref) / np.linalg.norm(ref))
    return {name: float(np.mean(x)) for name, x in errors.items()}


def test_per_channel_scales_beat_rotation_with_one_outlier_channel_and_values_bound_every_layout():
    e = _mean_errors(np.random.default_rng(), trials=60)  # fresh draws: the ordering
    assert e["int8 per-channel (page)"] < e["int8 per-token + rotation"] < e["int8 per-token"]
    for bits in ("int8", "int4"):
        floor = e[f"{bits} values only"]
        assert all(err > floor for name, err in e.items() if name.startswith(bits) and name != f"{bits} values only")
    assert e["int4 values only"] > 0.0625  # no 4-bit value code reaches the 5% (README)


def test_per_channel_scales_meet_the_int8_goal_on_average():
    """The README's figure, over 200 fixed draws: 0.875% vs 1.18% (single draws can pass 1%)."""
    e = _mean_errors(np.random.default_rng(0), trials=200)
    assert e["int8 per-channel (page)"] < 0.01 < e["int8 per-token + rotation"]
    # static channel factors from the first page, then the rotation (no page requantized): below 1% too
    assert e["int8 smoothed + rotation"] < 0.01
