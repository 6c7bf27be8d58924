"""Append cost against the arena's capacity, per arena dtype (`python -m arena_jax.benchmarks.studies.append_cost`).

One jitted, donated call appends one token to each of 8 rows at every layer of an 8-layer,
2-KV-head, head_dim-64 arena (`aj.append`, the jnp scatter that every non-GPU backend uses),
at a small and a large page count; the median of `repeats` timed calls (after one warm call).
A write that stays in place costs the same at both sizes; one that copies the arena grows with
it (XLA CPU in jaxlib 0.10 converts whole bf16 arrays to update them: `pallas_kernels/scatter.py`).
"""
from __future__ import annotations

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp

import arena_jax as aj


def measure(dtype: str, pages: int, repeats: int = 20) -> float:
    layout = aj.KVLayout(num_layers=8, num_kv_heads=2, head_dim=64, page_size=16, num_pages=pages, max_seqs=8,
                         max_pages_per_seq=min(pages // 8, 512), dtype=dtype)  # fmt: skip
    slots = jnp.arange(8, dtype=jnp.int32)
    cache, _ = aj.reserve(aj.create(layout), slots, 100)
    k = jnp.ones((8, 1, 2, 64), dtype if not layout.quantized else jnp.float32)

    @functools.partial(jax.jit, donate_argnums=0)
    def step(cache):
        for layer in range(8):
            cache = aj.append(cache, layer, slots, k, k, num_tokens=jnp.ones((8,), jnp.int32))
        return cache

    cache = jax.block_until_ready(step(cache))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        cache = jax.block_until_ready(step(cache))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.append_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,float16,bfloat16,int8,int4,float8_e4m3fn")
    p.add_argument("--pages", default="64,4096", help="small,large page counts (16 tokens a page)")
    p.add_argument("--repeats", type=int, default=20)
    a = p.parse_args(argv)
    small, large = (int(x) for x in a.pages.split(","))
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}; 8 layers x 8 rows x 1 token, 2 KV heads, head_dim 64")
    print(f"| arena dtype | {small} pages ms | {large} pages ms | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for dtype in a.dtypes.split(","):
        lo, hi = measure(dtype, small, a.repeats), measure(dtype, large, a.repeats)
        print(f"| {dtype} | {lo:.3f} | {hi:.3f} | {hi / lo:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
