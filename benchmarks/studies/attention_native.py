"""The native decode attention against the blockwise path it replaces, call by call (issue 39).

For each case (batch, KV heads, query group, head_dim, context), one jitted call of each over
the same float32 arena (pages mapped in order, every row holding `context` tokens, one query a
row), alternated call by call in one process: `pallas_kernels.cpu.attention.decode_attention`
(one C++ call through XLA's FFI) and `pallas_kernels.blockwise.paged_attention_blockwise` (XLA's
kernels: page gathers, dots, masks, the softmax's reductions). Each figure is the median of
`--repeats` calls after a warm-up, `block_until_ready` before the clock is read; both include
the call's dispatch (~10 us here). "keys read" is batch x KV heads x capacity x head_dim, what
`attention.worthwhile` weighs (`MAX_KEYS_READ`). Run it with one thread
(`XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"`, pinned).

Run: `python -m arena_jax.benchmarks.studies.attention_native [--cases 4:2:2:16:48,8:2:4:64:1024] [--repeats 300]`.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.blockwise import paged_attention_blockwise
from pallas_kernels.cpu import attention

__all__ = ["CASES", "measure", "main"]

# (batch, KV heads, query group, head_dim, context): the tiny and mid models' decode shapes
CASES = ((4, 2, 2, 16, 48), (1, 2, 2, 16, 128), (1, 2, 4, 64, 128), (4, 2, 4, 64, 128), (8, 2, 4, 64, 128),
         (32, 2, 2, 16, 128), (8, 2, 4, 64, 1024))  # fmt: skip
PAGE_SIZE = 16


def measure(batch: int, kv_heads: int, group: int, head_dim: int, context: int, repeats: int = 300,
            seed: int = 0) -> dict:  # fmt: skip
    rng = np.random.default_rng(seed)
    max_pages = -(-context // PAGE_SIZE) + 1
    shape = (1, kv_heads, batch * max_pages, PAGE_SIZE, head_dim)
    k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    page_map = jnp.arange(batch * max_pages, dtype=jnp.int32).reshape(batch, max_pages)
    lengths, num_tokens = jnp.full((batch,), context, jnp.int32), jnp.ones((batch,), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, kv_heads * group, head_dim)), jnp.float32)
    fns = {name: jax.jit(lambda q, k, v, f=f: f(q, k, v, 0, page_map, lengths, num_tokens))
           for name, f in (("native", attention.decode_attention), ("blockwise", paged_attention_blockwise))}  # fmt: skip
    outs = {name: f(q, k, v).block_until_ready() for name, f in fns.items()}  # compile
    err = float(jnp.max(jnp.abs(outs["native"] - outs["blockwise"])))
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():  # alternated
            t0 = time.perf_counter()
            f(q, k, v).block_until_ready()
            times[name].append(time.perf_counter() - t0)
    native, blockwise = (float(np.median(times[n]) * 1e6) for n in ("native", "blockwise"))
    capacity = max_pages * PAGE_SIZE
    return {"batch": batch, "kv_heads": kv_heads, "group": group, "head_dim": head_dim, "context": context,
            "capacity": capacity, "keys_read": batch * kv_heads * capacity * head_dim, "native_us": native,
            "blockwise_us": blockwise, "max_abs_difference": err,
            "worthwhile": attention.worthwhile(batch, kv_heads, capacity, head_dim)}  # fmt: skip


def _case(text: str) -> tuple[int, ...]:
    parts = tuple(int(x) for x in text.split(":"))
    if len(parts) != 5:
        raise argparse.ArgumentTypeError(f"{text!r}: batch:kv_heads:group:head_dim:context")
    return parts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.attention_native",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--cases", type=lambda t: tuple(_case(c) for c in t.split(",") if c), default=CASES,
                   help="comma-separated batch:kv_heads:group:head_dim:context")
    p.add_argument("--repeats", type=int, default=300)
    a = p.parse_args(argv)
    problem = attention.native_problem()
    if problem is not None:
        raise SystemExit(f"the native attention is not available here: {problem}")
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, float32, {a.repeats} calls each, alternated")
    print("| batch | KV heads | group | head_dim | context | keys read | native us | blockwise us | native / blockwise "
          "| worthwhile | max abs difference |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")
    for case in a.cases:
        r = measure(*case, repeats=a.repeats)
        print(f"| {r['batch']} | {r['kv_heads']} | {r['group']} | {r['head_dim']} | {r['context']} | {r['keys_read']:,} "
              f"| {r['native_us']:.1f} | {r['blockwise_us']:.1f} | {r['native_us'] / r['blockwise_us']:.2f} "
              f"| {'yes' if r['worthwhile'] else 'no'} | {r['max_abs_difference']:.1e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
