"""benchmarks/studies/dense_ratio.py (issue 39, items 3 and 5): the dense runner holds the context it
is given, and a measured case reports both steps and their ratio."""
from __future__ import annotations

import numpy as np
import pytest

from arena_jax import models
from arena_jax.benchmarks.studies import dense_ratio


def test_the_dense_runner_holds_the_context():
    model = models.init_random(models.LlamaConfig.tiny(), seed=0)
    runner = dense_ratio.DenseRunner(model, batch=2, context=5, capacity=8)
    cache = runner.cache
    assert cache.k.shape == (model.config.num_layers, 2, model.config.num_kv_heads, 8, model.config.head_dim)  # heads-major
    np.testing.assert_array_equal(np.asarray(cache.positions), [[0, 1, 2, 3, 4, -1, -1, -1]] * 2)
    assert int(cache.end) == 5 and np.asarray(cache.lengths).tolist() == [5, 5]
    runner.call()
    assert int(runner.cache.end) == 6 and np.asarray(runner.cache.positions)[:, 5].tolist() == [5, 5]


def test_a_case_reports_both_steps_and_their_ratio():
    row = dense_ratio.measure("tiny", batch=2, context=16, repeats=2)
    assert (row["model"], row["batch"], row["context"]) == ("tiny", 2, 16)
    assert row["capacity"] >= 16 + 2 + 2  # the context and the steps timed fit
    assert row["arena_ms"] > 0 and row["dense_ms"] > 0
    assert row["tokens_per_s_ratio"] == pytest.approx(1 / row["arena_over_dense_time"])
    assert row["layers"] == "scan"  # the tiny model's small layers: stacked, as load_pretrained builds them
    assert dense_ratio.measure("tiny", batch=1, context=8, repeats=1, scan_layers=False)["layers"] == "list"


def test_cases_name_a_known_model():
    assert dense_ratio._case("mid:8:4096") == ("mid", 8, 4096)
    with pytest.raises(Exception, match="'tiny' or 'mid'"):
        dense_ratio._case("huge:1:1")


def test_the_attention_study_compares_equal_attentions():
    """benchmarks/studies/attention_block.py: the paged and the dense attention it times agree
    on its random rows (checked inside `measure`), and both are timed."""
    from arena_jax.benchmarks.studies import attention_block

    row = attention_block.measure(batch=2, pages=3, repeats=2)
    assert (row["batch"], row["keys"]) == (2, 48) and row["paged_us"] > 0 and row["dense_us"] > 0
