"""Static sm_90a facts of the Mosaic GPU decode kernel (`pallas_kernels.gpu.mosaic_decode`), from
its lowering: no GPU, and no machine code.

Why no registers or spills here: Mosaic GPU compiles a kernel to machine code only when it
first runs, inside the CUDA plugin (`MosaicGpuCompile`, which initializes the CUDA driver and
aborts without one), and XLA's deviceless compile (the route `pallas_kernels.offline.sm90` uses for
the Triton kernels) keeps the kernel as an opaque `mosaic_gpu_v2` custom call. What the
lowering does give, on JAX >= 0.11 (`MOSAIC_GPU_DUMP_TO`): Mosaic's shared-memory plan
(`smem_scratch_bytes`) and the kernel's Mosaic GPU ops after layout inference: `wgmma`, TMA
loads and stores (`async_load` / `async_store`). JAX 0.10 lowers the kernel too but dumps
nothing, so there only `lowered` is known.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import re
import tempfile

import jax
import jax.numpy as jnp

from pallas_kernels.offline import sm90_compat

__all__ = ["MosaicVariant", "MosaicFacts", "MOSAIC_VARIANTS", "lower_mosaic_call"]

CUSTOM_CALL = "mosaic_gpu_v2"


@dataclasses.dataclass(frozen=True)
class MosaicVariant:
    """Decode at serving-sized shapes (as `sm90_variants`: 8 KV heads, 4096-token page tables)."""

    dtype: str = "bfloat16"
    head_dim: int = 128
    page_size: int = 16
    group: int = 4
    batch: int = 64

    @property
    def label(self) -> str:
        dt = {"bfloat16": "bf16", "float16": "fp16"}[self.dtype]
        return f"mosaic decode {dt} d{self.head_dim} p{self.page_size} g{self.group}"

    def call(self):
        """(fn, args): the kernel compiled for a GPU (not interpreted); args are ShapeDtypeStructs."""
        from pallas_kernels.gpu.mosaic_decode import mosaic_paged_decode

        sds, dtype = jax.ShapeDtypeStruct, jnp.dtype(self.dtype)
        arena = sds((2, 8, 1024, self.page_size, self.head_dim), dtype)
        rows = (sds((self.batch, 4096 // self.page_size), jnp.int32), sds((self.batch,), jnp.int32),
                sds((self.batch,), jnp.int32))
        q = sds((self.batch, 1, 8 * self.group, self.head_dim), dtype)
        return functools.partial(mosaic_paged_decode, interpret=False), (q, arena, arena, sds((), jnp.int32), *rows)


# Both dtypes, every page size it takes, head sizes 64 / 128 / 256, GQA groups 1 / 4 / 8.
MOSAIC_VARIANTS = (
    MosaicVariant(), MosaicVariant(group=8), MosaicVariant(group=1), MosaicVariant("float16", page_size=32),
    MosaicVariant(page_size=64, head_dim=64, group=8), MosaicVariant(page_size=128), MosaicVariant(head_dim=256, group=8),
)


@dataclasses.dataclass
class MosaicFacts:
    name: str
    lowered: bool
    smem: int | None = None  # bytes per CTA, Mosaic's plan (JAX >= 0.11)
    wgmma: int | None = None  # wgmma ops in the kernel (per pipeline step: q.k^T and p.v)
    tma_loads: int | None = None  # TMA copies global -> shared in the kernel's code
    tma_stores: int | None = None


@contextlib.contextmanager
def _dump_to(path: str):
    old = os.environ.get("MOSAIC_GPU_DUMP_TO")
    os.environ["MOSAIC_GPU_DUMP_TO"] = path  # read by Mosaic GPU at each lowering (JAX >= 0.11)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MOSAIC_GPU_DUMP_TO", None)
        else:
            os.environ["MOSAIC_GPU_DUMP_TO"] = old


def lower_mosaic_call(fn, args) -> MosaicFacts:
    """Lower `jax.jit(fn)(*args)` for an H100 (CUDA, abstract device) and read the facts of its
    one Mosaic GPU kernel."""
    from jax import export

    with tempfile.TemporaryDirectory(prefix="mosaic_") as dump, _dump_to(dump), sm90_compat.h100_target():
        text = export.export(jax.jit(fn), platforms=["cuda"])(*args).mlir_module()
        files = {f: open(os.path.join(dump, f)).read() for f in os.listdir(dump)}
    calls = text.count(f"stablehlo.custom_call @{CUSTOM_CALL}")
    if calls != 1:
        raise RuntimeError(f"expected one {CUSTOM_CALL} custom call in the lowered module, found {calls}")
    found = re.search(r"mosaic_paged_decode_g\d+_p\d+_d\d+", text)  # the kernel's name (in its serialized module)
    name = found.group(0) if found else "mosaic kernel"
    resources = next((t for f, t in files.items() if f.endswith("resources.txt")), None)
    after = next((t for f, t in files.items() if f.endswith("after_layout_inference.txt")), None)
    facts = MosaicFacts(name=name, lowered=True)
    if resources is not None:
        m = re.search(r"smem_scratch_bytes=(\d+)", resources)
        facts.smem = int(m.group(1)) if m else None
    if after is not None:
        ops = collections.Counter(re.findall(r"\bmosaic_gpu\.(wgmma|async_load|async_store)\b", after))
        facts.wgmma, facts.tma_loads, facts.tma_stores = ops["wgmma"], ops["async_load"], ops["async_store"]
    return facts
