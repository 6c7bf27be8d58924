"""Issue 37: greedy tokens do not depend on scheduling or on earlier tenants, for float, int8
and int4 arenas (smoothed + rotated keys, their defaults).

A smoothed arena's key factors are fixed when the cache is created (`models.generate`
calibrates them over the model before any request: `models.key_calibration`), so a key is
stored the same whichever request wrote it first and however the scheduler batched it. Drawn
workloads (prompts of 1-11 tokens, some sharing a prefix) x arena dtypes x scheduling modes
(batch sizes, mixed steps, decode blocks on and off, a prefix cache, a host tier: swap
preemption and a spill tier, an arena tight enough to preempt) give exactly the tokens of the
plainest schedule (separate prefills, one decode step per call). Before the fix, the first
write calibrated the factors: mixed steps and separate prefills gave other tokens within a
few dozen draws (3 of 24 int4 pairs)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arena_jax as aj
from arena_jax import models

NEW = 12
DTYPES = ("float32", "int8", "int4")
# A tight arena: two rows of up to 11 + 12 tokens need 12 pages of 4 and it has 10 (preemption).
LAYOUTS = {d: aj.KVLayout(2, 2, 32, 4, 10, 2, 8, d) for d in DTYPES}
# The plainest schedule: separate prefills, one decode step per call (the decode program is the
# same as the blocks', so the modes below compile only what they add).
REFERENCE = dict(batch_size=2, decode_block=1)
MODES = {
    "one row at a time": dict(batch_size=1, decode_block=1),
    "decode blocks": dict(batch_size=2),
    "mixed steps": dict(batch_size=2, mixed_steps=True),
    "prefix cache": dict(batch_size=2, prefix_cache=True),
    "host tier (swap)": dict(batch_size=2, host_pages=8),
    "prefix cache + host tier + mixed steps": dict(batch_size=2, prefix_cache=True, host_pages=4, mixed_steps=True),
}
_REFERENCE_TOKENS: dict = {}


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.presets.tiny(head_dim=32), seed=0)


def _run(model, prompts, dtype, **mode):
    return models.generate(model, prompts, NEW, layout=LAYOUTS[dtype], chunk_size=4, stop_tokens=(), **mode)


@st.composite
def workloads(draw):
    shared = draw(st.lists(st.integers(0, 127), min_size=0, max_size=6))
    prompts = []
    for _ in range(draw(st.integers(2, 4))):
        own = draw(st.lists(st.integers(0, 127), min_size=1, max_size=5))
        prompts.append((shared if draw(st.booleans()) else []) + own)
    return prompts


@pytest.mark.timeout(600)  # ~70-90 s of CPU unloaded: 4x that passes the global 300 s (docs/testing.md, "Timeouts")
@settings(max_examples=10)
@given(work=workloads(), dtype=st.sampled_from(DTYPES), mode=st.sampled_from(sorted(MODES)))
def test_tokens_do_not_depend_on_the_schedule(model, work, dtype, mode):
    key = (dtype, str(work))
    if key not in _REFERENCE_TOKENS:
        _REFERENCE_TOKENS[key] = _run(model, work, dtype, **REFERENCE).tokens
    got = _run(model, work, dtype, **MODES[mode])
    assert got.tokens == _REFERENCE_TOKENS[key], f"{dtype}, {mode}"
    assert aj.health(got.cache)["active_sequences"] == 0


def test_generate_calibrates_before_any_request(model):
    """A smoothed arena made by generate carries the model's calibrated factors (the same for
    any prompts: nothing written changes them); a float arena has none."""
    want = models.calibrate_key_factors(model)
    assert want.shape == (2, 2, 32) and (want >= 1).all()
    for prompts in ([[5, 6, 7]], [[1] * 9, [100, 3]]):
        cache = _run(model, prompts, "int8", batch_size=2).cache
        np.testing.assert_array_equal(np.asarray(cache.key_factors), want)
    assert _run(model, [[5, 6, 7]], "float32", batch_size=2).cache.key_factors is None


def test_calibration_tokens_are_checked_and_change_the_factors_only_by_the_keys(model):
    """Given tokens calibrate on the model's keys for them: an outlier channel in the key
    projection shows in the factors; bad tokens are refused naming them."""
    base = models.calibrate_key_factors(model, tokens=[[1, 2, 3, 4, 5, 6, 7, 8]])
    assert base.shape == (2, 2, 32)
    with pytest.raises(ValueError, match=r"tokens\[1\]"):
        models.calibrate_key_factors(model, tokens=[[1, 2], [3, 128]])
    with pytest.raises(ValueError, match="tokens must be a non-empty list"):
        models.calibrate_key_factors(model, tokens=[])
    with pytest.raises(ValueError, match="model must be a models.Llama"):
        models.calibrate_key_factors(None)
