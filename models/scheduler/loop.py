"""`Scheduler`: the loop that runs a list of `Seq`s to completion on a cache, one iteration
at a time: admit, then one prefill (or mixed) call and one decode call, then read the
results back and advance the rows. Its parts: `models.scheduler.admission`, `.prefix`,
`.swap`, `.run_ahead` (mixins holding the methods of each idea; the state is the
Scheduler's). It answers "what does one iteration do?"

Rows and slots: row r uses slot `slot_of[r]`. With dp data shards (a cache on a mesh with a
data axis), row r belongs to shard r // (batch / dp) and uses that shard's slot
`shard * max_seqs / dp + r % (batch / dp)`; pages are counted per shard and a shard short of
pages preempts its own newest sequence. A prefix index needs one shard (generate refuses it
on a data-parallel mesh).

Mixed steps (`mixed_chunks` > 0, `generate(mixed_steps=True)`). An iteration with prompt tokens
to feed runs ONE `models.steps.mixed_step`: every decoding row's token plus up to
`mixed_chunks` chunks of the rows admitted first (on a data-parallel cache, `mixed_chunks / dp`
per data shard, each of its own rows; the rest wait for the next step), so running
sequences advance in every step while a long prompt is fed, and the step's dense work is its
B + mixed_chunks * chunk tokens. Each step still serves a row, so the bound (`models.scheduler.admission`, "Progress") holds.

Arrivals (an online workload: `Seq.arrival`). A request is admitted only once the run is
`arrival` seconds old; FIFO still holds (a request not arrived yet holds the queue); with
nothing running the loop sleeps until the next arrival (not an iteration).
"""
from __future__ import annotations

import collections
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax.models.host_tier import HostTier
from arena_jax.models.scheduler.admission import Admission
from arena_jax.models.scheduler.prefix import PrefixPages
from arena_jax.models.scheduler.readback import fetch
from arena_jax.models.scheduler.run_ahead import RunAhead
from arena_jax.models.scheduler.seq import Seq
from arena_jax.models.sampling import SamplingParams
from arena_jax.models.scheduler.swap import HostSwap
from arena_jax.models.steps import bound_steps

__all__ = ["Scheduler"]


class Scheduler(Admission, PrefixPages, HostSwap, RunAhead):
    """Runs a list of `Seq`s to completion on `cache` (see `models.scheduler` and its modules)."""

    CHECK_ACCOUNTING = False  # tests: compare the host's page count with the device's after each step

    def __init__(self, model, cache, layout, batch_size, chunk_size, sampling, seed, stop, max_new, return_logits,
                 index=None, tier: HostTier | None = None, mixed_chunks: int = 0, decode_block: int = 1):  # fmt: skip
        self.graphdef, self.state = nnx.split(model)
        self.steps = bound_steps(self.graphdef, self.state)  # split and hashed once, not per step
        self.cache, self.layout = committed(cache), layout
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
        # Decode blocks (models.scheduler.run_ahead): up to this many decode steps per call; 1: one per call.
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
        # Run-ahead decode (models.scheduler.run_ahead, "Overlap"): the decode step dispatched before the
        # previous one was read back, as (out, slots, the Seq each row served), or None.
        self._ahead: tuple | None = None
        self._admit_current = False  # no row was vacated or preempted since the last `_admit`
        self._on_device: dict[bytes, jax.Array] = {}  # unchanged i32[B] inputs stay on the device
        self._token_sharding = None  # where a decode step's sampled tokens live (RunAhead._host_tokens)
        self.on_token = None  # (prompt index, token) -> None, called as each token is kept (generate's on_token)
        self.on_finish = None  # (Seq) -> None, called as a sequence ends (seq.finish says why)
        self.row_sampling = False  # each row samples with its Seq's own `sampling` (an online engine's requests)
        self.speculative = None  # a proposer (models.speculative.PromptLookup): decode by verify calls
        self.verify_calls = self.proposed_tokens = self.accepted_tokens = 0
        self._next_rows_cache: tuple | None = None  # run-ahead rows' arrays, reused while the same sequences go on
        self.run_ahead_steps = 0
        self.decode_step_seconds: list[float] = []  # per iteration that only decoded: its wall time / its decode steps

    def _max_new(self, seq: Seq) -> int:
        return self.max_new if seq.max_new is None else seq.max_new

    def _accept(self, r: int, token: int, logits) -> None:
        seq = self.rows[r]
        if seq.cancelled:  # the token is dropped: the request is gone
            self._end(r, "abort")
            return
        seq.generated.append(token)
        seq.times.append(time.perf_counter() - self.start)
        if logits is not None:  # (before on_token: a callback may read the token's logits)
            seq.logits.append(logits)
        if self.on_token is not None:
            self.on_token(seq.index, int(token))
        if len(seq.generated) == 1:
            self.first_token[seq.index] = seq.times[-1]
        if token in (self.stop if seq.stop is None else seq.stop):
            self._end(r, "stop")
        elif len(seq.generated) >= self._max_new(seq):
            self._end(r, "length")

    def _end(self, r: int, why: str) -> None:
        """Row r's sequence is done (`why`: Seq.finish): its row is vacated, its pages released."""
        seq = self.rows[r]
        seq.finish = why
        self._vacate(r)
        if self.on_finish is not None:
            self.on_finish(seq)

    def _set_row_sampling(self) -> None:
        """Each row's sampling from its Seq (`row_sampling`): arrays of the same shapes, no compile."""
        rows = [s.sampling if s is not None and s.sampling is not None else (0.0, 0, 1.0) for s in self.rows]
        temperature, top_k, top_p = (np.array(col) for col in zip(*rows))
        self.sampling = SamplingParams(jnp.asarray(temperature, jnp.float32), jnp.asarray(top_k, jnp.int32),
                                       jnp.asarray(top_p, jnp.float32))  # fmt: skip

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, seqs: list[Seq]) -> None:
        waiting = collections.deque(seqs)
        bound, self.iterations = self.step_bound(seqs, self.max_new), 0
        last, last_decode_only = time.perf_counter(), None
        while self.busy(waiting):
            if self._ahead is None and not self._running() and waiting[0].arrival > self._clock():
                time.sleep(waiting[0].arrival - self._clock())  # idle until the next request arrives
                continue
            self.iterations += 1
            if self.iterations > bound:  # a broken invariant, never a hang
                raise RuntimeError(f"the scheduler passed its bound of {bound} steps without finishing: a bug")
            decode_only = self.step(waiting)
            now = time.perf_counter()
            if decode_only and last_decode_only is not None:
                self.decode_step_seconds.append((now - last) / self._collected_steps)
            last, last_decode_only = now, decode_only
            if self.CHECK_ACCOUNTING and self.index is None:
                self._check_pages()
        self._flush()

    def busy(self, waiting: collections.deque) -> bool:
        """Anything left to do: a step in flight, a request waiting or a sequence running."""
        return self._ahead is not None or bool(waiting) or bool(self._running())

    def step(self, waiting: collections.deque) -> bool:
        """One iteration of the loop (`run`'s, or an online engine's); True if it only decoded."""
        if self._ahead is not None:  # this iteration's decode step is running: flush and admit were no-ops
            out, slots, seqs_served, steps = self._ahead
            self._ahead = None
            if self._finish_decode(out, slots, seqs_served, waiting, steps):
                raise RuntimeError("a run-ahead decode step was refused pages the scheduler counted: a bug")
            return True
        return self._iterate(waiting)

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
                slots[r], counts[r], seq_ids[r] = self.slot_of[r], len(piece), s.draw_key
        self._make_room_for(slots, counts)
        start = time.perf_counter()
        out, packed = self.steps.prefill(
            self.steps.leaves, self.cache, tokens, self._device(slots), counts,  # (numpy: `_verify`'s note)
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
            served[r], counts[r], seq_ids[r] = self.slot_of[r], len(piece), s.draw_key
        for r, s in enumerate(self.rows):
            if s is not None and s.pending == 1:
                tokens[r], slots[r], seq_ids[r] = s.ids[-1], self.slot_of[r], s.draw_key
                served[r], counts[r] = self.slot_of[r], 1
        self._make_room_for(served, counts)
        start = time.perf_counter()
        out, packed = self.steps.mixed(
            self.steps.leaves, self.cache, tokens, self._device(slots), chunks,  # (numpy: `_verify`'s note)
            chunk_slots, chunk_counts, chunk_rows, self._device(seq_ids), self.seed,
            self.sampling,
        )  # fmt: skip
        self.cache = out.cache
        self.mixed_calls += 1
        failed = self._collect(out, packed, served, counts)
        if self.tier is not None:
            self.tier.observe_prefill(int(chunk_counts.sum()), time.perf_counter() - start)
        return failed

    def _collect(self, out, packed, slots, counts, served: list | None = None, page_rows: bool = True, steps=None,
                 counted: bool = False) -> set:
        """Advance the rows the step served; the data shards where a row was refused for lack of pages.
        `served`: the Seq each row served; a row whose Seq has left it since (a stop token read
        back after this run-ahead step was dispatched) is skipped, its token discarded.
        `page_rows=False`: keep the page rows read last (a run-ahead step mapped no page).
        `steps` (a decode block: packed is i32[block, 2, B]): the steps row r ran, each feeding
        one token; a row's tokens after it stops are past its end (discarded). `counted` (a
        verify call: packed is i32[k + 2, 2, B]): as a block whose steps per row are its last
        entry (accepted proposals + 1)."""
        wanted = [packed, *self._swap_ins]  # packed: the sampled tokens and ok, i32[2, B] (a block: [block, 2, B])
        page_rows = page_rows and self.index is not None
        if page_rows:  # the page table rows the index needs travel with the sampled tokens
            # (from the latest cache: flushes since this step, e.g. the accounting check's, took
            # its cache; they change no running slot's row)
            wanted.append(self.cache.table.page_map)
        if self.return_logits:
            wanted.append(out.logits)
        packed, *rest = fetch(*wanted)
        if counted:
            *results, (per_row, _) = packed.tolist()
            per_row = [max(1, n) for n in per_row]  # a refused row: its first step's ok (False) is read
            self.accepted_tokens += sum(n - 1 for n, slot in zip(per_row, slots.tolist()) if slot >= 0)
        else:
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


def committed(cache: aj.KVCache) -> aj.KVCache:
    """A one-device cache committed to its device (no copy). A jitted step's outputs are committed
    when any input is (the host tier's arrays name a memory kind; the run-ahead decode feeds a
    step's tokens back), and a step lowers differently for a committed argument: a step first
    called with a fresh `aj.create` cache would compile again, same shapes, for its own output."""
    leaves = [x for x in jax.tree.leaves(cache) if isinstance(x, jax.Array)]
    if cache.sharding is not None or all(x.committed for x in leaves):
        return cache
    return jax.device_put(cache, next(iter(cache.k.devices())))
