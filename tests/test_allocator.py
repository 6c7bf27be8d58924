"""Targeted allocator tests: copy-on-write, LIFO reuse, admission order, bad input, health."""
from __future__ import annotations

import dataclasses
import functools

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


def test_run_keeping_pages_fill_blocks_and_put_a_whole_block_at_its_runs_end(monkeypatch):
    """`allocator._run_pages` (scale-row arenas' choice of pages; here asked for, in blocks of
    two 4-key pages), page by page: a whole block first-fit, at its run's end unless that run ends
    the arena; a prompt's part of a block short of it, a block from the end of the first run of
    two blocks or more; a page inside a block after the row's last when free; a block's start, or
    a page whose next is taken, the lowest free; a prefill continuing a block from its last page;
    no run that holds a block: the lowest free pages. The free stack: the free pages, lowest on
    top."""
    from arena_jax import allocator

    monkeypatch.setattr(allocator, "RUN_BLOCK_KEYS", 8)  # read when traced: a jit of this test's own
    reserve_runs = jax.jit(functools.partial(allocator.reserve_impl, run_pages=True))

    def reserve(cache, slots, tokens):  # padded to 4 rows: one compile per arena size
        pad = 4 - len(slots)
        slots, tokens = jnp.array(slots + [aj.PAD_SLOT] * pad), jnp.array(tokens + [0] * pad)
        cache, ok = reserve_runs(cache, slots, tokens)
        assert np.asarray(ok).all()
        return cache

    def pages(cache, slot):
        row = np.asarray(cache.table.page_map[slot])
        return row[row >= 0].tolist()

    def free(cache):
        n = int(cache.table.num_free)
        return np.asarray(cache.table.free_stack[:n])[::-1].tolist()  # top first

    cache = aj.create(dataclasses.replace(LAYOUT, num_pages=12, max_pages_per_seq=8))
    cache = reserve(cache, [0], [16])  # two whole blocks; the run ends the arena: from its start
    cache = reserve(cache, [1], [24])
    assert pages(cache, 0) == [0, 1, 2, 3] and pages(cache, 1) == [4, 5, 6, 7, 8, 9]
    cache = aj.release(cache, [0])  # free: 0-3, 10, 11
    cache = reserve(cache, [2], [8])  # a whole block: the run 0-3's end
    assert pages(cache, 2) == [2, 3] and free(cache) == [0, 1, 10, 11]
    cache = reserve(cache, [3], [4])  # a page at a block's start: the lowest free
    cache = reserve(cache, [3], [4])  # inside the block: the page after its last
    assert pages(cache, 3) == [0, 1]
    cache = reserve(cache, [2], [4])  # a block's start: the lowest free
    assert pages(cache, 2) == [2, 3, 10]
    cache = aj.release(cache, [1])  # free: 4-9, 11
    cache = reserve(cache, [2], [6])  # its block's rest after its last (11), then a block's first part
    assert pages(cache, 2) == [2, 3, 10, 11, 8]  # from the end of the first run of two blocks (4-9) less a block
    assert free(cache) == [4, 5, 6, 7, 9]

    cache = aj.create(dataclasses.replace(LAYOUT, num_pages=12))
    cache = reserve(cache, [0], [4])
    cache = reserve(cache, [1], [8])
    cache = aj.release(cache, [0])  # free: 0, 3-11
    cache = reserve(cache, [1], [4])  # a block's start: the lowest free, not the (free) page after its last
    assert pages(cache, 1) == [1, 2, 0]

    cache = aj.create(dataclasses.replace(LAYOUT, num_pages=8))
    cache = reserve(cache, [0, 1, 2], [4, 4, 4])
    cache = reserve(cache, [0], [8])  # the page after its last is taken: the lowest free (3), then a
    assert pages(cache, 0) == [0, 3, 6]  # block's first part from the end of the run 4-7 less a block

    cache = aj.create(dataclasses.replace(LAYOUT, num_pages=11, max_pages_per_seq=8))
    cache = reserve(cache, [2], [8])
    cache = reserve(cache, [2], [16])
    cache = reserve(cache, [3], [12])  # a block, then a block's first part with no run of two blocks free:
    assert pages(cache, 2) == [0, 1, 2, 3, 4, 5] and pages(cache, 3) == [6, 7, 8]  # the first run's start

    cache = aj.create(dataclasses.replace(LAYOUT, num_pages=6))
    cache = reserve(cache, [0, 1, 2, 3], [4, 4, 4, 4])
    cache = reserve(cache, [1], [4])  # the page after its last is taken: the lowest free
    assert [pages(cache, s) for s in range(4)] == [[0], [1, 4], [2], [3]]
    cache = aj.release(cache, [0, 2])  # free: 0, 2, 5 (no two in a row)
    cache = reserve(cache, [0], [8])  # no run holds the block: the lowest free pages
    assert pages(cache, 0) == [0, 2] and free(cache) == [5]


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
    assert np.asarray(cache.table.written[:, 0]).tolist() == [5] * LAYOUT.num_layers  # every layer's watermark cut
    assert bool(cache.table.active[0])
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


# ---- reserve's in-place branch against the allocator ---------------------------------------


def _reserve_with(grow):
    """`reserve_impl` jitted, with `grow` as its in-place branch (the allocator itself: the reference)."""
    from arena_jax import allocator

    def run(cache, slots, n):
        saved = allocator._grow_in_place
        allocator._grow_in_place = grow
        try:
            return allocator.reserve_impl(cache, slots, n)
        finally:
            allocator._grow_in_place = saved

    return jax.jit(run)


def test_reserve_in_place_branch_equals_the_allocator_on_random_calls():
    """On fresh random states and calls (duplicate, padded, out-of-range slots, bad counts,
    forks sharing a partly filled page), `reserve` with its in-place branch gives the same
    cache and ok as with the allocator on both branches; the calls take the in-place branch
    often (a decode-like step: rows inside their last page) and not always."""
    from arena_jax import allocator

    fast, reference = _reserve_with(allocator._grow_in_place), _reserve_with(allocator._allocate_and_map)
    rng = np.random.default_rng(0)
    took = []
    for trial in range(40):
        cache = aj.create(LAYOUT)
        for slot in range(3):  # some slots hold tokens; a fork shares a partly filled page
            n = int(rng.integers(0, 7))
            if n:
                cache, _, _ = fill(cache, slot, n, seed=3 * trial + slot)
        if rng.random() < 0.5 and int(cache.table.lengths[0]) > 0:
            cache = aj.fork(cache, [0], [3])
        lengths = np.asarray(cache.table.lengths)
        slots = rng.choice([-1, 0, 1, 2, 3, 3, 4, 7], size=4).astype(np.int32)
        inside = (LAYOUT.page_size - lengths % LAYOUT.page_size) % LAYOUT.page_size  # room in the last page
        room = np.where((slots >= 0) & (slots < 4), inside[np.clip(slots, 0, 3)], 1)
        n = np.where(rng.random(4) < 0.7, np.minimum(room, 1), rng.integers(-1, 9, 4)).astype(np.int32)
        want = jax.device_get(reference(snapshot(cache), slots, n))
        got = jax.device_get(fast(snapshot(cache), slots, n))
        assert_same(got, want)
        took.append(int(got[0].stats.pages_allocated) == int(cache.stats.pages_allocated))  # no page popped
    assert 5 < sum(took) < len(took), took


def test_stats_are_one_vector_read_by_name():
    """`CacheStats` packs the counters in one i32[N] (`STAT_NAMES` order); `bump` sums per-row
    flags and counts of any shape with scalars, each into its own counter, and refuses a name it
    does not know."""
    from arena_jax.kv_cache import STAT_NAMES, CacheStats

    stats = CacheStats.zeros()
    assert stats.counts.shape == (len(STAT_NAMES),) and jax.tree_util.tree_leaves(stats) == [stats.counts]
    stats = stats.bump(rejected_rows=jnp.array([True, False, True]), pages_allocated=3,
                       tokens_written=jnp.array([2, 5, 0]), cow_copies=jnp.ones((2, 2), bool))  # fmt: skip
    stats = jax.jit(lambda s: s.bump(rejected_rows=1, swap_ins=jnp.array([1, 1])))(stats)
    want = dict.fromkeys(STAT_NAMES, 0) | dict(rejected_rows=3, pages_allocated=3, tokens_written=7, cow_copies=4, swap_ins=2)
    assert {name: int(v) for name, v in stats.as_dict().items()} == want
    assert {name: int(getattr(stats, name)) for name in STAT_NAMES} == want
    with pytest.raises(TypeError, match="unknown counters \\['page_alocated'\\]"):
        stats.bump(page_alocated=1)
    # Counters of 2 data shards ([2, N], as a sharded cache holds them): per-row counts, rows in
    # shard order (the first half shard 0's), each shard's summed into its own row.
    sharded = CacheStats(counts=jnp.zeros((2, len(STAT_NAMES)), jnp.int32)).bump(
        proposed_tokens=jnp.array([1, 2, 3, 4]), accepted_tokens=jnp.array([True, False, True, True]))
    assert np.asarray(sharded.proposed_tokens).tolist() == [3, 7]
    assert np.asarray(sharded.accepted_tokens).tolist() == [1, 2]
    with pytest.raises(ValueError, match="counters of 2 data shards take per-row counts"):
        sharded.bump(proposed_tokens=1)


def _random_fields(rng, layout):
    s, m, p, n_layers = layout.max_seqs, layout.max_pages_per_seq, layout.num_pages, layout.num_layers
    return dict(page_map=rng.integers(-1, p, (s, m)), lengths=rng.integers(0, 99, s), active=rng.random(s) < 0.5,
                free_stack=rng.permutation(p), num_free=rng.integers(0, p + 1), refcount=rng.integers(0, 3, p),
                written=rng.integers(0, 99, (n_layers, s)), held=rng.integers(0, 5, p), arena_id=rng.integers(1, 2**31 - 1),
                epoch=rng.integers(0, 9))  # fmt: skip


def _fields(table):
    from arena_jax.kv_cache import PAGE_TABLE_FIELDS

    return {name: np.asarray(getattr(table, name)) for name in PAGE_TABLE_FIELDS}


def test_page_table_is_one_array_read_and_replaced_by_field():
    """The ten fields live in one array (`packed`: the regions `page_map`, `slot_words`,
    `page_words`, `words`): each reads back what it was given, `replace(<field>=...)` and
    `replace(<region>=...)` change that field or region alone (in and out of jit), and
    `set_slots` (the hot paths' one scatter) equals the `.at[...].set` it stands for, rows out of
    range dropped (a row past the slots must not land in the next region)."""
    from arena_jax.kv_cache import PAGE_TABLE_FIELDS, PageTable

    rng = np.random.default_rng(0)
    fields = _random_fields(rng, LAYOUT)
    table = PageTable.pack(**fields)
    assert len(jax.tree_util.tree_leaves(table)) == 1
    assert table.geometry == (LAYOUT.max_seqs, LAYOUT.max_pages_per_seq, LAYOUT.num_layers, LAYOUT.num_pages)
    assert {k: v.tolist() for k, v in _fields(table).items()} == {k: np.asarray(v).tolist() for k, v in fields.items()}
    assert table.active.dtype == jnp.bool_ and table.written.shape == (LAYOUT.num_layers, LAYOUT.max_seqs)
    for name in PAGE_TABLE_FIELDS:
        new = _random_fields(rng, LAYOUT)[name]
        for got in (table.replace(**{name: new}), jax.jit(lambda t, x, name=name: t.replace(**{name: x}))(table, new)):
            want = _fields(table) | {name: np.asarray(new)}
            assert {k: v.tolist() for k, v in _fields(got).items()} == {k: v.tolist() for k, v in want.items()}, name
    other = PageTable.pack(**_random_fields(rng, LAYOUT))
    for region in ("page_map", "slot_words", "page_words", "words"):
        got = jax.jit(lambda t, x, region=region: t.replace(**{region: x}))(table, getattr(other, region))
        for r in ("page_map", "slot_words", "page_words", "words"):
            np.testing.assert_array_equal(getattr(got, r), getattr(other if r == region else table, r), err_msg=region)
    with pytest.raises(TypeError, match=r"unknown fields \['lenghts'\]"):
        table.replace(lenghts=fields["lengths"])
    target = jnp.array([2, LAYOUT.max_seqs, 0, -5], jnp.int32)  # two rows out of range: dropped
    lengths, ends = jnp.array([7, 8, 9, 10], jnp.int32), jnp.array([3, 4, 5, 6], jnp.int32)
    got = table.set_slots(target, lengths=lengths, active=1, written_at=(1, ends))
    want = table.replace(lengths=table.lengths.at[target].set(lengths, mode="drop"),
                         active=table.active.at[target].set(True, mode="drop"),
                         written=table.written.at[1, target].set(ends, mode="drop"))  # fmt: skip
    assert_same(got, want)
    assert_same(table.set_slots(target), table)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scatter_region_equals_the_region_scatter_it_stands_for(seed):
    """`PageTable.scatter_region` (release's, truncate's and fork's one scatter
    into `packed`) equals `.at[rows, cols].set / .add(mode="drop")` on the region it names, rows
    out of range (negative, past the region) dropped and never landing in the next region, in and
    out of jit; and a table with data shards (a row a shard) takes the same call through its
    regions."""
    from arena_jax.kv_cache import PageTable

    rng = np.random.default_rng(seed)
    table = PageTable.pack(**_random_fields(rng, LAYOUT))
    for region in ("page_map", "slot_words", "page_words", "words"):
        view = getattr(table, region)
        num_rows, width = view.shape if view.ndim == 2 else (1, view.shape[0])
        # Distinct cells (a set to one cell twice has no order), rows from -2 to num_rows + 1.
        cells = rng.choice((num_rows + 4) * width, size=min(15, (num_rows + 4) * width), replace=False)
        rows = jnp.asarray(cells // width - 2, jnp.int32).reshape(-1, 1)
        cols = jnp.asarray(cells % width, jnp.int32).reshape(-1, 1)
        values = jnp.asarray(rng.integers(-50, 50, size=rows.shape), jnp.int32)
        dropped = jnp.where(rows < 0, num_rows, rows)  # `.at` wraps a negative index; these must be dropped
        for add in (False, True):
            at = (view if view.ndim == 2 else view[None]).at[dropped, cols]
            want = at.add(values, mode="drop") if add else at.set(values, mode="drop")
            want = table.replace(**{region: want if view.ndim == 2 else want[0]})
            for got in (table.scatter_region(region, rows, cols, values, add=add),
                        jax.jit(lambda t, r, c, x, region=region, add=add: t.scatter_region(region, r, c, x, add=add))(
                            table, rows, cols, values)):  # fmt: skip
                assert_same(got, want)
    shards = PageTable.pack(**_random_fields(rng, LAYOUT)).stacked(2)  # slots, pages in shard order; words a row a shard
    for region, rows, cols in (("slot_words", [0, LAYOUT.max_seqs + 1, 2 * LAYOUT.max_seqs, -1], [1, 0, 0, 0]),
                               ("words", [1, 0, 2, -1], [0, 0, 0, 0])):  # fmt: skip
        rows, cols, values = jnp.array(rows), jnp.array(cols), jnp.array([5, 6, 7, 8], jnp.int32)
        got = shards.scatter_region(region, rows, cols, values, add=True)
        want = getattr(shards, region).at[rows[:3], cols[:3]].add(values[:3], mode="drop")  # the negative row: dropped
        np.testing.assert_array_equal(getattr(got, region), want)


def test_a_cache_is_four_arrays():
    """What a jitted op passes, donates and aliases per call: k, v, the table's one array and
    the counters (8-bit arenas add their two scale arrays). Each array costs a call ~0.9 us on a
    CPU (benchmarks/RESULTS.md, "The page table in one array")."""
    cache = aj.create(LAYOUT)
    assert len(jax.tree_util.tree_leaves(cache)) == 4


def test_a_table_of_another_geometry_is_refused_naming_it():
    """A cache whose table is not its arena's (another layer count, pages, or a bare array) is a
    ValueError naming `cache.table`, before any op runs."""
    cache = aj.create(LAYOUT)
    for other in (dataclasses.replace(LAYOUT, num_layers=LAYOUT.num_layers + 1),
                  dataclasses.replace(LAYOUT, num_pages=LAYOUT.num_pages * 2)):
        bad = cache.replace(table=aj.create(other).table)
        with pytest.raises(ValueError, match=r"cache.table.packed .* does not hold the table of its geometry"):
            aj.reserve(bad, [0], [1])
    with pytest.raises(ValueError, match="cache.table must be a PageTable"):
        aj.reserve(cache.replace(table=cache.table.packed), [0], [1])


def test_a_cache_is_one_pytree_node_with_its_arrays_as_leaves():
    """`KVCache` flattens to its arrays in field order (the table's and the counters' inline)
    and back to equal objects of the same types, static fields kept; tree paths name the fields;
    a table or counters that are not a PageTable / CacheStats (a prefix) stay one leaf each."""
    from arena_jax.kv_cache import CacheStats, KVCache, PageTable

    cache = aj.create(dataclasses.replace(LAYOUT, dtype="int8"))
    cache = cache.replace(rotate_keys=True)
    leaves, treedef = jax.tree_util.tree_flatten(cache)
    t = cache.table
    expected = [cache.k, cache.v, t.packed, cache.stats.counts, cache.k_scale, cache.v_scale]
    assert len(leaves) == len(expected) and all(a is b for a, b in zip(leaves, expected))
    back = jax.tree_util.tree_unflatten(treedef, [np.asarray(x) + 1 for x in leaves])
    assert type(back) is KVCache and type(back.table) is PageTable and type(back.stats) is CacheStats
    assert back.rotate_keys and back.sharding is None and back.key_factors is None
    np.testing.assert_array_equal(back.table.slot_words, np.asarray(t.slot_words) + 1)
    np.testing.assert_array_equal(back.stats.counts, np.asarray(cache.stats.counts) + 1)
    np.testing.assert_array_equal(back.v_scale, np.asarray(cache.v_scale) + 1)
    assert back.replace(k=0).k == 0 and back.replace(k=0).table is back.table
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(cache)[0]]
    assert paths == [".k", ".v", ".table.packed", ".stats.counts", ".k_scale", ".v_scale"]
    assert back.table.geometry == t.geometry
    prefix = KVCache(k=1, v=2, table="table", stats="stats")
    assert jax.tree_util.tree_leaves(prefix) == [1, 2, "table", "stats"]
    doubled = jax.tree_util.tree_map(lambda spec, x: (spec, x.shape), prefix, KVCache(
        k=cache.k, v=cache.v, table=cache.table.page_map, stats=cache.stats.counts))
    assert doubled.table == ("table", cache.table.page_map.shape) and doubled.k == (1, cache.k.shape)
    assert jax.tree_util.tree_structure(cache) != jax.tree_util.tree_structure(cache.replace(rotate_keys=False))
    # flax.serialization, as for the flax.struct dataclass it was: a dict of its fields, restored
    from flax import serialization

    state = serialization.to_state_dict(back)
    assert sorted(state) == ["k", "k_scale", "key_factors", "stats", "table", "v", "v_scale"]
    assert sorted(state["table"]) == ["packed"]
    restored = serialization.from_state_dict(cache, serialization.msgpack_restore(serialization.msgpack_serialize(state)))
    assert type(restored.table) is PageTable and restored.rotate_keys
    jax.tree_util.tree_map(np.testing.assert_array_equal, restored, back)
    with pytest.raises(ValueError, match="missing fields"):
        serialization.from_state_dict(cache, {k: v for k, v in state.items() if k != "stats"})


def test_first_rows_pairwise_equals_the_scatter_min_on_random_batches(monkeypatch):
    """`first_rows` compares every pair of rows for batches up to `allocator.PAIRWISE_ROWS`, and
    scatters a min over the slots for larger ones: both give the same (in range, gather index,
    first row) on fresh random batches of duplicate, padded and out-of-range slots."""
    from arena_jax import allocator

    table = aj.create(LAYOUT).table
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    values = np.array([aj.PAD_SLOT, -5, LAYOUT.max_seqs, LAYOUT.max_seqs + 3, 2**31 - 1, *range(LAYOUT.max_seqs)])
    for _ in range(60):
        slots = jnp.asarray(rng.choice(values, size=int(rng.integers(1, 13))), jnp.int32)
        monkeypatch.setattr(allocator, "PAIRWISE_ROWS", 64)
        pairwise = allocator.first_rows(table, slots)
        monkeypatch.setattr(allocator, "PAIRWISE_ROWS", 0)
        scattered = allocator.first_rows(table, slots)
        for got, want in zip(pairwise, scattered):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"seed {seed}, slots {slots}")


def test_copying_row_is_the_ith_row_set_on_random_masks():
    """A copy loop's trip i copies `_copying_row(copies, i)`: the i-th row whose flag is set, for
    every trip the loop runs (i below the rows set), on fresh random masks of 1 to 12 rows."""
    from arena_jax import allocator

    seed = int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    row_of = jax.jit(allocator._copying_row)
    for _ in range(40):
        copies = rng.random(int(rng.integers(1, 13))) < rng.random()
        for i, want in enumerate(np.flatnonzero(copies)):
            got = int(row_of(jnp.asarray(copies), jnp.int32(i)))
            assert got == want, f"seed {seed}, copies {copies.astype(int)}, trip {i}: row {got}, want {want}"
