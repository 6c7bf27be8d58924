"""Run-ahead decode and decode blocks for `models.scheduler.Scheduler`: the decode step t+1
dispatched before step t is read back, when the host can prove what it is; up to
`decode_block` decode steps in one call; the inputs that do not change kept on the device; and
the tests' page check that counts a step in flight (`RunAhead`, a part of the Scheduler; also
importable as `models.decode_ahead`). It answers "what can the device run before the host has
read the last step back?"

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
import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj
from arena_jax.models.scheduler.readback import fetch
from arena_jax.models.scheduler.seq import Seq

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

    def _host_tokens(self, tokens: np.ndarray) -> jax.Array:
        """i32[B] tokens from the host, placed as a decode step's sampled tokens are (committed, with
        their sharding), so that a call fed the previous step's tokens on the device (run-ahead, the
        module docstring) is the same program as one fed the host's: one compile, not two. Off a mesh
        that is the arena's device; on a mesh, before any decode, split over its data axis (rows
        per data shard; replicated without one), then the sharding the last decode's came back with."""
        if self._token_sharding is None:
            where = self.cache.sharding
            if where is None:
                self._token_sharding = self.cache.k.sharding  # the Scheduler committed it to its device
            else:
                spec = jax.sharding.PartitionSpec(where.data_axis) if where.data_axis else jax.sharding.PartitionSpec()
                self._token_sharding = jax.sharding.NamedSharding(where.mesh, spec)
        return jax.device_put(tokens, self._token_sharding)

    def _decode(self, waiting: collections.deque, run_ahead: bool = False) -> set:
        if self.speculative is not None and not self.return_logits and any(
                s.speculate for s in self.rows if s is not None and s.pending == 1):  # fmt: skip
            return self._verify()
        run_ahead = run_ahead and self.speculative is None  # (a verify call may follow: nothing in flight)
        if self.index is None:
            self._flush()
        tokens = np.zeros((self.batch,), np.int32)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        seq_ids = np.zeros((self.batch,), np.int32)
        served: list[Seq | None] = [None] * self.batch
        for r, s in enumerate(self.rows):
            if s is not None and s.pending == 1:
                tokens[r], slots[r], seq_ids[r], served[r] = s.ids[-1], self.slot_of[r], s.draw_key, s
        if self.index is not None:
            live = np.flatnonzero(slots >= 0)
            self._make_room(live.tolist(), [1] * len(live))
        steps = self._block_steps([0] * self.batch, [r for r, s in enumerate(served) if s is not None], waiting)
        out = self._dispatch_decode(self._host_tokens(tokens), slots, seq_ids, steps)
        if not run_ahead:
            return self._collect(*out, slots, (slots >= 0).astype(np.int32), steps=steps)
        return self._finish_decode(out, slots, served, waiting, steps)

    def _verify(self) -> set:
        """Speculative decoding (models.speculative): every decoding row's last token and what the
        proposer proposes for it, in one verify call; each row advances by its accepted proposals
        + 1. A row that opted out (`Seq.speculate`) gets no proposals: it decodes plainly in the
        same call. Proposals are dropped (plain decoding, in the same call) where they might not
        fit the pages."""
        if self.index is None:
            self._flush()
        k = self.speculative.k
        tokens = np.zeros((self.batch, k + 1), np.int32)
        slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
        counts = np.zeros((self.batch,), np.int32)
        seq_ids = np.zeros((self.batch,), np.int32)
        decoding = [s is not None and s.pending == 1 for s in self.rows]
        requests = [(s.ids, self._max_new(s) - len(s.generated) - 1) if going and s.speculate else None
                    for s, going in zip(self.rows, decoding)]  # fmt: skip
        if hasattr(self.speculative, "propose_rows"):  # a batched proposer (models.DraftModel): one call
            proposals = self.speculative.propose_rows(requests)
        else:
            proposals = [None if q is None else self.speculative.propose(*q) for q in requests]
        for r, s in enumerate(self.rows):
            if decoding[r]:
                proposal = [] if requests[r] is None else list(proposals[r])[:k]
                tokens[r, 0], tokens[r, 1 : 1 + len(proposal)] = s.ids[-1], proposal
                slots[r], counts[r], seq_ids[r] = self.slot_of[r], 1 + len(proposal), s.draw_key
        if self.index is None and not self._pages_fit(counts.tolist()):
            tokens[:, 1:], counts = 0, np.minimum(counts, 1)  # a reservation might fail: plain decoding
        if self.index is not None:
            live = np.flatnonzero(slots >= 0)
            self._make_room(live.tolist(), counts[live].tolist())
        # (tokens and counts change every call: given as numpy, the jitted call uploads them itself,
        # ~15 us each, where a jnp.asarray first dispatches a conversion: ~20-80 us each)
        out, packed = self.steps.verify(self.steps.leaves, self.cache, tokens, self._device(slots), counts,
                                        self._device(seq_ids), self.seed, self.sampling)  # fmt: skip
        self.cache = out.cache
        self.verify_calls += 1
        self.proposed_tokens += int(counts.sum() - (slots >= 0).sum())
        self.decode_calls += 1
        return self._collect(out, packed, slots, (slots >= 0).astype(np.int32), counted=True)

    def _block_steps(self, in_flight: list[int], going: list[int], waiting: collections.deque):
        """i32[B]: the decode steps each row of `going` runs in the next call (module docstring,
        "Decode blocks"), or None for a plain `decode_step` (decode_block 1). Up to
        `decode_block` steps (none past max_new_tokens) while nothing waits, no row prefills,
        there is no prefix index, no logits are returned and each data shard's rows at their
        length after the in-flight steps (`in_flight[r]` tokens of a call not read back yet)
        and these fit its pages; else one step."""
        if self.block == 1:
            return None
        steps = np.zeros((self.batch,), np.int32)
        steps[going] = 1
        if waiting or self.index is not None or self.return_logits or any(s.pending != 1 for s in self._running()):
            return steps
        for r in going:
            steps[r] = min(self.block, self._max_new(self.rows[r]) - len(self.rows[r].generated) - in_flight[r])
        if not self._pages_fit([a + int(b) for a, b in zip(in_flight, steps)]):
            steps[going] = 1  # a block's reservation might fail: one step (the caller checks its pages)
        return steps

    def _pages_fit(self, extra: list[int]) -> bool:
        """Each data shard's running rows, holding `extra[r]` tokens more than they have fed, fit its pages."""
        size, per = self.layout.page_size, self.rows_per_shard
        for shard in range(self.dp):
            pages = sum(-(-(self.rows[r].fed + extra[r]) // size)
                        for r in range(shard * per, (shard + 1) * per) if self.rows[r] is not None)  # fmt: skip
            if pages > self.pages_per_shard:
                return False
        return True

    def _dispatch_decode(self, tokens: jax.Array, slots: np.ndarray, seq_ids: np.ndarray, steps: np.ndarray | None):
        if steps is None:
            out = self.steps.decode_step(
                self.steps.leaves, self.cache, tokens, self._device(slots), self._device(seq_ids), self.seed, self.sampling
            )
            self.decode_steps += 1
        else:
            out = self.steps.decode_block(
                self.steps.leaves, self.cache, tokens, self._device(slots), self._device(steps), self._device(seq_ids),
                self.seed, self.sampling, length=self.block,
            )  # fmt: skip
            self.decode_steps += int(steps.max(initial=0))
        self.cache = out[0].cache
        self._token_sharding = out[0].tokens.sharding
        self.decode_calls += 1
        out[1].copy_to_host_async()  # the tokens start home as soon as the step ends, not when read
        return out  # (StepOutput, packed i32[2, B] or i32[block, 2, B])

    def _finish_decode(self, out, slots: np.ndarray, served: list, waiting: collections.deque, steps) -> set:
        """Read back a dispatched decode step (or block), first dispatching the next one when the
        host can prove what it will be (`_next_decode_rows`): its tokens are this call's last,
        fed back on the device, so the device runs the next call while the host handles this one's tokens."""
        nxt = self._next_decode_rows(slots, served, waiting, steps)
        if nxt is not None:
            next_slots, next_ids, next_served, next_steps = nxt
            ahead = self._dispatch_decode(out[0].tokens, next_slots, next_ids, next_steps)
            self.run_ahead_steps += 1
        # Step t's cache went into step t+1 (donated): a prefix index keeps its page rows, which
        # neither step changed (`_next_decode_rows`).
        failed = self._collect(*out, slots, (slots >= 0).astype(np.int32), served, page_rows=nxt is None, steps=steps)
        if nxt is not None:
            if failed:
                raise RuntimeError("a decode step the scheduler counted pages for was refused: a bug in its accounting")
            self._ahead = (ahead, next_slots, next_served, next_steps)
        return failed

    def _next_decode_rows(self, slots: np.ndarray, served: list, waiting: collections.deque, steps=None):
        """(slots, seq ids, Seqs, steps) of the decode call that follows the in-flight one `slots` /
        `served` / `steps` (not read back yet; steps None: one step per row; the next call's
        steps: `_block_steps`), or None when it cannot be known before reading it back
        (the module docstring, "Overlap"). Rows assumed to go on: those whose Seq is still in its
        row (a stop token read back since is only known for the step before) and that have not
        reached max_new_tokens with the in-flight token; with a prefix index, only while neither
        step maps a page (the module docstring, "Overlap"). Plain Python on the rows (it runs every
        step, on the host's critical path): no numpy until the arrays it returns, which are
        reused while the same sequences go on in the same rows."""
        if not self.RUN_AHEAD or self._to_release and waiting:
            return None
        rows = [r for r, s in enumerate(served) if s is not None and self.rows[r] is s]
        if not rows:
            return None
        in_flight = [1] * self.batch if steps is None else steps.tolist()
        for s in self.rows:  # a row to prefill
            if s is not None and len(s.prompt) + len(s.generated) - s.fed != 1:
                return None
        going = [r for r in rows if len(served[r].generated) + in_flight[r] < self._max_new(served[r])]
        if waiting and (len(going) < len(rows) or not self._admit_current):
            return None  # a row frees up, so the next iteration admits
        if waiting and self._admit_clock < waiting[0].arrival <= self._clock():
            return None  # a request arrived since the last admission: the next iteration tries it
        if not going:
            return None
        size = self.layout.page_size
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
        self._flush()  # releases of rows vacated since (run before the next step, after the in-flight one)
        next_steps = self._block_steps(in_flight, going, waiting)
        if self.index is None:
            extra = [0] * self.batch  # tokens each row holds after the in-flight call and the next one
            for r in rows:
                extra[r] += in_flight[r]
            for r in going:
                extra[r] += 1 if next_steps is None else int(next_steps[r])
            if not self._pages_fit(extra):
                return None  # a reservation might fail: decide after reading the step back
        key = tuple((r, served[r].index, 1 if next_steps is None else int(next_steps[r])) for r in going)
        cached = self._next_rows_cache
        if cached is None or cached[0] != key:
            next_slots = np.full((self.batch,), aj.PAD_SLOT, np.int32)
            next_ids = np.zeros((self.batch,), np.int32)
            next_served: list[Seq | None] = [None] * self.batch
            for r in going:
                next_slots[r], next_ids[r], next_served[r] = self.slot_of[r], served[r].draw_key, served[r]
            cached = self._next_rows_cache = (key, next_slots, next_ids, next_served, next_steps)
        return cached[1:]

    def _check_pages(self) -> None:
        """Tests, without a prefix index: each shard's pages in use on the device are exactly its
        running sequences' `pages_for(fed)`, counting the token of a run-ahead step in flight."""
        self._flush()
        ahead = self._ahead[2] if self._ahead is not None else [None] * self.batch
        steps = self._ahead[3] if self._ahead is not None and self._ahead[3] is not None else np.ones(self.batch, int)
        free = np.asarray(fetch(self.cache.table.num_free)[0]).reshape(-1)
        for shard in range(self.dp):
            lo, hi = shard * self.rows_per_shard, (shard + 1) * self.rows_per_shard
            want = sum(self.layout.pages_for(self.rows[r].fed + (int(steps[r]) if ahead[r] is self.rows[r] else 0))
                       for r in range(lo, hi) if self.rows[r] is not None)  # fmt: skip
            have = self.pages_per_shard - int(free[shard])
            assert have == want, f"shard {shard}: the host counts {want} pages in use, the device {have}"
