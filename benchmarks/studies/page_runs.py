"""How many attention blocks of a serving workload's sequences are runs of consecutive pages (issue 42).

    python -m arena_jax.benchmarks.studies.page_runs [--page-size 32] [--steps 4000] [--seed 0]

The TPU decode kernel meets issue 42's bar at 8-bit pages under 128 for blocks whose pages are
one run of consecutive pages: it reads them a DMA a buffer (`pallas_kernels.tpu.attention.start_run`;
benchmarks/RESULTS.md "A block's pages as one run", "Runs of pages read one DMA a buffer"). How
often is a block such a run? This drives the real allocator (`aj.reserve` / `aj.release`, jitted, one
layer of a tiny head) with a serving workload: Poisson arrivals (one every 2 steps), prompts
lognormal around 1,000 tokens (64-6,000), outputs around 256 (16-1,500), 32 slots, an arena of
1,600 tokens a slot (admission waits for pages), one prompt admitted a step (its whole prefill
reserved at once), every running sequence growing by one token a step. Every 20 steps it looks
at each running sequence's whole blocks of `--block` keys: the share whose pages ascend one by
one with their scale rows, and one more, inside the arena ("runs": what the kernel reads as one,
`run_blocks`), and of those the share whose first page starts a scale row (128 / S pages a
row: "aligned"; the scale rows of `pallas_kernels.tpu.common.scale_rows`).

`--policy` picks the allocator: `arena` (default) is ours, run on the device, as it serves most
arenas; `stack` a numpy model of it (a LIFO stack of free pages, a fresh one popping 0, 1, 2, ...,
freed pages pushed in ascending order: it gives `arena`'s counts exactly, `tests/test_page_runs.py`);
`arena-runs` ours as it serves arenas of 8-bit scale rows (`reserve_impl(..., run_pages=True)`,
`_run_pages`, a block of `allocator.RUN_BLOCK_KEYS` at a time: a decode row inside a block takes
the page after its last when free; a prefill a whole block from the end of the first free run
that holds it, its last, partial block a block from the end of the first free run of two blocks;
the rest the lowest free pages) and `first-fit` a numpy model of that (the same pages,
`tests/test_page_runs.py`); `runs` a numpy
model of an allocator that keeps a sequence's pages consecutive: a decode row takes the page after
its last when that page is free, else a page from the smallest free run; a prefill takes the
smallest free run that holds it (from a scale-row boundary when the run leaves room), else the
longest runs in turn. Both numpy models serve rows in the same order as `aj.reserve` (first come,
first served) and refuse what it refuses (not enough free pages).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj
from arena_jax import allocator
from arena_jax.kv_cache import PAD_SLOT

__all__ = ["Workload", "ArenaPages", "NumpyPages", "POLICIES", "block_runs", "simulate", "main"]


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int = 600
    mean_gap: float = 2.0  # steps between arrivals (exponential)
    prompt: float = 1000.0  # lognormal median, tokens
    output: float = 256.0
    max_seqs: int = 32
    tokens_a_slot: int = 1600  # the arena's pages: max_seqs * tokens_a_slot / page_size
    max_len: int = 8192


def block_runs(page_map_row, length: int, page_size: int, block: int, num_pages: int | None = None) -> tuple[int, int, int]:
    """(whole blocks, runs, aligned runs) of one sequence: its first length // block blocks of
    block / page_size pages each; a run's pages ascend by one (and, given the arena's
    `num_pages`, its scale rows lie in the arena as the kernel's run needs: `run_blocks`); an
    aligned run's first page starts a 128-lane scale row (a multiple of 128 / page_size; every
    page at 128 or more)."""
    ppb, per_row = block // page_size, max(1, 128 // page_size)
    blocks = runs = aligned = 0
    for j in range(length // block):
        pages = np.asarray(page_map_row[j * ppb:(j + 1) * ppb])
        run = bool(np.all(np.diff(pages) == 1))
        if num_pages is not None and page_size < 128:
            run &= pages[0] >= 0 and pages[0] // per_row + ppb // per_row + 1 <= num_pages // per_row
        blocks, runs, aligned = blocks + 1, runs + run, aligned + (run and pages[0] % per_row == 0)
    return blocks, runs, aligned


class ArenaPages:
    """Ours: `aj.reserve` / `aj.release`, jitted, on a one-layer arena."""

    def __init__(self, page_size: int, num_pages: int, w: Workload, run_pages: bool = False):
        layout = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=page_size, num_pages=num_pages,
                             max_seqs=w.max_seqs, max_pages_per_seq=w.max_len // page_size, dtype="float32")  # fmt: skip
        self.cache, self.max_seqs = aj.create(layout), w.max_seqs
        # `reserve_impl`: what `aj.reserve` jits after its host checks, here with the choice of pages
        self._reserve = jax.jit(functools.partial(allocator.reserve_impl, run_pages=run_pages))
        self._release = jax.jit(aj.release)

    def _rows(self, pairs):  # [(slot, tokens)] -> the padded i32[max_seqs] slots and counts
        slots, n = np.full(self.max_seqs, PAD_SLOT, np.int32), np.zeros(self.max_seqs, np.int32)
        for i, (s, k) in enumerate(pairs):
            slots[i], n[i] = s, k
        return jnp.asarray(slots), jnp.asarray(n)

    def reserve(self, pairs) -> list[bool]:
        self.cache, ok = self._reserve(self.cache, *self._rows(pairs))
        return [bool(x) for x in np.asarray(ok)[: len(pairs)]]

    def release(self, slots) -> None:
        self.cache = self._release(self.cache, self._rows([(s, 0) for s in slots])[0])

    def rows(self):
        """(page map i32[max_seqs, M], lengths i32[max_seqs]) as numpy."""
        return np.asarray(self.cache.table.page_map), np.asarray(self.cache.table.lengths)


class NumpyPages:
    """A numpy allocator with `ArenaPages`' interface: policy "stack" (ours, modelled),
    "first-fit" (ours over scale rows, modelled) or "runs" (keeps a sequence's pages consecutive;
    module docstring)."""

    def __init__(self, page_size: int, num_pages: int, w: Workload, policy: str):
        self.page_size, self.policy, self.per_row = page_size, policy, max(1, 128 // page_size)
        self.free = np.ones(num_pages, bool)
        self.stack = list(range(num_pages - 1, -1, -1))  # "stack": the top (the end) pops page 0 first
        self.pages = [[] for _ in range(w.max_seqs)]
        self.lengths = np.zeros(w.max_seqs, np.int64)
        self.max_pages = w.max_len // page_size

    def _free_runs(self):
        edges = np.diff(np.concatenate([[0], self.free.astype(np.int8), [0]]))
        starts = np.flatnonzero(edges == 1)
        return starts, np.flatnonzero(edges == -1) - starts

    def _take(self, n: int, last: int | None) -> list[int]:
        if self.policy == "stack":
            got = [self.stack.pop() for _ in range(n)]
        elif last is not None and n == 1 and last + 1 < self.free.size and self.free[last + 1]:
            got = [last + 1]
        else:
            got = []
            while len(got) < n:
                need = n - len(got)
                starts, lengths = self._free_runs()
                fits = np.flatnonzero(lengths >= need)
                if fits.size:  # the smallest run that holds the rest, from a scale-row boundary if it can
                    i = fits[np.argmin(lengths[fits])]
                    first = starts[i]
                    aligned = -(-first // self.per_row) * self.per_row
                    first = aligned if need > 1 and aligned + need <= starts[i] + lengths[i] else first
                    got += range(first, first + need)
                else:  # the longest run, then the next
                    i = int(np.argmax(lengths))
                    got += range(starts[i], starts[i] + lengths[i])
                self.free[got] = False
        self.free[got] = False
        return got

    def _first_fit(self, served) -> None:
        """`allocator._run_pages` for the served rows [(slot, pages)] (blocks of ppb =
        RUN_BLOCK_KEYS / S pages): rows taking one page inside a block take the page after their
        last when free (the first such row wins); then rows taking more, block by block, in turn:
        a block they continue from the page after their last when the pages there are free; a
        block's first part short of the block, a block from the end of the first free run of two
        blocks or more; else the first free run that holds the part (a whole block at that run's
        end unless the run ends the arena), else the lowest free pages; then the rest the
        lowest free pages, in order."""
        got, size = {}, self.free.size
        ppb = max(1, allocator.RUN_BLOCK_KEYS // self.page_size)
        for slot, need in served:
            last = self.pages[slot][-1] if self.pages[slot] else None
            if need == 1 and len(self.pages[slot]) % ppb and last + 1 < size and self.free[last + 1]:
                got[slot] = [last + 1]
                self.free[last + 1] = False
        for slot, need in served:
            if need < 2:
                continue
            got[slot], have = [], len(self.pages[slot])
            last = self.pages[slot][-1] if self.pages[slot] else None
            for a in range(have, have + need):
                if a != have and a % ppb:
                    continue  # inside a block placed whole
                k = min(have + need, (a // ppb + 1) * ppb) - a
                at = None
                if a % ppb and last + k < size and self.free[last + 1:last + 1 + k].all():
                    at = last + 1
                else:
                    starts, lengths = self._free_runs()
                    fits, wide = np.flatnonzero(lengths >= k), np.flatnonzero(lengths >= 2 * ppb)
                    if a % ppb == 0 and k < ppb and wide.size:  # a block's first part: the block's room after it
                        at = starts[wide[0]] + lengths[wide[0]] - ppb
                    elif fits.size:
                        at, run_end = starts[fits[0]], starts[fits[0]] + lengths[fits[0]]
                        at = run_end - k if k == ppb and run_end < size else at
                pages = list(range(at, at + k)) if at is not None else list(np.flatnonzero(self.free)[:k])
                self.free[pages] = False
                got[slot] += pages
        for slot, need in served:
            if need and slot not in got:
                got[slot] = list(np.flatnonzero(self.free)[:need])
                self.free[got[slot]] = False
        for slot, pages in got.items():
            self.pages[slot] += [int(p) for p in pages]

    def reserve(self, pairs) -> list[bool]:
        """As `aj.reserve`: first come, first served, a row served when its demand plus every
        earlier row's fits the pages free at the call (so after a refused row, every later row
        that needs a page is refused too); a refused row takes nothing. Then the served rows
        take their pages, in order (`first-fit`: `_first_fit`)."""
        ok, asked, free, served = [], 0, int(self.free.sum()), []
        for slot, n in pairs:
            length = self.lengths[slot]
            need = -(-(length + n) // self.page_size) - len(self.pages[slot])
            asked += need
            if n < 0 or length + n > self.max_pages * self.page_size or (need and asked > free):
                ok.append(False)
                continue
            served.append((slot, need))
            self.lengths[slot] += n
            ok.append(True)
        if self.policy == "first-fit":
            self._first_fit(served)
        else:
            for slot, need in served:
                self.pages[slot] += self._take(need, self.pages[slot][-1] if self.pages[slot] else None) if need else []
        return ok

    def release(self, slots) -> None:
        for slot in slots:
            if self.policy == "stack":  # pushed ascending: the largest ends on top
                self.stack += sorted(self.pages[slot])
            self.free[self.pages[slot]] = True
            self.pages[slot], self.lengths[slot] = [], 0

    def rows(self):
        page_map = np.full((len(self.pages), self.max_pages), -1, np.int64)
        for slot, pages in enumerate(self.pages):
            page_map[slot, : len(pages)] = pages
        return page_map, self.lengths.copy()


POLICIES = ("arena", "stack", "arena-runs", "first-fit", "runs")


def simulate(page_size: int = 32, steps: int = 4000, seed: int = 0, block: int = 512, w: Workload = Workload(),
             every: int = 20, policy: str = "arena", looks: list | None = None) -> dict:  # fmt: skip
    """Drive the allocator (`policy`: `POLICIES`) with `w`; returns {blocks, runs, aligned,
    steps}: counts summed over the looks (every `every` steps). `looks`: a list to which each
    look appends {slot: its mapped pages} of the running sequences."""
    num_pages = w.max_seqs * w.tokens_a_slot // page_size
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if policy.startswith("arena"):
        pages = ArenaPages(page_size, num_pages, w, run_pages=policy == "arena-runs")
    else:
        pages = NumpyPages(page_size, num_pages, w, policy)
    rng = np.random.default_rng(seed)
    arrive = np.cumsum(rng.exponential(w.mean_gap, w.requests)).astype(int)
    prompt = np.clip(rng.lognormal(np.log(w.prompt), 0.6, w.requests), 64, 6000).astype(int)
    output = np.clip(rng.lognormal(np.log(w.output), 0.5, w.requests), 16, 1500).astype(int)
    slot_of, left, free_slots, queue, arrived = {}, {}, list(range(w.max_seqs)), [], 0
    totals = dict(blocks=0, runs=0, aligned=0, steps=0)
    for t in range(steps):
        totals["steps"] = t + 1
        while arrived < w.requests and arrive[arrived] <= t:
            queue.append(arrived)
            arrived += 1
        running = list(slot_of.items())
        if running:  # a decode step: every running sequence one token
            for (r, _), grown in zip(running, pages.reserve([(s, 1) for _, s in running])):
                left[r] -= int(grown)
        done = [r for r in slot_of if left[r] <= 0]
        if done:
            pages.release([slot_of[r] for r in done])
            for r in done:
                free_slots.append(slot_of.pop(r))
                del left[r]
        if queue and free_slots:  # one admission a step: the prompt's prefill, reserved whole
            r, s = queue[0], free_slots[-1]
            if pages.reserve([(s, int(prompt[r]))])[0]:
                queue.pop(0)
                free_slots.pop()
                slot_of[r], left[r] = s, int(output[r])
        if t % every == 0 and slot_of:
            page_map, lengths = pages.rows()
            if looks is not None:
                looks.append({s: page_map[s, :-(-int(lengths[s]) // page_size)].tolist() for s in sorted(slot_of.values())})
            for s in slot_of.values():
                b, runs, aligned = block_runs(page_map[s], int(lengths[s]), page_size, block, num_pages)
                totals["blocks"] += b
                totals["runs"] += runs
                totals["aligned"] += aligned
        if arrived >= w.requests and not queue and not slot_of:
            break
    return totals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.page_runs", description=__doc__.split("\n\n")[0])
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--block", type=int, default=512, help="keys a block (the TPU kernel's default)")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policy", choices=POLICIES, default="arena", help="the allocator (module docstring; default: arena)")
    a = p.parse_args(argv)
    if a.page_size < 1 or a.block % a.page_size:
        p.error(f"--block ({a.block}) must be a positive multiple of --page-size ({a.page_size})")
    got = simulate(a.page_size, a.steps, a.seed, a.block, policy=a.policy)
    share = lambda k: got[k] / max(got["blocks"], 1)  # noqa: E731
    print("| allocator | page size | steps | whole blocks seen | runs | aligned runs |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| {a.policy} | {a.page_size} | {got['steps']} | {got['blocks']} | {share('runs'):.1%} | {share('aligned'):.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
