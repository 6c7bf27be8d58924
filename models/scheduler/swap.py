"""The host tier's side of the scheduler: swap preemption (a preempted sequence's pages to
host memory and back) and prefix hits whose tail is on the host (`HostSwap`, a part of
`models.scheduler.Scheduler`; the cost model and the moves: `models.host_tier`). It answers
"does a preempted or hitting request move pages instead of recomputing them?"

The host tier (`models.host_tier`; the hooks: `_swap_out` in `_preempt`, `_restore` in
`_admit`, `_tiered_hit` in `_plan`, `_flush_host` in `_flush`) changes what a re-admitted or
hitting request computes, never what it is counted for, so 1.-3. hold as written (`models.scheduler.admission`, "Progress"):
- Swap preemption (no prefix index): the preempted (newest) sequence's written pages go to host
  pages and its slot is released by the same op, as a release would; it keeps `fed` and waits
  at the head of the queue. Its re-admission follows the re-admission rule (its final pages,
  plus everything running's remaining growth) and brings the pages back into its slot before
  any step: pages_for(fed) <= its final pages, counted by that rule, and the device has them
  (running sequences are counted at their whole length, never below what the device holds).
  Whether it swaps or recomputes (`SwapPolicy`, host pages free) changes only the tokens it
  computes. A swap_in the device refused anyway would be a broken count: the scheduler reads
  its `ok` back with the next step's results and raises (a bug, never a wrong token).
- A prefix index with a host tier: a hit is its device pages (mapped and counted as before)
  then pages only on the host, brought back into new pages the request owns: counted as pages
  the request needs, exactly like tokens it would compute. Evictions free device pages as
  before (a copy to the host frees the page as a drop does; host pages are never counted on the
  device), and before bringing a hit's host pages back the scheduler evicts what the admission
  counted as evictable, keeping those host copies. A spill that finds no host page drops the
  page instead: the host tier's capacity never blocks a step.
"""
from __future__ import annotations

from arena_jax.models.scheduler.seq import Seq

__all__ = ["HostSwap"]


class HostSwap:
    """Host-tier hooks for `Scheduler` (the module docstring): `_swap_out` in `_preempt`,
    `_restore` in `_admit`, `_tiered_hit` in `_plan`."""

    def _tiered_hit(self, hit):
        """A hit whose tail is on the host keeps that tail only if bringing it back costs less
        than recomputing it (`SwapPolicy`); else the hit is cut to its device pages."""
        if hit.host_pages and not (self.tier is not None and self.tier.worth_moving(hit.host_tokens, len(hit.host_pages), 1)):
            return hit.device_part()
        return hit

    def _restore(self, restore: list) -> None:
        """Bring admitted sequences' pages back from the host tier (`aj.swap_in`, appended after a
        hit's device pages). The admission counted those pages; with a prefix index, pages only
        it holds are evicted first to free them (never the host copies being read). The op's `ok`
        is read back with the next step's results (no extra sync): a refusal is a broken count."""
        if self.index is not None:
            keep = [n for *_, nodes in restore for n in nodes]
            self._evict(self._pages_in_use() - self.layout.num_pages, keep=keep)
        rows = [(self.slot_of[r], pages, tokens) for r, _, pages, tokens, _ in restore]
        while rows:  # `aj.swap_in` reads each host page once per call: rows sharing one (two
            # admissions hitting the same cached prefix on the host) go in later calls
            call, later, read = [], [], set()
            for row in rows:
                if read.intersection(row[1]):
                    later.append(row)
                else:
                    call.append(row)
                    read.update(row[1])
            self.cache, ok = self.tier.swap_in(self.cache, call, self.batch)
            self._swap_ins.append(ok)
            rows = later
        self._page_rows_exact = False
        for r, seq, pages, tokens, _ in restore:
            if seq.swapped is not None:  # the scheduler's own host pages: free again (after the copy, in order)
                self.cache = self.tier.release(self.cache, seq.swapped, self.batch * self.layout.max_pages_per_seq)
                seq.swapped = None

    def _swap_out(self, r: int, seq: Seq) -> bool:
        """Without a prefix index: move the sequence's written pages to host pages (its slot is
        released by the same op) and keep `fed`; with one, preemption indexes the pages and
        eviction spills them (`_evict`). False: recompute it."""
        if self.tier is None or self.index is not None:
            return False
        self._flush()  # pending releases first: the slot's own release comes with the swap
        self.cache, pages = self.tier.swap_out(self.cache, self.slot_of[r], seq.fed, self.batch)
        if pages is None:
            return False
        seq.swapped, seq.swapped_tokens = pages, seq.fed
        self.rows[r] = None
        return True
