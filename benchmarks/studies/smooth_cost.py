"""What smoothed keys cost a decode step of the cache (`python -m arena_jax.benchmarks.studies.smooth_cost`).

One jitted, donated call appends one token to each of `rows` rows and attends one query per
row, at every layer of an int8 arena with Llama-3-8B-shaped heads (8 KV / 32 query heads,
head_dim 128), each row holding `context` tokens; the cache's default backend. Two arenas,
`smooth_keys` off and on (rotation on in both), timed in alternating rounds in one process (each first in half of them):
the medians and their ratio. Smoothing adds per layer: the calibration's masked absmax over the
new keys and a sort of [heads, head_dim] (kept by a `where` once the layer is calibrated), a
division of the new keys and a multiplication of q.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj


def _setup(smooth: bool, layers: int, rows: int, context: int):
    pages = -(-(context + 64) // 16)
    layout = aj.KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, page_size=16, num_pages=rows * pages,
                         max_seqs=rows, max_pages_per_seq=pages, dtype="int8", smooth_keys=smooth, rotate_keys=True)
    slots = jnp.arange(rows, dtype=jnp.int32)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((rows, context, 8, 128)), jnp.float32)
    cache, _ = aj.reserve(aj.create(layout), slots, context)
    for layer in range(layers):
        cache = aj.append(cache, layer, slots, k, k)
    new = jnp.asarray(rng.standard_normal((rows, 1, 8, 128)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((rows, 1, 32, 128)), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache):
        cache, _ = aj.reserve(cache, slots, 1)
        out = jnp.zeros_like(q)
        for layer in range(layers):
            cache = aj.append(cache, layer, slots, new, new)
            out = out + aj.attend(q, cache, layer, slots)
        cache = aj.truncate(cache, slots, jnp.full((rows,), context, jnp.int32))  # back to `context` tokens
        return cache, out

    return cache, step


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.smooth_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=20, help="timed steps per round")
    a = p.parse_args(argv)
    runs = {smooth: _setup(smooth, a.layers, a.rows, a.context) for smooth in (False, True)}
    times = {False: [], True: []}
    for smooth, (cache, step) in runs.items():  # compile and warm
        runs[smooth] = (jax.block_until_ready(step(cache)[0]), step)
    for r in range(a.rounds):
        for smooth in (False, True) if r % 2 == 0 else (True, False):  # each goes first in half the rounds
            cache, step = runs[smooth]
            for _ in range(a.steps):
                t0 = time.perf_counter()
                cache, out = jax.block_until_ready(step(cache))
                times[smooth].append(time.perf_counter() - t0)
            runs[smooth] = (cache, step)
    off, on = (statistics.median(times[s]) * 1e3 for s in (False, True))
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; int8 arena, {a.layers} layers x {a.rows} rows x "
          f"{a.context} tokens, 8 KV / 32 q heads, head_dim 128; {a.rounds} alternating rounds x {a.steps} steps")
    print("| smooth_keys | median step ms | min ms |")
    print("| --- | ---: | ---: |")
    for s in (False, True):
        print(f"| {'on' if s else 'off'} | {statistics.median(times[s]) * 1e3:.3f} | {min(times[s]) * 1e3:.3f} |")
    print(f"on / off: {on / off:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
