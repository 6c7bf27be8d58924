"""The host tier's jitted ops (`models.steps.swap_out_rows`, `swap_in_rows`, `offload_page_rows`)
compiled for a TPU v5e without a TPU: does a page move touch a page, or the whole arena?

One v5e device (from libtpu's topology, `pallas_kernels.offline.tpu`), a Llama-3-8B-shaped
arena (8 KV heads, head_dim 128; `num_layers` of its 32 layers) of 4,096 16-token pages' worth
of tokens, and a host tier of a quarter of that in `pinned_host` memory, all as placed
ShapeDtypeStructs (nothing allocated), the cache and the host tier donated; 8 rows move.
The host tier is in its TPU format (an 8-bit arena's pages as 32-bit words,
`arena_jax.host.host_page_format`). What the compiled module says
(`tpu_compile.module_facts`): XLA's bytes accessed, temp memory, and every copy of an array as
large as a quarter of a k / v arena.

    python -m arena_jax.benchmarks.studies.tpu_host_tier [--layers 32]

Placement note: the inputs sit on a one-device mesh (`NamedSharding`), not a
`SingleDeviceSharding`: JAX 0.10 gives a ShapeDtypeStruct the host memory space in its type
only through a NamedSharding's memory kind.
"""
from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["HOST_OPS", "compile_host_op", "arena_bytes"]

HOST_OPS = ("swap_out_rows", "swap_in_rows", "offload_page_rows")
ROWS = 8
TOKENS = 4096 * 16  # arena tokens; the host tier holds a quarter


def compile_host_op(op: str, dtype: str = "bfloat16", num_layers: int = 2, target: str = "tpu-v5e", tensor: int = 1,
                    page_size: int | None = None):
    """Compile `models.steps.<op>` for `target`; returns (compiled, cache, host) (the latter two
    as the placed ShapeDtypeStructs it was compiled for). `tensor` > 1: the cache and the host
    tier split over the KV heads of that many devices (a `tensor` mesh axis). `page_size`:
    default 16 tokens, 128 for an 8-bit arena."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    import arena_jax as aj
    from arena_jax.host import HostArena, host_page_format, packs_as_words, page_arrays
    from arena_jax.sharding import _cache_specs
    from arena_jax.models import steps
    from arena_jax.models.config import LlamaConfig
    from pallas_kernels.offline import tpu as tpu_compile

    if op not in HOST_OPS:
        raise ValueError(f"op={op!r}; expected one of {HOST_OPS}")
    config = dataclasses.replace(LlamaConfig.llama3_8b(), num_layers=num_layers)
    page = page_size or (16 if jnp.dtype(dtype).itemsize > 1 else 128)
    layout = config.kv_layout(page_size=page, num_pages=TOKENS // page, max_seqs=32, max_seq_len=4096, dtype=dtype)
    mesh = Mesh(np.array(tpu_compile.tpu_devices(target, "2x2")[:tensor]), ("tensor",))
    with tpu_compile.tpu_lowering(target):  # (aj.create then judges the TPU's writes, not this host's)
        cache = jax.eval_shape(lambda: aj.create(layout, mesh=mesh if tensor > 1 else None))
    if tensor > 1:
        places = jax.tree.map(cache.sharding.named, _cache_specs(cache))
        host_spec = cache.sharding.arena_spec
    else:
        places, host_spec = jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), cache), PartitionSpec()
    cache = jax.tree.map(lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where), cache, places)
    host_pages = TOKENS // 4 // page
    pages = {}
    for name, x in page_arrays(cache).items():  # in the host tier's TPU format (8-bit pages as words)
        shape, host_dtype = host_page_format(x, host_pages, packs_as_words(x, "tpu"))
        pages[name] = jax.ShapeDtypeStruct(shape, host_dtype, sharding=NamedSharding(mesh, host_spec, memory_kind="pinned_host"))
    everywhere = NamedSharding(mesh, PartitionSpec())
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=everywhere)  # noqa: E731
    factors = cache.key_factors  # (the cache's own abstract factors: the host tier records a copy of them)
    host = HostArena(pages=pages, held=i32(host_pages), host_id=i32(), sharding=cache.sharding, arena_id=i32(),
                     key_factors=factors, layout=layout)
    rows = {
        "swap_out_rows": (i32(ROWS), i32(ROWS, layout.max_pages_per_seq)),  # slots, host pages
        "swap_in_rows": (i32(ROWS, layout.max_pages_per_seq), i32(ROWS), i32(ROWS)),  # host pages, tokens, dst
        "offload_page_rows": (i32(ROWS), i32(ROWS)),  # device pages, host pages
    }[op]
    with tpu_compile.tpu_lowering(target):
        compiled = getattr(steps, op).trace(cache, host, *rows).lower().compile()
    return compiled, cache, host


def arena_bytes(cache) -> int:
    """Bytes of one of the arena's k / v arrays, per device."""
    local = cache.k.sharding.shard_shape(cache.k.shape)
    return int(np.prod(local)) * jnp.dtype(cache.k.dtype).itemsize


def main(argv=None) -> None:
    from pallas_kernels.offline import tpu as tpu_compile

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args(argv)
    print(f"host tier ops, TPU v5e, Llama-3-8B KV geometry, {args.layers} layers, {ROWS} rows moved")
    print(f"{'op':18s} {'arena':9s} {'GB accessed':>11s} {'temp MiB':>9s}  copies of >= 1/4 k-arena-sized arrays")
    for dtype in ("bfloat16", "int8"):
        for op in HOST_OPS:
            compiled, cache, _ = compile_host_op(op, dtype, args.layers)
            facts = tpu_compile.module_facts(compiled, big=arena_bytes(cache) // 4)
            copies = ", ".join(shape for _, shape, _ in facts.big_copies) or "none"
            print(f"{op:18s} {dtype:9s} {facts.bytes_accessed / 1e9:11.3f} {facts.temp_bytes / 2**20:9.1f}  {copies}")


if __name__ == "__main__":
    main()
