"""What a decode step costs per call beyond its work (issue 39, item 3: the tour's case).

    python -m arena_jax.benchmarks.studies.call_cost [--rounds 40] [--ops 40] [--fold-limits 0]

Two measurements, one process, one thread (run it with `XLA_FLAGS="--xla_cpu_multi_thread_eigen=false"`
and `taskset -c 1` for figures that compare):

- steps per call: `arena-bench decode`'s case (`decode.DecodeSettings()`: tiny model, batch 4, a
  32-token prompt, pages of 16), its arena and dense decode steps, k = 1, 2, 4, 8 of them inside
  one jit (`lax.fori_loop`, the trip count an argument, the cache donated), the sides
  alternated call by call in a fresh random order each round; each (side, k) the median of the
  calls. `--fold-limits 0` adds an arena side whose short reductions are XLA's (`arena_jax.unrolled`
  with `UNROLL_LIMIT = 0`, the step as it was before session 54), compiled in the same process. A straight line through
  the four medians splits a call into a cost per step (its slope: the steps' work) and a cost
  per call (its intercept: dispatch, the runtime's per-execution setup, and whatever a step
  run first in a call costs more than the next one).
- what an op costs per call, run or not: a jit of an 8-float vector whose untaken `lax.cond`
  branch holds `--ops` copies of one op (each behind an optimization barrier, so none fuses
  into another), against the same branch holding none. XLA's CPU runtime builds, at every
  execution, a buffer table with an entry (a heap-allocated async value) for every constant and
  for every value of a reduction's, scatter's or sort's own computation ("thread-local"
  allocations), whether its kernel runs or not; elementwise kernels have none.

Each program's `to_apply` computations are counted too (reductions, scatters, argmaxes: their
computations' values are the thread-local allocations above).
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax import models, unrolled
from arena_jax.benchmarks import decode
from arena_jax.benchmarks.studies.context_cost import _timed
from arena_jax.models import dense_baseline

__all__ = ["OPS", "embedded_computations", "op_cost", "step_cost", "main"]

# One op of each kind, on an f32[8] vector (`op_cost`).
OPS = {
    "elementwise": lambda x, i: x * (i + 2) + 1,
    "reduction (max)": lambda x, i: x + jnp.max(x * (i + 2)),
    "cumulative sum": lambda x, i: jnp.cumsum(x * (i + 2)),
    "scatter-add": lambda x, i: x.at[(x > i).astype(jnp.int32)].add(1.0),
    "argmax": lambda x, i: x + jnp.argmax(x * (i + 2)).astype(x.dtype),
    "constant array": lambda x, i: x * jnp.asarray(np.arange(8, dtype=np.float32) * (i + 2) + 1),
}


def embedded_computations(hlo_text: str) -> int:
    """The `to_apply` computations an optimized HLO module's instructions call (a reduction's,
    a scatter's, an argmax's: XLA CPU allocates each value of them per execution)."""
    return hlo_text.count("to_apply=")


def _median_call(fn, args, calls: int) -> float:
    return float(np.median([_timed(lambda: fn(*args)) for _ in range(calls)]))


def op_cost(ops: int = 40, calls: int = 3000) -> list[dict]:
    """Per op kind: us a call that `ops` copies of it add in an untaken branch, and in a run one."""
    x = jnp.arange(8, dtype=jnp.float32)

    def program(op, count: int, taken: bool):
        def branch(a):
            for i in range(count):
                a = jax.lax.optimization_barrier(op(a, i))
            return a

        return jax.jit(lambda x: jax.lax.cond(x[0] < 100 if taken else x[0] > 100, branch, lambda a: a + 1, x))

    rows = []
    for name, op in OPS.items():
        shapes = {"none": (0, False), "untaken": (ops, False), "run": (ops, True)}  # (copies, branch taken)
        progs = {key: program(op, count, taken) for key, (count, taken) in shapes.items()}
        for p in progs.values():
            jax.block_until_ready(p(x))
        us = {key: 0.0 for key in progs}
        for _ in range(5):  # the three alternated in five stretches
            for key, p in progs.items():
                us[key] += _median_call(p, (x,), calls // 5) * 1e6 / 5
        rows.append({"op": name, "ops": ops, "embedded computations": embedded_computations(
            progs["untaken"].lower(x).compile().as_text()),
            "untaken us per op": (us["untaken"] - us["none"]) / ops, "run us per op": (us["run"] - us["none"]) / ops})  # fmt: skip
    return rows


def _programs(s: decode.DecodeSettings, steps: int):
    """(arena k-step jit, its args, dense k-step jit, its args, compiled HLO texts) for the case,
    both caches sized to the prompt plus `steps` decode steps or its new tokens, the more."""
    capacity = s.prompt_len + max(steps, s.new_tokens)
    model, _ = decode.build_model(s)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(s.seed)
    prompts = jnp.asarray(rng.integers(0, model.config.vocab_size, size=(s.batch, s.prompt_len), dtype=np.int32))
    slots = jnp.arange(s.batch, dtype=jnp.int32)
    counts = jnp.full((s.batch,), s.prompt_len, jnp.int32)
    layout = models.default_layout(model, s.batch, capacity, page_size=s.page_size)
    out = models.prefill(graphdef, state, aj.create(layout), prompts, slots, counts)
    dense = dense_baseline.init_dense_cache(model.config, s.batch, capacity, model.dtype)
    first, dense = dense_baseline.dense_prefill(graphdef, state, dense, prompts, counts)
    step, dense_step = models.decode_step.__wrapped__, dense_baseline.dense_decode.__wrapped__

    def arena_steps(state, cache, tokens, k):  # k arena decode steps
        def body(_, c):
            o = step(graphdef, state, c[0], c[1], slots)
            return o.cache, o.tokens

        return jax.lax.fori_loop(0, k, body, (cache, tokens))

    def dense_steps(state, cache, tokens, k):  # k dense decode steps
        def body(_, c):
            t, cache = dense_step(graphdef, state, c[0], c[1])
            return cache, t

        return jax.lax.fori_loop(0, k, body, (cache, tokens))

    texts = {"arena": models.decode_step.lower(graphdef, state, out.cache, out.tokens, slots).compile().as_text(),
             "dense": dense_baseline.dense_decode.lower(graphdef, state, dense, first).compile().as_text()}  # fmt: skip
    return (jax.jit(arena_steps, donate_argnums=(1,)), (state, out.cache, out.tokens),
            jax.jit(dense_steps, donate_argnums=(1,)), (state, dense, first), texts)  # fmt: skip


def _compiled_sides(s: decode.DecodeSettings, steps: int, fold_limits) -> tuple[dict, dict]:
    """({side: (compiled k-step program, args)}, {side: one step's optimized HLO}): the dense
    side and an arena side per `arena_jax.unrolled.UNROLL_LIMIT` in `fold_limits` ("arena" for
    None, the limit as built; "arena, folds <= n" else; 0: every short reduction left to XLA),
    each traced and compiled with its limit (ahead of time: a compiled program keeps its limit)."""
    sides, texts, built = {}, {}, unrolled.UNROLL_LIMIT
    try:
        for limit in fold_limits:
            jax.clear_caches()
            unrolled.UNROLL_LIMIT = built if limit is None else limit
            arena_fn, arena_args, dense_fn, dense_args, text = _programs(s, steps)
            name = "arena" if limit is None else f"arena, folds <= {limit}"
            sides[name] = (arena_fn.lower(*arena_args, jnp.int32(1)).compile(), arena_args)
            texts[name] = text["arena"]
            if "dense" not in sides:
                sides["dense"] = (dense_fn.lower(*dense_args, jnp.int32(1)).compile(), dense_args)
                texts["dense"] = text["dense"]
    finally:
        unrolled.UNROLL_LIMIT = built
        jax.clear_caches()
    return sides, texts


def step_cost(ks=(1, 2, 4, 8), rounds: int = 40, s: decode.DecodeSettings | None = None, fold_limits=(None,)) -> dict:
    """{side: {"k": [median us a call], "per step": us, "per call": us, "embedded computations": n}}.
    `fold_limits`: an arena side per `UNROLL_LIMIT` (`_compiled_sides`); the sides run in a fresh
    random order each round (the first call after a round's cache copies runs cold)."""
    calls = 3  # a round's calls in a row from a fresh copy of the prefilled caches, the last two timed
    sides, texts = _compiled_sides(s or decode.DecodeSettings(), calls * max(ks), fold_limits)
    times = {(side, k): [] for side in sides for k in ks}
    order = np.random.default_rng(0)
    for r in range(rounds + 1):  # the first round warms up
        names = list(sides)
        order.shuffle(names)
        for k in ks:
            trips = jnp.int32(k)
            carry = {side: (jax.tree.map(jnp.copy, args[1]), args[2]) for side, (_, args) in sides.items()}  # (cache, tokens)
            jax.block_until_ready(carry)
            for call in range(calls):
                for side in names:
                    fn, args = sides[side]
                    t0 = time.perf_counter()
                    carry[side] = fn(args[0], *carry[side], trips)
                    jax.block_until_ready(carry[side][1])
                    if r and call:
                        times[(side, k)].append(time.perf_counter() - t0)
    out = {}
    for side in sides:
        medians = [float(np.median(times[(side, k)])) * 1e6 for k in ks]
        slope, intercept = np.polyfit(ks, medians, 1)
        out[side] = {"k": dict(zip(ks, medians)), "per step": float(slope), "per call": float(intercept),
                     "embedded computations": embedded_computations(texts[side])}  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.call_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=40, help="rounds of the steps-per-call measurement")
    p.add_argument("--ops", type=int, default=40, help="copies of each op in the op-cost programs")
    p.add_argument("--fold-limits", default="", help="also arena sides built with these `arena_jax.unrolled.UNROLL_LIMIT`s, "
                   "comma-separated (0: every short reduction left to XLA, as before session 54)")
    a = p.parse_args(argv)
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    limits = (None,) + tuple(int(x) for x in a.fold_limits.split(",") if x)
    cost = step_cost(rounds=a.rounds, fold_limits=limits)
    ks = list(cost["arena"]["k"])
    print("| side | " + " | ".join(f"k = {k} (us a call)" for k in ks) + " | per step (slope) | per call (intercept) "
          "| `to_apply` computations of one step |")  # fmt: skip
    print("| --- |" + " ---: |" * (len(ks) + 3))
    for side, row in cost.items():
        print(f"| {side} | " + " | ".join(f"{row['k'][k]:.1f}" for k in ks)
              + f" | {row['per step']:.1f} | {row['per call']:.1f} | {row['embedded computations']} |")  # fmt: skip
    print()
    print("| op | `to_apply` computations (the untaken program) | us a call per op, untaken | us a call per op, run |")
    print("| --- | ---: | ---: | ---: |")
    for row in op_cost(a.ops):
        print(f"| {row['op']} | {row['embedded computations']} | {row['untaken us per op']:.2f} | {row['run us per op']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
