"""benchmarks/studies/call_cost.py (issue 39, item 3): the steps-per-call fit and the op-cost
programs measure what they say, on tiny settings."""
from __future__ import annotations

import dataclasses
from unittest import mock

import jax
import numpy as np

from arena_jax import allocator
from arena_jax import plan as plan_lib
from arena_jax.benchmarks import decode
from arena_jax.benchmarks.studies import call_cost


def test_the_step_cost_fits_a_line_through_each_sides_calls():
    from arena_jax import unrolled

    built = unrolled.UNROLL_LIMIT
    s = dataclasses.replace(decode.DecodeSettings(), batch=2, prompt_len=8, new_tokens=8)
    # reserve and the plan as XLA's ops (a TPU's): on a CPU they are native calls, with no reduction to fold
    jax.clear_caches()
    with mock.patch.object(allocator, "RESERVE_KERNEL", False), mock.patch.object(plan_lib, "PLAN_KERNEL", False):
        cost = call_cost.step_cost(ks=(1, 3), rounds=1, s=s, fold_limits=(None, 0))
    jax.clear_caches()
    assert set(cost) == {"arena", "arena, folds <= 0", "dense"}
    for side, row in cost.items():
        assert set(row["k"]) == {1, 3} and all(t > 0 for t in row["k"].values()), side
        # two points: the line passes through both
        assert np.isclose(row["per call"] + row["per step"], row["k"][1])
        assert np.isclose(row["per call"] + 3 * row["per step"], row["k"][3])
    # the arena's step holds its page bookkeeping's reductions and scatters beside the model's;
    # with its short reductions left to XLA (fold limit 0), more of them
    computations = {side: row["embedded computations"] for side, row in cost.items()}
    assert computations["arena, folds <= 0"] > computations["arena"] > computations["dense"] > 0
    assert unrolled.UNROLL_LIMIT == built  # the study put the limit back


def test_the_op_programs_count_each_ops_computations():
    rows = {r["op"]: r for r in call_cost.op_cost(ops=3, calls=10)}
    assert set(rows) == set(call_cost.OPS)
    assert rows["elementwise"]["embedded computations"] == 0  # no computation of its own
    assert rows["constant array"]["embedded computations"] == 0
    assert rows["reduction (max)"]["embedded computations"] >= 3  # one per copy (XLA may split a long one)
    assert rows["scatter-add"]["embedded computations"] >= 3


def test_embedded_computations_counts_to_apply_calls():
    text = "%r = f32[] reduce(%a, %b), to_apply=%add\n%s = f32[4] scatter(...), to_apply=%upd\n%c = f32[4] add(%x, %y)"
    assert call_cost.embedded_computations(text) == 2
