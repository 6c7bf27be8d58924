"""How many attention blocks of a serving workload's sequences are runs of consecutive pages (issue 42).

    python -m arena_jax.benchmarks.studies.page_runs [--page-size 32] [--steps 4000] [--seed 0]

The TPU decode kernel would meet issue 42's bar at 8-bit pages of 32 and 64 for blocks whose
pages are one run of consecutive pages (a DMA a block for K, V and each scale array:
`tpu_dma_bounds --variants run`, benchmarks/RESULTS.md "A block's pages as one run"). How often
is a block such a run? This drives the real allocator (`aj.reserve` / `aj.release`, jitted, one
layer of a tiny head) with a serving workload: Poisson arrivals (one every 2 steps), prompts
lognormal around 1,000 tokens (64-6,000), outputs around 256 (16-1,500), 32 slots, an arena of
1,600 tokens a slot (admission waits for pages), one prompt admitted a step (its whole prefill
reserved at once), every running sequence growing by one token a step. Every 20 steps it looks
at each running sequence's whole blocks of `--block` keys: the share whose pages ascend one by
one ("runs"), and of those the share whose first page starts a scale row (128 / S pages a
row: "aligned"; the scale rows of `pallas_kernels.tpu.common.scale_rows`).
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj
from arena_jax.kv_cache import PAD_SLOT

__all__ = ["Workload", "block_runs", "simulate", "main"]


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: int = 600
    mean_gap: float = 2.0  # steps between arrivals (exponential)
    prompt: float = 1000.0  # lognormal median, tokens
    output: float = 256.0
    max_seqs: int = 32
    tokens_a_slot: int = 1600  # the arena's pages: max_seqs * tokens_a_slot / page_size
    max_len: int = 8192


def block_runs(page_map_row, length: int, page_size: int, block: int) -> tuple[int, int, int]:
    """(whole blocks, runs, aligned runs) of one sequence: its first length // block blocks of
    block / page_size pages each; a run's pages ascend by one; an aligned run's first page
    starts a 128-lane scale row (a multiple of 128 / page_size; every page at 128 or more)."""
    ppb, per_row = block // page_size, max(1, 128 // page_size)
    blocks = runs = aligned = 0
    for j in range(length // block):
        pages = np.asarray(page_map_row[j * ppb:(j + 1) * ppb])
        run = bool(np.all(np.diff(pages) == 1))
        blocks, runs, aligned = blocks + 1, runs + run, aligned + (run and pages[0] % per_row == 0)
    return blocks, runs, aligned


def simulate(page_size: int = 32, steps: int = 4000, seed: int = 0, block: int = 512, w: Workload = Workload(),
             every: int = 20) -> dict:  # fmt: skip
    """Drive the allocator with `w`; returns {blocks, runs, aligned, steps}: counts summed over
    the looks (every `every` steps)."""
    layout = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=page_size,
                         num_pages=w.max_seqs * w.tokens_a_slot // page_size, max_seqs=w.max_seqs,
                         max_pages_per_seq=w.max_len // page_size, dtype="float32")  # fmt: skip
    cache = aj.create(layout)
    reserve, release = jax.jit(aj.reserve), jax.jit(aj.release)
    rng = np.random.default_rng(seed)
    arrive = np.cumsum(rng.exponential(w.mean_gap, w.requests)).astype(int)
    prompt = np.clip(rng.lognormal(np.log(w.prompt), 0.6, w.requests), 64, 6000).astype(int)
    output = np.clip(rng.lognormal(np.log(w.output), 0.5, w.requests), 16, 1500).astype(int)
    slot_of, left, free_slots, queue, arrived = {}, {}, list(range(w.max_seqs)), [], 0
    totals = dict(blocks=0, runs=0, aligned=0, steps=0)

    def rows(pairs):  # [(slot, tokens)] -> the padded i32[max_seqs] slots and counts
        slots, n = np.full(w.max_seqs, PAD_SLOT, np.int32), np.zeros(w.max_seqs, np.int32)
        for i, (s, k) in enumerate(pairs):
            slots[i], n[i] = s, k
        return jnp.asarray(slots), jnp.asarray(n)

    for t in range(steps):
        totals["steps"] = t + 1
        while arrived < w.requests and arrive[arrived] <= t:
            queue.append(arrived)
            arrived += 1
        running = list(slot_of.items())
        if running:  # a decode step: every running sequence one token
            cache, ok = reserve(cache, *rows([(s, 1) for _, s in running]))
            for (r, _), grown in zip(running, np.asarray(ok)):
                left[r] -= int(grown)
        done = [r for r in slot_of if left[r] <= 0]
        if done:
            cache = release(cache, rows([(slot_of[r], 0) for r in done])[0])
            for r in done:
                free_slots.append(slot_of.pop(r))
                del left[r]
        if queue and free_slots:  # one admission a step: the prompt's prefill, reserved whole
            r, s = queue[0], free_slots[-1]
            cache, ok = reserve(cache, *rows([(s, int(prompt[r]))]))
            if bool(np.asarray(ok)[0]):
                queue.pop(0)
                free_slots.pop()
                slot_of[r], left[r] = s, int(output[r])
        if t % every == 0 and slot_of:
            page_map, lengths = np.asarray(cache.table.page_map), np.asarray(cache.table.lengths)
            for s in slot_of.values():
                b, runs, aligned = block_runs(page_map[s], int(lengths[s]), page_size, block)
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
    a = p.parse_args(argv)
    if a.page_size < 1 or a.block % a.page_size:
        p.error(f"--block ({a.block}) must be a positive multiple of --page-size ({a.page_size})")
    got = simulate(a.page_size, a.steps, a.seed, a.block)
    share = lambda k: got[k] / max(got["blocks"], 1)  # noqa: E731
    print("| page size | steps | whole blocks seen | runs | aligned runs |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {a.page_size} | {got['steps']} | {got['blocks']} | {share('runs'):.1%} | {share('aligned'):.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
