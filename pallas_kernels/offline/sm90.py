"""Compile the Pallas kernels for an H100 (sm_90a) on a host without a GPU; read their static facts.

No GPU and no CUDA driver are needed, only three wheels on top of the project
(`scripts/install_sm90_tools.sh` installs them, pinned to the installed jax):

    jax-cuda12-plugin, jax-cuda12-pjrt   (== jax's version, --no-deps: the PJRT plugin, its
                                          Triton compiler and XLA's GPU compiler; no cuDNN etc.)
    nvidia-cuda-nvcc-cu12                (ptxas and libdevice)

and the CUDA plugin must load without a GPU: run with `JAX_PLATFORMS=cpu` (the plugin then
skips its CUDA-library check) or `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`.

Steps for one kernel call (`compile_call`); what differs between JAX releases is in
`pallas_kernels.offline.sm90_compat` (JAX 0.10 and 0.11 both work):
1. Lower for CUDA (`jax.export(..., platforms=["cuda"])`, an abstract H100 named as the
   target) and pull each Pallas kernel (the `__gpu$xla.gpu.triton` custom call: Triton IR
   bytecode, num_warps, num_stages, grid) out of the StableHLO.
2. Triton IR -> PTX, by one of two routes:
   - "xla" (default): XLA's whole GPU compiler, deviceless, for an H100 target description
     (`jax.experimental.topologies`); PTX and launch shared memory come from its dump. This is
     what runs on a GPU with jaxlib 0.10 and 0.11 (both emit the `__gpu$xla.gpu.triton` custom
     call that XLA compiles with its bundled Triton), so the spill checks use it.
   - "plugin" (jaxlib <= 0.10 only): the CUDA plugin's Triton handler. Same Triton, different
     LLVM/PTX options (it reports slightly different registers), about as fast. jaxlib 0.11
     removed the handler; there `tooling_problem("plugin")` says so.
3. `ptxas -arch=sm_90a -v` on the PTX: registers, spill stores/loads, stack, static shared
   memory; the PTX itself tells the tensor-core instruction (`wgmma` / `mma.sync`) and TMA use
   (`cp.async.bulk.tensor`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile

import jax

from pallas_kernels.offline import sm90_compat
from pallas_kernels.offline.sm90_compat import H100_KIND, TRITON_DEPRECATION  # noqa: F401  (re-exported)

__all__ = ["SM90", "KernelFacts", "tooling_problem", "compile_call", "lower_triton_calls", "h100_lowering", "occupancy"]

TRITON_TARGET = "__gpu$xla.gpu.triton"

# H100 (sm_90) per-SM and per-block limits, for the occupancy estimate and the smem check.
SM90 = dict(
    regs_per_sm=65536,
    reg_alloc_unit=256,  # registers are allocated per warp in units of 256
    smem_per_sm=233472,
    smem_per_block=232448,  # the opt-in maximum for one CTA (227 KiB)
    smem_reserved_per_cta=1024,
    max_warps_per_sm=64,
    max_ctas_per_sm=32,
)

# XLA's description of an H100 SXM (as in xla/tools/hlo_opt/gpu_specs/h100_sxm.txtpb).
H100_TARGET_CONFIG = """
gpu_device_info {
  threads_per_block_limit: 1024  threads_per_warp: 32  shared_memory_per_block: 49152
  shared_memory_per_core: 233472  threads_per_core_limit: 2048  core_count: 132  fpus_per_core: 128
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000  l2_cache_size: 52428800  clock_rate_ghz: 1.98
  device_memory_size: 84978434048  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }  registers_per_core_limit: 65536  registers_per_block_limit: 65536
}
platform_name: "CUDA"
device_description_str: "NVIDIA H100 80GB HBM3"
"""


@dataclasses.dataclass
class KernelFacts:
    """Static facts of one compiled kernel (sm_90a)."""

    name: str
    num_warps: int
    num_stages: int
    grid: tuple
    regs: int = 0  # per thread
    spill_stores: int = 0  # bytes
    spill_loads: int = 0  # bytes
    stack: int = 0  # bytes per thread
    smem: int = 0  # bytes per CTA: Triton's dynamic shared memory + ptxas static
    tensor_core: str = "none"  # "wgmma" | "mma" | "none" (float32 IEEE dots use FMA)
    mma_shapes: tuple = ()  # e.g. ("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",)
    tma: bool = False  # cp.async.bulk.tensor in the PTX
    cp_async: int = 0  # static count of cp.async (Ampere-style async copies)

    @property
    def ctas_per_sm(self) -> int:
        return occupancy(self.regs, self.smem, self.num_warps)[0]

    @property
    def limiter(self) -> str:
        return occupancy(self.regs, self.smem, self.num_warps)[1]

    @property
    def smem_ok(self) -> bool:
        return self.smem <= SM90["smem_per_block"]


def occupancy(regs: int, smem: int, num_warps: int) -> tuple[int, str]:
    """Resident CTAs per SM on sm_90 (an estimate from registers, shared memory and warps) and
    the resource that limits it."""
    per_warp = -(-max(regs, 1) * 32 // SM90["reg_alloc_unit"]) * SM90["reg_alloc_unit"]
    limits = {
        "regs": (SM90["regs_per_sm"] // per_warp) // num_warps,
        "smem": SM90["smem_per_sm"] // (smem + SM90["smem_reserved_per_cta"]) if smem else SM90["max_ctas_per_sm"],
        "warps": SM90["max_warps_per_sm"] // num_warps,
        "ctas": SM90["max_ctas_per_sm"],
    }
    limiter = min(limits, key=limits.get)
    return limits[limiter], limiter


# ---- tooling -------------------------------------------------------------------------------------


def find_ptxas() -> str | None:
    """ptxas from the nvidia-cuda-nvcc-cu12 wheel, else from PATH."""
    try:
        import nvidia.cuda_nvcc as nvcc  # pip: nvidia-cuda-nvcc-cu12

        for root in list(nvcc.__path__):
            path = os.path.join(root, "bin", "ptxas")
            if os.path.exists(path):
                return path
    except ImportError:
        pass
    return shutil.which("ptxas")


def tooling_problem(via: str = "xla") -> str | None:
    """Why the sm_90a compile cannot run here (with the fix), or None when it can."""
    version = jax.__version__
    install = "bash scripts/install_sm90_tools.sh"
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return f"jax-cuda12-plugin=={version} is not installed ({install})"
    problem = sm90_compat.cuda_topology_problem(H100_TARGET_CONFIG)
    if problem is not None:
        return ("the CUDA plugin is installed but XLA's deviceless GPU compiler is unavailable "
                f"({problem}); without a GPU the plugin loads only with JAX_PLATFORMS=cpu or "
                f"JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 set before jax starts, and its version must be "
                f"jax's {version} ({install})")
    if find_ptxas() is None:
        return f"ptxas not found: pip install nvidia-cuda-nvcc-cu12 ({install})"
    if via == "plugin" and sm90_compat.triton_handler() is None:
        return (f"via='plugin' needs the CUDA plugin's Triton compilation handler, which jaxlib "
                f"{jax.__version__} does not have (removed in jaxlib 0.11); use via='xla'")
    return None


def h100_lowering():
    """Lower for an H100 on a host without a GPU (`sm90_compat.h100_target`; a context manager)."""
    return sm90_compat.h100_target()


@dataclasses.dataclass
class _TritonCall:
    name: str
    ir: bytes
    num_warps: int
    num_stages: int
    grid: tuple


def lower_triton_calls(fn, args) -> list[_TritonCall]:
    """Export `fn(*args)` (ShapeDtypeStructs) for CUDA; every Pallas kernel in it."""
    from jax import export
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir

    checks = [export.DisabledSafetyCheck.custom_call(TRITON_TARGET)]
    with h100_lowering():
        exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args)
    calls = []
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(exported.mlir_module())

        def visit(op):
            for region in op.regions:
                for block in region.blocks:
                    for child in block.operations:
                        child = child.operation
                        if (child.name == "stablehlo.custom_call"
                                and ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_TARGET):
                            cfg = ir.DictAttr(child.attributes["mhlo.backend_config"])
                            i32 = lambda key: ir.IntegerAttr(cfg[key]).value  # noqa: E731
                            calls.append(_TritonCall(
                                name=ir.StringAttr(cfg["name"]).value,
                                ir=ir.StringAttr(cfg["ir"]).value_bytes,
                                num_warps=i32("num_warps"),
                                num_stages=i32("num_stages"),
                                grid=(i32("grid_x"), i32("grid_y"), i32("grid_z")),
                            ))
                        visit(child)

        visit(module.operation)
    if not calls:
        raise RuntimeError(f"no {TRITON_TARGET} custom call in the lowered module")
    return calls


# XLA's default backend optimization level, whatever XLA_FLAGS says: the facts are those of the
# PTX a GPU user's XLA emits. (The test suite compiles for the CPU at level 0, tests/conftest.py;
# at level 0 the kernels' PTX is unoptimized and, through ptxas, spills: 17 variants did.)
DEFAULT_OPTIMIZATION = {"xla_backend_optimization_level": 3}


def _xla_ptx(fn, args, names, workdir) -> dict:
    """Deviceless XLA compile for an H100: {kernel name: (ptx, dynamic smem bytes)}."""
    h100 = jax.sharding.SingleDeviceSharding(sm90_compat.cuda_topology(H100_TARGET_CONFIG).devices[0])
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=h100) for a in args]
    dump = tempfile.mkdtemp(prefix="xla_", dir=workdir)
    with h100_lowering():
        jax.jit(fn).trace(*placed).lower().compile({"xla_dump_to": dump, **sm90_compat.PTX_DUMP_OPTIONS,
                                                    **DEFAULT_OPTIMIZATION})
    files = sorted(os.listdir(dump))
    ptxs = [open(os.path.join(dump, f)).read() for f in files if f.endswith(".ptx")]
    thunks = "".join(open(os.path.join(dump, f)).read() for f in files if f.endswith("thunk_sequence.txt"))
    found = {}
    for name in names:
        ptx = next((p for p in ptxs if f".entry {name}(" in p), None)
        if ptx is None:
            raise RuntimeError(f"XLA's PTX (in {dump}) has no entry {name}")
        smem = re.search(rf"\b{re.escape(name)} grid: .*?shared_memory: (\d+) bytes", thunks)
        found[name] = (ptx, int(smem.group(1)) if smem else 0)
    return found


def _plugin_ptx(call: _TritonCall) -> tuple[str, int]:
    compile_triton = sm90_compat.triton_handler()
    if compile_triton is None:
        raise RuntimeError(tooling_problem("plugin"))
    result = compile_triton("cuda", call.ir, "9.0", num_warps=call.num_warps, num_ctas=1, num_stages=call.num_stages)
    return result.asm, result.smem_bytes


def _ptxas(ptx: str, name: str, workdir: str) -> dict:
    """`ptxas -arch=sm_90a -v` on the PTX; numbers of entry `name`."""
    ptx_path, cubin = os.path.join(workdir, name + ".ptx"), os.path.join(workdir, name + ".cubin")
    with open(ptx_path, "w") as f:
        f.write(ptx)
    proc = subprocess.run([find_ptxas(), "-arch=sm_90a", "-v", ptx_path, "-o", cubin], capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        raise RuntimeError(f"ptxas failed (rc={proc.returncode}):\n{log.strip()}")
    part = next((p for p in log.split("Compiling entry function")[1:] if p.startswith(f" '{name}'")), log)
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, part)) else 0  # noqa: E731
    return dict(regs=num(r"Used (\d+) registers"), spill_stores=num(r"(\d+) bytes spill stores"),
                spill_loads=num(r"(\d+) bytes spill loads"), stack=num(r"(\d+) bytes stack frame"),
                static_smem=num(r"(\d+) bytes smem"))


def _entry(ptx: str, name: str) -> str:
    start = ptx.find(f".entry {name}(")
    end = ptx.find(".entry ", start + 1) if start >= 0 else -1
    return ptx[max(start, 0): end if end > 0 else None]


def _opcodes(ptx: str):
    """PTX opcodes, one per statement; Triton's inline asm puts several on a line."""
    for stmt in re.split(r"[;\n]", ptx):
        stmt = stmt.strip().lstrip("{").strip()
        if stmt.startswith("@"):  # predicated: "@%p1 ld.global..."
            stmt = stmt.split(None, 1)[1] if " " in stmt else ""
        if stmt:
            yield stmt.split(None, 1)[0]


def compile_call(fn, args, *, via: str = "xla", workdir: str | None = None) -> list[KernelFacts]:
    """Every Pallas kernel of `jax.jit(fn)(*args)` compiled for sm_90a, with its static facts."""
    if via not in ("xla", "plugin"):
        raise ValueError(f"via={via!r}; expected 'xla' or 'plugin'")
    if via == "plugin" and sm90_compat.triton_handler() is None:
        raise ValueError(tooling_problem("plugin"))
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="sm90_"))
        calls = lower_triton_calls(fn, args)
        xla = _xla_ptx(fn, args, [c.name for c in calls], workdir) if via == "xla" else {}
        facts = []
        for call in calls:
            ptx, smem = xla[call.name] if via == "xla" else _plugin_ptx(call)
            info = _ptxas(ptx, call.name, workdir)
            body = _entry(ptx, call.name)
            ops = list(_opcodes(body))
            shapes = tuple(sorted(set(re.findall(r"\b((?:wgmma\.mma_async|mma\.sync)[\w.]*)", body))))
            kind = ("wgmma" if any(o.startswith("wgmma.mma_async") for o in ops)
                    else "mma" if any(o.startswith("mma.") for o in ops) else "none")
            facts.append(KernelFacts(
                name=call.name, num_warps=call.num_warps, num_stages=call.num_stages, grid=call.grid,
                regs=info["regs"], spill_stores=info["spill_stores"], spill_loads=info["spill_loads"],
                stack=info["stack"], smem=smem + info["static_smem"], tensor_core=kind, mma_shapes=shapes,
                tma=any(o.startswith("cp.async.bulk.tensor") for o in ops),
                cp_async=sum(o.startswith(("cp.async.ca.", "cp.async.cg.")) for o in ops),
            ))
        return facts
