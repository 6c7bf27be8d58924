"""What differs between JAX releases in the offline sm_90a compile (`pallas_kernels.offline.sm90`), in one place.

Tested on JAX 0.10.2 and 0.11.2 (the two CI lines). `paths()` says which way this JAX goes;
`tests/test_compile_sm90.py` checks it and prints it.

- Target GPU ("abstract-h100" | "gpu"). JAX 0.11's Pallas lowering asks the current device
  which GPU it targets and, on a host without one, raises "No supported GPU devices found,
  please specify an abstract GPU device using AbstractDevice". We always name an H100 through
  the public `jax.sharding.AbstractDevice` in an `AbstractMesh` when the default backend is not
  a GPU; JAX 0.10 ignores it (same lowered module, checked on both lines).
- Deviceless compile ("topology"). `jax.experimental.topologies.get_topology_desc(platform=
  "cuda", target_config=...)` gives compile-only H100 devices: the CUDA plugin is loaded and
  XLA's GPU compiler runs without a GPU. Same public call on both.
- PTX of the kernels ("xla-dump-emitter-ptx"). jaxlib 0.10 dumped every module's PTX under
  `xla_dump_to`; jaxlib 0.11 dumps it only for emitters matching `xla_dump_emitter_re`, so we
  always pass "^ptx$" (0.10 accepts and ignores it; ".*" would also dump Triton's per-pass IR,
  20 MB and 10 s per kernel).
- The CUDA plugin's own Triton compiler, for `via="plugin"` ("jaxlib-triton-handler" | None).
  jaxlib <= 0.10 registered it in the private `jax._src.lib.triton` (`has_compilation_handler`,
  `compile`); jaxlib 0.11 removed both (its `triton` module only has `dialect`: XLA compiles
  the Triton IR). Where it is gone, `via="plugin"` is refused with that reason; the default
  `via="xla"` (what a GPU runs) works on both.
"""
from __future__ import annotations

import contextlib
import warnings

import jax

__all__ = ["H100_KIND", "PTX_DUMP_OPTIONS", "paths", "h100_target", "cuda_topology", "cuda_topology_problem",
           "triton_handler"]

H100_KIND = "NVIDIA H100 80GB HBM3"
H100_CORES = 132
# Compile options that make XLA write each module's PTX under xla_dump_to, on jaxlib 0.10 and 0.11.
PTX_DUMP_OPTIONS = {"xla_dump_emitter_re": "^ptx$"}
# JAX >= 0.11 warns that the Pallas Triton lowering is deprecated; the kernels select it on
# purpose (pallas_kernels/README.md, "JAX versions"), so the warning is expected while lowering here.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def triton_handler():
    """The CUDA plugin's Triton compiler, `compile(platform, ir, arch, *, num_warps, num_ctas,
    num_stages) -> result(.asm, .smem_bytes)`, where this jaxlib has one (<= 0.10); else None."""
    from jax._src.lib import triton  # private; the only place it is touched

    has = getattr(triton, "has_compilation_handler", None)
    if has is None or not hasattr(triton, "compile"):
        return None
    jax.devices()  # plugins register their handler when initialized
    return triton.compile if has("cuda") else None


def paths() -> dict:
    """Which way this JAX goes: {"target": "gpu" | "abstract-h100", "ptx": "xla-dump-emitter-ptx",
    "plugin_route": "jaxlib-triton-handler" | None}."""
    return dict(
        target="gpu" if jax.default_backend() == "gpu" else "abstract-h100",
        ptx="xla-dump-emitter-ptx",
        plugin_route="jaxlib-triton-handler" if triton_handler() is not None else None,
    )


@contextlib.contextmanager
def h100_target():
    """Lower Pallas kernels for an H100 on a host without a GPU (no-op on a GPU host)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        if jax.default_backend() == "gpu":
            yield
            return
        device = jax.sharding.AbstractDevice(device_kind=H100_KIND, num_cores=H100_CORES, platform="cuda")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
        with jax.sharding.use_abstract_mesh(mesh):
            yield


_TOPOLOGY = {}


def cuda_topology(target_config: str):
    """Compile-only CUDA devices for `target_config` (a GpuTargetConfigProto in text form)."""
    if target_config not in _TOPOLOGY:
        from jax.experimental import topologies

        _TOPOLOGY[target_config] = topologies.get_topology_desc("", "cuda", target_config=target_config,
                                                                topology="1x1x1")
    return _TOPOLOGY[target_config]


def cuda_topology_problem(target_config: str) -> str | None:
    """Why XLA's deviceless CUDA compiler is unavailable here, or None."""
    try:
        cuda_topology(target_config)
    except Exception as e:  # noqa: BLE001 - any failure means the same thing: no deviceless compile
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None
