"""pallas_kernels/cpu/plan.py and plan.cc: a forward pass's plan as one native call (issue 39, item 4).

`arena_jax.plan._plan` with the native call against its jnp ops (`native=False`) on the tables
random histories leave (reserve, per-layer appends of random lengths, fork, release), for
random rows: duplicate, out-of-range, padded, over-wide and over-long; every array of the plan
equal. And end to end: `models.generate` with the default and with XLA's plan.
"""
from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from arena_jax import plan as plan_lib
from arena_jax.kv_cache import PAD_SLOT

SLOTS, LAYERS, HEADS, DIM = 5, 3, 2, 8
LAYOUT = aj.KVLayout(num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, page_size=4, num_pages=12, max_seqs=SLOTS,
                     max_pages_per_seq=5, dtype="float32")  # fmt: skip


def _history(rng):
    """A cache after random reserves (each layer then appending a random part of what was
    reserved: watermarks differ by layer), forks and releases."""
    cache = aj.create(LAYOUT)
    for _ in range(rng.integers(0, 8)):
        op = rng.choice(3, p=[0.6, 0.25, 0.15])
        if op == 0:
            slots = rng.choice(SLOTS, 2, replace=False).astype(np.int32)
            room = 20 - np.asarray(cache.table.lengths)[slots]  # (aj.reserve refuses past max_seq_len)
            asked = np.minimum(rng.integers(0, 7, 2), room).astype(np.int32)
            cache, ok = aj.reserve(cache, jnp.asarray(slots), jnp.asarray(asked))
            written = np.asarray(cache.table.written)[:, slots]  # [L, 2]
            room = np.maximum(np.asarray(cache.table.lengths)[slots][None, :] - written, 0)
            for layer in range(LAYERS):
                n = rng.integers(0, room[layer] + 1).astype(np.int32)
                kv = jnp.asarray(rng.standard_normal((2, max(int(n.max()), 1), HEADS, DIM)), jnp.float32)
                cache = aj.append(cache, layer, jnp.asarray(slots), kv, kv, num_tokens=jnp.asarray(n))
        elif op == 1:
            active = np.asarray(cache.table.active)
            whole = np.all(np.asarray(cache.table.written) == np.asarray(cache.table.lengths)[None, :], axis=0)
            busy, idle = np.nonzero(active & whole)[0], np.nonzero(active == 0)[0]  # (fork takes written slots)
            if busy.size and idle.size:
                cache = aj.fork(cache, jnp.asarray([rng.choice(busy)], jnp.int32), jnp.asarray([rng.choice(idle)], jnp.int32))
        else:
            cache = aj.release(cache, jnp.asarray([rng.integers(0, SLOTS)], jnp.int32))
    return cache


def test_the_native_plan_is_the_jnp_plan_on_random_tables():
    seed = np.random.SeedSequence().entropy  # fresh tables each run
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    seen = {"written": 0, "dropped": 0, "rejected": 0}
    for _ in range(60):
        cache = _history(rng)
        batch, width = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        slots = rng.integers(-1, SLOTS + 1, batch).astype(np.int32)
        slots[rng.random(batch) < 0.15] = PAD_SLOT
        num_tokens = rng.integers(-1, width + 2, batch).astype(np.int32)
        args = (cache, jnp.asarray(slots), jnp.asarray(num_tokens), width, bool(rng.integers(2)))
        want, got = plan_lib._plan(*args, native=False), plan_lib._plan(*args, native=True)
        for name in ("slots", "num_tokens", "rows", "tokens", "rows4", "counts", "epoch"):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
        assert (got.width, got.page_size, got.deferred) == (want.width, want.page_size, want.deferred)
        if got.deferred:  # `plan_and_commit`'s one call: its plan, and its commit as the jnp plan's
            plan, committed = plan_lib._native_plan_and_commit(*args[:4])
            for name in ("rows", "tokens", "rows4", "counts", "epoch"):
                np.testing.assert_array_equal(np.asarray(getattr(plan, name)), np.asarray(getattr(want, name)))
            expected = want.commit(cache)
            np.testing.assert_array_equal(np.asarray(committed.table.packed), np.asarray(expected.table.packed))
            np.testing.assert_array_equal(np.asarray(committed.stats.counts), np.asarray(expected.stats.counts))
        counts = np.asarray(want.counts).sum(axis=0)
        stats = aj.CacheStats(counts=jnp.asarray(counts)).as_dict()
        seen["written"] += int(stats["tokens_written"]) > 0
        seen["dropped"] += int(stats["dropped_writes"]) > 0
        seen["rejected"] += int(stats["rejected_rows"]) > 0
    assert min(seen.values()) >= 3, seen  # the cases wrote, dropped writes and rejected rows


def test_plan_and_commit_is_plan_step_then_commit():
    """`plan_and_commit` (one native call) against `plan_step(deferred=True)` and `commit`, with the
    native plan and with XLA's ops; on the host it checks its arguments as `plan_step` does."""
    slots, counts = jnp.asarray([0, 2], jnp.int32), jnp.asarray([3, 1], jnp.int32)
    cache, _ = aj.reserve(aj.create(LAYOUT), slots, counts)
    want = aj.plan_step(cache, slots, counts, 3, deferred=True)
    expected = want.commit(cache)
    for kernel in ("auto", False):
        with mock.patch.object(plan_lib, "PLAN_KERNEL", kernel), \
                mock.patch.object(plan_lib, "_native_plan_and_commit", wraps=plan_lib._native_plan_and_commit) as one:
            plan, got = plan_lib.plan_and_commit(cache, slots, counts, 3)
        assert one.call_count == (kernel == "auto") and plan.deferred
        for name in ("rows", "tokens", "rows4", "counts", "epoch"):
            np.testing.assert_array_equal(np.asarray(getattr(plan, name)), np.asarray(getattr(want, name)))
        np.testing.assert_array_equal(np.asarray(got.table.packed), np.asarray(expected.table.packed))
        np.testing.assert_array_equal(np.asarray(got.stats.counts), np.asarray(expected.stats.counts))
    written = np.asarray(got.table.written)
    assert (written[:, 0] == 3).all() and (written[:, 2] == 1).all() and (written[:, 1] == 0).all()
    with pytest.raises(ValueError, match="width"):
        plan_lib.plan_and_commit(cache, slots, counts, 0)
    with pytest.raises(ValueError, match="slots"):
        plan_lib.plan_and_commit(cache, jnp.asarray([0, 9], jnp.int32), counts, 3)


def test_where_the_plan_is_native():
    assert plan_lib.PLAN_KERNEL == "auto" and jax.default_backend() == "cpu"
    assert plan_lib._plans_natively("auto") and plan_lib._plans_natively("cpu") and not plan_lib._plans_natively(False)
    for bad in (True, "gpu", "yes"):
        with pytest.raises(ValueError, match="PLAN_KERNEL must be"):
            plan_lib._plans_natively(bad)
    with mock.patch("pallas_kernels.cpu.plan.native_problem", return_value="no C++ compiler found"):
        assert not plan_lib._plans_natively("auto")
    with mock.patch("pallas_kernels.tpu.common.target_platform", return_value="gpu"):
        assert not plan_lib._plans_natively("auto")
    with mock.patch.object(plan_lib, "_native_plan", wraps=plan_lib._native_plan) as called:
        cache, _ = aj.reserve(aj.create(LAYOUT), jnp.asarray([0], jnp.int32), jnp.asarray([3], jnp.int32))
        aj.plan_step(cache, jnp.asarray([0], jnp.int32), jnp.asarray([3], jnp.int32), 3)
    assert called.call_count == 1


def test_generate_with_the_native_plan_decodes_the_same_tokens():
    from arena_jax import models

    model = models.init_random(models.LlamaConfig.tiny(), seed=1, std=0.2)
    prompts = np.random.default_rng(4).integers(0, model.config.vocab_size, (3, 9)).tolist()
    got = models.generate(model, prompts, 10, batch_size=2, chunk_size=4)
    jax.clear_caches()
    with mock.patch.object(plan_lib, "PLAN_KERNEL", False), mock.patch.object(plan_lib, "_native_plan") as native:
        want = models.generate(model, prompts, 10, batch_size=2, chunk_size=4)
    jax.clear_caches()
    assert native.call_count == 0
    assert got.tokens == want.tokens and [len(t) for t in got.tokens] == [10] * 3
    np.testing.assert_array_equal(np.asarray(got.cache.stats.counts), np.asarray(want.cache.stats.counts))


def test_a_row_that_would_write_a_shared_page_is_planned_as_refused():
    """A slot with reserved room in a page it shares (not reachable through the checked ops; a
    table edited by hand) writes nothing under either plan, and its dropped write is counted."""
    from arena_jax.kv_cache import _regions

    cache, _ = aj.reserve(aj.create(LAYOUT), jnp.asarray([0], jnp.int32), jnp.asarray([6], jnp.int32))
    kv = jnp.ones((1, 6, HEADS, DIM), jnp.float32)
    for layer in range(LAYERS):
        cache = aj.append(cache, layer, jnp.asarray([0], jnp.int32), kv, kv)
    cache = aj.fork(cache, jnp.asarray([0], jnp.int32), jnp.asarray([1], jnp.int32))  # pages shared, the last half full
    lengths_at = _regions(cache.table.geometry)["slot_words"][0] + 1 * (2 + LAYERS)
    cache = cache.replace(table=cache.table.replace(packed=cache.table.packed.at[lengths_at].set(8)))  # room in it
    args = (cache, jnp.asarray([1], jnp.int32), jnp.asarray([2], jnp.int32), 2, False)
    want, got = plan_lib._plan(*args, native=False), plan_lib._plan(*args, native=True)
    for name in ("rows", "tokens", "rows4", "counts"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)
    assert np.asarray(got.rows4)[:LAYERS, 0, 1].tolist() == [-1] * LAYERS  # refused at every layer
    assert aj.CacheStats(counts=jnp.asarray(np.asarray(got.counts).sum(axis=0))).as_dict()["dropped_writes"] == LAYERS
