"""The host-side scheduler of `models.generate`: batch rows, the waiting queue, page accounting,
preemption and (with a prefix index) prefix hits, indexing and eviction. Device work is the
jitted steps of `models.steps`; this module decides what goes into them.

Rows and slots: row r uses slot `slot_of[r]`. With dp data shards (a cache on a mesh with a
data axis), row r belongs to shard r // (batch / dp) and uses that shard's slot
`shard * max_seqs / dp + r % (batch / dp)`; pages are counted per shard and a shard short of
pages preempts its own newest sequence. A prefix index needs one shard (generate refuses it
on a data-parallel mesh).

Prefix accounting: the host keeps an exact count of the pages in use, the index's pages (the
cache's holds) plus, per running sequence, its mapped pages that are not indexed
(`pages_for(fed) - in_index`: they are its own). Tests check it against the device's
`num_free` after every step (`CHECK_ACCOUNTING`). `free` below is the pages of a shard that no
running sequence claims (each counted at its whole current length, plus the copy a pending
copy-on-write needs), counting the index's unlocked pages as free (they can be evicted).

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

The host tier (`models.host_tier`; the hooks: `_swap_out` in `_preempt`, `_restore` in
`_admit`, `_tiered_hit` in `_plan`, `_flush_host` in `_flush`) changes what a re-admitted or
hitting request computes, never what it is counted for, so 1.-3. hold as written:
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

Mixed steps (`mixed_chunks` > 0, `generate(mixed_steps=True)`). An iteration with prompt tokens
to feed runs ONE `models.steps.mixed_step`: every decoding row's token plus up to
`mixed_chunks` chunks of the rows admitted first (on a data-parallel cache, `mixed_chunks / dp`
per data shard, each of its own rows; the rest wait for the next step), so running
sequences advance in every step while a long prompt is fed, and the step's dense work is its
B + mixed_chunks * chunk tokens. Each step still serves a row, so the bound below holds.

Arrivals (an online workload: `Seq.arrival`). A request is admitted only once the run is
`arrival` seconds old; FIFO still holds (a request not arrived yet holds the queue); with
nothing running the loop sleeps until the next arrival (not an iteration).

Overlap (run-ahead decode). After dispatching a decode step t, the
scheduler dispatches step t+1 before reading t back, when it can prove what t+1 is: every
running row decoded in t (none to prefill), no admission is due (the queue is empty, or no row
frees up at t and none was vacated since the last admission attempt: with only growing
sequences a request that did not fit still does not), and each shard's running sequences at
their length after t+1 fit its pages, so neither step can be refused (the device's pages in use
are exactly the running sequences' `pages_for(fed)`: `_check_pages`). Step t+1's rows are t's
minus those reaching max_new_tokens at t, fed t's sampled tokens on the device. A stop token is
read one step late: that row's token from t+1 is discarded and its slot released after t+1, so
tokens (and logits) are the same as with `RUN_AHEAD = False`; only the admission that the stop
allows comes one step later. Slots and sequence ids are uploaded once per distinct value, and
the steps are bound to the model's static parts once (`models.steps.bound_steps`). With a
prefix index, step t+1 runs ahead only where neither step maps a page (page_size - 2 of every
page_size steps of a row): the page rows the host read last stay exact for indexing the pages
that fill up and the sequences that stop, no reservation can fail and nothing needs evicting;
a row that stops at t is indexed as it is, and its token from t+1 lands past the indexed ones.

Decode blocks (`decode_block` > 1; `generate`'s default 8 offline off a TPU). A decode call runs up to
`decode_block` steps (`models.steps.BoundSteps.decode_block`, a while loop of the decode step on
the device, each row's sampled token fed to its next step) when nothing waits to be admitted
(no admission can be due: the queue is empty), every running row decodes, there is no prefix
index and no logits are returned: row r runs min(decode_block, max_new_tokens - generated)
steps, if each shard's rows at their length after them fit its pages (else one step). So no
reservation in a block can fail, and the pages in use are the running rows' `pages_for(fed)`
as before. The host reads a block back at once: each row accepts its tokens in order up to a
stop token; the rest were computed past its end and are discarded, and its slot is released
as at a stop. Run-ahead applies to blocks as to steps (the next block's rows are those that
go on after the in-flight one's steps). Tokens are the one-step loop's: a block's step is the
same computation as a `decode_step` call (bit for bit, tests/test_overlap.py). With
decode_block > 1 every decode call (a single step too: a block whose rows run one step, which
also returns its logits) goes through the block program, so one decode program is compiled.
"""
from __future__ import annotations

import collections
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from models.decode_ahead import RunAhead
from models.host_tier import HostTier
from models.steps import (bound_steps, drop_host_page_rows, drop_page_rows, evict_to_host_rows, flush_rows,
                          fork_page_rows, hold_page_rows, offload_page_rows, release_rows)  # fmt: skip

__all__ = ["Seq", "Scheduler", "fetch"]


def fetch(*xs) -> list[np.ndarray]:
    """Device arrays on the host, whole: one transfer when this process holds them all, else
    each gathered from the other processes of a multi-host mesh."""
    if all(getattr(x, "is_fully_addressable", True) for x in xs):
        if len(xs) == 1:  # the usual step: one array, no tree walk
            return [np.asarray(xs[0])]
        return [np.asarray(x) for x in jax.device_get(xs)]
    from jax.experimental import multihost_utils

    return [np.asarray(multihost_utils.process_allgather(x, tiled=True)) for x in xs]


@dataclasses.dataclass
class Seq:
    index: int  # position in the prompt list; also keys its random draws
    prompt: list[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    logits: list[np.ndarray] = dataclasses.field(default_factory=list)
    fed: int = 0  # tokens of prompt + generated whose K/V are in the cache
    admitted: int = -1  # admission order (for last-in-first-out preemption)
    preemptions: int = 0  # times it was preempted (at most once: module docstring)
    # Prefix cache bookkeeping: the deepest index node this sequence locks, how many of its
    # mapped pages are indexed, the partly used hit page its first reserve copies, and how many
    # of its full pages were indexed.
    anchor: object = None
    in_index: int = 0
    cow_node: object = None
    indexed_full: int = 0
    # Swap preemption: the host pages holding its first `fed` tokens while it waits (None: none).
    swapped: list[int] | None = None
    swapped_tokens: int = 0
    lost: int = 0  # tokens it had in the cache when preempted
    arrival: float = 0.0  # seconds after the run's start when it may be admitted (an online workload)
    times: list[float] = dataclasses.field(default_factory=list)  # when each generated token was read back (s after start)

    @property
    def ids(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def pending(self) -> int:
        return len(self.prompt) + len(self.generated) - self.fed


class Scheduler(RunAhead):
    """Runs a list of `Seq`s to completion on `cache` (see the module docstring)."""

    CHECK_ACCOUNTING = False  # tests: compare the host's page count with the device's after each step

    def __init__(self, model, cache, layout, batch_size, chunk_size, sampling, seed, stop, max_new, return_logits,
                 index=None, tier: HostTier | None = None, mixed_chunks: int = 0, decode_block: int = 1):  # fmt: skip
        self.graphdef, self.state = nnx.split(model)
        self.steps = bound_steps(self.graphdef, self.state)  # split and hashed once, not per step
        self.cache, self.layout = cache, layout
        self.batch, self.chunk = batch_size, chunk_size
        self.sampling = sampling.rows(batch_size)  # arrays: greedy and sampled runs share one compile
        self.seed = jnp.asarray(seed, jnp.int32)
        self.stop, self.max_new, self.return_logits = stop, max_new, return_logits
        self.rows: list[Seq | None] = [None] * batch_size
        self.dp = cache.sharding.dp if cache.sharding is not None else 1
        self.rows_per_shard = batch_size // self.dp
        self.pages_per_shard = layout.num_pages // self.dp
        self.slot_of = [(r // self.rows_per_shard) * (layout.max_seqs // self.dp) + r % self.rows_per_shard
                        for r in range(batch_size)]  # fmt: skip
        self.preemptions = self.prefill_calls = self.decode_calls = self.mixed_calls = self.iterations = 0
        self.decode_steps = 0  # decode steps the device ran (a decode block's: its longest row's)
        self.discarded_tokens = 0  # tokens sampled past a row's stop (a run-ahead step's, a block's later steps)
        # Decode blocks (module docstring): up to this many decode steps per call; 1: one per call.
        self.block = decode_block
        self._collected_steps = 1  # decode steps of the call `_collect` read back last
        # Mixed steps (module docstring, "Mixed steps"): prompt chunks per step beside the decode rows
        # (mixed_chunks / dp per data shard); 0: off.
        assert mixed_chunks % self.dp == 0, "mixed steps take the same number of chunks on every data shard"
        self.mixed_chunks = mixed_chunks
        self._admit_clock = -1.0  # when `_admit` last ran (s after start): an arrival since makes admission due
        self.prompt_tokens = self.prefill_tokens = self.hit_tokens = self.evictions = self.recomputed_tokens = 0
        self.first_token: dict[int, float] = {}
        self.start = time.perf_counter()
        self._admissions = 0
        self._to_release: list[int] = []
        self.index = index
        assert index is None or self.dp == 1, "a prefix index needs one data shard"
        self._holds: list[tuple[int, int]] = []  # (page, tokens) the cache must hold, before any release
        self._drops: list[int] = []  # pages whose holds go, after the releases
        self._page_rows: np.ndarray | None = None  # page_map as of the last step
        self._page_rows_exact = False  # no page mapped outside the steps since it was read (run-ahead needs it)
        # The host tier (models.host_tier): host pages to free, then (page, host page) copies to make.
        self.tier = tier
        assert tier is None or self.dp == 1, "a host tier needs one data shard"
        self._host_drops: list[int] = []
        self._offloads: list[tuple[int, int]] = []
        self._swap_ins: list = []  # swap_in `ok` arrays, read back with the next step's results
        # Run-ahead decode (module docstring, "Overlap"): the decode step dispatched before the
        # previous one was read back, as (out, slots, the Seq each row served), or None.
        self._ahead: tuple | None = None
        self._admit_current = False  # no row was vacated or preempted since the last `_admit`
        self._on_device: dict[bytes, jax.Array] = {}  # unchanged i32[B] inputs stay on the device
        self._next_rows_cache: tuple | None = None  # run-ahead rows' arrays, reused while the same sequences go on
        self.run_ahead_steps = 0
        self.decode_step_seconds: list[float] = []  # per iteration that only decoded: its wall time / its decode steps

    # ---- bookkeeping --------------------------------------------------------------------
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

    def _pages_in_use(self) -> int:
        """Prefix mode: exactly the device's pages in use, once pending releases are flushed."""
        private = sum(self.layout.pages_for(s.fed) - s.in_index for s in self._running())
        return self.index.num_pages + private

    def _lifetime_growth(self, shard: int) -> int:
        """Pages the running sequences of a shard may still take: each up to `final_pages`."""
        return sum(max(0, self._final_pages(s) - self.layout.pages_for(len(s.ids))) for s in self._running(shard))

    def _final_pages(self, seq: Seq) -> int:
        """The most pages `seq` can ever map: its prompt plus every token it may generate."""
        return self.layout.pages_for(len(seq.prompt) + self.max_new)

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

    def _tiered_hit(self, hit):
        """A hit whose tail is on the host keeps that tail only if bringing it back costs less
        than recomputing it (`SwapPolicy`); else the hit is cut to its device pages."""
        if hit.host_pages and not (self.tier is not None and self.tier.worth_moving(hit.host_tokens, len(hit.host_pages), 1)):
            return hit.device_part()
        return hit

    def _admit(self, waiting: collections.deque) -> None:
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
                    f"prompt {seq.index} ({len(seq.prompt)} tokens + {self.max_new} new) cannot run even alone in "
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
        self._admit_current = True

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

    def _index(self, seq: Seq, row: np.ndarray, num_tokens: int):
        ins = self.index.insert(seq.ids[:num_tokens], row[: self.layout.pages_for(num_tokens)])
        self._holds += ins.hold
        self._drops += ins.drop
        self._host_drops += ins.drop_host
        return ins

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

    def _accept(self, r: int, token: int, logits) -> None:
        seq = self.rows[r]
        seq.generated.append(token)
        seq.times.append(time.perf_counter() - self.start)
        if len(seq.generated) == 1:
            self.first_token[seq.index] = seq.times[-1]
        if logits is not None:
            seq.logits.append(logits)
        if token in self.stop or len(seq.generated) >= self.max_new:
            self._vacate(r)

    # ---- the loop ---------------------------------------------------------------------------
    @staticmethod
    def step_bound(seqs: list[Seq], max_new: int) -> int:
        """The most loop iterations `run` can take (module docstring, "Progress"): each feeds a
        token, evicts a page or preempts a sequence; a sequence is fed at most twice and
        preempted at most once, and every eviction undoes an insertion of a written page."""
        tokens = sum(len(s.prompt) + max_new for s in seqs)
        return 4 * tokens + 2 * len(seqs) + 1  # + a run-ahead step whose rows all stopped, per request

    def run(self, seqs: list[Seq]) -> None:
        waiting = collections.deque(seqs)
        bound, self.iterations = self.step_bound(seqs, self.max_new), 0
        last, last_decode_only = time.perf_counter(), None
        while self._ahead is not None or waiting or self._running():
            if self._ahead is None and not self._running() and waiting[0].arrival > self._clock():
                time.sleep(waiting[0].arrival - self._clock())  # idle until the next request arrives
                continue
            self.iterations += 1
            if self.iterations > bound:  # a broken invariant, never a hang
                raise RuntimeError(f"the scheduler passed its bound of {bound} steps without finishing: a bug")
            if self._ahead is not None:  # this iteration's decode step is running: flush and admit were no-ops
                out, slots, seqs_served, steps = self._ahead
                self._ahead = None
                if self._finish_decode(out, slots, seqs_served, waiting, steps):
                    raise RuntimeError("a run-ahead decode step was refused pages the scheduler counted: a bug")
                decode_only = True
            else:
                decode_only = self._iterate(waiting)
            now = time.perf_counter()
            if decode_only and last_decode_only is not None:
                self.decode_step_seconds.append((now - last) / self._collected_steps)
            last, last_decode_only = now, decode_only
            if self.CHECK_ACCOUNTING and self.index is None:
                self._check_pages()
        self._flush()

    def _clock(self) -> float:
        return time.perf_counter() - self.start

    def _iterate(self, waiting: collections.deque) -> bool:
        """One iteration without a run-ahead step in flight; True if it was a decode step alone."""
        self._flush(force=False)
        self._admit(waiting)
        if not self._running():
            raise RuntimeError("no sequence could be admitted")  # excluded by generate's size checks
        failed = set()  # data shards that refused a row for lack of pages
        prefilled = any(s.pending > 1 for s in self._running())
        if prefilled and self.mixed_chunks:
            failed |= self._mixed()
        elif prefilled:
            failed |= self._prefill()
        decoded = not (prefilled and self.mixed_chunks) and any(s.pending == 1 for s in self._running())
        if decoded:
            failed |= self._decode(waiting, run_ahead=not failed)
        for shard in sorted(failed):
            # Pages only the cache holds go before any running sequence (at least one: the
            # host's count said the step would fit, so it must be short of the device's).
            if not (self.index is not None and self.index.evictable_pages and self._evict(1)):
                self._preempt(waiting, shard)
        return decoded and not prefilled and not failed

    def _prefill(self) -> set:
        if self.index is None:  # with an index, `_make_room` flushes (with its evictions, in one call)
            self._flush()  # pages of sequences that just finished are free for this step
        tokens = np.zeros((self.batch, self.chunk), np.int32)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        counts = np.zeros((self.batch,), np.int32)
        seq_ids = np.zeros((self.batch,), np.int32)
        for r, s in enumerate(self.rows):
            if s is not None and s.pending > 1:
                piece = s.ids[s.fed : s.fed + self.chunk]
                tokens[r, : len(piece)] = piece
                slots[r], counts[r], seq_ids[r] = self.slot_of[r], len(piece), s.index
        if self.index is not None:
            live = np.flatnonzero(slots >= 0)
            self._make_room(live.tolist(), counts[live].tolist())
        start = time.perf_counter()
        out, packed = self.steps.prefill(
            self.steps.leaves, self.cache, jnp.asarray(tokens), self._device(slots), jnp.asarray(counts),
            self._device(seq_ids), self.seed, self.sampling,
        )  # fmt: skip
        self.cache = out.cache
        self.prefill_calls += 1
        failed = self._collect(out, packed, slots, counts)  # reads the step's results back: the time includes its work
        if self.tier is not None:
            self.tier.observe_prefill(int(counts.sum()), time.perf_counter() - start)
        return failed

    def _mixed(self) -> set:
        """One mixed step: every decoding row's token and up to `mixed_chunks` prompt chunks
        (of the rows admitted first) in one call (`models.steps.mixed_step`)."""
        if self.index is None:
            self._flush()
        batch, width = self.batch, self.chunk
        tokens, seq_ids = np.zeros((batch,), np.int32), np.zeros((batch,), np.int32)
        slots = np.full((batch,), aj.PAD_SLOT, np.int32)  # the decode part's rows
        chunks = np.zeros((self.mixed_chunks, width), np.int32)
        chunk_slots = np.full((self.mixed_chunks,), aj.PAD_SLOT, np.int32)
        chunk_counts = np.zeros((self.mixed_chunks,), np.int32)
        chunk_rows = np.full((self.mixed_chunks,), -1, np.int32)
        served, counts = np.full((batch,), aj.PAD_SLOT, np.int32), np.zeros((batch,), np.int32)  # per batch row
        # Each data shard's chunk block (mixed_chunks / dp chunks) feeds its own rows admitted first.
        per, place = self.mixed_chunks // self.dp, []
        for shard in range(self.dp):
            rows = range(shard * self.rows_per_shard, (shard + 1) * self.rows_per_shard)
            prefilling = sorted((r for r in rows if self.rows[r] is not None and self.rows[r].pending > 1),
                                key=lambda r: self.rows[r].admitted)  # fmt: skip
            place += [(shard * per + i, r) for i, r in enumerate(prefilling[:per])]
        for i, r in place:
            s = self.rows[r]
            piece = s.ids[s.fed : s.fed + width]
            chunks[i, : len(piece)], chunk_slots[i], chunk_counts[i], chunk_rows[i] = piece, self.slot_of[r], len(piece), r
            served[r], counts[r], seq_ids[r] = self.slot_of[r], len(piece), s.index
        for r, s in enumerate(self.rows):
            if s is not None and s.pending == 1:
                tokens[r], slots[r], seq_ids[r] = s.ids[-1], self.slot_of[r], s.index
                served[r], counts[r] = self.slot_of[r], 1
        if self.index is not None:
            live = np.flatnonzero(served >= 0)
            self._make_room(live.tolist(), counts[live].tolist())
        start = time.perf_counter()
        out, packed = self.steps.mixed(
            self.steps.leaves, self.cache, jnp.asarray(tokens), self._device(slots), jnp.asarray(chunks),
            jnp.asarray(chunk_slots), jnp.asarray(chunk_counts), jnp.asarray(chunk_rows), self._device(seq_ids), self.seed,
            self.sampling,
        )  # fmt: skip
        self.cache = out.cache
        self.mixed_calls += 1
        failed = self._collect(out, packed, served, counts)
        if self.tier is not None:
            self.tier.observe_prefill(int(chunk_counts.sum()), time.perf_counter() - start)
        return failed

    def _collect(self, out, packed, slots, counts, served: list | None = None, page_rows: bool = True, steps=None) -> set:
        """Advance the rows the step served; the data shards where a row was refused for lack of pages.
        `served`: the Seq each row served; a row whose Seq has left it since (a stop token read
        back after this run-ahead step was dispatched) is skipped, its token discarded.
        `page_rows=False`: keep the page rows read last (a run-ahead step mapped no page).
        `steps` (a decode block: packed is i32[block, 2, B]): the steps row r ran, each feeding
        one token; a row's tokens after it stops are past its end (discarded)."""
        wanted = [packed, *self._swap_ins]  # packed: the sampled tokens and ok, i32[2, B] (a block: [block, 2, B])
        page_rows = page_rows and self.index is not None
        if page_rows:  # the page table rows the index needs travel with the sampled tokens
            # (from the latest cache: flushes since this step, e.g. the accounting check's, took
            # its cache; they change no running slot's row)
            wanted.append(self.cache.table.page_map)
        if self.return_logits:
            wanted.append(out.logits)
        packed, *rest = fetch(*wanted)
        results = packed.tolist() if steps is not None else [packed.tolist()]  # [step][tokens, ok][B]
        per_row = steps.tolist() if steps is not None else [1] * len(results[0][0])
        self._collected_steps = max(1, max(per_row))
        swapped_in, rest = rest[: len(self._swap_ins)], rest[len(self._swap_ins) :]
        self._swap_ins = []
        if not all(x.all() for x in swapped_in):  # pads are True: a False is a row the admission counted
            raise RuntimeError("swap_in refused a row the scheduler counted pages for: a bug in its page accounting")
        if page_rows:
            self._page_rows, self._page_rows_exact = rest.pop(0), True
        logits = rest.pop(0) if self.return_logits else None
        failed = set()
        counts, rows, index = counts.tolist(), self.rows, self.index  # (plain Python: this runs every step)
        for r, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            seq = rows[r]
            if served is not None and seq is not served[r]:
                self.discarded_tokens += per_row[r]
                continue  # it stopped at the step before: these tokens are past its end
            for j, (next_tokens, ok) in enumerate(results[: per_row[r]]):
                if not ok[r]:
                    failed.add(r // self.rows_per_shard)
                    break
                seq.fed += counts[r]
                if index is not None:
                    self._index_running(seq, r)
                if seq.fed == len(seq.prompt) + len(seq.generated):  # all in the cache: the sample is its next token
                    self._accept(r, next_tokens[r], None if logits is None else logits[r])
                if rows[r] is not seq:
                    self.discarded_tokens += per_row[r] - j - 1
                    break  # it stopped: the block's later tokens are past its end
        if self.index is not None and self.CHECK_ACCOUNTING:
            self._flush()
            in_use = self.layout.num_pages - int(self.cache.table.num_free)
            assert in_use == self._pages_in_use(), f"host counts {self._pages_in_use()} pages in use, device {in_use}"
        return failed

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
