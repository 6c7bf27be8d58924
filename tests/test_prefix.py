"""Prefix caching: the device ops (`fork_pages` / `hold_pages` / `drop_pages`) by name, the host
index (`PrefixCache`: token-granular lookup, replacement, LRU leaves first, locks), and
`generate(prefix_cache=...)`: the same tokens as without it, under memory pressure (evictions
and preemptions) and across calls, with the host's page count equal to the device's.

The model-based test (test_allocator_model.py) searches the device ops at random, with and
without a user's jit; the generation tests share test_models.py's shapes (tiny model, 4 rows,
16-token pages, chunks of 8), so in one session the steps compile once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from arena_jax import models
from arena_jax.models.scheduler import Scheduler

LAYOUT = aj.KVLayout(
    num_layers=2, num_kv_heads=1, head_dim=16, page_size=4, num_pages=8, max_seqs=4, max_pages_per_seq=4, dtype="float32"
)


def kv(n, value):
    return jnp.full((1, n, 1, 16), value, jnp.float32)


def fill(cache, slot, n, value):
    cache, ok = aj.reserve(cache, [slot], n)
    assert bool(ok[0])
    for layer in (0, 1):
        cache = aj.append(cache, layer, [slot], kv(n, value), kv(n, value))
    return cache


def page_values(cache, page, n, layer=0):
    return np.asarray(cache.k)[layer, 0, page, :n, 0]


def snapshot(cache):
    return jax.tree_util.tree_map(np.array, cache)


# ---- device ops -----------------------------------------------------------------------------------------


def test_a_held_partial_page_is_copied_when_its_sequence_writes_on():
    """The cache holds a sequence's partly filled last page; the sequence's next reserve copies it
    (copy-on-write), so the cached tokens stay as they were; a slot made from the pages reads them."""
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)  # a full page and 2 tokens of the next
    row = np.asarray(cache.table.page_map[0])
    cache = aj.hold_pages(cache, row[:2], [4, 2])
    np.testing.assert_array_equal(np.asarray(cache.table.refcount)[row[:2]], [2, 2])
    cache = fill(cache, 0, 3, 2.0)  # writes on: positions 6..8
    new_row = np.asarray(cache.table.page_map[0])
    assert new_row[0] == row[0] and new_row[1] != row[1] and int(cache.stats.cow_copies) == 1
    np.testing.assert_array_equal(page_values(cache, row[1], 4), [1, 1, 0, 0])  # the held page: its 2 tokens, untouched
    np.testing.assert_array_equal(page_values(cache, new_row[1], 4), [1, 1, 2, 2])
    cache = aj.fork_pages(cache, [row[:2]], [5], [1])  # 5 tokens: all of page 0, 1 of the held 2
    np.testing.assert_array_equal(cache.table.written[:, 1], [5, 5])
    out = aj.attend(jnp.ones((1, 1, 1, 16)), cache, 0, [1])
    np.testing.assert_allclose(out, 1.0, rtol=1e-6)
    cache = aj.release(cache, [0, 1])
    cache = aj.drop_pages(cache, row[:2])
    assert int(cache.table.num_free) == LAYOUT.num_pages and int(cache.stats.pages_evicted) == 2


def test_fork_pages_at_a_page_boundary_shares_every_page_and_copies_nothing():
    cache = fill(aj.create(LAYOUT), 0, 8, 1.0)
    row = np.asarray(cache.table.page_map[0])
    cache = aj.hold_pages(cache, row[:2], 4)
    cache = aj.release(cache, [0])
    cache = aj.fork_pages(cache, [row[:2]], [8], [2])
    cache = fill(cache, 2, 3, 5.0)
    assert int(cache.stats.cow_copies) == 0 and np.asarray(cache.table.page_map[2])[2] not in row[:2]
    assert aj.health(cache)["cached_pages"] == 2 and aj.health(cache)["cached_only_pages"] == 0


HOST_ERRORS = {
    "hold a free page": (lambda c, r: aj.hold_pages(c, [7], 1), "page 7 is free"),
    "hold twice": (lambda c, r: aj.hold_pages(aj.hold_pages(c, r[:1], 4), r[:1], 4), "already held"),
    "hold unwritten tokens": (lambda c, r: aj.hold_pages(c, r[1:2], 3), "written 2 of its tokens"),
    "hold 0 tokens": (lambda c, r: aj.hold_pages(c, r[:1], 0), "a hold covers 1 to page_size=4 tokens"),
    "hold a pending page": (lambda c, r: aj.hold_pages(aj.reserve(c, [0], 1)[0], r[1:2], 2), "not yet written"),
    "hold a page twice in a call": (lambda c, r: aj.hold_pages(c, [r[0], r[0]], 4), "names a page twice"),
    "hold page out of range": (lambda c, r: aj.hold_pages(c, [8], 1), r"pages must be in \[0, num_pages=8\)"),
    "hold page beyond int32": (lambda c, r: aj.hold_pages(c, [2**32], 1), "outside int32"),
    "drop a page not held": (lambda c, r: aj.drop_pages(c, r[:1]), "not held by the cache"),
    "fork unheld pages": (lambda c, r: aj.fork_pages(c, [r[:2]], [6], [1]), "only tokens the cache holds"),
    "fork past the hold": (lambda c, r: aj.fork_pages(aj.hold_pages(c, r[:2], [4, 1]), [r[:2]], [6], [1]), "held for 1 tokens"),
    "fork a page twice": (lambda c, r: aj.fork_pages(aj.hold_pages(c, r[:1], 4), [[r[0], r[0]]], [6], [1]), "uses a page twice"),
    "fork too wide": (lambda c, r: aj.fork_pages(c, np.zeros((1, 5), np.int32), [1], [1]), "more than max_pages_per_seq"),
    "fork too many tokens": (lambda c, r: aj.fork_pages(c, [r[:2]], [9], [1]), "more than the 2 pages"),
    "fork rows and dst differ": (lambda c, r: aj.fork_pages(c, [r[:2]], [6], [1, 2]), "pages has 1 rows but dst has 2"),
}


@pytest.mark.parametrize("case", list(HOST_ERRORS))
def test_host_errors_name_the_argument_and_leave_the_cache_untouched(case):
    call, needle = HOST_ERRORS[case]
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    row = np.asarray(cache.table.page_map[0])
    with pytest.raises(ValueError, match=needle):
        call(cache, row)


hold_in_jit = jax.jit(lambda c, p, n: aj.hold_pages(c, p, n), donate_argnums=0)
drop_in_jit = jax.jit(lambda c, p: aj.drop_pages(c, p), donate_argnums=0)
fork_pages_in_jit = jax.jit(lambda c, p, n, d: aj.fork_pages(c, p, n, d), donate_argnums=0)


def test_in_jit_a_hold_dropped_twice_frees_the_page_once_and_counts_the_rest():
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    row = np.asarray(cache.table.page_map[0])
    cache = hold_in_jit(cache, jnp.asarray([row[0], row[0], row[1], 7, -1]), jnp.asarray([4, 4, 3, 1, 1]))
    assert int(cache.stats.pages_held) == 1 and int(cache.stats.rejected_rows) == 3  # a duplicate, past the fill, free
    cache = aj.release(cache, [0])
    before = int(cache.table.num_free)
    cache = drop_in_jit(cache, jnp.asarray([row[0], row[0], row[1], -1]))
    assert int(cache.table.num_free) == before + 1 and int(cache.stats.pages_evicted) == 1
    assert int(cache.stats.rejected_rows) == 5  # the second drop of row[0], and row[1] never held
    cache = drop_in_jit(cache, jnp.asarray([row[0], 2**31 - 1, -(2**31), 8]))
    assert int(cache.table.num_free) == LAYOUT.num_pages and int(cache.stats.rejected_rows) == 9
    assert sorted(np.asarray(cache.table.free_stack).tolist()) == list(range(LAYOUT.num_pages))


@pytest.mark.parametrize(
    "row, count",
    [([0, 1], 7), ([0, 0], 6), ([0, 9], 6), ([1, 0], 5), ([0, 1], 2**31 - 1), ([0, 1], -1), ([-1, 1], 4)],
    ids=["past the hold", "a page twice", "out of range", "a partial page first", "int32 max", "negative", "no page"],
)
def test_in_jit_fork_pages_refuses_what_the_cache_does_not_hold_and_keeps_the_destination(row, count):
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    pages = np.asarray(cache.table.page_map[0])
    cache = hold_in_jit(cache, jnp.asarray(pages[:2]), jnp.asarray([4, 2]))
    cache = fill(cache, 1, 3, 7.0)
    before = snapshot(cache.table)
    mapped = jnp.asarray([[pages[i] if 0 <= i < 2 else i for i in row]])
    cache = fork_pages_in_jit(cache, mapped, jnp.asarray([count]), jnp.asarray([1]))
    jax.tree_util.tree_map(np.testing.assert_array_equal, snapshot(cache.table), before)
    assert int(cache.stats.rejected_rows) == 1


def test_in_jit_fork_pages_serves_the_first_of_duplicate_destinations():
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    pages = np.asarray(cache.table.page_map[0])
    cache = hold_in_jit(cache, jnp.asarray(pages[:2]), jnp.asarray([4, 2]))
    cache = fork_pages_in_jit(cache, jnp.asarray([pages[:2], pages[:2]]), jnp.asarray([6, 4]), jnp.asarray([1, 1]))
    assert int(cache.table.lengths[1]) == 6 and int(cache.stats.rejected_rows) == 1
    np.testing.assert_array_equal(np.asarray(cache.table.refcount)[pages[:2]], [3, 3])
    out = aj.attend(jnp.ones((1, 1, 1, 16)), cache, 1, [1])
    np.testing.assert_allclose(out, 1.0, rtol=1e-6)


def test_in_jit_a_page_with_pending_writes_cannot_be_held():
    """Holding it would make the slot's pending positions land in a shared page."""
    cache = aj.create(LAYOUT)
    cache, _ = aj.reserve(cache, [0], 8)
    for layer, n in ((0, 6), (1, 6)):
        cache = aj.append(cache, layer, [0], kv(n, 1.0), kv(n, 1.0))  # positions 6, 7 reserved, not written
    pages = np.asarray(cache.table.page_map[0])
    cache = hold_in_jit(cache, jnp.asarray(pages[:2]), jnp.asarray([4, 2]))
    assert np.asarray(cache.table.held)[pages[:2]].tolist() == [4, 0] and int(cache.stats.rejected_rows) == 1
    cache = aj.append(cache, 0, [0], kv(2, 3.0), kv(2, 3.0))
    assert int(cache.stats.dropped_writes) == 0  # the pending positions are still the slot's own


# ---- the index --------------------------------------------------------------------------------------------

IDX_LAYOUT = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, num_pages=32, max_seqs=4,
                         max_pages_per_seq=8, dtype="float32")  # fmt: skip


def test_lookup_is_token_granular_and_bounded():
    index = aj.PrefixCache(IDX_LAYOUT)
    ids = list(range(10))  # pages: [0..3] [4..7] [8, 9]
    ins = index.insert(ids, [5, 6, 7])
    assert ins.hold == [(5, 4), (6, 4), (7, 2)] and ins.drop == [] and [n.page for n in ins.nodes] == [5, 6, 7]
    assert index.lookup(ids + [42]).num_tokens == 10
    hit = index.lookup([0, 1, 2, 3, 4, 5, 99])  # diverges inside the second page
    assert (hit.num_tokens, hit.pages) == (6, (5, 6))
    assert index.lookup(ids, limit=len(ids) - 1).num_tokens == 9
    assert index.lookup([0, 1, 2, 3, 4, 5, 6, 7, 8], limit=5).pages == (5, 6)
    assert index.lookup([7, 1]).num_tokens == 0
    assert index.lookup([]).num_tokens == 0


def test_insert_keeps_one_page_per_content_and_replaces_shorter_partial_pages():
    index = aj.PrefixCache(IDX_LAYOUT)
    index.insert([1, 2, 3, 4, 5], [0, 1])  # a full page, then 1 token
    dup = index.insert([1, 2, 3, 4, 5, 6], [2, 3])  # page 2 holds what page 0 does: not held
    assert dup.hold == [(3, 2)] and dup.drop == [1] and [n.page for n in dup.nodes] == [3]
    covered = index.insert([1, 2, 3, 4, 5], [4, 5])  # what page 3 already holds: nothing new
    assert covered.hold == [] and covered.drop == []
    full = index.insert([1, 2, 3, 4, 5, 6, 7, 8], [0, 6])  # a full page replaces the partly filled one
    assert full.hold == [(6, 4)] and full.drop == [3]
    assert index.pages() == {0: 4, 6: 4} and index.metrics()["prefix_replaced_pages"] == 2
    # A partly filled page a running sequence maps is not replaced.
    index.insert([1, 2, 3, 4, 9], [0, 7])
    index.lock(index.lookup([1, 2, 3, 4, 9]).nodes[-1])
    assert index.insert([1, 2, 3, 4, 9, 9], [0, 8]).drop == []


def test_eviction_is_lru_leaves_first_and_never_touches_locked_pages():
    index = aj.PrefixCache(IDX_LAYOUT)
    index.insert(list(range(12)), [0, 1, 2])  # a chain of three full pages
    index.insert(list(range(4)) + [50, 51, 52, 53], [0, 3])  # a sibling branch under page 0
    index.insert([90, 91, 92, 93], [4])  # another root
    index.acquire(index.lookup(list(range(12))), 12)  # the chain: used last, and locked
    assert index.evictable_pages == 2  # pages 3 and 4 (page 0 is the locked chain's root)
    assert index.evict(5) == [3, 4]  # LRU first; nothing locked
    hit = index.lookup(list(range(12)))
    index.unlock(hit.nodes[-1])
    assert index.evict(2) == [2, 1]  # leaves before their parents
    assert index.evict(9) == [0] and index.num_pages == 0 and index.evictable_pages == 0
    m = index.metrics()
    assert m["prefix_evicted_pages"] == 5 and m["prefix_lookups"] == 1 and m["prefix_hit_rate"] == 1.0


def test_index_check_compares_with_the_device_holds():
    cache = fill(aj.create(LAYOUT), 0, 6, 1.0)
    row = np.asarray(cache.table.page_map[0])
    index = aj.PrefixCache(LAYOUT)
    ins = index.insert([1, 2, 3, 4, 5, 6], row[:2])
    cache = aj.hold_pages(cache, [p for p, _ in ins.hold], [k for _, k in ins.hold])
    index.check(cache)
    assert aj.health(cache, index)["prefix_index_matches"] is True
    other = aj.PrefixCache(LAYOUT)
    with pytest.raises(ValueError, match="does not belong to this cache"):
        other.check(cache)


# ---- generate ---------------------------------------------------------------------------------------------

BATCH, CHUNK = 4, 8


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(), seed=0, std=0.2)  # test_models.py's model


@pytest.fixture(scope="module")
def small_layout(model):
    return model.config.kv_layout(page_size=16, num_pages=6, max_seqs=BATCH, max_seq_len=64, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    """Two system prompts (20 and 9 tokens) under six user turns: prefixes shared at token granularity."""
    rng = np.random.default_rng(1)
    system = [rng.integers(0, 128, 20).tolist(), rng.integers(0, 128, 9).tolist()]
    return [system[i % 2] + rng.integers(0, 128, int(n)).tolist() for i, n in enumerate((3, 10, 1, 5, 12, 7))]


@pytest.fixture()
def check_accounting(monkeypatch):
    """After every step, the host's count of pages in use must equal the device's; a sequence
    is preempted only when the prefix cache has nothing left to evict."""
    monkeypatch.setattr(Scheduler, "CHECK_ACCOUNTING", True)
    preempt = Scheduler._preempt

    def checked(self, waiting, shard=0):
        assert self.index is None or self.index.evictable_pages == 0, "preempted while the cache could evict"
        preempt(self, waiting, shard)

    monkeypatch.setattr(Scheduler, "_preempt", checked)


def _run(model, layout, prompts, new=20, **kwargs):
    return models.generate(model, prompts, new, batch_size=BATCH, chunk_size=CHUNK, layout=layout, **kwargs)


def _healthy(result):
    h = aj.health(result.cache, result.prefix_cache)
    assert h["active_sequences"] == 0 and h["rejected_rows"] == 0 and h["dropped_writes"] == 0
    assert h["prefix_index_matches"] and h["free_pages"] + h["cached_pages"] == h["num_pages"]
    # Every hold dropped freed its page: nothing a sequence mapped was ever let go by the cache.
    assert h["holds_dropped"] == h["pages_evicted"] == h["prefix_evicted_pages"] + h["prefix_replaced_pages"]
    return h


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_k=5, seed=3)], ids=["greedy", "sampled"])
def test_prefix_cache_gives_the_same_tokens_under_memory_pressure(model, small_layout, prompts, sampling, check_accounting):
    without = _run(model, small_layout, prompts, **sampling)
    cached = _run(model, small_layout, prompts, prefix_cache=True, **sampling)
    assert cached.tokens == without.tokens
    assert without.preemptions > 0  # 6 pages for 4 rows of up to 52 tokens: memory is short
    assert cached.prefix_hit_tokens > 0 and cached.evictions > 0 and cached.preemptions > 0  # evicted first
    assert cached.prefill_tokens == cached.prompt_tokens - cached.prefix_hit_tokens < without.prefill_tokens
    h = _healthy(cached)
    assert h["prefix_forks"] > 0 and h["cow_copies"] > 0  # hits ending inside a page were copied on write


def test_later_calls_hit_what_earlier_ones_cached(model, small_layout, prompts, check_accounting):
    first = _run(model, small_layout, prompts[:3], new=6, prefix_cache=True)
    assert first.prefix_hit_tokens == 20  # the third prompt shares the first's 20-token system prompt
    turn2 = [prompts[0] + first.tokens[0] + [5, 6, 7]]  # the next turn of the first conversation
    before = models.TRACE_COUNTS.copy()
    second = models.generate(model, turn2, 6, batch_size=BATCH, chunk_size=CHUNK, cache=first.cache,
                             prefix_cache=first.prefix_cache)  # fmt: skip
    assert all(models.TRACE_COUNTS[k] == before[k] for k in ("prefill", "decode_step", "fork_page_rows"))  # no recompile
    assert second.prefix_cache is first.prefix_cache
    # The whole earlier turn is a hit: its prompt and the 5 answer tokens fed back (not the last one).
    assert second.prefix_hit_tokens == len(prompts[0]) + 5
    assert second.tokens == _run(model, small_layout, turn2, new=6).tokens
    _healthy(second)


def test_generate_refuses_a_cache_and_index_that_do_not_belong_together(model, small_layout, prompts):
    run = _run(model, small_layout, prompts[:1], new=2, prefix_cache=True)
    assert aj.health(run.cache)["cached_pages"] > 0
    with pytest.raises(ValueError, match="held by a prefix cache: pass its PrefixCache"):
        _run(model, None, prompts[:1], new=2, cache=run.cache)
    with pytest.raises(ValueError, match="does not belong to this cache"):
        _run(model, None, prompts[:1], new=2, cache=run.cache, prefix_cache=aj.PrefixCache(small_layout))
    with pytest.raises(ValueError, match="needs the cache holding its pages"):
        _run(model, small_layout, prompts[:1], new=2, prefix_cache=run.prefix_cache)
    with pytest.raises(ValueError, match="prefix_cache must be a bool or an arena_jax.PrefixCache"):
        _run(model, small_layout, prompts[:1], new=2, prefix_cache="yes")


def test_cli_prefix_cache(capsys):
    from arena_jax.models.cli import main

    args = ["--prompt", "hello arena, hello pages", "--max-new-tokens", "6", "--batch", "4", "--num-pages", "6",
            "--chunk-size", "8", "--max-seq-len", "64", "--num-prompts", "5", "--no-compile-cache", "--prefix-cache"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "prefix cache:" in out and "hit rate" in out


def test_generate_binds_the_index_to_its_arena_and_its_model(model, small_layout, prompts):
    a = _run(model, small_layout, prompts[:1], new=2, prefix_cache=True)
    b = _run(model, small_layout, prompts[:1], new=2, prefix_cache=True)
    assert a.prefix_cache.pages() == b.prefix_cache.pages()  # the same holds: only the arenas' ids differ
    with pytest.raises(ValueError, match="belongs to arena"):
        _run(model, None, prompts[:1], new=2, cache=b.cache, prefix_cache=a.prefix_cache)
    other = models.init_random(models.LlamaConfig.tiny(), seed=1, std=0.2)  # same shapes, other weights
    with pytest.raises(ValueError, match="made with tag"):
        _run(other, None, prompts[:1], new=2, cache=a.cache, prefix_cache=a.prefix_cache)
    c = _run(model, None, prompts[:1], new=2, cache=a.cache, prefix_cache=a.prefix_cache)  # refusals changed nothing
    assert c.prefix_hit_tokens > 0
    with pytest.raises(ValueError, match="continue from the newest result"):  # a.cache was donated to that call
        _run(model, None, prompts[:1], new=2, cache=a.cache, prefix_cache=a.prefix_cache)
    _healthy(_run(model, None, prompts[:1], new=2, cache=c.cache, prefix_cache=c.prefix_cache))


@pytest.mark.parametrize(
    "call, needle",
    [
        (lambda m, c: aj.health(None), "cache must be a KVCache"),
        (lambda m, c: aj.health(c, "yes"), "prefix must be an arena_jax.PrefixCache or None"),
        (lambda m, c: models.generate(m, [[1, 2]], 2, cache={"k": 1}), "cache must be an arena_jax.KVCache"),
        (lambda m, c: models.generate(m, [[1, 2]], 2, layout="big"), "layout must be an arena_jax.KVLayout"),
    ],
    ids=["health(None)", "health(cache, str)", "generate(cache=dict)", "generate(layout=str)"],
)
def test_wrong_types_are_value_errors(model, call, needle):
    with pytest.raises(ValueError, match=needle):
        call(model, aj.create(LAYOUT))
