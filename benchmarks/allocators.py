"""The three KV allocators that `arena-bench capacity` serves a workload with.

Each backend holds real allocator state and answers one call per simulation step:

    step(grow, finishing, admit) -> StepResult

  grow       running sequences, oldest admission first; each needs one more token position
  finishing  per grow row: the sequence ends with this token (its memory is freed next step)
  admit      waiting sequences at the queue head, in order, each with a free slot assigned;
             each needs `ctx` positions (its prompt, or prompt + tokens generated before a
             preemption). Served first come, first served: the first that does not fit blocks
             the rest.

When growth is refused for some sequences, the newest of them is preempted (its memory is
freed and the scheduler requeues it for recompute) and the others stall for this step,
keeping their memory (the freed memory serves them next step). The backends:

* `ArenaBackend`: arena_jax itself. `aj.reserve` / `aj.release` on a real `KVCache` whose page
  count equals the budget's (tiny head_dim / layers: the allocator state is what is measured),
  one jitted call per step (`arena_step`: release, then one batched reserve for every running
  sequence's next token and the admitted prompts), then one small device-to-host read.
  `benchmarks.arena_sim` runs the same step with the scheduler on the device (the default).
* `ContiguousBackend(headroom=None)`: one `max_seq_len` slab per request (the usual JAX/Flax
  dense cache), in a token-granular first-fit free list over the same budget.
* `ContiguousBackend(headroom=0.25)`: a slab of prompt + 25% headroom, regrown by 25% when
  exceeded: extended in place when the next block is free, else a new block is allocated
  first-fit, the tokens copied, and the old block freed (counted).

Figures after a step leave out the sequences that finished or were preempted in it: every
backend frees their memory at the start of the next step, before growing and admitting.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj
from arena_jax.layout import ROW_ALIGN_BYTES

__all__ = [
    "Seq",
    "StepResult",
    "FirstFit",
    "ArenaBackend",
    "ContiguousBackend",
    "tiny_arena_layout",
    "arena_step",
    "check_with_health",
]


@dataclasses.dataclass
class Seq:
    rid: int
    arrival: int
    prompt_len: int
    output_len: int
    generated: int = 0
    slot: int = -1
    first_admit: int | None = None
    preemptions: int = 0

    @property
    def ctx(self) -> int:
        """Token positions the sequence holds (or needs on admission)."""
        return self.prompt_len + self.generated


@dataclasses.dataclass
class StepResult:
    ok_grow: list[bool]  # per grow row
    ok_admit: list[bool]  # per admit row
    tokens_held: int  # token positions held by running sequences after the step
    reserved_tokens: int  # token positions of memory reserved for them (pages / slabs)


# ---- arena_jax -----------------------------------------------------------------------------


def tiny_arena_layout(num_pages: int, page_size: int, max_seqs: int, max_seq_len: int) -> aj.KVLayout:
    """A real arena with the budget's page count and the smallest legal page (1 layer, 1 KV head)."""
    head_dim = 8
    while (head_dim * 2) % ROW_ALIGN_BYTES:  # bf16: 2 bytes
        head_dim *= 2
    return aj.KVLayout(
        num_layers=1,
        num_kv_heads=1,
        head_dim=head_dim,
        page_size=page_size,
        num_pages=num_pages,
        max_seqs=max_seqs,
        max_pages_per_seq=-(-max_seq_len // page_size),
        dtype="bfloat16",
    )


def _newest_refused(live, ok):
    """bool[S]: the last live row whose growth was refused (the preemption victim), if any."""
    rows = jnp.arange(live.shape[0])
    last = jnp.max(jnp.where(live & ~ok, rows, -1))
    return rows == last


def arena_step(cache, free_slots, grow_slots, finishing, admit_slots, admit_tokens, watermark_pages):
    """One scheduler step on the real cache: free, grow, admit. Fixed shapes: it never recompiles.

    free_slots   i32[S]  sequences that finished or were preempted last step (PAD_SLOT padded)
    grow_slots   i32[S]  running sequences, oldest admission first; each grows by one token
    finishing    bool[S] per grow row: this is its last token (freed at the next step)
    admit_slots  i32[K]  queue head, each with a free slot; admit_tokens i32[K] positions wanted
    """
    cache = aj.release(cache, free_slots)
    t = cache.table
    page = cache.k.shape[3]
    grow_live = grow_slots != aj.PAD_SLOT
    grow_len = jnp.where(grow_live, t.lengths[jnp.maximum(grow_slots, 0)], 0)
    # Admission policy (not the allocator): admit a prefix of the queue head whose pages, after this
    # step's growth, leave `watermark_pages` free. The reservation itself is the real `aj.reserve`.
    grow_pages = jnp.sum(grow_live & (grow_len % page == 0))
    admit_pages = jnp.where(admit_slots != aj.PAD_SLOT, -(-admit_tokens // page), 0)
    room = t.num_free - grow_pages - watermark_pages
    admit_ok = jnp.cumsum(admit_pages) <= room
    admit_slots = jnp.where(admit_ok, admit_slots, aj.PAD_SLOT)
    # One batched reservation: growth first (running sequences are served before new ones).
    slots = jnp.concatenate([grow_slots, admit_slots])
    tokens = jnp.concatenate([grow_live.astype(jnp.int32), jnp.where(admit_ok, admit_tokens, 0)])
    cache, ok = aj.reserve(cache, slots, tokens)
    n = grow_slots.shape[0]
    ok_grow, ok_admit = ok[:n] & grow_live, ok[n:] & (admit_slots != aj.PAD_SLOT)
    # Finished sequences and the newest one that could not grow (preempted) are released at the
    # start of the next step; the figures below leave them out already. Other refused rows stall.
    leaving = (ok_grow & finishing) | _newest_refused(grow_live, ok_grow)
    t = cache.table
    leave_len = jnp.where(leaving, t.lengths[jnp.maximum(grow_slots, 0)], 0)
    tokens_held = jnp.sum(jnp.where(t.active, t.lengths, 0)) - jnp.sum(leave_len)
    pages_in_use = t.refcount.shape[0] - t.num_free - jnp.sum(-(-leave_len // page))
    return cache, ok_grow, ok_admit, tokens_held, pages_in_use, jnp.where(leaving, grow_slots, aj.PAD_SLOT)


_arena_step = jax.jit(arena_step, donate_argnames=("cache",))


@functools.partial(jax.jit, donate_argnames=("cache",))
def _arena_release(cache, slots):
    return aj.release(cache, slots)


def check_with_health(cache, pending, running: int, tokens: int, reserved_tokens: int) -> float:
    """Cross-check a step's figures with `aj.health` (reads the whole state back); returns utilization.

    `pending` slots (finished or preempted, released at the next step) are still in the cache
    but already left out of the step's figures.
    """
    h = aj.health(cache)
    page = cache.layout.page_size
    pend = pending[pending != aj.PAD_SLOT]
    lengths = np.asarray(cache.table.lengths)[pend]
    h_tokens = h["tokens_held"] - int(lengths.sum())
    h_reserved = (h["pages_in_use"] - int(np.sum(-(-lengths // page)))) * page
    if (h_tokens, h_reserved) != (tokens, reserved_tokens) or h["active_sequences"] - len(pend) != running:
        raise AssertionError(
            f"aj.health ({h['active_sequences'] - len(pend)} sequences, {h_tokens} tokens, {h_reserved} reserved) "
            f"disagrees with the step ({running}, {tokens}, {reserved_tokens})"
        )
    return h_tokens / h_reserved if h_reserved else 1.0


class ArenaBackend:
    name = "arena (arena_jax)"
    key = "arena"

    def __init__(self, layout: aj.KVLayout, max_admit: int, watermark_pages: int):
        self.layout = layout
        self.max_admit = max_admit
        self.watermark_pages = np.int32(watermark_pages)
        self.cache = aj.create(layout)
        self.pending = np.full(layout.max_seqs, aj.PAD_SLOT, np.int32)

    @staticmethod
    def _rows(values, size, fill):
        out = np.full(size, fill, np.int32)
        out[: len(values)] = values
        return out

    def step(self, grow: list[Seq], finishing: list[bool], admit: list[Seq]) -> StepResult:
        S, K = self.layout.max_seqs, self.max_admit
        fin = np.zeros(S, bool)
        fin[: len(finishing)] = finishing
        self.cache, *out = _arena_step(
            self.cache,
            self.pending,
            self._rows([s.slot for s in grow], S, aj.PAD_SLOT),
            fin,
            self._rows([s.slot for s in admit], K, aj.PAD_SLOT),
            self._rows([s.ctx for s in admit], K, 0),
            self.watermark_pages,
        )
        ok_grow, ok_admit, tokens, pages, self.pending = jax.device_get(out)
        return StepResult(
            ok_grow=ok_grow[: len(grow)].tolist(),
            ok_admit=ok_admit[: len(admit)].tolist(),
            tokens_held=int(tokens),
            reserved_tokens=int(pages) * self.layout.page_size,
        )

    def drain(self) -> None:
        self.cache = _arena_release(self.cache, self.pending)
        self.pending = np.full(self.layout.max_seqs, aj.PAD_SLOT, np.int32)

    def check(self, res: StepResult, running: list[Seq]) -> float:
        return check_with_health(self.cache, self.pending, len(running), res.tokens_held, res.reserved_tokens)

    def counters(self) -> dict:
        h = aj.health(self.cache)
        return {
            "pages_allocated": h["pages_allocated"],
            "pages_recycled": h["pages_recycled"],
            "failed_reservations": h["failed_reservations"],
            "cow_copies": h["cow_copies"],
            "leaked_pages_after_drain": h["pages_in_use"],
        }


# ---- contiguous slabs in a first-fit free list -----------------------------------------------


class FirstFit:
    """A token-granular first-fit free list over [0, capacity): sorted, coalesced free blocks."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.starts: list[int] = [0]
        self.sizes: list[int] = [capacity]

    def alloc(self, n: int) -> int | None:
        for i, size in enumerate(self.sizes):
            if size >= n:
                start = self.starts[i]
                if size == n:
                    del self.starts[i], self.sizes[i]
                else:
                    self.starts[i] += n
                    self.sizes[i] -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] > start or i < len(self.starts) and start + n > self.starts[i]:
            raise AssertionError(f"double free or overlap at [{start}, {start + n})")
        self.starts.insert(i, start)
        self.sizes.insert(i, n)
        if i + 1 < len(self.starts) and start + n == self.starts[i + 1]:  # merge with the next block
            self.sizes[i] += self.sizes.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.sizes[i - 1] == start:  # merge with the previous block
            self.sizes[i - 1] += self.sizes.pop(i)
            self.starts.pop(i)

    def extend(self, start: int, old: int, new: int) -> bool:
        """Grow the block [start, start+old) in place to `new` tokens if the next block is free."""
        end = start + old
        i = bisect.bisect_left(self.starts, end)
        if i < len(self.starts) and self.starts[i] == end and self.sizes[i] >= new - old:
            if self.sizes[i] == new - old:
                del self.starts[i], self.sizes[i]
            else:
                self.starts[i] += new - old
                self.sizes[i] -= new - old
            return True
        return False

    @property
    def free_tokens(self) -> int:
        return sum(self.sizes)


class ContiguousBackend:
    """headroom=None: one max_seq_len slab per request; else prompt * (1 + headroom), regrown by it."""

    def __init__(self, budget_tokens: int, max_seq_len: int, headroom: float | None, max_admit: int, watermark_tokens: int):
        self.heap = FirstFit(budget_tokens)
        self.max_seq_len = max_seq_len
        self.headroom = headroom
        self.max_admit = max_admit
        # Growth slack kept free on admission; a max-length slab never grows, so it needs none.
        self.watermark = 0 if headroom is None else watermark_tokens
        self.blocks: dict[int, tuple[int, int]] = {}  # slot -> (start, capacity in tokens)
        self.pending: list[int] = []  # slots to free at the start of the next step
        self.slabs_allocated = 0
        self.slabs_freed = 0
        self.regrowths = 0
        self.in_place = 0
        self.copies = 0
        self.tokens_copied = 0
        if headroom is None:
            self.name, self.key = "contiguous max-length", "contiguous_max"
        else:
            self.name, self.key = f"contiguous +{headroom:.0%} growth", "contiguous_growth"

    def _size(self, tokens: int) -> int:
        if self.headroom is None:
            return self.max_seq_len
        return min(self.max_seq_len, max(tokens + 1, math.ceil(tokens * (1 + self.headroom))))

    def _free(self, slot: int) -> None:
        start, cap = self.blocks.pop(slot)
        self.heap.free(start, cap)
        self.slabs_freed += 1

    def _grow(self, s: Seq) -> bool:
        start, cap = self.blocks[s.slot]
        if s.ctx + 1 <= cap:
            return True
        new = self._size(cap)
        if self.heap.extend(start, cap, new):
            self.regrowths += 1
            self.in_place += 1
            self.blocks[s.slot] = (start, new)
            return True
        moved = self.heap.alloc(new)  # realloc: the old block is still held while copying
        if moved is None:
            return False
        self.regrowths += 1
        self.copies += 1
        self.tokens_copied += s.ctx
        self.heap.free(start, cap)
        self.blocks[s.slot] = (moved, new)
        self.slabs_allocated += 1
        self.slabs_freed += 1
        return True

    def step(self, grow: list[Seq], finishing: list[bool], admit: list[Seq]) -> StepResult:
        for slot in self.pending:
            self._free(slot)
        self.pending = []
        ok_grow = [self._grow(s) for s in grow]
        refused = [i for i, ok in enumerate(ok_grow) if not ok]
        victim = refused[-1] if refused else None  # the newest refused sequence is preempted
        for i, (s, ok, fin) in enumerate(zip(grow, ok_grow, finishing)):
            if (ok and fin) or i == victim:
                self.pending.append(s.slot)
        ok_admit, blocked = [], False
        for s in admit[: self.max_admit]:
            size = self._size(s.ctx)
            start = None if blocked else self.heap.alloc(size)
            if start is not None and self.heap.free_tokens < self.watermark:
                self.heap.free(start, size)
                start = None
            if start is None:
                blocked = True
                ok_admit.append(False)
                continue
            self.blocks[s.slot] = (start, size)
            self.slabs_allocated += 1
            ok_admit.append(True)
        ok_admit += [False] * (len(admit) - len(ok_admit))
        held = sum(s.ctx + ok for i, (s, ok, fin) in enumerate(zip(grow, ok_grow, finishing)) if not (ok and fin) and i != victim)
        held += sum(s.ctx for s, ok in zip(admit, ok_admit) if ok)
        leaving = set(self.pending)
        reserved = sum(cap for slot, (_, cap) in self.blocks.items() if slot not in leaving)
        return StepResult(ok_grow, ok_admit, held, reserved)

    def drain(self) -> None:
        for slot in self.pending:
            self._free(slot)
        self.pending = []

    def counters(self) -> dict:
        out = {"slabs_allocated": self.slabs_allocated, "slabs_freed": self.slabs_freed}
        if self.headroom is not None:
            out.update(regrowths=self.regrowths, regrown_in_place=self.in_place, copies=self.copies, tokens_copied=self.tokens_copied)
        out["leaked_tokens_after_drain"] = self.heap.capacity - self.heap.free_tokens
        return out
