"""Each hole an adversarial review found in the cache, as a test (the model-based test in
test_allocator_model.py searches the same space at random; these pin the named cases).

Written watermarks: attention reads only tokens appended at its layer; append writes at the
watermark and refuses rows past the reservation. Totality inside a user's jit: duplicates,
out-of-range values, int32 extremes, self-forks, PAD and idle sources, bad layers are refused
and counted, never corrupting. Host checks: integers checked before any cast, clear errors.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj

LAYOUT = aj.KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=16, page_size=4, num_pages=8, max_seqs=4, max_pages_per_seq=4, dtype="float32"
)
BACKENDS = ["reference", "pallas"]
ATTEND_BACKENDS = BACKENDS + ["xla"]  # "xla" appends as "reference" does; it differs in attention only


def kv(n, value, batch=1):
    return jnp.full((batch, n, 1, 16), value, jnp.float32)


def fill(cache, slot, n, value, layers=(0, 1), backend="reference"):
    cache, ok = aj.reserve(cache, [slot], n)
    assert bool(ok[0])
    for layer in layers:
        cache = aj.append(cache, layer, [slot], kv(n, value), kv(n, value), backend=backend)
    return cache


def slot_values(cache, slot, layer=0):
    """K values (first lane) of a slot's reserved positions, through its page table."""
    n = int(cache.table.lengths[slot])
    pos = np.arange(n)
    pages = np.asarray(cache.table.page_map[slot])[pos // LAYOUT.page_size]
    return np.asarray(cache.k)[layer, 0, pages, pos % LAYOUT.page_size, 0]


def snapshot(cache):
    return jax.tree_util.tree_map(np.array, cache)


def table_invariants(cache):
    t = cache.table
    page_map, refcount, num_free = np.asarray(t.page_map), np.asarray(t.refcount), int(t.num_free)
    held = np.asarray(t.held)
    counts = np.zeros(LAYOUT.num_pages, int)
    np.add.at(counts, page_map[page_map >= 0], 1)
    np.testing.assert_array_equal(refcount, counts + (held > 0))  # the prefix cache's hold is one more reference
    assert ((held >= 0) & (held <= LAYOUT.page_size)).all()
    free = np.asarray(t.free_stack)[:num_free]
    assert 0 <= num_free <= LAYOUT.num_pages and len(set(free.tolist())) == num_free and not refcount[free].any()
    assert num_free + np.count_nonzero(refcount) == LAYOUT.num_pages
    assert (np.asarray(t.written) <= np.asarray(t.lengths)[None, :]).all()


# ---- stale data never reaches attention ------------------------------------------------------------


@pytest.mark.parametrize("backend", ATTEND_BACKENDS)
@pytest.mark.parametrize("stale", [7.0, np.nan])
def test_reserved_but_unwritten_positions_are_never_read(backend, stale):
    """A slot reserves 8, appends 3 and attends: it sees its 3 tokens, not the earlier tenant's 5."""
    cache = fill(aj.create(LAYOUT), 0, 8, stale)
    cache = aj.release(cache, [0])
    cache, _ = aj.reserve(cache, [1], 8)  # the tenant's pages, LIFO
    cache = aj.append(cache, 0, [1], kv(3, 1.0), kv(3, 1.0), backend=backend)
    out = aj.attend(jnp.ones((1, 1, 1, 16)), cache, 0, [1], backend=backend)
    np.testing.assert_allclose(out, 1.0, rtol=1e-6)  # the mean of its own V (all ones), nothing stale


@pytest.mark.parametrize("backend", ATTEND_BACKENDS)
def test_attend_before_append_is_an_error_on_the_host_and_zeros_in_jit(backend):
    cache = fill(aj.create(LAYOUT), 0, 3, 5.0)
    cache, _ = aj.reserve(cache, [0], 2)  # reserved, not appended
    with pytest.raises(ValueError, match="written at layer 0"):
        aj.attend(jnp.ones((1, 5, 1, 16)), cache, 0, [0], backend=backend)
    traced = jax.jit(lambda q, c, s, n: aj.attend(q, c, 0, s, num_tokens=n, backend=backend))
    out = traced(jnp.ones((2, 5, 1, 16)), cache, jnp.array([0, 0]), jnp.array([5, 3]))
    assert not np.asarray(out[0]).any(), "asked for 5 query tokens of 3 written: zeros"
    np.testing.assert_allclose(out[1, :3], 5.0, rtol=1e-6)  # the 3 written tokens attend to themselves


@pytest.mark.parametrize("backend", ATTEND_BACKENDS)
def test_a_layer_sees_only_what_was_appended_at_that_layer(backend):
    cache = fill(aj.create(LAYOUT), 0, 4, 2.0)
    cache, _ = aj.reserve(cache, [0], 4)
    cache = aj.append(cache, 0, [0], kv(4, 6.0), kv(4, 6.0), backend=backend)  # layer 0 only
    np.testing.assert_array_equal(cache.table.written[:, 0], [8, 4])
    q = jnp.ones((1, 1, 1, 16))
    np.testing.assert_allclose(aj.attend(q, cache, 1, [0], backend=backend), 2.0, rtol=1e-6)
    assert aj.health(cache)["reserved_unwritten_tokens"] == 4


# ---- append never overwrites -------------------------------------------------------------------------


append_in_jit = jax.jit(lambda c, layer, s, k, v, backend: aj.append(c, layer, s, k, v, backend=backend),
                        static_argnums=5, donate_argnums=0)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_after_a_failed_reservation_writes_nothing_and_is_counted(backend):
    cache = fill(aj.create(LAYOUT), 0, 16, 1.0)  # 4 pages
    cache = fill(cache, 2, 4, 3.0)  # 1 page
    cache = fill(cache, 1, 12, 2.0)  # 3 pages: the arena's 8 are taken
    cache, ok = aj.reserve(cache, [1], 3)  # needs a 9th page
    assert not bool(ok[0])
    before = slot_values(cache, 1)
    with pytest.raises(ValueError, match="would pass its reservation .* aj.reserve them first"):  # on the host
        aj.append(cache, 0, [1], kv(3, 9.0), kv(3, 9.0), backend=backend)
    cache = append_in_jit(cache, 0, jnp.asarray([1]), kv(3, 9.0), kv(3, 9.0), backend)  # inside jit: total, counted
    np.testing.assert_array_equal(slot_values(cache, 1), before)
    assert int(cache.stats.dropped_writes) == 1
    np.testing.assert_array_equal(cache.table.written[:, 1], [12, 12])


@pytest.mark.parametrize("backend", BACKENDS)
def test_append_without_or_beyond_a_reservation_writes_nothing(backend):
    cache = fill(aj.create(LAYOUT), 0, 5, 1.0)
    with pytest.raises(ValueError, match=r"slots\[0\]=0: appending 2 tokens at layer 0 would pass its reservation"):
        aj.append(cache, 0, [0], kv(2, 9.0), kv(2, 9.0), backend=backend)
    with pytest.raises(ValueError, match=r"slots\[0\]=3 has no reservation .* call aj.reserve"):
        aj.append(cache, 0, [3], kv(2, 9.0), kv(2, 9.0), backend=backend)
    cache = append_in_jit(cache, 0, jnp.asarray([0]), kv(2, 9.0), kv(2, 9.0), backend)  # no reservation
    cache, _ = aj.reserve(cache, [0], 2)
    cache = append_in_jit(cache, 0, jnp.asarray([0]), kv(3, 9.0), kv(3, 9.0), backend)  # 3 > 2 reserved
    np.testing.assert_array_equal(slot_values(cache, 0)[:5], 1.0)
    assert int(cache.stats.dropped_writes) == 2 and int(cache.stats.tokens_written) == 5
    cache = aj.append(cache, 0, [0], kv(2, 3.0), kv(2, 3.0), backend=backend)  # exactly the reservation
    np.testing.assert_array_equal(slot_values(cache, 0), [1, 1, 1, 1, 1, 3, 3])


def test_append_refuses_a_shared_page_even_if_the_table_were_inconsistent():
    """The second wall: reserved positions lie in private pages by construction (reserve copies a
    shared last page, fork refuses unsettled sources), so this needs a hand-made table."""
    cache = fill(aj.create(LAYOUT), 0, 2, 1.0)
    cache = aj.fork(cache, [0], [1])
    t = cache.table  # give slot 1 a pending reservation inside the shared page
    cache = cache.replace(table=t.replace(lengths=t.lengths.at[1].set(4)))
    cache = append_in_jit(cache, 0, jnp.asarray([1]), kv(2, 9.0), kv(2, 9.0), "reference")
    np.testing.assert_array_equal(slot_values(cache, 0), [1, 1])
    assert int(cache.stats.dropped_writes) == 1


# ---- totality inside a user's jit -------------------------------------------------------------------

reserve_in_jit = jax.jit(lambda c, s, n: aj.reserve(c, s, n), donate_argnums=0)
release_in_jit = jax.jit(lambda c, s: aj.release(c, s), donate_argnums=0)
fork_in_jit = jax.jit(lambda c, s, d: aj.fork(c, s, d), donate_argnums=0)
truncate_in_jit = jax.jit(lambda c, s, n: aj.truncate(c, s, n), donate_argnums=0)


def test_duplicate_release_after_fork_frees_nothing_the_other_slot_maps():
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    cache = aj.fork(cache, [0], [1])
    cache = release_in_jit(cache, jnp.array([1, 1]))
    table_invariants(cache)
    assert int(cache.stats.rejected_rows) == 1 and int(cache.table.num_free) == LAYOUT.num_pages - 2
    cache = fill(cache, 2, 8, 5.0)  # a new sequence takes free pages only
    np.testing.assert_array_equal(slot_values(cache, 0), 1.0)


def test_duplicate_rows_in_reserve_and_fork_serve_the_first_and_count_the_rest():
    cache = fill(aj.create(LAYOUT), 0, 4, 1.0)
    cache, ok = reserve_in_jit(cache, jnp.array([1, 1, 1]), jnp.array([3, 5, 9]))
    np.testing.assert_array_equal(ok, [True, False, False])
    assert int(cache.table.lengths[1]) == 3 and int(cache.stats.rejected_rows) == 2
    cache = aj.append(cache, 0, [1], kv(3, 2.0), kv(3, 2.0))
    cache = aj.append(cache, 1, [1], kv(3, 2.0), kv(3, 2.0))
    cache = fork_in_jit(cache, jnp.array([0, 1]), jnp.array([2, 2]))  # dst 2 twice: the first wins
    table_invariants(cache)
    np.testing.assert_array_equal(slot_values(cache, 2), 1.0)
    assert int(cache.stats.rejected_rows) == 3


def test_a_reservation_that_would_overflow_int32_is_refused():
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    before = int(cache.table.num_free)
    cache, ok = reserve_in_jit(cache, jnp.array([0, 1]), jnp.array([2**31 - 1, -(2**31)]))
    assert not np.asarray(ok).any()
    assert int(cache.table.num_free) == before and int(cache.table.lengths[0]) == 6
    assert int(cache.stats.rejected_rows) == 2 and int(cache.stats.failed_reservations) == 0
    table_invariants(cache)


@pytest.mark.parametrize("src", [1, aj.PAD_SLOT, 3, 7, -5], ids=["self", "pad", "idle", "out of range", "negative"])
def test_a_fork_that_cannot_be_served_leaves_the_destination_intact(src):
    cache = fill(aj.create(LAYOUT), 1, 6, 4.0)
    before = snapshot(cache.table)
    cache = fork_in_jit(cache, jnp.array([src]), jnp.array([1]))
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot(cache.table), before)
    assert int(cache.stats.rejected_rows) == 1


def test_fork_refuses_a_source_with_a_pending_reservation():
    cache = fill(aj.create(LAYOUT), 0, 3, 1.0)
    cache, _ = aj.reserve(cache, [0], 2)
    with pytest.raises(ValueError, match="not yet written"):
        aj.fork(cache, [0], [1])
    cache = fork_in_jit(cache, jnp.array([0]), jnp.array([1]))
    assert not bool(cache.table.active[1]) and int(cache.stats.rejected_rows) == 1
    table_invariants(cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_counts_and_out_of_range_layers_write_nothing_on_either_backend(backend):
    cache = fill(aj.create(LAYOUT), 0, 3, 1.0)
    cache, _ = aj.reserve(cache, [0], 3)
    step = jax.jit(lambda c, layer, s, n: aj.append(c, layer, s, kv(3, 9.0), kv(3, 9.0), num_tokens=n, backend=backend),
                   donate_argnums=0)  # fmt: skip
    k_before = np.asarray(cache.k)
    for layer, n in ((0, -2), (2, 3), (-1, 3), (2**31 - 1, 3)):
        cache = step(cache, jnp.int32(layer), jnp.array([0]), jnp.array([n]))
    np.testing.assert_array_equal(np.asarray(cache.k), k_before)
    assert int(cache.stats.tokens_written) == 3 and int(cache.stats.rejected_rows) == 4
    np.testing.assert_array_equal(cache.table.written[:, 0], [3, 3])


def test_truncate_refuses_growth_and_negative_lengths_in_jit():
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    cache = truncate_in_jit(cache, jnp.array([0, 0, 1]), jnp.array([9, 2, -1]))
    assert int(cache.table.lengths[0]) == 6 and int(cache.stats.rejected_rows) == 3
    cache = truncate_in_jit(cache, jnp.array([0]), jnp.array([2]))
    assert int(cache.table.lengths[0]) == 2
    np.testing.assert_array_equal(cache.table.written[:, 0], [2, 2])
    table_invariants(cache)


# ---- the host path: no silent wrong values, clear errors --------------------------------------------

HOST_ERRORS = {
    "int64 slot wraps": (lambda c: aj.reserve(c, np.array([2**32 + 2], np.int64), 1), "outside int32"),
    "python slot wraps": (lambda c: aj.release(c, [2**32 + 2]), "outside int32"),
    "int64 count wraps": (lambda c: aj.reserve(c, [1], np.array([2**32 + 1], np.int64)), "outside int32"),
    "int64 layer wraps": (lambda c: aj.append(c, np.int64(2**32), [0], kv(1, 0.0), kv(1, 0.0)), "outside int32"),
    "huge truncate": (lambda c: aj.truncate(c, [0], [2**40]), "outside int32"),
    "float slot": (lambda c: aj.release(c, [1.0]), "integers"),
    "bool slot": (lambda c: aj.release(c, [True]), "integers"),
    "string count": (lambda c: aj.reserve(c, [1], ["5"]), "integers"),
    "k as a list": (lambda c: aj.append(c, 0, [0], [[[[0.0] * 16]]], kv(1, 0.0)), "k must be a JAX or numpy array"),
    "q as a list": (lambda c: aj.attend([[[[0.0] * 16]]], c, 0, [0]), "q must be a JAX or numpy array"),
    "window of zero": (lambda c: aj.attend(jnp.ones((1, 1, 1, 16)), c, 0, [0], sliding_window=0), "sliding_window"),
    "window as bool": (lambda c: aj.attend(jnp.ones((1, 1, 1, 16)), c, 0, [0], sliding_window=True), "sliding_window"),
    "nan sm_scale": (lambda c: aj.attend(jnp.ones((1, 1, 1, 16)), c, 0, [0], sm_scale=float("nan")), "sm_scale"),
    "window as float": (lambda c: aj.attend(jnp.ones((1, 1, 1, 16)), c, 0, [0], sliding_window=4.0), "sliding_window"),
    "negative window array": (lambda c: aj.attend(jnp.ones((1, 1, 1, 16)), c, 0, [0], sliding_window=jnp.int32(-2)),
                              "sliding_window"),
    "zero soft cap": (lambda c: aj.attend(jnp.ones((1, 1, 1, 16)), c, 0, [0], logits_soft_cap=0.0), "logits_soft_cap"),
    "inf soft cap": (lambda c: aj.attend(jnp.ones((1, 1, 1, 16)), c, 0, [0], logits_soft_cap=float("inf")),
                     "logits_soft_cap"),
    "soft cap as bool": (lambda c: aj.attend(jnp.ones((1, 1, 1, 16)), c, 0, [0], logits_soft_cap=True), "logits_soft_cap"),
    "fork from PAD": (lambda c: aj.fork(c, [aj.PAD_SLOT], [1]), "PAD_SLOT"),
}


@pytest.mark.parametrize("case", list(HOST_ERRORS))
def test_host_errors_name_the_argument_and_leave_the_cache_untouched(case):
    call, needle = HOST_ERRORS[case]
    cache = fill(aj.create(LAYOUT), 0, 3, 1.0)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=needle):
        call(cache)
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot(cache), before)


def test_float64_arena_is_refused():
    with pytest.raises(ValueError, match="float64"):
        aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, num_pages=1, max_seqs=1, max_pages_per_seq=1, dtype="float64")


def test_sm_scale_may_be_a_concrete_jax_scalar_but_not_a_traced_one():
    cache = fill(aj.create(LAYOUT), 0, 3, 1.0)
    q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
    np.testing.assert_allclose(aj.attend(q, cache, 0, [0], sm_scale=jnp.float32(0.5)), aj.attend(q, cache, 0, [0], sm_scale=0.5))
    with pytest.raises(ValueError, match="concrete"):
        jax.jit(lambda s: aj.attend(q, cache, 0, [0], sm_scale=s))(0.5)


def test_soft_cap_must_be_concrete_and_a_traced_window_an_integer_scalar():
    cache = fill(aj.create(LAYOUT), 0, 3, 1.0)
    q = jnp.ones((1, 1, 1, 16))
    with pytest.raises(ValueError, match="logits_soft_cap must be a concrete number"):
        jax.jit(lambda cap: aj.attend(q, cache, 0, [0], logits_soft_cap=cap))(30.0)
    for bad in (jnp.float32(4.0), jnp.ones(2, jnp.int32), jnp.bool_(True)):
        with pytest.raises(ValueError, match="sliding_window must be a positive int, None or a traced integer scalar"):
            jax.jit(lambda w: aj.attend(q, cache, 0, [0], sliding_window=w))(bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_longer_than_any_sequence_is_no_window(backend):
    cache = fill(aj.create(LAYOUT), 0, 9, 1.0)
    cache, _ = aj.reserve(cache, [0], 1)
    cache = aj.append(cache, 0, [0], kv(1, 3.0), kv(1, 3.0))
    q = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
    want = aj.attend(q, cache, 0, [0], backend=backend)
    np.testing.assert_array_equal(aj.attend(q, cache, 0, [0], sliding_window=10**30, backend=backend), want)
    np.testing.assert_array_equal(aj.attend(q, cache, 0, [0], sliding_window=LAYOUT.max_seq_len, backend=backend), want)


def test_nan_in_a_sequences_own_inputs_propagates_alike_on_both_backends():
    cache = aj.create(LAYOUT)
    cache = fill(cache, 0, 5, 1.0)
    cache = fill(cache, 1, 5, 1.0)
    cache, _ = aj.reserve(cache, [1], 1)
    cache = aj.append(cache, 0, [1], kv(1, np.nan), kv(1, 2.0))  # slot 1's own K holds NaN
    q = jnp.ones((2, 1, 1, 16)).at[0, 0, 0, 3].set(jnp.nan)  # slot 0's query holds NaN
    outs = [np.asarray(aj.attend(q, cache, 0, [0, 1], backend=b)) for b in ATTEND_BACKENDS]
    for out in outs:
        assert np.isnan(out).all()


def test_a_geometry_the_kernels_cannot_take_is_refused_at_the_call():
    small = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4, num_pages=2, max_seqs=1, max_pages_per_seq=2, dtype="float32")
    with pytest.raises(ValueError, match="head_dim=4"):
        aj.attend(jnp.ones((1, 1, 1, 4)), aj.create(small), 0, [aj.PAD_SLOT], backend="pallas")
