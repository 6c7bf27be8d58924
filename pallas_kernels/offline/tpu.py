"""Compile for TPU v5e / v6e on a host without a TPU, and read what the compiled module says.

Needs `libtpu` (the `jax[tpu]` extra pinned to the installed jax; `scripts/install_tpu_tools.sh`
installs it). `jax.experimental.topologies.get_topology_desc(topology_name="v5e:2x2",
platform="tpu")` then gives TPU devices without hardware; a jitted function lowered with inputs
placed on them (ShapeDtypeStructs with a sharding: nothing is allocated) compiles with libtpu's
XLA and Mosaic compilers exactly as on a TPU host. Mosaic's checks (tile alignment of every
DMA and vector access, VMEM limits, supported dtypes) all run; nothing executes.

What a compiled module tells (`kernel_facts`, `module_facts`):
- per Mosaic kernel (`tpu_custom_call`): its name and the VMEM it uses (scoped memory the
  compiler assigned, `used_scoped_memory_configs`, memory space 1);
- for the module: generated code size, argument / output / alias / temp bytes
  (`memory_analysis()`), XLA's cost analysis (`cost_analysis()`: flops, bytes accessed; a
  Mosaic kernel contributes its `pl.CostEstimate`, which our kernels derive from their DMA
  plan), the input/output aliasing, and every `copy` XLA inserted of an array as large as (a
  fraction of) the arena, with the op it came from (a relayout or a defensive copy of the
  cache must never appear; memory-space prefetches, `copy-start`, are not counted).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re

import jax
import numpy as np

__all__ = ["TARGETS", "tooling_problem", "tpu_devices", "tpu_lowering", "compile_for_tpu", "kernel_facts",
           "module_facts", "KernelFacts", "ModuleFacts"]

# target name -> (topology prefix, device kind libtpu reports)
TARGETS = {"tpu-v5e": ("v5e", "TPU v5 lite"), "tpu-v6e": ("v6e", "TPU v6 lite")}
INSTALL = "bash scripts/install_tpu_tools.sh"
# libtpu looks these up at start-up (on a TPU VM from the metadata server); set, they silence
# its warnings. They name no real host and change nothing about the compiled code. libtpu also
# takes a host-wide lock (/tmp/libtpu_lockfile) so that one process owns the TPU chips; a
# deviceless compile owns no chip, so two processes compiling at once (two pytest runs) may share.
_LIBTPU_ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-4", "TPU_WORKER_HOSTNAMES": "localhost",
               "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def tooling_problem() -> str | None:
    """Why TPU compilation cannot run here (with the fix), or None when it can."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return f"libtpu is not installed (`pip install jax[tpu]=={jax.__version__}`, or {INSTALL})"
    try:
        tpu_devices("tpu-v5e", "2x2")
    except Exception as e:  # noqa: BLE001 - any failure to load libtpu is reported with its message
        return f"libtpu is installed but gives no TPU topology ({type(e).__name__}: {str(e)[:200]}); {INSTALL}"
    return None


@functools.cache
def tpu_devices(target: str = "tpu-v5e", shape: str = "2x2") -> tuple:
    """The devices of a `shape` slice ("2x2", "2x4") of `target`, from libtpu, without hardware."""
    if target not in TARGETS:
        raise ValueError(f"target={target!r}; expected one of {sorted(TARGETS)}")
    for key, value in _LIBTPU_ENV.items():
        os.environ.setdefault(key, value)
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(topology_name=f"{TARGETS[target][0]}:{shape}", platform="tpu")
    return tuple(topo.devices)


@contextlib.contextmanager
def tpu_lowering(target: str = "tpu-v5e"):
    """Pallas TPU lowering asks the default device for the chip (tile sizes, generation): name one."""
    with jax.default_device(tpu_devices(target)[0]):
        yield


def mesh_of(target: str, shape: str, axis_names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A mesh over a `shape` slice, e.g. ("2x4", ("data", "model")) -> 2 x 4 devices."""
    devices = tpu_devices(target, shape)
    dims = tuple(int(d) for d in shape.split("x"))
    if len(axis_names) != len(dims):
        raise ValueError(f"mesh {shape} has {len(dims)} axes, got names {axis_names}")
    return jax.sharding.Mesh(np.asarray(devices).reshape(dims), axis_names)


def placed(tree, sharding):
    """ShapeDtypeStructs (or arrays) of `tree` placed with `sharding` (one, or a matching tree)."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, sharding)


def compile_for_tpu(fn, args, *, target: str = "tpu-v5e", donate_argnums=(), static_argnums=()):
    """`jax.jit(fn).lower(*args).compile()` for `target`. `args` are ShapeDtypeStructs: placed
    ones (with a sharding on TPU devices) are used as they are; unplaced ones go on one device."""
    one = jax.sharding.SingleDeviceSharding(tpu_devices(target)[0])
    leaves = [a if getattr(a, "sharding", None) is not None or not hasattr(a, "shape")
              else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one) for a in args]
    with tpu_lowering(target):
        return jax.jit(fn, donate_argnums=donate_argnums, static_argnums=static_argnums).trace(*leaves).lower().compile()


@dataclasses.dataclass
class KernelFacts:
    name: str
    vmem_bytes: int  # scoped VMEM the compiler assigned to the kernel (memory space 1)
    estimate: dict  # the kernel's CostEstimate as XLA received it ({} when none)


@dataclasses.dataclass
class ModuleFacts:
    code_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    flops: float
    bytes_accessed: float
    aliased_params: tuple  # entry parameter numbers aliased to an output
    big_copies: tuple  # (op, shape, op_name) of copies of arrays of at least `big` bytes
    kernels: tuple
    param_shapes: dict  # entry parameter number -> "dtype[dims]" (per device in an SPMD module)

    def params_of_shape(self, shape: str) -> tuple:
        return tuple(sorted(n for n, s in self.param_shapes.items() if s == shape))

    def weight_copies(self, cache_params=()) -> tuple:
        """The big copies of model weights: named after a model parameter (`state[...]`), or of
        the shape of an entry parameter other than `cache_params` (a stacked weight sliced in a
        layer scan loses its op name). The rest of `big_copies` are copies of the cache."""
        cache = set(cache_params)
        other = {s for n, s in self.param_shapes.items() if n not in cache}
        return tuple(c for c in self.big_copies if c[2].startswith("state[") or c[1] in other)

    def cache_copies(self, cache_params=()) -> tuple:
        weights = set(self.weight_copies(cache_params))
        return tuple(c for c in self.big_copies if c not in weights)


_HLO_NAMES = {"bool": "pred", "int8": "s8", "uint8": "u8", "float8_e4m3fn": "f8e4m3fn", "float8_e5m2": "f8e5m2",
              "int16": "s16", "uint16": "u16", "bfloat16": "bf16", "float16": "f16", "int32": "s32", "uint32": "u32",
              "float32": "f32", "int64": "s64", "uint64": "u64", "float64": "f64"}


def hlo_shape(dtype, shape) -> str:
    """How HLO text writes an array type: hlo_shape("int8", (2, 3)) == "s8[2,3]"."""
    import numpy as np

    return f"{_HLO_NAMES[np.dtype(dtype).name]}[{','.join(map(str, shape))}]"


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def _shape_bytes(dtype: str, dims: str) -> int:
    n = 1
    for d in dims.split(","):
        if d.strip():
            n *= int(d)
    return n * _DTYPE_BYTES.get(dtype, 4)


def kernel_facts(hlo_text: str) -> list[KernelFacts]:
    """Every Mosaic kernel (`tpu_custom_call`) of a compiled module's text."""
    facts = []
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        name = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line).group(1)
        vmem = sum(int(m.group(2)) for m in re.finditer(
            r'\{"memory_space":"(\d+)","offset":"\d+","size":"(\d+)"\}', line.split('"used_scoped_memory_configs"')[-1])
            if m.group(1) == "1")
        est = re.search(r'"cost_estimate":(\{[^}]*\})', line)
        facts.append(KernelFacts(name=name, vmem_bytes=vmem, estimate=json.loads(est.group(1)) if est else {}))
    return facts


def module_facts(compiled, *, big: int) -> ModuleFacts:
    """Facts of a compiled TPU executable; `big`: the byte size from which a copy counts
    (the arena's size, or a shard of it)."""
    text = compiled.as_text()
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    header = text[: text.find("\n")]
    aliased = tuple(sorted({int(p) for p in re.findall(r"\}:\s*\((\d+),", header)}))
    copies = []
    for line in text.splitlines():
        m = re.search(r"=\s*(\w+)\[([\d,]*)\]\{[^}]*\}\s+(copy)\(", line)
        if m and _shape_bytes(m.group(1), m.group(2)) >= big:
            name = re.search(r'op_name="([^"]*)"', line)
            copies.append((m.group(3), f"{m.group(1)}[{m.group(2)}]", name.group(1) if name else ""))
    entry = text[text.find("\nENTRY"):]
    params = {int(m.group(3)): f"{m.group(1)}[{m.group(2)}]"
              for m in re.finditer(r"=\s*(\w+)\[([\d,]*)\]\{[^}]*\}\s+parameter\((\d+)\)", entry)}
    return ModuleFacts(
        code_bytes=int(mem.generated_code_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes),
        output_bytes=int(mem.output_size_in_bytes), alias_bytes=int(mem.alias_size_in_bytes),
        temp_bytes=int(mem.temp_size_in_bytes), flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)), aliased_params=aliased, big_copies=tuple(copies),
        kernels=tuple(kernel_facts(text)), param_shapes=params)
