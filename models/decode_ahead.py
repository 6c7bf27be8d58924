"""Run-ahead decode for `models.scheduler.Scheduler` (its docstring, "Overlap"): the decode
step t+1 dispatched before step t is read back, when the host can prove what it is; the
inputs that do not change kept on the device; and the tests' page check that counts a step
in flight. A mixin: the Scheduler's state and bookkeeping are its own.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj

if TYPE_CHECKING:
    from models.scheduler import Seq

__all__ = ["RunAhead"]


class RunAhead:
    """Decode steps for `Scheduler`: `_decode` (one step, read back now or after the next is
    dispatched), `_finish_decode`, `_next_decode_rows`, `_check_pages`."""

    RUN_AHEAD = True  # dispatch a decode step before reading the previous one back; False: the reference

    def _device(self, rows: np.ndarray) -> jax.Array:
        """An i32[B] input on the device, uploaded once per distinct value (slots and sequence ids
        change only when sequences come and go)."""
        key = rows.tobytes()
        on = self._on_device.get(key)
        if on is None:
            if len(self._on_device) >= 64:
                self._on_device.clear()
            on = self._on_device[key] = jnp.asarray(rows)
        return on

    def _decode(self, waiting: collections.deque, run_ahead: bool = False) -> set:
        if self.index is None:
            self._flush()
        tokens = np.zeros((self.batch,), np.int32)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        seq_ids = np.zeros((self.batch,), np.int32)
        served: list[Seq | None] = [None] * self.batch
        for r, s in enumerate(self.rows):
            if s is not None and s.pending == 1:
                tokens[r], slots[r], seq_ids[r], served[r] = s.ids[-1], self.slot_of[r], s.index, s
        if self.index is not None:
            live = np.flatnonzero(slots >= 0)
            self._make_room(live.tolist(), [1] * len(live))
        out = self._dispatch_decode(jnp.asarray(tokens), slots, seq_ids)
        if not run_ahead:
            return self._collect(*out, slots, (slots >= 0).astype(np.int32))
        return self._finish_decode(out, slots, served, waiting)

    def _dispatch_decode(self, tokens: jax.Array, slots: np.ndarray, seq_ids: np.ndarray):
        out = self.steps.decode_step(
            self.steps.leaves, self.cache, tokens, self._device(slots), self._device(seq_ids), self.seed, self.sampling
        )
        self.cache = out[0].cache
        self.decode_calls += 1
        out[1].copy_to_host_async()  # the tokens start home as soon as the step ends, not when read
        return out  # (StepOutput, packed i32[2, B])

    def _finish_decode(self, out, slots: np.ndarray, served: list, waiting: collections.deque) -> set:
        """Read back a dispatched decode step, first dispatching the next one when the host can
        prove what it will be (`_next_decode_rows`): its tokens are this step's, fed back on the
        device, so the device runs step t+1 while the host handles step t's tokens."""
        nxt = self._next_decode_rows(slots, served, waiting)
        if nxt is not None:
            next_slots, next_ids, next_served = nxt
            ahead = self._dispatch_decode(out[0].tokens, next_slots, next_ids)
            self.run_ahead_steps += 1
        # Step t's cache went into step t+1 (donated): a prefix index keeps its page rows, which
        # neither step changed (`_next_decode_rows`).
        failed = self._collect(*out, slots, (slots >= 0).astype(np.int32), served, page_rows=nxt is None)
        if nxt is not None:
            if failed:
                raise RuntimeError("a decode step the scheduler counted pages for was refused: a bug in its accounting")
            self._ahead = (ahead, next_slots, next_served)
        return failed

    def _next_decode_rows(self, slots: np.ndarray, served: list, waiting: collections.deque):
        """(slots, seq ids, Seqs) of the decode step that follows the in-flight one `slots` /
        `served` (not read back yet), or None when it cannot be known before reading it back
        (`models.scheduler` docstring, "Overlap"). Rows assumed to go on: those whose Seq is still in its
        row (a stop token read back since is only known for the step before) and that have not
        reached max_new_tokens with the in-flight token; with a prefix index, only while neither
        step maps a page (the module docstring of `models.scheduler`). Plain Python on the rows (it runs every
        step, on the host's critical path): no numpy until the arrays it returns, which are
        reused while the same sequences go on in the same rows."""
        if not self.RUN_AHEAD or self._to_release and waiting:
            return None
        rows = [r for r, s in enumerate(served) if s is not None and self.rows[r] is s]
        if not rows:
            return None
        for s in self.rows:  # a row to prefill
            if s is not None and len(s.prompt) + len(s.generated) - s.fed != 1:
                return None
        going = [r for r in rows if len(served[r].generated) + 1 < self.max_new]
        if waiting and (len(going) < len(rows) or not self._admit_current):
            return None  # a row frees up, so the next iteration admits
        if waiting and self._admit_clock < waiting[0].arrival <= self._clock():
            return None  # a request arrived since the last admission: the next iteration tries it
        if not going:
            return None
        size, per = self.layout.page_size, self.rows_per_shard
        if self.index is not None:
            # With a prefix index the host reads page rows back with each step (to index the
            # pages that fill up) and makes room by evicting: run ahead only where neither the
            # in-flight step nor the next maps a page, so the rows it holds stay exact, no
            # reservation can fail and nothing needs evicting (and none mapped outside the steps
            # since they were read: a prefix hit's fork, a swap-in).
            if not self._page_rows_exact:
                return None
            for r in rows:
                s = self.rows[r]
                if s.cow_node is not None or -(-(s.fed + 2) // size) != -(-s.fed // size):
                    return None
            self._flush()
        else:
            self._flush()  # releases of rows vacated since (run before the next step, after the in-flight one)
            extra = [0] * self.batch  # tokens each row holds after the in-flight step and the next one
            for r in rows:
                extra[r] += 1
            for r in going:
                extra[r] += 1
            for shard in range(self.dp):
                pages = sum(-(-(self.rows[r].fed + extra[r]) // size)
                            for r in range(shard * per, (shard + 1) * per) if self.rows[r] is not None)  # fmt: skip
                if pages > self.pages_per_shard:
                    return None  # a reservation might fail: decide after reading the step back
        key = tuple((r, served[r].index) for r in going)
        cached = self._next_rows_cache
        if cached is None or cached[0] != key:
            next_slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
            next_ids = np.zeros((self.batch,), np.int32)
            next_served: list[Seq | None] = [None] * self.batch
            for r in going:
                next_slots[r], next_ids[r], next_served[r] = self.slot_of[r], served[r].index, served[r]
            cached = self._next_rows_cache = (key, next_slots, next_ids, next_served)
        return cached[1:]

    def _check_pages(self) -> None:
        """Tests, without a prefix index: each shard's pages in use on the device are exactly its
        running sequences' `pages_for(fed)`, counting the token of a run-ahead step in flight."""
        from models.scheduler import fetch

        self._flush()
        ahead = self._ahead[2] if self._ahead is not None else [None] * self.batch
        free = np.asarray(fetch(self.cache.table.num_free)[0]).reshape(-1)
        for shard in range(self.dp):
            lo, hi = shard * self.rows_per_shard, (shard + 1) * self.rows_per_shard
            want = sum(self.layout.pages_for(self.rows[r].fed + (ahead[r] is self.rows[r]))
                       for r in range(lo, hi) if self.rows[r] is not None)  # fmt: skip
            have = self.pages_per_shard - int(free[shard])
            assert have == want, f"shard {shard}: the host counts {want} pages in use, the device {have}"
