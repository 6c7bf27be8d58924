"""Compile time and decode step time against model depth (issue 17: compile time must not grow
with depth; the layer scan must not slow the step).

    JAX_PLATFORMS=cpu python -m benchmarks.layer_scaling --layers 2 8 32 --json
    JAX_PLATFORMS=cpu python -m benchmarks.layer_scaling --steps 64 --model mid

For each depth: the first-call compile time of `models.decode_step` (lower + compile, no
persistent cache; a fresh graphdef per depth so nothing is reused) and of `models.prefill`,
then the median wall time of a warm decode step (batch rows decoding after one prefill,
`jax.block_until_ready` after each step). Uses only the public API, so the same file measures
an older checkout: `PYTHONPATH=/path/to/old python benchmarks/layer_scaling.py`.

Models: `tiny` (hidden 64, 4/2 heads, vocab 128: the tiny width the compile goal is stated
for) and `mid` (hidden 512, 8/2 heads, MLP 1536, vocab 32000: issue 17's mid model).
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
import models

WIDTHS = {
    "tiny": dict(),
    "mid": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_heads=8, num_kv_heads=2),
}


def measure(num_layers: int, *, model: str = "tiny", batch: int = 8, prompt_len: int = 128, steps: int = 32,
            page_size: int = 16) -> dict:
    config = models.LlamaConfig.tiny(num_layers=num_layers, max_position_embeddings=4096, **WIDTHS[model])
    net = models.init_random(config, seed=0)
    graphdef, state = nnx.split(net)
    layout = models.default_layout(net, batch, prompt_len + steps + 2, page_size=page_size, dtype="float32")
    cache = aj.create(layout)
    slots = jnp.arange(batch, dtype=jnp.int32)
    greedy = models.GREEDY.rows(batch)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (batch, prompt_len)), jnp.int32)
    counts = jnp.full((batch,), prompt_len, jnp.int32)

    t0 = time.perf_counter()
    prefill = models.prefill.lower(graphdef, state, cache, tokens, slots, counts, slots, 0, greedy).compile()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    decode = models.decode_step.lower(graphdef, state, cache, tokens[:, 0], slots, slots, 0, greedy).compile()
    decode_s = time.perf_counter() - t0

    out = prefill(state, cache, tokens, slots, counts, slots, 0, greedy)
    cache, nxt = out.cache, out.tokens
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = decode(state, cache, nxt, slots, slots, 0, greedy)
        jax.block_until_ready(out.tokens)
        times.append(time.perf_counter() - t0)
        cache, nxt = out.cache, out.tokens
    warm = times[2:] or times
    return dict(model=model, layers=num_layers, batch=batch, context=prompt_len,
                compile_decode_s=round(decode_s, 3), compile_prefill_s=round(prefill_s, 3),
                step_ms_p50=round(1e3 * statistics.median(warm), 3), step_ms_min=round(1e3 * min(warm), 3))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--model", choices=sorted(WIDTHS), default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for layers in args.layers:
        row = measure(layers, model=args.model, batch=args.batch, prompt_len=args.prompt_len, steps=args.steps)
        rows.append(row)
        if not args.json:
            print(f"{row['model']} L={layers:3d}: compile decode_step {row['compile_decode_s']:7.2f} s, prefill "
                  f"{row['compile_prefill_s']:7.2f} s; decode step p50 {row['step_ms_p50']:8.2f} ms "
                  f"(min {row['step_ms_min']:.2f})", flush=True)
    if args.json:
        json.dump(dict(jax=jax.__version__, backend=jax.default_backend(), rows=rows), sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
