"""Targeted allocator tests: copy-on-write, LIFO reuse, admission order, bad input, health."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj

LAYOUT = aj.KVLayout(
    num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=8, max_seqs=4, max_pages_per_seq=4, dtype="float32"
)


def snapshot(cache):
    """A host copy of every array (ops donate the cache passed in)."""
    return jax.tree_util.tree_map(np.array, cache)


def assert_same(a, b):
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def fill(cache, slot, n, seed):
    """Reserve and append n random tokens to one slot at every layer; return (cache, k, v)."""
    cache, ok = aj.reserve(cache, [slot], n)
    assert bool(ok[0])
    key = jax.random.key(seed)
    shape = (1, n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    k, v = jax.random.normal(key, (2, LAYOUT.num_layers) + shape)
    for layer in range(LAYOUT.num_layers):
        cache = aj.append(cache, layer, [slot], k[layer], v[layer])
    return cache, k, v


def slot_data(cache, slot):
    """[L, H, len, D] of a slot's K, gathered through its page table on the host."""
    pm, n = np.asarray(cache.table.page_map[slot]), int(cache.table.lengths[slot])
    pos = np.arange(n)
    return np.asarray(cache.k)[:, :, pm[pos // LAYOUT.page_size], pos % LAYOUT.page_size]


def pages_in_use(cache):
    return LAYOUT.num_pages - int(cache.table.num_free)


# ---- copy-on-write -----------------------------------------------------------------------


@pytest.mark.parametrize("writer", ["child", "parent", "both", "both_child_first"])
def test_copy_on_write_keeps_parent_bytes_and_copies_one_page(writer):
    cache = aj.create(LAYOUT)
    cache, _, _ = fill(cache, 0, 6, seed=0)  # 1.5 pages: the last one partly filled
    cache = aj.fork(cache, [0], [1])
    parent_before = slot_data(cache, 0)
    used_before = pages_in_use(cache)
    slots = {"child": [1], "parent": [0], "both": [0, 1], "both_child_first": [1, 0]}[writer]

    cache, ok = aj.reserve(cache, slots, 1)
    assert np.asarray(ok).all()
    new = jax.random.normal(jax.random.key(1), (len(slots), 1, LAYOUT.num_kv_heads, LAYOUT.head_dim))
    for layer in range(LAYOUT.num_layers):
        cache = aj.append(cache, layer, slots, new, new)

    assert int(cache.stats.cow_copies) == 1, "exactly one page copied"
    assert pages_in_use(cache) == used_before + 1
    shared_prefix = slot_data(cache, 0)[:, :, :6]
    np.testing.assert_array_equal(shared_prefix, parent_before, err_msg="parent's tokens changed")
    np.testing.assert_array_equal(slot_data(cache, 1)[:, :, :6], parent_before, err_msg="child's prefix differs")
    for row, slot in enumerate(slots):
        np.testing.assert_array_equal(slot_data(cache, slot)[:, :, 6], np.broadcast_to(new[row, 0], (2, 2, 16)))
    if writer.startswith("both"):  # the two writes landed on different pages
        assert cache.table.page_map[0, 1] != cache.table.page_map[1, 1]
    # Full pages stay shared: no copy of the first page.
    assert cache.table.page_map[0, 0] == cache.table.page_map[1, 0]


def test_copy_on_write_without_a_free_page_fails_cleanly():
    cache = aj.create(LAYOUT)
    cache, _, _ = fill(cache, 0, 6, seed=0)  # 2 pages
    cache = aj.fork(cache, [0], [1])
    cache, ok = aj.reserve(cache, [2, 3], jnp.array([16, 8]))  # the other 6 pages
    assert np.asarray(ok).all() and int(cache.table.num_free) == 0
    before = snapshot(cache)

    cache, ok = aj.reserve(cache, [1], 1)  # needs a private copy of the shared half page: none left
    assert not bool(ok[0])
    after = snapshot(cache)
    assert_same(after.k, before.k)
    assert_same(after.table, before.table)
    assert int(cache.stats.failed_reservations) == int(before.stats.failed_reservations) + 1

    # Appending anyway (ignoring ok) must not write into the page the parent still holds.
    parent = slot_data(cache, 0)
    x = jnp.full((1, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim), 7.0)
    cache = jax.jit(lambda c: aj.append(c, 0, [1], x, x), donate_argnums=0)(cache)  # in jit: dropped and counted
    np.testing.assert_array_equal(slot_data(cache, 0), parent)
    assert int(cache.stats.dropped_writes) == 1


# ---- free stack and admission ---------------------------------------------------------------


def test_lifo_reuses_the_most_recently_freed_pages_first():
    cache = aj.create(LAYOUT)
    cache, _ = aj.reserve(cache, [0, 1], jnp.array([4, 8]))  # slot 0: 1 page, slot 1: 2 pages
    freed = set(np.asarray(cache.table.page_map[1, :2]).tolist())
    cache = aj.release(cache, [1])
    cache, _ = aj.reserve(cache, [2], 8)
    assert set(np.asarray(cache.table.page_map[2, :2]).tolist()) == freed
    assert int(cache.stats.pages_recycled) == 2


def test_fresh_arena_hands_out_pages_in_order():
    cache = aj.create(LAYOUT)
    cache, _ = aj.reserve(cache, [0], 12)
    np.testing.assert_array_equal(cache.table.page_map[0, :3], [0, 1, 2])


def test_in_page_extension_is_served_when_pages_run_out():
    cache = aj.create(LAYOUT)
    cache, _ = aj.reserve(cache, [0, 1, 2], jnp.array([2, 16, 12]))  # 1 + 4 + 3 pages: arena full
    assert int(cache.table.num_free) == 0
    cache, ok = aj.reserve(cache, [2, 0], jnp.array([4, 1]))  # slot 2 needs a page; slot 0 fits in its page
    np.testing.assert_array_equal(ok, [False, True])
    assert int(cache.table.lengths[0]) == 3 and int(cache.table.lengths[2]) == 12
    assert int(cache.stats.metadata_ops) == 1


def test_admission_is_first_come_first_served_in_batch_order():
    cache = aj.create(LAYOUT)
    cache, _ = aj.reserve(cache, [3], 12)  # 3 pages: 5 left
    # 4 + 2 + 1 pages: row 1 does not fit, and row 2 (which alone would) does not overtake it.
    cache, ok = aj.reserve(cache, [0, 1, 2], jnp.array([16, 8, 4]))
    np.testing.assert_array_equal(ok, [True, False, False])
    np.testing.assert_array_equal(cache.table.lengths[:3], [16, 0, 0])
    assert not bool(cache.table.active[1])


def test_padded_rows_do_nothing():
    cache = aj.create(LAYOUT)
    cache, ok = aj.reserve(cache, [aj.PAD_SLOT, 0], jnp.array([4, 4]))
    np.testing.assert_array_equal(ok, [True, True])
    assert int(cache.table.num_free) == LAYOUT.num_pages - 1
    x = jnp.ones((2, 4, LAYOUT.num_kv_heads, LAYOUT.head_dim)).at[0].set(5.0)  # row 0 is the padded one
    cache = aj.append(cache, 0, [aj.PAD_SLOT, 0], x, x)
    assert np.count_nonzero(np.asarray(cache.k) == 5) == 0, "a padded row wrote into the arena"


def test_truncate_releases_whole_pages_and_regrows():
    cache = aj.create(LAYOUT)
    cache, k, _ = fill(cache, 0, 11, seed=3)  # 3 pages
    cache = aj.truncate(cache, [0], [5])  # keeps 2 pages
    assert pages_in_use(cache) == 2 and int(cache.table.lengths[0]) == 5
    np.testing.assert_array_equal(slot_data(cache, 0), np.asarray(k[:, 0, :5]).transpose(0, 2, 1, 3))
    cache, ok = aj.reserve(cache, [0], 4)
    assert bool(ok[0]) and pages_in_use(cache) == 3


# ---- bad input: ValueError naming the argument and the limit; the cache untouched --------------


BAD_CALLS = {
    "slot out of range": (lambda c: aj.reserve(c, [4], 1), "max_seqs=4"),
    "negative slot": (lambda c: aj.reserve(c, [-2], 1), "slots"),
    "duplicate slots": (lambda c: aj.reserve(c, [1, 1], 1), "duplicate"),
    "too many tokens": (lambda c: aj.reserve(c, [1], 17), "16"),
    "grow past the limit": (lambda c: aj.reserve(c, [0], 14), "16"),
    "negative tokens": (lambda c: aj.reserve(c, [1], -1), "num_tokens"),
    "wrong kv dtype": (lambda c: aj.append(c, 0, [0], jnp.ones((1, 1, 2, 16), jnp.bfloat16), jnp.ones((1, 1, 2, 16), jnp.bfloat16)), "float32"),
    "wrong head count": (lambda c: aj.append(c, 0, [0], jnp.ones((1, 1, 8, 16)), jnp.ones((1, 1, 8, 16))), "num_kv_heads=2"),
    "wrong head_dim": (lambda c: aj.append(c, 0, [0], jnp.ones((1, 1, 2, 8)), jnp.ones((1, 1, 2, 8))), "head_dim=16"),
    "layer out of range": (lambda c: aj.append(c, 2, [0], jnp.ones((1, 1, 2, 16)), jnp.ones((1, 1, 2, 16))), "num_layers=2"),
    "batch mismatch": (lambda c: aj.append(c, 0, [0, 1], jnp.ones((1, 1, 2, 16)), jnp.ones((1, 1, 2, 16))), "batch"),
    "q heads not a multiple": (lambda c: aj.attend(jnp.ones((1, 1, 3, 16)), c, 0, [0]), "num_kv_heads=2"),
    "truncate grows": (lambda c: aj.truncate(c, [0], [9]), "truncate only shortens"),
    "fork onto itself": (lambda c: aj.fork(c, [0], [0]), "forked onto itself"),
    "fork an idle slot": (lambda c: aj.fork(c, [3], [2]), "not in use"),
    "bad backend": (lambda c: aj.attend(jnp.ones((1, 1, 2, 16)), c, 0, [0], backend="cuda"), "backend"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_raises_and_leaves_the_cache_unchanged(case):
    call, needle = BAD_CALLS[case]
    cache, _, _ = fill(aj.create(LAYOUT), 0, 3, seed=0)
    before = snapshot(cache)
    with pytest.raises(ValueError, match=needle):
        call(cache)
    assert_same(snapshot(cache), before)


def test_layout_rejects_bad_geometry():
    with pytest.raises(ValueError, match="multiple of 16 bytes"):  # a 24-byte token row
        aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=6, page_size=2, num_pages=4, max_seqs=1, max_pages_per_seq=2, dtype="float32")
    with pytest.raises(ValueError, match="num_pages"):
        aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, page_size=16, num_pages=0, max_seqs=1, max_pages_per_seq=2)


# ---- stats and health ---------------------------------------------------------------------


def test_health_reports_utilization_waste_and_counters():
    cache = aj.create(LAYOUT)
    cache, _, _ = fill(cache, 0, 6, seed=0)  # 2 pages, 6 of 8 positions used
    cache = aj.fork(cache, [0], [1])  # sharing adds no pages
    report = aj.health(cache)
    assert report["pages_in_use"] == 2 and report["free_pages"] == 6
    assert report["tokens_held"] == 6 and report["logical_tokens"] == 12
    assert report["utilization"] == pytest.approx(6 / 8)
    assert report["internal_waste_tokens"] == 2
    assert report["shared_pages"] == 2
    assert report["tokens_written"] == 6 and report["pages_allocated"] == 2
    assert report["metadata_ops"] == 1  # the fork


def test_a_truncate_that_shortens_nothing_counts_as_nothing():
    cache, _ = aj.reserve(aj.create(LAYOUT), [0], 5)
    cache = aj.truncate(cache, [1, 2], 0)  # idle slots
    cache = aj.truncate(cache, [0], 5)  # to its own length
    assert int(cache.stats.metadata_ops) == 0 and int(cache.stats.rejected_rows) == 0
    cache = aj.truncate(cache, [0], 3)
    assert int(cache.stats.metadata_ops) == 1
