"""One layer's decode attention alone: the "xla" backend (`paged_attention_blockwise`) against
the dense baseline's (`models.dense_baseline._attention`), at a model step's shapes (issue 39).

Each row: `batch` rows of one query token over `pages` pages of `page_size` keys, every row
holding all but the last 20 positions of its pages; the mid model's heads (8 query / 2 KV,
head_dim 64), float32, an 8-layer arena (the rows read layer 3). The dense attention gets the
same keys as a `[B, Hkv, S, D]` layer (what the dense step slices out of its cache). Both are
jits of their own, called alternately; the figure is the median of `--repeats` calls (after a
warm-up), dispatch included (the paged call passes seven arrays, the dense five).

Run: `python -m arena_jax.benchmarks.studies.attention_block [--cases 1:10,8:10,4:4]` (batch:pages),
one thread and pinned (`taskset -c 1`) for figures that compare.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from arena_jax.models.dense_baseline import _attention
from pallas_kernels.blockwise import paged_attention_blockwise

__all__ = ["measure", "main"]

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS, PAGE = 8, 2, 64, 8, 16


def _inputs(batch: int, pages: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    num_pages, keys = batch * pages, pages * PAGE
    k_arena = jnp.asarray(rng.standard_normal((LAYERS, KV_HEADS, num_pages, PAGE, HEAD_DIM)), jnp.float32)
    v_arena = jnp.asarray(rng.standard_normal(k_arena.shape), jnp.float32)
    page_map = jnp.asarray(rng.permutation(num_pages).reshape(batch, pages), jnp.int32)
    lengths = jnp.full((batch,), keys - 20, jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, Q_HEADS, HEAD_DIM)), jnp.float32)
    layer = 3
    pos = np.arange(keys)
    # The dense layer: the same keys in order (page_map row b's pages, position p at page p // PAGE)
    k_dense, v_dense = (a[layer][:, page_map][:, :, pos // PAGE, pos % PAGE].transpose(1, 0, 2, 3)
                        for a in (k_arena, v_arena))  # fmt: skip
    key_pos = jnp.where(pos[None] < lengths[:, None], pos[None], -1).astype(jnp.int32)
    paged = (q, k_arena, v_arena, jnp.int32(layer), page_map, lengths, jnp.ones((batch,), jnp.int32))
    dense = (q, k_dense, v_dense, (lengths - 1)[:, None], key_pos)
    return paged, dense


def measure(batch: int, pages: int, repeats: int = 300) -> dict:
    paged_args, dense_args = _inputs(batch, pages)
    paged = jax.jit(paged_attention_blockwise)
    dense = jax.jit(lambda q, k, v, q_pos, key_pos: _attention(q, k, v, q_pos, key_pos, None, HEAD_DIM**-0.5, None))
    np.testing.assert_allclose(np.asarray(paged(*paged_args)), np.asarray(dense(*dense_args)), atol=2e-5, rtol=0)
    times = {"paged": [], "dense": []}
    for _ in range(repeats):
        for name, fn, args in (("paged", paged, paged_args), ("dense", dense, dense_args)):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    paged_us, dense_us = (float(np.median(times[n]) * 1e6) for n in ("paged", "dense"))
    return {"batch": batch, "keys": pages * PAGE, "paged_us": paged_us, "dense_us": dense_us,
            "paged_over_dense": paged_us / dense_us}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.attention_block",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default="1:10,8:10,4:4", help="comma-separated batch:pages (pages of 16 keys)")
    p.add_argument("--repeats", type=int, default=300)
    a = p.parse_args(argv)
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    print("| batch | keys | paged (xla) us | dense us | paged / dense |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for case in a.cases.split(","):
        batch, pages = (int(x) for x in case.split(":"))
        r = measure(batch, pages, a.repeats)
        print(f"| {batch} | {r['keys']} | {r['paged_us']:.1f} | {r['dense_us']:.1f} | {r['paged_over_dense']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
