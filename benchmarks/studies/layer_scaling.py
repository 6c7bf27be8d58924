"""Compile time and decode step time against model depth, and the layer scan against a Python
loop of the same layers (issue 17: compile time must not grow with depth; the step must not slow).

    JAX_PLATFORMS=cpu python -m arena_jax.benchmarks.studies.layer_scaling --layers 2 8 32          # compile times
    JAX_PLATFORMS=cpu python -m arena_jax.benchmarks.studies.layer_scaling --compare --model mid --layers 8

Default mode, per depth: the first-call compile time of `models.decode_step` and of
`models.prefill` (lower + compile, no persistent cache; a fresh graphdef per depth so
nothing is reused), then the median wall time of warm decode steps (batch rows decoding after
one prefill, `jax.block_until_ready` after each step). It uses only the public API (apart from
`--compare` / `--no-scan`), so the same file measures an older checkout:
`PYTHONPATH=/path/to/old python benchmarks/studies/layer_scaling.py`.

`--compare`: in ONE process, the same weights as stacked layers run by `jax.lax.scan`
(`scan_layers=True`) and as a list of layers run by a Python loop (`scan_layers=False`, the
pre-scan structure); timed rounds alternate between the two so that load on a shared machine
hits both; per variant the median and the minimum over rounds of each round's median step
(wall time), and, on every other round, the median step's CPU time (all the process's threads:
the work a step costs, much less sensitive than wall time to other processes on the machine).

Models: `tiny` (hidden 64, 4/2 heads, vocab 128: the width the compile goal is stated for) and
`mid` (hidden 512, 8/2 heads, MLP 1536, vocab 32000: issue 17's mid model). float32.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax import models

WIDTHS = {
    "tiny": dict(),
    "mid": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2),
}


class _Run:
    """One model compiled for decode, its cache after a prefill of the prompts."""

    def __init__(self, num_layers, *, model, batch, prompt_len, steps, page_size=16, scan_layers=None):
        config = models.LlamaConfig.tiny(num_layers=num_layers, max_position_embeddings=8192, **WIDTHS[model])
        kwargs = {} if scan_layers is None else dict(scan_layers=scan_layers)  # an older checkout has no such flag
        net = models.init_random(config, seed=0, **kwargs)
        graphdef, self.state = nnx.split(net)
        layout = models.default_layout(net, batch, prompt_len + steps + 2, page_size=page_size, dtype="float32")
        cache = aj.create(layout)
        self.slots = jnp.arange(batch, dtype=jnp.int32)
        self.greedy = models.GREEDY.rows(batch)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt_len)), jnp.int32)
        counts = jnp.full((batch,), prompt_len, jnp.int32)
        s, g = self.slots, self.greedy
        t0, c0 = time.perf_counter(), time.process_time()
        prefill = models.prefill.lower(graphdef, self.state, cache, tokens, s, counts, s, 0, g).compile()
        self.prefill_s, self.prefill_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        t0, c0 = time.perf_counter(), time.process_time()
        self.decode = models.decode_step.lower(graphdef, self.state, cache, tokens[:, 0], s, s, 0, g).compile()
        self.decode_s, self.decode_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        out = prefill(self.state, cache, tokens, s, counts, s, 0, g)
        self.cache, self.tokens = out.cache, out.tokens

    def steps(self, n: int, clock=time.perf_counter) -> list[float]:
        times = []
        for _ in range(n):
            t0 = clock()
            out = self.decode(self.state, self.cache, self.tokens, self.slots, self.slots, 0, self.greedy)
            jax.block_until_ready(out.tokens)
            times.append(clock() - t0)
            self.cache, self.tokens = out.cache, out.tokens
        return times


def measure(num_layers: int, *, model="tiny", batch=8, prompt_len=128, steps=32, scan_layers=None) -> dict:
    run = _Run(num_layers, model=model, batch=batch, prompt_len=prompt_len, steps=steps, scan_layers=scan_layers)
    times = run.steps(steps)
    warm = times[2:] or times
    return dict(model=model, layers=num_layers, batch=batch, context=prompt_len, scan_layers=scan_layers,
                compile_decode_s=round(run.decode_s, 3), compile_prefill_s=round(run.prefill_s, 3),
                compile_decode_cpu_s=round(run.decode_cpu_s, 3), compile_prefill_cpu_s=round(run.prefill_cpu_s, 3),
                step_ms_p50=round(1e3 * statistics.median(warm), 3), step_ms_min=round(1e3 * min(warm), 3))


def compare(num_layers: int, *, model="tiny", batch=8, prompt_len=128, rounds=8, steps=10) -> dict:
    total = rounds * steps + 2
    runs = {name: _Run(num_layers, model=model, batch=batch, prompt_len=prompt_len, steps=total, scan_layers=scan)
            for name, scan in (("scan", True), ("loop", False))}  # fmt: skip
    for run in runs.values():
        run.steps(2)  # warm
    medians = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for r in range(rounds):
        for name, run in runs.items():
            if r % 2:  # CPU time (all of the process's threads): what the step costs, whatever else runs
                cpu[name].append(statistics.median(run.steps(steps, time.process_time)))
            else:
                medians[name].append(statistics.median(run.steps(steps)))
    out = dict(model=model, layers=num_layers, batch=batch, context=prompt_len, rounds=rounds, steps_per_round=steps)
    for name, run in runs.items():
        out[name] = dict(compile_decode_s=round(run.decode_s, 3),
                         step_ms_median=round(1e3 * statistics.median(medians[name]), 3),
                         step_ms_best_round=round(1e3 * min(medians[name]), 3),
                         step_cpu_ms_median=round(1e3 * statistics.median(cpu[name]), 3))  # fmt: skip
    for key in ("median", "best_round", "cpu_ms_median"):
        key = f"step_ms_{key}" if key != "cpu_ms_median" else "step_cpu_ms_median"
        out[f"scan_over_loop_{key}"] = round(out["scan"][key] / out["loop"][key], 3)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--model", choices=sorted(WIDTHS), default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps (--compare: per round)")
    parser.add_argument("--rounds", type=int, default=8, help="--compare: alternated rounds")
    parser.add_argument("--compare", action="store_true", help="scan vs Python loop of the layers, in one process")
    parser.add_argument("--no-scan", action="store_true", help="build the models with scan_layers=False")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for layers in args.layers:
        common = dict(model=args.model, batch=args.batch, prompt_len=args.prompt_len)
        if args.compare:
            row = compare(layers, rounds=args.rounds, steps=args.steps, **common)
            sc, lo = row["scan"], row["loop"]
            line = (f"{args.model} L={layers}: decode step wall median scan {sc['step_ms_median']:.2f} ms vs loop "
                    f"{lo['step_ms_median']:.2f} ms (x{row['scan_over_loop_step_ms_median']}; best round "
                    f"x{row['scan_over_loop_step_ms_best_round']}); CPU time {sc['step_cpu_ms_median']:.2f} vs "
                    f"{lo['step_cpu_ms_median']:.2f} ms (x{row['scan_over_loop_step_cpu_ms_median']}); compile "
                    f"{sc['compile_decode_s']:.1f} s vs {lo['compile_decode_s']:.1f} s")
        else:
            row = measure(layers, steps=args.steps, scan_layers=False if args.no_scan else None, **common)
            line = (f"{row['model']} L={layers:3d}: compile decode_step {row['compile_decode_s']:6.2f} s "
                    f"(CPU {row['compile_decode_cpu_s']:6.2f} s), prefill {row['compile_prefill_s']:6.2f} s (CPU "
                    f"{row['compile_prefill_cpu_s']:6.2f} s); decode step p50 {row['step_ms_p50']:8.2f} ms "
                    f"(min {row['step_ms_min']:.2f})")
        rows.append(row)
        if not args.json:
            print(line, flush=True)
    if args.json:
        json.dump(dict(jax=jax.__version__, backend=jax.default_backend(), rows=rows), sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
