"""`aj.plan_step`: every layer's append / attend with the step's plan equals the same calls
without it, on fresh random states (uneven watermarks, shared pages, duplicate, padded,
out-of-range and over-long rows inside jit); a plan of another epoch writes and reads nothing;
the ops that can unmap or share a slot's page advance the epoch, and only when they change
something."""
from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj

LAYOUT = aj.KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, page_size=4, num_pages=40, max_seqs=6,
                     max_pages_per_seq=8, dtype="float32")  # fmt: skip
WIDTH = 3


def _state(seed: int):
    """A random cache: slots 0-3 filled to random lengths, their layers' watermarks uneven
    (layer l of slot s written up to a random point), slot 4 a fork of slot 0 (shared pages),
    slot 5 idle. Returns (cache, numpy rng)."""
    rng = np.random.default_rng(seed)
    cache = aj.create(LAYOUT)
    lengths = rng.integers(1, 14, size=4)
    slots = jnp.arange(4, dtype=jnp.int32)
    cache, ok = aj.reserve(cache, slots, jnp.asarray(lengths, jnp.int32))
    assert bool(ok.all())
    for layer in range(LAYOUT.num_layers):
        n = lengths.copy()
        if layer > 0:  # layers 1, 2 of slots 1-3: some tokens not yet written (uneven watermarks)
            n[1:] -= rng.integers(0, 2, size=3) * np.minimum(n[1:], rng.integers(1, 3, size=3))
        k, v = (jnp.asarray(rng.normal(size=(4, 14, 2, 16)), jnp.float32) for _ in range(2))
        cache = aj.append(cache, layer, slots, k, v, num_tokens=jnp.asarray(n, jnp.int32))
    cache = aj.fork(cache, [0], [4])  # slot 0 is written at every layer: shared pages from here on
    return cache, rng


def _rows(rng):
    """A step's rows as a user's jit may get them: slots with a pad, a duplicate, an idle and an
    out-of-range slot, counts up to WIDTH + 1 (over the tokens axis) and a negative one."""
    slots = rng.choice([0, 1, 2, 3, 4, 5, 0, aj.PAD_SLOT, 9], size=6, replace=False)
    counts = rng.choice([0, 1, 2, 3, 3, 4, -1], size=6)
    return jnp.asarray(slots, jnp.int32), jnp.asarray(counts, jnp.int32)


def _step(cache, slots, n, q, k, v, layers, plan_it: bool, backend: str):
    """reserve, then append + attend at `layers` (in that order), with or without a plan."""
    cache, _ = aj.reserve(cache, slots, jnp.clip(n, 0, WIDTH))
    plan = aj.plan_step(cache, slots, n, WIDTH) if plan_it else None
    outs = []
    for layer in layers:
        cache = aj.append(cache, layer, slots, k, v, num_tokens=n, backend=backend, plan=plan)
        outs.append(aj.attend(q, cache, layer, slots, num_tokens=n, backend=backend, plan=plan, sliding_window=5))
    return cache, outs


def _assert_caches_equal(got, want):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("backend", ["xla", "reference"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_planned_step_equals_the_unplanned_calls_inside_jit(seed, backend):
    cache, rng = _state(seed)
    slots, n = _rows(rng)
    q = jnp.asarray(rng.normal(size=(6, WIDTH, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(6, WIDTH, 2, 16)), jnp.float32) for _ in range(2))
    layers = jnp.asarray(list(rng.permutation(LAYOUT.num_layers)) + [LAYOUT.num_layers, -1], jnp.int32)  # + out of range
    copy = jax.tree.map(jnp.copy, cache)

    def run(plan_it):
        def body(cache, slots, n, layers):
            return _step(cache, slots, n, q, k, v, [layers[i] for i in range(layers.shape[0])], plan_it, backend)

        return jax.jit(body)(cache if plan_it else copy, slots, n, layers)

    got, got_out = run(True)
    want, want_out = run(False)
    _assert_caches_equal(got, want)
    for a, b in zip(got_out, want_out):
        np.testing.assert_array_equal(a, b)
    assert int(got.stats.rejected_rows) > 0  # the bad rows and layers were refused, not dropped silently


def _stale_plan(deferred: bool):
    """A plan of slots 1 and 2 (a token each), then slot 2 released and its pages reserved by slot
    5: the table's epoch moved on, and the stale plan would write those pages. Returns (cache,
    plan, slots, num_tokens, rng)."""
    cache, rng = _state(5)
    slots, n = jnp.asarray([1, 2], jnp.int32), jnp.asarray([1, 1], jnp.int32)
    cache, _ = aj.reserve(cache, slots, n)
    plan = aj.plan_step(cache, slots, n, WIDTH, deferred=deferred)
    cache = aj.release(cache, [2])
    cache, ok = aj.reserve(cache, [5], 16)
    assert bool(ok.all()) and int(cache.table.epoch) != int(plan.epoch)
    return cache, plan, slots, n, rng


@pytest.mark.parametrize("commit_first", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_deferred_plan_committed_once_equals_the_unplanned_calls(seed, commit_first):
    """`plan_step(..., deferred=True)`: every layer appended once (in a random order) writes
    K/V only, and one `commit`, before or after the layers, leaves the cache (arena, watermarks,
    counters) and the outputs exactly as the per-layer calls without a plan do; inside jit, with
    padded, duplicate, idle, out-of-range and over-long rows."""
    cache, rng = _state(seed)
    slots, n = _rows(rng)
    q = jnp.asarray(rng.normal(size=(6, WIDTH, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(6, WIDTH, 2, 16)), jnp.float32) for _ in range(2))
    layers = [int(x) for x in rng.permutation(LAYOUT.num_layers)]
    copy = jax.tree.map(jnp.copy, cache)

    @jax.jit
    def deferred(cache, slots, n):
        cache, _ = aj.reserve(cache, slots, jnp.clip(n, 0, WIDTH))
        plan = aj.plan_step(cache, slots, n, WIDTH, deferred=True)
        assert plan.deferred
        reserved = (cache.table.packed, cache.stats.counts)
        cache = plan.commit(cache) if commit_first else cache
        outs = []
        for layer in layers:
            cache = aj.append(cache, layer, slots, k, v, num_tokens=n, plan=plan)
            outs.append(aj.attend(q, cache, layer, slots, num_tokens=n, plan=plan, sliding_window=5))
        appended = (cache.table.packed, cache.stats.counts)
        return (cache if commit_first else plan.commit(cache)), outs, reserved, appended

    got, got_out, reserved, appended = deferred(cache, slots, n)
    if not commit_first:  # the appends wrote K/V only: the table and counters waited for the commit
        for a, b in zip(reserved, appended):
            np.testing.assert_array_equal(a, b)
    want, want_out = jax.jit(lambda c, s, m: _step(c, s, m, q, k, v, layers, False, "xla"))(copy, slots, n)
    _assert_caches_equal(got, want)
    for a, b in zip(got_out, want_out):
        np.testing.assert_array_equal(a, b)
    assert int(got.stats.rejected_rows) > 0 and int(got.stats.tokens_written) > 0


def test_a_deferred_plan_of_another_epoch_commits_no_watermark():
    """A deferred plan kept past a call that moved the epoch: its appends write nothing, its
    commit moves no watermark and counts each layer's rejected rows, as per-layer appends of a
    stale plan do; a plan that is not deferred commits nothing."""
    cache, plan, slots, n, rng = _stale_plan(deferred=True)
    k, v = (jnp.asarray(rng.normal(size=(2, WIDTH, 2, 16)), jnp.float32) for _ in range(2))
    before = jax.tree.map(np.asarray, cache)

    @jax.jit
    def stale(cache):
        for layer in range(LAYOUT.num_layers):
            cache = aj.append(cache, layer, slots, k, v, num_tokens=n, plan=plan)
        return plan.commit(cache)

    after = stale(cache)
    np.testing.assert_array_equal(after.k, before.k)
    np.testing.assert_array_equal(after.table.packed, before.table.packed)
    assert int(after.stats.rejected_rows) == int(before.stats.rejected_rows) + 2 * LAYOUT.num_layers
    assert aj.plan_step(cache, slots, n, WIDTH).commit(cache) is cache
    with pytest.raises(ValueError, match="deferred must be a bool"):
        aj.plan_step(cache, slots, n, WIDTH, deferred=1)


def test_a_planned_step_equals_the_unplanned_calls_on_the_host():
    cache, rng = _state(3)
    slots, n = jnp.asarray([2, 0, 3], jnp.int32), jnp.asarray([3, 1, 2], jnp.int32)
    q = jnp.asarray(rng.normal(size=(3, WIDTH, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(3, WIDTH, 2, 16)), jnp.float32) for _ in range(2))
    copy = jax.tree.map(jnp.copy, cache)
    got, got_out = _step(cache, slots, n, q, k, v, [2, 0, 1], True, "xla")
    want, want_out = _step(copy, slots, n, q, k, v, [2, 0, 1], False, "xla")
    _assert_caches_equal(got, want)
    for a, b in zip(got_out, want_out):
        np.testing.assert_array_equal(a, b)


def test_a_layer_appended_twice_with_one_plan_keeps_its_watermark():
    cache, rng = _state(4)
    slots, n = jnp.asarray([1, 2], jnp.int32), jnp.asarray([2, 2], jnp.int32)
    k, v = (jnp.asarray(rng.normal(size=(2, WIDTH, 2, 16)), jnp.float32) for _ in range(2))
    cache, _ = aj.reserve(cache, slots, n)
    plan = aj.plan_step(cache, slots, n, WIDTH)
    once = aj.append(cache, 0, slots, k, v, num_tokens=n, plan=plan)
    written = np.asarray(once.table.written)
    with pytest.raises(ValueError, match="would pass its reservation"):  # the host refuses a second append
        aj.append(once, 0, slots, k, v, num_tokens=n, plan=plan)
    twice = jax.jit(lambda c: aj.append(c, 0, slots, k, v, num_tokens=n, plan=plan))(once)  # inside jit: total
    np.testing.assert_array_equal(twice.table.written, written)
    assert bool((np.asarray(twice.table.written) <= np.asarray(twice.table.lengths)[None]).all())


def test_a_plan_of_another_epoch_writes_and_reads_nothing():
    cache, plan, slots, n, rng = _stale_plan(deferred=False)
    q = jnp.asarray(rng.normal(size=(2, WIDTH, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, WIDTH, 2, 16)), jnp.float32) for _ in range(2))
    before = jax.tree.map(np.asarray, cache)

    @jax.jit
    def stale(cache):
        cache = aj.append(cache, 0, slots, k, v, num_tokens=n, plan=plan)
        return cache, aj.attend(q, cache, 0, slots, num_tokens=n, plan=plan)

    after, out = stale(cache)
    np.testing.assert_array_equal(after.k, before.k)
    np.testing.assert_array_equal(after.table.written, before.table.written)
    assert int(after.stats.rejected_rows) == int(before.stats.rejected_rows) + 2
    np.testing.assert_array_equal(out, 0.0)


def _settled():
    """Slots 0-3 with 8 tokens each, written at every layer; slots 4, 5 idle."""
    cache = aj.create(LAYOUT)
    slots = jnp.arange(4, dtype=jnp.int32)
    cache, _ = aj.reserve(cache, slots, 8)
    kv = jnp.ones((4, 8, 2, 16), jnp.float32)
    for layer in range(LAYOUT.num_layers):
        cache = aj.append(cache, layer, slots, kv, kv)
    return cache


def _released(cache):
    return aj.release(cache, [1])


def _truncated(cache):
    return aj.truncate(cache, [1], [1])


def _forked(cache):
    return aj.fork(cache, [2], [5])


def _held(cache):
    return aj.hold_pages(cache, [int(cache.table.page_map[2, 0])], [LAYOUT.page_size])


@pytest.mark.parametrize("op", [_released, _truncated, _forked, _held])
def test_ops_that_unmap_or_share_a_page_advance_the_epoch(op):
    cache = _settled()
    epoch = int(cache.table.epoch)
    assert int(op(cache).table.epoch) == epoch + 1


def test_calls_that_change_nothing_keep_the_epoch():
    cache = _settled()
    epoch = int(cache.table.epoch)
    for call in (lambda c: aj.release(c, [5]),  # an idle slot
                 lambda c: aj.truncate(c, [0], [int(c.table.lengths[0])]),  # to its own length
                 lambda c: aj.reserve(c, [0, 1], [3, 4])[0]):  # reserve maps more pages only
        cache = call(cache)
        assert int(cache.table.epoch) == epoch


def _equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (jitted calls, loops, branches)."""
    for eqn in jaxpr.eqns:
        yield from _equations_of(eqn)


def _equations_of(eqn):
    """An equation and every equation of the jaxprs inside it."""
    yield eqn
    for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield from _equations(inner)


def test_the_layer_loop_of_a_model_step_looks_up_no_page():
    """`models.decode_step` (layers under `lax.scan`) plans once: inside the layer loop nothing
    gathers from the page table or the reference counts (before the plan, every layer's append
    and attend did both)."""
    from flax import nnx

    from arena_jax import models
    from arena_jax.models import steps

    model = models.init_random(models.LlamaConfig.tiny(), seed=0)
    graphdef, state = nnx.split(model)
    layout = model.config.kv_layout(page_size=8, num_pages=37, max_seqs=6, max_seq_len=64, dtype=model.dtype)
    cache = aj.create(layout)
    slots = jnp.arange(4, dtype=jnp.int32)
    step = steps.decode_step.__wrapped__
    from arena_jax import allocator, plan as plan_lib

    # The plan and reserve as XLA's ops (a TPU's; on a CPU they are native calls, no gather at all).
    with mock.patch.object(plan_lib, "PLAN_KERNEL", False), mock.patch.object(allocator, "RESERVE_KERNEL", False):
        jaxpr = jax.make_jaxpr(lambda c: step(graphdef, state, c, jnp.zeros((4,), jnp.int32), slots))(cache).jaxpr
    loops = [e for e in _equations(jaxpr) if e.primitive.name == "scan"]
    assert loops, "the layers are not scanned"
    table_shapes = {(tuple(cache.table.page_map.shape), "int32"), (tuple(cache.table.refcount.shape), "int32")}
    lookups = [(e.primitive.name, [getattr(v.aval, "shape", None) for v in e.invars])
               for loop in loops for e in _equations(loop.params["jaxpr"].jaxpr)
               if e.primitive.name in ("gather", "dynamic_slice") and any(
                   (tuple(getattr(v.aval, "shape", ())), str(getattr(v.aval, "dtype", ""))) in table_shapes
                   for v in e.invars)]  # fmt: skip
    assert lookups == []
    # The check sees a lookup where there is one: the step outside the loop (the plan, reserve) has them.
    outside = [e for e in jaxpr.eqns if e.primitive.name != "scan"]
    assert any(e.primitive.name == "gather" and any(tuple(getattr(v.aval, "shape", ())) == tuple(cache.table.page_map.shape)
                                                    for v in e.invars)
               for eqn in outside for e in _equations_of(eqn))  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "int8"])
def test_a_plan_entry_waits_for_data_without_changing_its_index(dtype):
    """`arena_ops.waits_for` gives the index it is given for any data (NaN, infinities, -0, the
    extremes; fresh random bits) and, on XLA's CPU backend, keeps the data as an operand of the
    compiled index: XLA does not fold the dependency away (`benchmarks/studies/op_hlo.py`,
    "loop: most waiting", shows what it is for)."""
    from arena_jax.arena_ops import waits_for as _waits_for

    rng = np.random.default_rng()
    width = jnp.dtype(dtype).itemsize * 8
    bits = rng.integers(-(2 ** (width - 1)), 2 ** (width - 1), size=(64,))
    xs = jax.lax.bitcast_convert_type(jnp.asarray(bits, f"int{width}"), dtype)
    if dtype != "int8":
        xs = jnp.concatenate([jnp.asarray([jnp.nan, jnp.inf, -jnp.inf, -0.0], dtype), xs])
    index = jnp.int32(rng.integers(0, 1000))
    got = jax.jit(jax.vmap(lambda x: _waits_for(index, x)))(xs)
    np.testing.assert_array_equal(np.asarray(got), np.full(xs.shape, int(index)))
    assert _waits_for(index, None) is index and _waits_for(index, jnp.zeros((0,), dtype)) is index
    text = jax.jit(lambda i, x: _waits_for(i, jnp.tanh(x.astype(jnp.float32)).astype(dtype))).lower(
        jnp.int32(3), jnp.ones((4,), dtype)).compile().as_text()  # fmt: skip
    assert "tanh" in text  # the index still reads the data it waits for
