"""Run-ahead decode with a prefix cache: `generate(prefix_cache=True)`'s decode step with
`Scheduler.RUN_AHEAD` on and off, alternated in one process (models.scheduler, "Overlap").

    python -m arena_jax.benchmarks.studies.prefix_run_ahead [--rounds 5] [--batch 8] [--new 128]

Tiny model (`LlamaConfig.tiny()`, float32), prompts of a shared 96-token prefix + 32 tokens of
their own, greedy, no stop tokens. Per variant: the median over rounds of each round's median
decode step (`Generation.decode_step_seconds`), how many decode steps ran ahead, and whether
the tokens are equal.
"""
from __future__ import annotations

import argparse

import numpy as np

from arena_jax import models
from arena_jax.models.scheduler import Scheduler


def measure(rounds: int = 5, batch: int = 8, new: int = 128) -> dict:
    net = models.init_random(models.LlamaConfig.tiny(), seed=0)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 128, 96).tolist()
    prompts = [shared + rng.integers(0, 128, 32).tolist() for _ in range(batch)]
    kwargs = dict(sampling=models.Sampling(stop_tokens=()), serving=models.Serving(
        batch_size=batch, chunk_size=32, layout=models.default_layout(net, batch, 256, dtype="float32"), prefix_cache=True))
    steps, tokens, ahead_steps, calls = {True: [], False: []}, {}, {}, {}
    try:
        for ahead in (True, False):  # warm: compile both schedules' programs
            Scheduler.RUN_AHEAD = ahead
            models.generate(net, prompts, new, **kwargs)
        for _ in range(rounds):
            for ahead in (True, False):
                Scheduler.RUN_AHEAD = ahead
                r = models.generate(net, prompts, new, **kwargs)
                steps[ahead].append(float(np.median(r.decode_step_seconds)) * 1e3)
                tokens[ahead], ahead_steps[ahead], calls[ahead] = r.tokens, r.run_ahead_steps, r.decode_calls
    finally:
        Scheduler.RUN_AHEAD = True
    on, off = float(np.median(steps[True])), float(np.median(steps[False]))
    return dict(step_ms_run_ahead=on, step_ms_no_run_ahead=off, speedup=off / on, rounds_ms=steps,
                run_ahead_steps=ahead_steps[True], decode_calls=calls[True], same_tokens=tokens[True] == tokens[False])  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args(argv)
    r = measure(args.rounds, args.batch, args.new)
    print(f"prefix cache on, batch {args.batch}, {args.new} new tokens, {args.rounds} rounds")
    print(f"  RUN_AHEAD=True   median decode step {r['step_ms_run_ahead']:.3f} ms  (rounds {np.round(r['rounds_ms'][True], 3).tolist()})")
    print(f"  RUN_AHEAD=False  median decode step {r['step_ms_no_run_ahead']:.3f} ms  (rounds {np.round(r['rounds_ms'][False], 3).tolist()})")
    print(f"  off / on {r['speedup']:.2f}x; {r['run_ahead_steps']} of {r['decode_calls']} decode steps ran ahead; "
          f"tokens equal: {r['same_tokens']}")


if __name__ == "__main__":
    main()
