"""The prefix index's side of the scheduler: indexing the pages sequences write, the exact
count of pages in use, eviction before a step, and the queue of page operations (holds,
releases, host drops, copies to the host, dropped holds) flushed in order (`PrefixPages`, a
part of `models.scheduler.Scheduler`). It answers "which pages does the cache hold, and
when do the ops that change that run?"

Prefix accounting: the host keeps an exact count of the pages in use, the index's pages (the
cache's holds) plus, per running sequence, its mapped pages that are not indexed
(`pages_for(fed) - in_index`: they are its own). Tests check it against the device's
`num_free` after every step (`CHECK_ACCOUNTING`). `free` (`Admission._free_pages`) is the pages of a shard that no
running sequence claims (each counted at its whole current length, plus the copy a pending
copy-on-write needs), counting the index's unlocked pages as free (they can be evicted).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import arena_jax as aj
from arena_jax.models.scheduler.seq import Seq
from arena_jax.models.steps import drop_host_page_rows, drop_page_rows, evict_to_host_rows, flush_rows, hold_page_rows, offload_page_rows, release_rows

__all__ = ["PrefixPages"]


class PrefixPages:
    """Prefix bookkeeping and queued page ops for `Scheduler` (the module docstring): `_index`,
    `_index_running`, `_pages_in_use`, `_make_room`, `_evict`, `_flush`."""

    def _pages_in_use(self) -> int:
        """Prefix mode: exactly the device's pages in use, once pending releases are flushed."""
        private = sum(self.layout.pages_for(s.fed) - s.in_index for s in self._running())
        return self.index.num_pages + private

    def _index(self, seq: Seq, row: np.ndarray, num_tokens: int):
        ins = self.index.insert(seq.ids[:num_tokens], row[: self.layout.pages_for(num_tokens)])
        self._holds += ins.hold
        self._drops += ins.drop
        self._host_drops += ins.drop_host
        return ins

    def _index_running(self, seq: Seq, r: int) -> None:
        """After a served step: the partly used hit page was copied; newly full pages are indexed."""
        if seq.cow_node is not None:  # reserve gave the slot its own copy of the hit's last page
            parent = seq.cow_node.parent
            new_anchor = None if parent is self.index.root else parent
            self.index.relock(seq.anchor, new_anchor)
            seq.anchor, seq.cow_node = new_anchor, None
            seq.in_index -= 1
        full = seq.fed // self.layout.page_size
        if full > seq.indexed_full:
            ins = self._index(seq, self._page_rows[self.slot_of[r]], full * self.layout.page_size)
            if ins.nodes:
                self.index.relock(seq.anchor, ins.nodes[-1])
                seq.anchor = ins.nodes[-1]
            seq.in_index = len(ins.nodes)
            seq.indexed_full = full

    def _flush(self, force: bool = True) -> None:
        """Holds first (a finished sequence's pages are held before its slot lets them go),
        then releases, then host pages freed, then copies to the host tier (which may reuse them),
        then dropped holds. Fixed shapes: one compile each. Holds alone may wait (`force=False`:
        a running sequence's full pages, which no step writes again) until something that needs
        them (a fork of held pages, a release, an eviction) flushes them with it."""
        if not (self._holds or self._to_release or self._drops or self._host_drops or self._offloads):
            return
        if not force and not (self._to_release or self._drops or self._host_drops or self._offloads):
            return
        width = self.batch * self.layout.max_pages_per_seq
        if self.index is not None and max(map(len, (self._holds, self._drops, self._host_drops, self._offloads))) <= width:
            self._flush_at_once(width)
            return
        while self._holds:
            part, self._holds = self._holds[:width], self._holds[width:]
            pages = np.full((width,), aj.PAD_PAGE, np.int32)
            counts = np.ones((width,), np.int32)
            pages[: len(part)], counts[: len(part)] = zip(*part)
            self.cache = hold_page_rows(self.cache, jnp.asarray(pages), jnp.asarray(counts))
        if self._to_release:
            slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
            slots[self._to_release] = [self.slot_of[r] for r in self._to_release]
            self.cache = release_rows(self.cache, jnp.asarray(slots))
            self._to_release = []
        self._flush_host(width)
        while self._drops:
            part, self._drops = self._drops[:width], self._drops[width:]
            pages = np.full((width,), aj.PAD_PAGE, np.int32)
            pages[: len(part)] = part
            self.cache = drop_page_rows(self.cache, jnp.asarray(pages))

    def _flush_at_once(self, width: int) -> None:
        """`_flush` as one call (`steps.flush_rows`: the same order), when everything fits its rows."""
        holds, counts = np.full((width,), aj.PAD_PAGE, np.int32), np.ones((width,), np.int32)
        if self._holds:
            holds[: len(self._holds)], counts[: len(self._holds)] = zip(*self._holds)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        slots[self._to_release] = [self.slot_of[r] for r in self._to_release]
        host_drops, pages, host_pages, drops = (np.full((width,), aj.PAD_PAGE, np.int32) for _ in range(4))
        host_drops[: len(self._host_drops)] = self._host_drops
        if self._offloads:
            pages[: len(self._offloads)], host_pages[: len(self._offloads)] = zip(*self._offloads)
        drops[: len(self._drops)] = self._drops
        host = self.tier.host if self.tier is not None else None
        self.cache, host = flush_rows(self.cache, host, *map(jnp.asarray, (holds, counts, slots, host_drops, pages, host_pages, drops)))
        if self.tier is not None:
            self.tier.host = host
            self.tier.count_move(len(self._offloads))
        self._holds, self._to_release, self._host_drops, self._offloads, self._drops = [], [], [], [], []

    def _flush_host(self, width: int) -> None:
        """The prefix index's host-tier moves: host pages freed, then device pages copied there
        (their holds dropped by the same op), then the plan's other dropped holds: one call when
        they fit its rows (the usual case), else one call each, in that order."""
        if (self._host_drops or self._offloads) and max(len(self._host_drops), len(self._offloads), len(self._drops)) <= width:
            rows = [np.full((width,), aj.PAD_PAGE, np.int32) for _ in range(4)]
            rows[0][: len(self._host_drops)] = self._host_drops
            if self._offloads:
                rows[1][: len(self._offloads)], rows[2][: len(self._offloads)] = zip(*self._offloads)
            rows[3][: len(self._drops)] = self._drops
            self.cache, self.tier.host = evict_to_host_rows(self.cache, self.tier.host, *map(jnp.asarray, rows))
            self.tier.count_move(len(self._offloads))
            self._host_drops, self._offloads, self._drops = [], [], []
            return
        while self._host_drops:
            part, self._host_drops = self._host_drops[:width], self._host_drops[width:]
            pages = np.full((width,), aj.PAD_PAGE, np.int32)
            pages[: len(part)] = part
            self.cache, self.tier.host = drop_host_page_rows(self.cache, self.tier.host, jnp.asarray(pages))
        while self._offloads:
            part, self._offloads = self._offloads[:width], self._offloads[width:]
            pages = np.full((width,), aj.PAD_PAGE, np.int32)
            host_pages = np.full((width,), aj.PAD_PAGE, np.int32)
            pages[: len(part)], host_pages[: len(part)] = zip(*part)
            self.cache, self.tier.host = offload_page_rows(self.cache, self.tier.host, jnp.asarray(pages), jnp.asarray(host_pages))
            self.tier.count_move(len(part))

    def _make_room_for(self, served: np.ndarray, counts: np.ndarray) -> None:
        """Prefix mode: `_make_room` for the rows a step serves (`served[r]` >= 0: a slot), each
        feeding `counts[r]` tokens; nothing without a prefix index."""
        if self.index is not None:
            live = np.flatnonzero(served >= 0)
            self._make_room(live.tolist(), counts[live].tolist())

    def _make_room(self, rows: list[int], counts) -> None:
        """Prefix mode, before a step: evict what the step's reservations need beyond the free pages
        (the host's count already is what the device will hold once the pending ops run), then
        flush everything pending, evictions included."""
        size = self.layout.page_size
        demand = 0
        for r, n in zip(rows, counts):
            s = self.rows[r]
            demand += -(-(s.fed + n) // size) - -(-s.fed // size) + (s.cow_node is not None and n > 0)
        self._evict(demand - (self.layout.num_pages - self._pages_in_use()))
        self._flush(force=False)

    def _evict(self, num_pages: int, keep=()) -> int:
        """Free up to `num_pages` device pages only the index holds (LRU; with a host tier they
        are copied there first, `PrefixCache.evict_plan`). Returns how many."""
        if num_pages <= 0:
            return 0
        if self.index.host_capacity:
            plan = self.index.evict_plan(num_pages, keep=keep)
            self._host_drops += plan.drop_host
            self._offloads += plan.offload
            self._drops += plan.drop
            freed = plan.device_pages
        else:
            pages = self.index.evict(num_pages)
            self._drops += pages
            freed = len(pages)
        self.evictions += freed
        self._flush()
        return freed
