"""What a module-level step call pays to find its program: the graphdef's hash (issue 39, item 3).

    python -m arena_jax.benchmarks.studies.graphdef_hash [--calls 600] [--layers 2,8,32]

`models.decode_step` and `models.dense_baseline.dense_decode` take the model's graphdef as a
static argument. A plain `jax.jit` hashes a static argument on every call (and compares it with
the one it compiled for), and an nnx graphdef's hash walks the whole graph. `models.model_jit`
keeps the plain jit (`._jit`) and calls one with the graphdef bound instead, found by the
graphdef object's identity. For the tiny model's width (hidden 64, vocabulary 128) at each
depth, layers stacked in a scan ("scan", the tiny preset) or a list ("list", as
`load_pretrained` builds layers of 1 MiB or more on a CPU), it prints:

- `hash(graphdef)` alone (timeit);
- one decode call, batch 4, greedy, of the paged step and of the dense step, each through the
  plain jit and through `model_jit`, the four alternated call by call (`--calls` each, every
  32nd call untimed: the caches are emptied there), the median wall time to a ready result.

Run it with one thread (`XLA_FLAGS="--xla_cpu_multi_thread_eigen=false
intra_op_parallelism_threads=1"`) and pinned (`taskset -c 0`) for figures that compare.
"""
from __future__ import annotations

import argparse
import os
import time
import timeit

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models import dense_baseline

__all__ = ["measure", "main"]

BATCH, RESET = 4, 32


def _paged(model, graphdef, state, fn):
    layout = models.default_layout(model, BATCH, 2 * RESET, page_size=16)
    slots = jnp.arange(BATCH, dtype=jnp.int32)
    box = {"cache": aj.create(layout), "tokens": jnp.zeros((BATCH,), jnp.int32)}

    def reset():
        box["cache"] = models.release_rows(box["cache"], slots)

    def call():
        out = fn(graphdef, state, box["cache"], box["tokens"], slots)
        box["cache"], box["tokens"] = out.cache, out.tokens
        return out

    return reset, call


def _dense(model, graphdef, state, fn):
    box = {"tokens": jnp.zeros((BATCH,), jnp.int32)}

    def reset():
        box["cache"] = dense_baseline.init_dense_cache(model.config, BATCH, 2 * RESET, model.dtype)

    def call():
        box["tokens"], box["cache"] = fn(graphdef, state, box["cache"], box["tokens"])
        return box["cache"]

    reset()
    return reset, call


def measure(layers: int, scan: bool, calls: int = 600) -> dict:
    """One depth and layer form: the hash and the four calls' medians, in microseconds."""
    cfg = models.LlamaConfig.tiny().with_num_layers(layers)
    model = models.init_random(cfg, seed=0, scan_layers=scan)
    graphdef, state = nnx.split(model)
    runs = {"paged, jax.jit": _paged(model, graphdef, state, models.decode_step._jit),
            "paged, model_jit": _paged(model, graphdef, state, models.decode_step),
            "dense, jax.jit": _dense(model, graphdef, state, dense_baseline.dense_decode._jit),
            "dense, model_jit": _dense(model, graphdef, state, dense_baseline.dense_decode)}  # fmt: skip
    times = {name: [] for name in runs}
    for i in range(calls + calls // (RESET - 1) + 2):
        for name, (reset, call) in runs.items():
            if i % RESET == 0:
                reset()
                jax.block_until_ready(call())  # untimed (the first: compile)
                continue
            t0 = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - t0)
    n = 200
    row = {"layers": layers, "form": "scan" if scan else "list",
           "hash_us": timeit.timeit(lambda: hash(graphdef), number=n) / n * 1e6}  # fmt: skip
    row.update({name: float(np.median(t[:calls])) * 1e6 for name, t in times.items()})
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.graphdef_hash",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--calls", type=int, default=600, help="timed calls of each of the four (default 600)")
    p.add_argument("--layers", type=lambda t: [int(x) for x in t.split(",") if x], default=[2, 8, 32],
                   help="depths, comma-separated (default 2,8,32): 2 as a scan (the tiny preset) and as a list, "
                        "the others as a list")  # fmt: skip
    a = p.parse_args(argv)
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, {os.cpu_count()} cores,"
          f" batch {BATCH}, median of {a.calls} calls each, us")  # fmt: skip
    print("| layers | form | hash(graphdef) | paged, jax.jit | paged, model_jit | saved | dense, jax.jit "
          "| dense, model_jit | saved |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    forms = [(n, s) for n in a.layers for s in ((True, False) if n == 2 else (False,))]
    for layers, scan in forms:
        r = measure(layers, scan, a.calls)
        pj, pm, dj, dm = (r[k] for k in ("paged, jax.jit", "paged, model_jit", "dense, jax.jit", "dense, model_jit"))
        print(f"| {layers} | {r['form']} | {r['hash_us']:.1f} | {pj:.1f} | {pm:.1f} | {pj - pm:.1f} | {dj:.1f} "
              f"| {dm:.1f} | {dj - dm:.1f} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
