"""`aj.positions`, `aj.append_attend`, `aj.begin_step` / `CacheStep`: the helpers equal the ops
they stand for, on fresh random data, on the host and inside a user's jit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj

LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=16, max_seqs=4,
                     max_pages_per_seq=6, dtype="float32")  # fmt: skip
rng = np.random.default_rng(0)


def _rand(*shape):
    return jnp.asarray(rng.normal(size=shape), jnp.float32)


def _prefilled(lengths, seed=1):
    """The same prefilled cache for the same lengths and seed (fresh random K/V)."""
    local = np.random.default_rng(seed)
    cache = aj.create(LAYOUT)
    slots = jnp.arange(len(lengths), dtype=jnp.int32)
    cache, ok = aj.reserve(cache, slots, jnp.asarray(lengths, jnp.int32))
    assert bool(ok.all())
    t = max(lengths)
    for layer in range(LAYOUT.num_layers):
        k, v = (jnp.asarray(local.normal(size=(len(lengths), t, 2, 16)), jnp.float32) for _ in range(2))
        cache = aj.append(cache, layer, slots, k, v, num_tokens=jnp.asarray(lengths, jnp.int32))
    return cache, slots


def test_positions_are_the_newest_reserved_tokens():
    cache, slots = _prefilled([5, 3, 9])
    n = jnp.asarray([2, 0, 3], jnp.int32)
    cache, _ = aj.reserve(cache, slots, n)
    pos = aj.positions(cache, jnp.asarray([0, 1, aj.PAD_SLOT]), jnp.asarray([2, 0, 3]))
    np.testing.assert_array_equal(pos, [[5, 6, 0], [0, 0, 0], [0, 0, 0]])  # padded rows and tokens: 0
    pos = aj.positions(cache, slots, n, width=4)
    np.testing.assert_array_equal(pos, [[5, 6, 0, 0], [0, 0, 0, 0], [9, 10, 11, 0]])
    with pytest.raises(ValueError, match="width must be given inside jit"):
        jax.jit(lambda c, s, n: aj.positions(c, s, n))(cache, slots, n)
    jitted = jax.jit(lambda c, s, n: aj.positions(c, s, n, width=4))(cache, slots, n)
    np.testing.assert_array_equal(jitted, pos)


@pytest.mark.parametrize("window", [None, 3])
def test_append_attend_and_a_cache_step_equal_the_ops_they_stand_for(window):
    lengths, new = [5, 3, 8], jnp.asarray([2, 1, 3], jnp.int32)
    q, k, v = _rand(3, 3, 4, 16), _rand(3, 3, 2, 16), _rand(3, 3, 2, 16)

    cache, slots = _prefilled(lengths)
    cache, _ = aj.reserve(cache, slots, new)
    want = []
    for layer in range(2):
        cache = aj.append(cache, layer, slots, k, v, num_tokens=new)
        want.append(aj.attend(q, cache, layer, slots, num_tokens=new, sliding_window=window, sm_scale=0.3))

    cache2, _ = _prefilled(lengths)
    step, ok = aj.begin_step(cache2, slots, new, width=3)
    assert bool(ok.all())
    np.testing.assert_array_equal(step.positions, aj.positions(step.cache, slots, new, width=3))
    for layer in range(2):
        step, out = step.attend(layer, q, k, v, sliding_window=window, sm_scale=0.3)
        np.testing.assert_array_equal(out, want[layer])
    cache3, _ = _prefilled(lengths)
    cache3, _ = aj.reserve(cache3, slots, new)
    cache3, out = aj.append_attend(q, k, v, cache3, 0, slots, num_tokens=new, sliding_window=window, sm_scale=0.3)
    np.testing.assert_array_equal(out, want[0])


def test_a_step_inside_jit_pads_the_rows_that_got_no_pages():
    cache, _ = _prefilled([16, 16, 16, 6])  # 14 of the 16 pages
    slots, new = jnp.asarray([0, 1, 3], jnp.int32), jnp.asarray([8, 4, 1], jnp.int32)  # row 0 takes the last 2 pages
    q, k, v = _rand(3, 8, 4, 16), _rand(3, 8, 2, 16), _rand(3, 8, 2, 16)

    @jax.jit
    def forward(cache, slots, new):
        step, ok = aj.begin_step(cache, slots, new, width=8)
        outs = []
        for layer in range(2):
            step, out = step.attend(layer, q, k, v)
            outs.append(out)
        return step, ok, outs

    step, ok, outs = forward(cache, slots, new)
    np.testing.assert_array_equal(ok, [True, False, True])
    np.testing.assert_array_equal(step.slots, [0, aj.PAD_SLOT, 3])
    np.testing.assert_array_equal(step.num_tokens, [8, 0, 1])
    np.testing.assert_array_equal(step.cache.table.written[:, [0, 1, 3]], [[24, 16, 7]] * 2)
    assert int(step.cache.stats.dropped_writes) == 0 and not np.asarray(outs[1][1]).any()  # the padded row: zeros
    assert np.abs(np.asarray(outs[1][0])).sum() > 0


def test_positions_refuse_rows_they_cannot_place():
    """Rows past the width, idle slots and tokens never reserved used to get positions cut short
    or zeros: on the host each is a ValueError naming the row (PAD_SLOT rows are not checked)."""
    cache, _ = _prefilled([5, 3, 9])  # slot 3 is idle
    with pytest.raises(ValueError, match=r"num_tokens\[0\]=3 exceeds width=2, the step's tokens axis T"):
        aj.positions(cache, [0, 1, aj.PAD_SLOT], [3, 1, 3], width=2)
    with pytest.raises(ValueError, match=r"slots\[1\]=3 is idle .*aj.reserve"):
        aj.positions(cache, [0, 3, 1], [1, 1, 1])
    with pytest.raises(ValueError, match=r"num_tokens\[2\]=4 is more than the 3 tokens slot 1 holds"):
        aj.positions(cache, [0, 2, 1], [1, 1, 4])


def test_a_step_refuses_rows_past_its_width():
    """begin_step(num_tokens > width) reserved the tokens and failed later in attend: on the host
    a ValueError (the cache untouched); inside jit the row is refused and counted, reserving nothing."""
    cache, slots = _prefilled([5, 3, 9])
    with pytest.raises(ValueError, match=r"num_tokens\[1\]=3 exceeds width=2"):
        aj.begin_step(cache, slots, [1, 3, 0], width=2)
    assert np.asarray(cache.table.lengths).tolist() == [5, 3, 9, 0] and aj.health(cache)["free_pages"] == 10
    step, ok = jax.jit(lambda c, s, n: aj.begin_step(c, s, n, width=2))(cache, slots, jnp.asarray([1, 3, 0], jnp.int32))
    np.testing.assert_array_equal(ok, [True, False, True])
    np.testing.assert_array_equal(step.slots, [0, aj.PAD_SLOT, 2])
    np.testing.assert_array_equal(step.num_tokens, [1, 0, 0])
    assert np.asarray(step.cache.table.lengths).tolist() == [6, 3, 9, 0]
    assert int(step.cache.stats.rejected_rows) == int(cache.stats.rejected_rows) + 1
    assert aj.health(step.cache)["free_pages"] == 10  # slot 0's 6th token fits its second page


@pytest.mark.parametrize("scan", [False, True])
def test_a_step_inside_jit_sets_the_watermarks_of_the_layers_it_appended(scan):
    """Inside jit, `begin_step`'s plan is deferred: each layer's `attend` writes K/V only and
    counts its append, and the watermarks and counters of the layers appended are set once, when
    `step.cache` is read. A forward pass that skips layer 0, appends layer 1 twice and names a
    layer out of range (traced, or a scan's counter) leaves the cache and outputs that the same
    calls give with the plan's per-layer bookkeeping (fresh random data): layer 0's watermark
    does not move, the repeat and the stray layer count what their appends count."""
    cache, slots = _prefilled([5, 3, 8])
    new = jnp.asarray([2, 1, 3], jnp.int32)
    data = [(_rand(3, 3, 4, 16), _rand(3, 3, 2, 16), _rand(3, 3, 2, 16)) for _ in range(4)]
    layers = jnp.asarray([1, 1, 7, 1], jnp.int32)  # traced: the scan's counter, and the stray 7

    def order(traced):  # a Python loop's layers: ints where they can be, the stray one traced
        return [1, 1, traced[2], 1] if not scan else None

    @jax.jit
    def per_layer(cache, layers):
        cache, ok = aj.reserve(cache, slots, new)
        plan = aj.plan_step(cache, slots, new, 3)  # not deferred: each append sets its watermark
        outs = []
        for layer, (q, k, v) in zip([layers[i] for i in range(4)], data):
            cache = aj.append(cache, layer, slots, k, v, num_tokens=new, plan=plan)
            outs.append(aj.attend(q, cache, layer, slots, num_tokens=new, sliding_window=3, plan=plan))
        return cache, ok, outs

    @jax.jit
    def stepped(cache, layers):
        step, ok = aj.begin_step(cache, slots, new, width=3)
        assert step.plan.deferred
        if scan:
            qs, ks, vs = (jnp.stack(x) for x in zip(*data))

            def body(step, xs):
                layer, q, k, v = xs
                return step.attend(layer, q, k, v, sliding_window=3)

            step, outs = jax.lax.scan(body, step, (layers, qs, ks, vs))
            outs = list(outs)
        else:
            outs = []
            for layer, (q, k, v) in zip(order(layers), data):
                step, out = step.attend(layer, q, k, v, sliding_window=3)
                outs.append(out)
        return step.cache, ok, outs

    want_cache, want_ok, want = per_layer(_prefilled([5, 3, 8])[0], layers)
    got_cache, ok, got = stepped(cache, layers)
    np.testing.assert_array_equal(ok, want_ok)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    for name in ("k", "v"):
        np.testing.assert_array_equal(getattr(got_cache, name), getattr(want_cache, name))
    np.testing.assert_array_equal(got_cache.table.packed[:-1], want_cache.table.packed[:-1])  # (last: the arena's id)
    np.testing.assert_array_equal(got_cache.stats.counts, want_cache.stats.counts)
    written = np.asarray(got_cache.table.written)
    np.testing.assert_array_equal(written[0, :3], [5, 3, 8])  # layer 0 skipped: its watermark stayed
    np.testing.assert_array_equal(written[1, :3], [7, 4, 11])
    assert int(got_cache.stats.rejected_rows) > 0  # the stray layer's rows, counted


def test_a_step_cache_replaced_has_nothing_pending():
    """`step.replace(cache=c)` sets the arena as given, watermarks and counters included: the
    layers appended before it are the new cache's business, the ones after are counted anew."""
    cache, slots = _prefilled([5, 3, 8])
    new = jnp.asarray([1, 1, 1], jnp.int32)
    q, k, v = _rand(3, 1, 4, 16), _rand(3, 1, 2, 16), _rand(3, 1, 2, 16)

    @jax.jit
    def forward(cache):
        step, _ = aj.begin_step(cache, slots, new, width=1)
        step, _ = step.attend(0, q, k, v)
        step = step.replace(cache=step.cache)  # layer 0 committed here
        step, _ = step.attend(1, q, k, v)
        return step.cache

    before = int(cache.stats.tokens_written)
    out = forward(cache)
    np.testing.assert_array_equal(np.asarray(out.table.written)[:, :3], [[6, 4, 9], [6, 4, 9]])
    assert int(out.stats.tokens_written) == before + 3  # layer 0's append counted once (tokens count there)


def test_a_step_made_inside_jit_runs_on_outside_it():
    """A `CacheStep` returned by a jit (its plan deferred) and run on outside it: each eager
    layer sets its own watermark, so the eager ops' host checks pass, and the cache equals the
    per-layer calls' (the jitted layer's watermark set at the commit). Slot 2 starts empty: an
    eager attention over a layer whose watermark waited for the commit would be refused."""
    cache, slots = _prefilled([5, 3, 0])
    new = jnp.asarray([2, 1, 3], jnp.int32)
    data = [(_rand(3, 3, 4, 16), _rand(3, 3, 2, 16), _rand(3, 3, 2, 16)) for _ in range(2)]

    @jax.jit
    def first_layer(cache):
        step, _ = aj.begin_step(cache, slots, new, width=3)
        return step.attend(0, *data[0])

    step, out0 = first_layer(cache)
    step, out1 = step.attend(1, *data[1])
    want, _ = _prefilled([5, 3, 0])
    want, _ = aj.reserve(want, slots, new)
    for layer, (q, k, v) in enumerate(data):
        want = aj.append(want, layer, slots, k, v, num_tokens=new)
        np.testing.assert_array_equal([out0, out1][layer], aj.attend(q, want, layer, slots, num_tokens=new))
    got = step.cache
    for name in ("k", "v"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
    np.testing.assert_array_equal(got.table.packed[:-1], want.table.packed[:-1])
    np.testing.assert_array_equal(got.stats.counts, want.stats.counts)
