"""`aj.PrefixCache` on its own: input validation (page ids, token ids, lock balance) and a
hypothesis state machine over any call order, whose counters must agree with a recount of the
tree after every step; and the index's binding to one arena and one model tag.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import arena_jax as aj

LAYOUT = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, num_pages=8, max_seqs=4,
                     max_pages_per_seq=4, dtype="float32")  # fmt: skip


# ---- validation, by name ----------------------------------------------------------------------------------

BAD_CALLS = {
    "insert a PAD page": (lambda ix: ix.insert([1, 2, 3], [aj.PAD_PAGE]), r"pages\[0\] is PAD_PAGE"),
    "insert a page out of range": (lambda ix: ix.insert([1, 2, 3], [99]), r"pages\[0\]=99 is outside \[0, num_pages=8\)"),
    "insert a negative page": (lambda ix: ix.insert([1, 2, 3], [-5]), r"outside \[0, num_pages=8\)"),
    "insert a float page": (lambda ix: ix.insert([1, 2, 3], [1.0]), "page ids are integers"),
    "insert a page twice": (lambda ix: ix.insert(list(range(8)), [3, 3]), "names a page twice"),
    "insert too few pages": (lambda ix: ix.insert(list(range(5)), [3]), "5 tokens need 2 pages, got 1"),
    "insert string tokens": (lambda ix: ix.insert("abc", [1]), "integer token ids"),
    "insert a string token": (lambda ix: ix.insert([1, "a", 3], [1]), r"ids\[1\] is 'a'"),
    "insert a float token": (lambda ix: ix.insert([1, 2.0], [1]), r"ids\[1\] is 2.0"),
    "insert a bool token": (lambda ix: ix.insert([True], [1]), r"ids\[0\] is True"),
    "insert a negative token": (lambda ix: ix.insert([-1], [1]), r"ids\[0\]=-1 is outside"),
    "lookup float tokens": (lambda ix: ix.lookup([1.5]), r"ids\[0\] is 1.5"),
    "lookup a negative limit": (lambda ix: ix.lookup([1], limit=-1), "limit must be a non-negative integer"),
    "evict a negative count": (lambda ix: ix.evict(-1), "num_pages must be a non-negative integer"),
    "unlock a node never locked": (lambda ix: ix.unlock(ix.lookup([1, 2, 3]).nodes[0]), "is not locked"),
    "unlock a foreign node": (lambda ix: ix.unlock(_other_node()), "not a node of this index"),
    "acquire a hand-made hit": (lambda ix: ix.acquire(aj.PrefixHit(3, (5,)), 3), "pages are not its nodes' pages"),
    "acquire fewer tokens than hit": (lambda ix: ix.acquire(ix.lookup([1, 2, 3]), 2), "fewer than the hit's 3"),
}


def _other_node():
    other = aj.PrefixCache(LAYOUT)
    other.insert([1, 2, 3], [0])
    return other.lookup([1, 2, 3]).nodes[0]


def _state(ix):
    return (ix.pages(), ix.num_pages, ix.evictable_pages, ix.metrics(), [n.locks for n in ix._nodes.values()])


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_calls_raise_value_errors_and_change_nothing(case):
    call, needle = BAD_CALLS[case]
    ix = aj.PrefixCache(LAYOUT)
    ix.insert([1, 2, 3], [2])
    before = _state(ix)
    with pytest.raises(ValueError, match=needle):
        call(ix)
    assert _state(ix) == before


def test_an_extra_unlock_is_refused_and_eviction_still_frees_every_unlocked_page():
    ix = aj.PrefixCache(LAYOUT)
    ix.insert([1, 2, 3, 4, 5, 6], [0, 1])
    anchor = ix.acquire(ix.lookup([1, 2, 3, 4, 5, 6]), 6)
    assert ix.evictable_pages == 0
    ix.unlock(anchor)
    with pytest.raises(ValueError, match="is not locked"):
        ix.unlock(anchor)
    assert ix.evictable_pages == 2 and sorted(ix.evict(10)) == [0, 1] and ix.num_pages == 0
    with pytest.raises(ValueError, match="has left the index"):
        ix.lock(anchor)


def test_numpy_integers_are_token_and_page_ids():
    ix = aj.PrefixCache(LAYOUT)
    ins = ix.insert(np.arange(1, 6, dtype=np.int64), np.asarray([4, 5], np.int32))
    assert ins.hold == [(4, 4), (5, 1)]
    assert ix.lookup(np.asarray([1, 2, 3, 4, 5])).pages == (4, 5)


# ---- any call order: the counters agree with a recount ------------------------------------------------------


class IndexMachine(RuleBasedStateMachine):
    """Sequences over a 3-token alphabet (so prefixes are shared) inserted with free pages; anchors
    acquired, moved deeper (relock) and released; evictions; and refused calls in between."""

    def __init__(self):
        super().__init__()
        self.ix = aj.PrefixCache(LAYOUT)
        self.anchors = []  # locks held, as the nodes locked

    def _free_pages(self):
        return [p for p in range(LAYOUT.num_pages) if p not in self.ix.pages()]

    @rule(ids=st.lists(st.integers(0, 2), min_size=1, max_size=12), data=st.data())
    def insert(self, ids, data):
        need = -(-len(ids) // LAYOUT.page_size)
        free = self._free_pages()
        if len(free) < need:
            return
        pages = data.draw(st.permutations(free))[:need]
        before = self.ix.num_pages
        ins = self.ix.insert(ids, pages)
        assert self.ix.num_pages == before + len(ins.hold) - len(ins.drop)
        assert {p for p, _ in ins.hold} <= set(pages) and not set(ins.drop) & set(self.ix.pages())

    @rule(ids=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def acquire(self, ids):
        hit = self.ix.lookup(ids, limit=len(ids) - 1)
        assert hit.num_tokens <= len(ids) - 1 and len(hit.pages) == -(-hit.num_tokens // LAYOUT.page_size)
        assert all(p in self.ix.pages() for p in hit.pages)
        anchor = self.ix.acquire(hit, len(ids))
        if anchor is not None:
            self.anchors.append(anchor)

    @precondition(lambda self: self.anchors)
    @rule(data=st.data())
    def unlock(self, data):
        anchor = self.anchors.pop(data.draw(st.integers(0, len(self.anchors) - 1)))
        self.ix.unlock(anchor)

    @precondition(lambda self: self.anchors)
    @rule(data=st.data())
    def relock_deeper_or_elsewhere(self, data):
        i = data.draw(st.integers(0, len(self.anchors) - 1))
        nodes = list(self.ix._nodes.values())
        new = data.draw(st.sampled_from(nodes))
        self.ix.relock(self.anchors[i], new)
        self.anchors[i] = new

    @rule()
    def extra_unlock_is_refused(self):
        unlocked = [n for n in self.ix._nodes.values() if n.locks == 0]
        if unlocked:
            with pytest.raises(ValueError, match="is not locked"):
                self.ix.unlock(unlocked[0])

    @rule(page=st.sampled_from([-1, 8, 99]), ids=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def bad_insert_is_refused(self, page, ids):
        before = self.ix.pages()
        with pytest.raises(ValueError, match="pages"):
            self.ix.insert(ids, [page])
        assert self.ix.pages() == before

    @rule(n=st.integers(0, 9))
    def evict(self, n):
        evictable = self.ix.evictable_pages
        out = self.ix.evict(n)
        assert len(out) == min(n, evictable) and not set(out) & set(self.ix.pages())

    @invariant()
    def counters_agree_with_a_recount(self):
        ix = self.ix
        nodes = list(ix._nodes.values())
        expect = {id(n): 0 for n in nodes}
        for anchor in self.anchors:
            node = anchor
            while node is not ix.root:
                assert node.live, "a locked node left the index"
                expect[id(node)] += 1
                node = node.parent
        assert {id(n): n.locks for n in nodes} == expect
        assert ix.evictable_pages == sum(1 for n in nodes if n.locks == 0)
        assert ix.pages() == {n.page: len(n.tokens) for n in nodes}
        # Everything unlocked can be evicted, leaves first: the rest is exactly the locked nodes.
        trial = copy.deepcopy(ix)
        trial.evict(trial.evictable_pages)
        assert trial.num_pages == ix.num_pages - ix.evictable_pages


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_index_counters_stay_consistent_under_any_call_order = IndexMachine.TestCase


class TieredIndexMachine(IndexMachine):
    """The same calls on an index with a host tier of 3 pages: evictions are plans (host pages
    freed, device pages copied there, holds dropped), hits may end in host pages, and inserting
    tokens a host-only node holds makes the caller's page its device copy."""

    HOST = 3

    def __init__(self):
        super().__init__()
        self.ix = aj.PrefixCache(LAYOUT, host_pages=self.HOST)

    @rule(ids=st.lists(st.integers(0, 2), min_size=1, max_size=12))
    def acquire(self, ids):
        hit = self.ix.lookup(ids, limit=len(ids) - 1)
        assert len(hit.pages) + len(hit.host_pages) == -(-hit.num_tokens // LAYOUT.page_size)
        assert set(hit.pages) <= set(self.ix.pages()) and set(hit.host_pages) <= set(self.ix.host_pages())
        assert not hit.host_pages or hit.device_tokens == len(hit.pages) * LAYOUT.page_size
        anchor = self.ix.acquire(hit, len(ids))
        if anchor is not None:
            assert anchor.page is not None  # only device nodes are locked
            self.anchors.append(anchor)

    @rule(n=st.integers(0, 9), data=st.data())
    def evict(self, n, data):
        ix = self.ix
        pages, on_host, evictable = ix.pages(), ix.host_pages(), ix.evictable_pages
        keep = data.draw(st.lists(st.sampled_from(list(ix._host_nodes.values())), max_size=2)) if on_host else []
        kept = {k.host_page for k in keep}
        plan = ix.evict_plan(n, keep=keep)
        assert plan.device_pages == min(n, evictable)
        assert set(plan.drop_host) <= set(on_host) and not set(plan.drop_host) & kept  # pinned copies stay
        free = set(range(self.HOST)) - (set(on_host) - set(plan.drop_host))
        targets = [hp for _, hp in plan.offload]
        assert len(set(targets)) == len(targets) and set(targets) <= free  # only free host pages are written
        gone = {p for p, _ in plan.offload} | set(plan.drop)
        assert gone <= set(pages) and not gone & set(ix.pages()) and len(gone) == plan.device_pages
        assert set(ix.host_pages()) == (set(on_host) - set(plan.drop_host)) | set(targets)

    @rule()
    def drop_every_host_copy(self):
        on_host = set(self.ix.host_pages())
        assert set(self.ix.drop_host_copies()) == on_host and not self.ix.host_pages()

    @invariant()
    def counters_agree_with_a_recount(self):
        ix = self.ix
        nodes = list(ix._nodes.values())
        expect = {id(n): 0 for n in nodes}
        for anchor in self.anchors:
            node = anchor
            while node is not ix.root:
                assert node.live and node.page is not None, "a locked node left the device"
                expect[id(node)] += 1
                node = node.parent
        assert {id(n): n.locks for n in nodes} == expect
        assert ix.evictable_pages == sum(1 for n in nodes if n.locks == 0)
        assert ix.pages() == {n.page: len(n.tokens) for n in nodes}
        assert ix.host_pages() == {n.host_page: len(n.tokens) for n in ix._host_nodes.values()}
        assert sorted(ix._free_host + list(ix.host_pages())) == list(range(self.HOST))  # each host page once
        for node in set(nodes) | set(ix._host_nodes.values()):
            assert node.live and (node.page is not None or node.host_page is not None)
            assert node.page is None or node.parent is ix.root or node.parent.page is not None  # device nodes: an upper subtree
        trial = copy.deepcopy(ix)
        assert trial.evict_plan(trial.evictable_pages).device_pages == ix.evictable_pages
        assert trial.num_pages == ix.num_pages - ix.evictable_pages


TieredIndexMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_a_tiered_index_stays_consistent_under_any_call_order = TieredIndexMachine.TestCase


def test_eviction_across_tiers_is_lru_device_then_host_then_gone():
    """Three device pages for three 4-token prompts on one host page: the oldest goes to the host,
    then the next oldest takes the host page and the oldest leaves the index; a lookup of the
    prompt on the host finds its host page, and its return as a device page keeps the copy."""
    ix = aj.PrefixCache(LAYOUT, host_pages=1)
    for i, page in enumerate((5, 6, 7)):
        ix.insert([i] * 4, [page])
    plan = ix.evict_plan(1)
    assert (plan.offload, plan.drop, plan.drop_host) == ([(5, 0)], [], [])
    plan = ix.evict_plan(1)  # page 6 is older than nothing on the host but prompt 0: prompt 0 goes
    assert (plan.offload, plan.drop, plan.drop_host) == ([(6, 0)], [], [0])
    assert ix.lookup([0] * 4).num_tokens == 0
    hit = ix.lookup([1] * 5, limit=4)
    assert (hit.num_tokens, hit.pages, hit.host_pages) == (4, (), (0,))
    ins = ix.insert([1] * 4, [3])  # the prompt came back into page 3: it becomes the device copy
    assert ins.hold == [(3, 4)] and ix.pages() == {3: 4, 7: 4} and ix.host_pages() == {0: 4}
    plan = ix.evict_plan(2)  # LRU: prompt 2 (page 7) is older than prompt 1; both have to go
    assert (plan.offload, sorted(plan.drop), plan.drop_host) == ([], [3, 7], [])  # 7: no room; 3: copy exists
    assert ix.host_pages() == {0: 4} and not ix.pages()


def test_an_index_with_a_host_tier_needs_evict_plan():
    ix = aj.PrefixCache(LAYOUT, host_pages=2)
    with pytest.raises(ValueError, match="evict_plan"):
        ix.evict(1)
    with pytest.raises(ValueError, match="host_pages must be a non-negative integer"):
        aj.PrefixCache(LAYOUT, host_pages=-1)


def test_host_pages_past_int32_are_refused_by_name():
    """2**40 host pages was a bare MemoryError (the index lists its free host pages)."""
    with pytest.raises(ValueError, match=r"host_pages must be at most 2147483647 \(2\*\*31 - 1: host page ids are int32"):
        aj.PrefixCache(LAYOUT, host_pages=2**40)


# ---- binding: one arena, one model -------------------------------------------------------------------------


def _held_cache():
    cache = aj.create(LAYOUT)
    cache, _ = aj.reserve(cache, [0], 3)
    cache = aj.append(cache, 0, [0], np.ones((1, 3, 1, 16), np.float32), np.ones((1, 3, 1, 16), np.float32))
    page = int(cache.table.page_map[0, 0])
    cache = aj.hold_pages(cache, [page], 3)
    return aj.release(cache, [0]), page


def test_an_index_bound_to_one_arena_refuses_another_with_the_same_holds():
    a, page = _held_cache()
    b, page_b = _held_cache()
    assert page == page_b  # same page ids and counts: only the arena's identity tells them apart
    ix = aj.PrefixCache(LAYOUT)
    ix.insert([1, 2, 3], [page])
    ix.bind(a)
    ix.check(a)
    with pytest.raises(ValueError, match="belongs to arena"):
        ix.check(b)
    assert int(a.table.arena_id) != int(b.table.arena_id)


def test_an_index_tagged_for_one_model_refuses_another_tag():
    a, page = _held_cache()
    ix = aj.PrefixCache(LAYOUT, tag="model-a")
    ix.insert([1, 2, 3], [page])
    ix.bind(a, tag="model-a")
    with pytest.raises(ValueError, match="made with tag 'model-a', not 'model-b'"):
        ix.check(a, tag="model-b")
    with pytest.raises(ValueError, match="tag must be hashable"):
        aj.PrefixCache(LAYOUT, tag=[1])


def test_a_donated_cache_is_refused_with_a_pointer_to_the_newest_result():
    cache = aj.create(LAYOUT)
    newer, _ = aj.reserve(cache, [0], 3)
    with pytest.raises(ValueError, match="continue from the newest result"):
        aj.reserve(cache, [0], 3)
    aj.reserve(newer, [0], 1)
