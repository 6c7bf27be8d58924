"""`benchmarks.studies.page_runs`: how many attention blocks of a workload are runs of consecutive
pages (issue 42's contiguous-page DMAs; benchmarks/RESULTS.md, "A block's pages as one run")."""
from __future__ import annotations

import numpy as np

from arena_jax.benchmarks.studies import page_runs


def test_block_runs_counts_runs_and_their_alignment():
    # pages of 32 keys, blocks of 4 pages (128 keys); a scale row holds 4 pages
    row = np.array([8, 9, 10, 11,  5, 6, 7, 8,  3, 2, 1, 0,  20, 21, 23, 24,  40, 41, 42, 43,  -1, -1])
    assert page_runs.block_runs(row, 5 * 128 + 7, 32, 128) == (5, 3, 2)  # runs: 8.., 5.., 40..; aligned: 8, 40
    assert page_runs.block_runs(row, 127, 32, 128) == (0, 0, 0)  # no whole block yet
    assert page_runs.block_runs(row, 128, 128, 128) == (1, 1, 1)  # a block of one page is a run, aligned


def test_block_runs_counts_the_runs_the_kernel_reads_and_the_allocator_makes():
    """Given the arena's pages, a run counts as the TPU kernel flags it (`run_blocks`: its scale
    rows, and one more, inside the arena), on random page tables; the allocator's blocks are the
    kernel's (`RUN_BLOCK_KEYS`)."""
    from arena_jax import allocator
    from pallas_kernels.tpu import attention

    assert allocator.RUN_BLOCK_KEYS == attention.DEFAULT_BLOCK_K
    rng = np.random.default_rng(0)
    for page_size, num_pages in ((16, 64), (32, 40), (64, 24)):
        ppb = 128 // page_size * 2  # blocks of 256 keys
        for _ in range(20):
            first = rng.integers(-1, num_pages - ppb + 1, size=6)
            row = (first[:, None] + np.arange(ppb) * rng.choice([1, 1, 1, 2], size=(6, 1))).reshape(-1)
            flags = np.asarray(attention.run_blocks(row[None], page_size, num_pages, ppb))
            got = page_runs.block_runs(row, row.size * page_size, page_size, ppb * page_size, num_pages)
            assert got[:2] == (6, int(flags.sum())), (row, flags, got)


def test_a_lone_sequence_in_a_fresh_arena_is_all_runs():
    """One request: its prompt's pages are popped 0, 1, 2, ... and its decode pages follow them."""
    got = page_runs.simulate(32, steps=41, block=512, w=page_runs.Workload(requests=1, prompt=3000.0))
    assert got["blocks"] > 0 and got["runs"] == got["aligned"] == got["blocks"], got


def test_the_numpy_model_of_our_allocator_gives_its_counts():
    """`--policy stack` (numpy) is ours (`--policy arena`, `aj.reserve` / `aj.release`) block for
    block, at two page sizes, admissions and releases included; the run-keeping policy turns
    more of the same blocks into runs."""
    w = page_runs.Workload(requests=40, mean_gap=1.0, max_seqs=8, tokens_a_slot=700)
    for size in (32, 64):
        arena, stack = (page_runs.simulate(size, steps=300, w=w, every=5, policy=p) for p in ("arena", "stack"))
        assert stack == arena and arena["blocks"] > 50 and arena["runs"] < arena["blocks"], (stack, arena)
        runs = page_runs.simulate(size, steps=300, w=w, every=5, policy="runs")
        assert runs["runs"] > arena["runs"], (runs, arena)


def test_the_numpy_model_of_our_run_keeping_allocator_gives_its_counts():
    """`--policy first-fit` (numpy) is ours over scale-row arenas (`--policy arena-runs`:
    `reserve_impl(..., run_pages=True)`, `_run_pages`) block for block, in one process after ours as most arenas
    get it (each keeps its own traces); it admits what ours admits (the same blocks seen) and
    makes more of them runs."""
    w = page_runs.Workload(requests=40, mean_gap=1.0, max_seqs=8, tokens_a_slot=700)
    for size in (32, 64):
        stack = page_runs.simulate(size, steps=300, w=w, every=5, policy="arena")
        looks = {"arena-runs": [], "first-fit": []}
        runs, model = (page_runs.simulate(size, steps=300, w=w, every=5, policy=p, looks=looks[p]) for p in looks)
        assert runs == model and runs["blocks"] == stack["blocks"] > 50, (runs, model, stack)
        assert looks["arena-runs"] == looks["first-fit"] and len(looks["first-fit"]) > 40  # page for page
        assert runs["runs"] > stack["runs"], (runs, stack)
