"""KNOWN JAX BUG, not ours: a minimal repro (no arena_jax code) and the check that we avoid it.

jaxlib 0.11.2 segfaults in XLA's CPU compile (`backend_compile_and_load`; the crash is in
Shardy's canonicalizer, `mlir::sdy::ManualComputationUnusedInputsPattern::matchAndRewrite`,
under `CpuCompiler::RunHloPasses`) on a `jax.shard_map` over 2 or more devices whose body
closes over a zero-sized constant: JAX passes the constant into the manual computation as an
operand, XLA's zero-sized-HLO elimination replaces its use, and the pattern that then drops the
unused operand crashes. jaxlib 0.10.2 compiles the same StableHLO (identical lowering) and runs
it, and so does jaxlib 0.12.0.1 (fixed there). GSPMD (`jax_use_shardy_partitioner=False`,
deprecated) does not crash.

How we met it: `aj.fork_pages` on a tensor-parallel cache
(`tests/sharded_checks.py::test_prefix_ops_on_a_tensor_parallel_cache_equal_one_device`) built
a page-map row as `full(...).at[:, :width].set(...)`; at width == max_pages that full-width
slice update is a scatter whose index vector is an empty constant (i32[0]).
Workaround (ours): shard_map bodies never create zero-sized constants; `fork_pages` pads the row
instead. `tests/sharded_checks.py` asserts that the lowered sharded ops give no manual
computation a zero-sized operand (`zero_sized_manual_operands`), on every JAX, so a new op
cannot bring the crash back. If you meet the crash elsewhere: look for a full-width slice
update (`x.at[:, :n].set(y)` with n == x.shape[1]), `jnp.asarray([])` or a `[0:0]` slice of a
numpy constant inside a sharded op.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest

# jaxlib versions seen to crash on the program below (0.10.2 and 0.12.0.1 run it).
AFFECTED = ("0.11.",)

REPRO = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
body = lambda x: x + jnp.asarray(np.zeros((0,), np.float32)).sum()  # closes over an f32[0] constant
print(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.ones(4)).sum())
"""


def zero_sized_manual_operands(stablehlo: str) -> list[str]:
    """The block arguments of every `sdy.manual_computation` (a shard_map body) in `stablehlo`
    (a lowered module's text) whose type has a zero dimension, e.g. ["%arg3: tensor<0xi32>"]."""
    found = []
    for args in re.findall(r"sdy\.manual_computation\(.*?manual_axes=\{[^}]*\} \((.*?)\) \{", stablehlo):
        found += [a.strip() for a in args.split(", %") if re.search(r"tensor<(?:\d+x)*0x", a)]
    return found


def _run_repro() -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip())
    return subprocess.run([sys.executable, "-c", REPRO], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(jax.lib.__version__.startswith(AFFECTED),
                    reason=f"JAX bug on jaxlib {jax.lib.__version__}: a shard_map closing over a zero-sized constant "
                           "segfaults XLA's CPU compile (Shardy ManualComputationUnusedInputsPattern); arena_jax "
                           "avoids the pattern (see this module's docstring)")
def test_repro_runs_where_jax_is_not_affected():
    proc = _run_repro()
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stderr[-2000:]}"
    assert proc.stdout.strip().splitlines()[-1] == "4.0"


def _lowered_on_two_devices(body) -> str:
    """StableHLO of `shard_map(body)` over an abstract 2-device mesh (this process has one device)."""
    from jax import export
    from jax.sharding import PartitionSpec as P

    mesh = jax.sharding.AbstractMesh((2,), ("x",))
    with jax.sharding.use_abstract_mesh(mesh):
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))
        return export.export(fn, platforms=["cpu"])(jax.ShapeDtypeStruct((4, 4), "float32")).mlir_module()


def test_the_detector_sees_the_pattern():
    """`zero_sized_manual_operands` finds a full-width slice update's empty index (lowering only:
    no compile, no crash) and nothing in the same body written without it."""
    import numpy as np

    ones = np.ones((4, 4), np.float32)
    found = zero_sized_manual_operands(_lowered_on_two_devices(lambda x: x.at[:, :4].set(jax.numpy.asarray(ones))))
    assert found and all(re.search(r"tensor<0xi32>", a) for a in found), found
    text = _lowered_on_two_devices(lambda x: x * 0 + jax.numpy.asarray(ones))
    assert "sdy.manual_computation" in text and zero_sized_manual_operands(text) == []
