"""benchmarks/studies/gpu_step.py (issue 39, items 1 and 2): its variants run on any backend,
split-K off means one split, no plan means none, and `capacity` sizes the page table and the
dense cache."""
from __future__ import annotations

from unittest import mock

from arena_jax import models
from arena_jax.benchmarks.studies import gpu_step
from pallas_kernels._common import BlockSizes

SHAPE = dict(batch=1, tokens=1, num_kv_heads=8, group=4, page_size=16, head_dim=128, max_pages=256)


def test_the_one_split_variant_traces_with_one_split():
    assert BlockSizes.for_attention(**SHAPE).num_splits > 1  # a batch-1 decode splits by default
    with gpu_step._one_split():
        assert BlockSizes.for_attention(**SHAPE).num_splits == 1
    assert BlockSizes.for_attention(**SHAPE).num_splits > 1


def test_the_no_plan_variant_traces_a_step_that_plans_nothing():
    import arena_jax as aj

    cache = aj.create(aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, num_pages=4, max_seqs=1,
                                  max_pages_per_seq=4, dtype="float32"))  # fmt: skip
    assert aj.plan_step(cache, [0], [1], 1) is not None
    with gpu_step._no_plan():
        assert aj.plan_step(cache, [0], [1], 1) is None
    assert aj.plan_step(cache, [0], [1], 1) is not None


def test_a_case_runs_every_variant_at_the_capacity_asked():
    config = models.LlamaConfig.tiny()
    by_kind = {"scan": models.init_random(config, seed=0)}
    with mock.patch.object(gpu_step, "DenseRunner", wraps=gpu_step.DenseRunner) as dense:
        rows = gpu_step.measure(by_kind, batch=2, context=16, variants=("arena", "arena-1split", "arena-noplan", "arena-xla-reserve", "dense"), repeats=2,
                                page_size=16, seed=0, log=lambda *_: None, capacity=128)  # fmt: skip
    assert dense.call_args.args[3] == 128  # the dense cache's length: the page table's capacity
    assert [r["variant"] for r in rows] == ["arena", "arena-1split", "arena-noplan", "arena-xla-reserve", "dense"]
    assert all(r["step_ms"] > 0 and r["batch"] == 2 and r["context"] == 16 for r in rows)
