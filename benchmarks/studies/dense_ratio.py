"""The paged decode step against the dense baseline's, context by context (issue 39, items 3 and 5).

For each model ("tiny": the built-in tiny Llama's geometry; "mid": hidden 512, 8 layers, 8 query / 2 KV
heads, head_dim 64, vocab 32,000, float32, as `context_cost`), batch and context c (tokens every
row holds), two decode steps alternate call by call in one process:

- arena: `models.decode_step` (reserve + every layer's append / attend + greedy sampling, one
         jit, the cache donated) on an arena sized to c plus the steps timed, filled without a
         model (`context_cost._filled_cache`: reserve c tokens, random K/V at every layer);
- dense: `models.dense_baseline.dense_decode` on a dense cache of the same capacity, every row
         holding c tokens (positions set, K/V zeros: a step's cost does not depend on the values).

Both run one model, built as `load_pretrained` would build it here (`models.default_scan_layers`:
on a CPU the mid model's 12 MiB layers are a list, read in place by their matmuls; the tiny
model's stay stacked in a scan); `--scan-layers` / `--no-scan-layers` choose. Until 2026-12-02
(session 47) both ran stacked layers, whose weights a CPU's scan copies out every step (about
half of the mid model's batch-1 step, in both).

Both are jits of our own over the model's state, its graphdef closed over: neither hashes the
graphdef per call, as the module-level jits (static `graphdef`) did until 2026-12-02 (session 51:
`models.model_jit`). Until 2026-11-28 (session 21)
only the arena's was; the dense step paid that hash, ~40-50 us a call on this CPU, which
inflated the tiny model's ratio from about 0.6x to 0.8x (benchmarks/RESULTS.md). Until
2026-11-29 (session 26) the arena's runner also set the backend's environment variable around
every call, ~2.5 us a call charged to the arena only; it now does so for the first (tracing) call.

Both caches hold context + `--repeats` + 2 tokens a row, rounded up to whole pages (the steps
timed fit), printed as "tokens a row": `--repeats` changes what attention reads, and past 256
tokens a row (512 where the batch is small: `blockwise.one_block`) the arena's attention takes
its loop path instead of one block
(benchmarks/RESULTS.md, "The page table in four arrays").
Each figure is the median of `--repeats` timed calls after one untimed warm-up (compile),
`block_until_ready` before the clock is read; "arena / dense" is the median of the per-pair
ratios of step times, and its inverse the tokens/s ratio `arena-bench decode` prints. Run it
with one thread (`XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"`)
and pinned (`taskset -c 0`) for figures that compare.

Run: `python -m arena_jax.benchmarks.studies.dense_ratio [--cases tiny:4:32,mid:8:4096] [--json out.json]`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arena_jax import models
from arena_jax.benchmarks.studies.context_cost import Settings, _filled_cache, _layout, _Runner, _timed
from arena_jax.models import dense_baseline

__all__ = ["CASES", "DenseRunner", "run", "main"]

# (model, batch, context): the goals of issue 39, item 3
CASES = (("tiny", 4, 32), ("tiny", 1, 128), ("mid", 1, 128), ("mid", 8, 128), ("mid", 8, 1024), ("mid", 8, 4096))
TINY = models.LlamaConfig.tiny()


def _settings(model: str, batch: int, context: int, repeats: int) -> Settings:
    s = Settings(batch=batch, repeats=repeats, capacity=context + repeats + 2, backends=("xla",))
    if model == "tiny":
        s = dataclasses.replace(s, hidden=TINY.hidden_size, intermediate=TINY.intermediate_size, layers=TINY.num_layers,
                                q_heads=TINY.num_heads, kv_heads=TINY.num_kv_heads, vocab=TINY.vocab_size)  # fmt: skip
    return s


class DenseRunner:
    """The dense baseline's decode step, every row holding `context` tokens (`compiler_options`:
    the jit's, e.g. `models.steps.STEP_COMPILER_OPTIONS`)."""

    def __init__(self, model, batch: int, context: int, capacity: int, compiler_options=None):
        graphdef, self.state = nnx.split(model)
        raw = dense_baseline.dense_decode.__wrapped__  # a jit of our own, as the arena's (`_Runner`): no static
        self.fn = jax.jit(lambda *a: raw(graphdef, *a), donate_argnums=(1,),  # graphdef hashed per call
                          compiler_options=compiler_options)  # fmt: skip
        cache = dense_baseline.init_dense_cache(model.config, batch, capacity, model.dtype)
        slot = jnp.arange(capacity, dtype=jnp.int32)[None, :]
        self.cache = cache.replace(lengths=jnp.full((batch,), context, jnp.int32),
                                   positions=jnp.broadcast_to(jnp.where(slot < context, slot, -1), cache.positions.shape),
                                   end=jnp.int32(context))  # fmt: skip
        self.tokens = jnp.zeros((batch,), jnp.int32)

    def call(self):
        self.tokens, self.cache = self.fn(self.state, self.cache, self.tokens)
        return self.tokens


def measure(model_name: str, batch: int, context: int, repeats: int = 15, seed: int = 0,
            scan_layers: bool | None = None) -> dict:  # fmt: skip
    """One case, both steps alternated. `scan_layers`: the model's layers stacked in a scan or
    a list; None: as `load_pretrained` builds them here (`models.default_scan_layers`)."""
    s = _settings(model_name, batch, context, repeats)
    cfg = s.config()
    dtype = jnp.dtype(s.dtype)
    scan = models.default_scan_layers(cfg, dtype) if scan_layers is None else scan_layers
    model = models.init_random(cfg, seed=seed, dtype=dtype, scan_layers=scan)
    arena_cache = _filled_cache(s, _layout(s, cfg, s.capacity, s.layers), context, np.random.default_rng(seed))
    runners = {"arena": _Runner(s, "step", "xla", arena_cache, model),
               "dense": DenseRunner(model, batch, context, arena_cache.layout.max_seq_len)}  # fmt: skip
    for r in runners.values():
        _timed(r.call)  # compile
    times = {name: [] for name in runners}
    for _ in range(repeats):
        for name, r in runners.items():  # alternated: arena, dense, arena, dense, ...
            times[name].append(_timed(r.call))
    arena, dense = np.asarray(times["arena"]), np.asarray(times["dense"])
    ratio = float(np.median(arena / dense))
    return {"model": model_name, "batch": batch, "context": context, "capacity": int(arena_cache.layout.max_seq_len),
            "layers": "scan" if scan else "list",
            "arena_ms": float(np.median(arena) * 1e3),
            "dense_ms": float(np.median(dense) * 1e3), "arena_over_dense_time": ratio,
            "tokens_per_s_ratio": 1.0 / ratio}  # fmt: skip


def _case(text: str) -> tuple[str, int, int]:
    model, batch, context = text.split(":")
    if model not in ("tiny", "mid"):
        raise argparse.ArgumentTypeError(f"{text!r}: the model is 'tiny' or 'mid'")
    return model, int(batch), int(context)


def run(cases=CASES, repeats: int = 15, log=print, scan_layers: bool | None = None) -> list[dict]:
    rows = []
    for model_name, batch, context in cases:
        row = measure(model_name, batch, context, repeats, scan_layers=scan_layers)
        rows.append(row)
        log(f"| {model_name} | {row['layers']} | {batch} | {context} | {row['capacity']} | {row['arena_ms']:.3f} "
            f"| {row['dense_ms']:.3f} "
            f"| {row['arena_over_dense_time']:.2f} | {row['tokens_per_s_ratio']:.2f}x |")  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.dense_ratio", description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=lambda t: tuple(_case(c) for c in t.split(",") if c), default=CASES,
                   help="comma-separated model:batch:context (default: issue 39's goals)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", default=None, help="write the rows here")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--scan-layers", dest="scan_layers", action="store_const", const=True, default=None,
                      help="stacked layers in a scan for every model (default: as load_pretrained builds each here, "
                           "models.default_scan_layers: the mid model's 12 MiB layers a list on a CPU)")  # fmt: skip
    form.add_argument("--no-scan-layers", dest="scan_layers", action="store_const", const=False,
                      help="a list of layers for every model")
    a = p.parse_args(argv)
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, {os.cpu_count()} cores")
    print("| model | layers | batch | context | tokens a row (both caches) | arena step ms | dense step ms "
          "| arena / dense (time) | tokens/s ratio |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = run(a.cases, a.repeats, scan_layers=a.scan_layers)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cases": [list(c) for c in a.cases], "repeats": a.repeats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
