"""Admission and preemption: which waiting request takes a free row, which running one gives
its pages back, and the bound on the loop's steps that follows (`Admission`, a part of
`models.scheduler.Scheduler`). It answers "who runs next, and why does everything finish?"

Admission (FIFO; the head of the queue waits while it does not fit, so nothing overtakes it).
A request's *final pages* are `pages_for(len(prompt) + max_new_tokens)`, the most it can ever
map; `generate` refuses up front any request whose final pages exceed a shard's pages.
- With a prefix index, the request's candidates are its longest hit, then that hit cut back to
  its whole pages. A hit of h tokens maps h // page_size whole pages the request would need
  anyway; a hit ending inside a page also keeps that page locked in the index until the
  request's first step has copied it (copy-on-write): one page more than the request's own. The
  pages a hit locks leave `free`. The first candidate that fits is taken; when nothing runs, the
  whole-page cut is always taken (it fits: below).
- A first admission fits when its pages for prompt + 1 token, minus the hit's whole pages, plus
  one page of growth per running sequence of the shard, fit in `free` (the watermark).
- A re-admission (the request was preempted before) fits only when its final pages minus the
  hit's whole pages, plus every running sequence's remaining growth up to its final pages, fit
  in `free`: room for the whole remaining life of everything running.
- When nothing runs, the whole-page cut always fits: no page is locked (locks belong to
  running sequences), so `free` = pages - hit's whole pages >= final pages - hit's whole pages.

Progress (the bound `step_bound` enforces; a test draws tiny budgets against it).
1. The oldest running sequence of a shard is never preempted while it has company (preemption
   takes the newest), and alone it always fits: the device then holds only its own pages, a
   pending copy it was admitted with room for, and evictable pages, and `_make_room` evicts
   what each step needs. So it finishes.
2. A request is preempted at most once. When it is preempted it is the newest running, so
   everything running is older; it waits at the head of the queue, so nothing newer is
   admitted before it; it is re-admitted with room for the whole remaining life of itself and
   of everything running then. Sequences admitted after it are newer and are preempted
   before it; once they are gone, every page the shard's sequences ask for was counted at its
   re-admission, and evictions and finishing sequences only add pages. So no step fails while
   it is the newest: it is never preempted again.
3. Each loop iteration serves a row (feeding at least one token), evicts a page, or preempts a
   sequence. A request is admitted at most twice (2.), and one admission feeds at most its
   prompt + new tokens, so tokens fed are at most twice each request's prompt + new tokens.
   An eviction frees a page the index held, and a hold is taken only on a page an admission
   maps as its own (a page it wrote, or one it brought back from the host tier), at most its
   final pages <= its prompt + new tokens per admission: evictions are at most twice the
   tokens too. Preemptions are at most the number of requests. Hence at most
   `4 * sum(len(prompt) + max_new_tokens) + len(requests)` iterations (`Scheduler.step_bound`);
   `run` raises (a bug, never a hang) if it ever gets past that.
"""
from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np

import arena_jax as aj
from arena_jax.models.scheduler.seq import Seq
from arena_jax.models.steps import fork_page_rows

__all__ = ["Admission"]


class Admission:
    """Admission, vacating and preemption for `Scheduler` (the module docstring): `_plan`,
    `_admit`, `_vacate`, `_preempt`, the page counts they use and `step_bound`."""

    def _running(self, shard: int | None = None) -> list[Seq]:
        rows = self.rows if shard is None else self.rows[shard * self.rows_per_shard : (shard + 1) * self.rows_per_shard]
        return [s for s in rows if s is not None]

    def _free_pages(self, shard: int = 0) -> int:
        """Pages of a data shard not claimed by its running sequences, each counted at its full
        length to be fed (a row still prefilling will take them; a decoding row its next token's
        page). With a prefix index: minus the index's pages, plus those it could evict."""
        if self.index is None:
            used = sum(self.layout.pages_for(len(s.ids)) for s in self._running(shard))
            return self.pages_per_shard - used
        claims = sum(self.layout.pages_for(len(s.ids)) - s.in_index + (s.cow_node is not None) for s in self._running())
        return self.layout.num_pages - self.index.num_pages - claims + self.index.evictable_pages

    def _lifetime_growth(self, shard: int) -> int:
        """Pages the running sequences of a shard may still take: each up to `final_pages`."""
        return sum(max(0, self._final_pages(s) - self.layout.pages_for(len(s.ids))) for s in self._running(shard))

    def _final_pages(self, seq: Seq) -> int:
        """The most pages `seq` can ever map: its prompt plus every token it may generate."""
        return self.layout.pages_for(len(seq.prompt) + self._max_new(seq))

    def _plan(self, seq: Seq, shard: int):
        """(fits, hit) for admitting `seq` into `shard` now (module docstring, "Admission")."""
        running = self._running(shard)
        free = self._free_pages(shard)
        hits = [None]
        if self.index is not None:
            hit = self._tiered_hit(self.index.lookup(seq.ids, limit=len(seq.ids) - 1))
            whole = hit.whole_pages(self.layout.page_size)
            hits = [hit, whole] if whole.num_tokens != hit.num_tokens else [hit]
        for hit in hits:
            # The device pages a hit maps are pages the sequence would need anyway (a partly used
            # last one is copied: not counted); its host pages are brought back into new pages.
            full = 0 if hit is None else len(hit.pages) if hit.host_pages else hit.num_tokens // self.layout.page_size
            # The pages a hit locks (its device part) leave the evictable pool.
            avail = free - (sum(1 for n in hit.nodes[: len(hit.pages)] if not n.locks) if hit is not None else 0)
            if seq.preemptions:  # a second admission is for good: room for every running sequence's whole life
                fits = self._final_pages(seq) - full + self._lifetime_growth(shard) <= avail
            else:  # watermark: this sequence, plus one page of growth per running sequence
                fits = self.layout.pages_for(len(seq.ids) + 1) - full + len(running) <= avail
            if fits or (not running and hit is hits[-1]):
                return fits, hit
        return False, None

    def _admit(self, waiting: collections.deque) -> None:
        placed = False
        fork = []  # (row, hit)
        restore = []  # (row, seq, host pages, tokens, index nodes): brought back from the host tier after the forks
        now = self._admit_clock = self._clock()
        for r in range(self.batch):
            if not waiting or waiting[0].arrival > now:  # FIFO: a request not arrived yet holds the queue
                break
            if self.rows[r] is not None:
                continue
            seq, shard = waiting[0], r // self.rows_per_shard
            fits, hit = self._plan(seq, shard)
            if not fits:
                if self._running(shard):
                    if self.dp == 1:
                        break
                    continue  # another data shard may have room
                raise RuntimeError(  # excluded by generate's checks: a request fits the arena alone
                    f"prompt {seq.index} ({len(seq.prompt)} tokens + {self._max_new(seq)} new) cannot run even alone in "
                    f"{self.pages_per_shard} pages of {self.layout.page_size}"
                )
            waiting.popleft()
            seq.fed, seq.admitted = 0, self._admissions
            self._admissions += 1
            self.rows[r] = seq
            self.prompt_tokens += len(seq.ids)
            if seq.swapped is not None:  # swapped out when preempted: its pages come back
                restore.append((r, seq, seq.swapped, seq.swapped_tokens, []))
                seq.fed = seq.swapped_tokens
            if hit is not None:
                seq.anchor = self.index.acquire(hit, len(seq.ids))
                seq.fed, seq.in_index = hit.num_tokens, len(hit.pages)
                partial = hit.num_tokens % self.layout.page_size and not hit.host_pages
                seq.cow_node = hit.nodes[-1] if partial else None
                seq.indexed_full = len(hit.pages) if hit.host_pages else hit.num_tokens // self.layout.page_size
                self.hit_tokens += hit.num_tokens
                if hit.device_tokens:
                    fork.append((r, hit))
                if hit.host_pages:
                    restore.append((r, seq, list(hit.host_pages), hit.host_tokens, hit.nodes[len(hit.pages) :]))
            self.prefill_tokens += len(seq.ids) - seq.fed
            self.recomputed_tokens += max(0, seq.lost - seq.fed)  # a re-admission: what did not come back
            seq.lost = 0
            placed = True
        if fork:
            self._flush()  # the pages it maps must be held
            pages = np.full((self.batch, self.layout.max_pages_per_seq), aj.PAD_PAGE, np.int32)
            counts = np.zeros((self.batch,), np.int32)
            dst = np.full((self.batch,), aj.PAD_SLOT, np.int32)
            for r, hit in fork:
                pages[r, : len(hit.pages)], counts[r], dst[r] = hit.pages, hit.device_tokens, self.slot_of[r]
            self.cache = fork_page_rows(self.cache, jnp.asarray(pages), jnp.asarray(counts), jnp.asarray(dst))
            self._page_rows_exact = False  # rows mapped since the last read-back
        if restore:
            self._restore(restore)
        if placed and self.row_sampling:
            self._set_row_sampling()
        self._admit_current = True

    def _vacate(self, r: int) -> None:
        seq = self.rows[r]
        if self.index is not None:  # index everything it wrote (a partly filled last page too)
            if seq.fed:
                self._index(seq, self._page_rows[self.slot_of[r]], seq.fed)
            self.index.unlock(seq.anchor)
            seq.anchor, seq.in_index, seq.cow_node, seq.indexed_full = None, 0, None, 0
        self.rows[r] = None
        self._to_release.append(r)
        self._admit_current = False

    def _preempt(self, waiting: collections.deque, shard: int = 0) -> None:
        """Release the most recently admitted running sequence of a data shard and requeue it first:
        swapped out to the host tier if the cost model says so (`_swap_out`), else recomputed."""
        rows = range(shard * self.rows_per_shard, (shard + 1) * self.rows_per_shard)
        r = max((r for r in rows if self.rows[r] is not None), key=lambda r: self.rows[r].admitted)
        seq = self.rows[r]
        seq.lost = seq.fed  # tokens whose K/V it had: recomputed unless they come back
        if not self._swap_out(r, seq):
            self._vacate(r)
            seq.fed = 0
        seq.preemptions += 1
        self._flush()
        waiting.appendleft(seq)
        self.preemptions += 1
        self._admit_current = False

    @staticmethod
    def step_bound(seqs: list[Seq], max_new: int) -> int:
        """The most loop iterations `run` can take (module docstring, "Progress"): each feeds a
        token, evicts a page or preempts a sequence; a sequence is fed at most twice and
        preempted at most once, and every eviction undoes an insertion of a written page."""
        tokens = sum(len(s.prompt) + (max_new if s.max_new is None else s.max_new) for s in seqs)
        return 4 * tokens + 2 * len(seqs) + 1  # + a run-ahead step whose rows all stopped, per request
