"""Why 8-bit arenas take pages of 128 or 256 on a TPU: the scales' layout, compiled (issue 42).

    python -m arena_jax.benchmarks.studies.tpu_scale_layouts [--target tpu-v5e] [--pages 8192]

An 8-bit arena's scales are f32 `[L, Hkv, P, S]`, one per token and head. Compiled for a TPU
without one (libtpu, `jax.experimental.topologies`), for each page size S this prints:

- the default layout XLA gives the scales (major to minor): S >= 128 keeps them row-major (a
  page's scales are one row, one DMA); S < 128 puts the pages in the lanes, so a page's S
  scales are a column no DMA can read;
- what the two XLA-side workarounds would cost per layer call, from the compiled program:
  `scatter`, an append's new scales written with `.at[layer, :, page, slot].set` (one value
  per row and head, the cache donated), and `gather`, attention's scales for a page table
  `[B, M]` gathered into rows `[B, Hkv, M * S]`. Each is compiled plain and through the
  swapped view `[L, Hkv, S, P]` (a bitcast of the S < 128 layout). "copies" counts copy
  instructions whose result is as large as one layer's scales or larger; "temp" is XLA's
  temporary memory.

A copy of the whole scales array per append is what rules the workarounds out: at S < 128 each
costs more than the K/V bytes the step moves.
"""
from __future__ import annotations

import argparse
import re

import jax
import jax.numpy as jnp

__all__ = ["run", "main"]

TOPOLOGY = {"tpu-v5e": "v5e:2x2", "tpu-v6e": "v6e:2x2"}


def _scatter(swapped: bool):
    def f(scales, layer, pages, slots, values):  # values [B, Hkv]
        if not swapped:
            return scales.at[layer, :, pages, slots].set(values, mode="drop")
        t = jnp.swapaxes(scales, 2, 3).at[layer, :, slots, pages].set(values, mode="drop")
        return jnp.swapaxes(t, 2, 3)

    return f


def _gather(swapped: bool):
    def g(scales, layer, page_map):  # -> [B, Hkv, M * S]
        if not swapped:
            out = scales[layer][:, page_map]  # [H, B, M, S]
            return out.transpose(1, 0, 2, 3).reshape(page_map.shape[0], scales.shape[1], -1)
        out = jnp.swapaxes(scales, 2, 3)[layer][:, :, page_map]  # [H, S, B, M]
        return out.transpose(2, 0, 3, 1).reshape(page_map.shape[0], scales.shape[1], -1)

    return g


def _facts(compiled, layer_bytes: int) -> tuple[int, int]:
    """(copies whose result is >= one layer's scales, temp bytes)."""
    copies = 0
    for line in compiled.as_text().splitlines():
        m = re.search(r"= f32\[([\d,]+)\]\{[^}]*\} copy\(", line)
        if m:
            size = 4
            for d in m.group(1).split(","):
                size *= int(d)
            copies += size >= layer_bytes
    return copies, compiled.memory_analysis().temp_size_in_bytes


def run(target: str = "tpu-v5e", layers: int = 32, kv_heads: int = 8, pages: int = 8192, batch: int = 32,
        table_keys: int = 4096, page_sizes=(16, 32, 64, 128), log=print) -> list[dict]:  # fmt: skip
    from jax.experimental import topologies
    from jax.sharding import SingleDeviceSharding

    device = topologies.get_topology_desc(TOPOLOGY[target], "tpu").devices[0]
    sharding = SingleDeviceSharding(device)

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    log(f"# {target}, jax {jax.__version__}: scales f32[{layers}, {kv_heads}, {pages}, S], batch {batch}, "
        f"page tables of {table_keys} keys")  # fmt: skip
    log("| S | default layout (major to minor) | op | view | copies >= a layer's scales | temp MiB |")
    log("|---:|---|---|---|---:|---:|")
    rows = []
    for s in page_sizes:
        scales = spec((layers, kv_heads, pages, s), jnp.float32)
        layer = spec((), jnp.int32)
        identity = jax.jit(lambda x: x).lower(scales).compile()
        layout = identity.input_formats[0][0].layout.major_to_minor
        layer_bytes = kv_heads * pages * s * 4
        cases = {
            "scatter": (_scatter, (scales, layer, spec((batch,), jnp.int32), spec((batch,), jnp.int32),
                                   spec((batch, kv_heads), jnp.float32)), dict(donate_argnums=0)),  # fmt: skip
            "gather": (_gather, (scales, layer, spec((batch, table_keys // s), jnp.int32)), {}),
        }
        for op, (make, args, jit_kwargs) in cases.items():
            for swapped in (False, True):
                compiled = jax.jit(make(swapped), **jit_kwargs).lower(*args).compile()
                copies, temp = _facts(compiled, layer_bytes)
                row = dict(page_size=s, layout=list(layout), op=op, swapped=swapped, copies=copies, temp_bytes=temp)
                rows.append(row)
                log(f"| {s} | {layout} | {op} | {'[L, H, S, P]' if swapped else '[L, H, P, S]'} | {copies} "
                    f"| {temp / 2**20:,.1f} |")  # fmt: skip
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arena_jax.benchmarks.studies.tpu_scale_layouts",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--target", default="tpu-v5e", choices=sorted(TOPOLOGY))
    p.add_argument("--pages", type=int, default=8192)
    a = p.parse_args(argv)
    run(a.target, pages=a.pages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
