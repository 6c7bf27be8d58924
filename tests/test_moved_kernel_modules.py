"""Issue 38 moved modules into subpackages (`pallas_kernels/gpu|tpu|offline/`, `benchmarks/studies/`);
every old dotted path must still import, as the very same module object, lazily (importing the
package pulls in none of the moved tooling), and `python -m <old path>` must still run."""
from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys

import pytest

import benchmarks
import pallas_kernels

ROOT = pathlib.Path(__file__).resolve().parent.parent

PALLAS = {
    "append": "gpu.append", "paged_attention": "gpu.attention", "mosaic_decode": "gpu.mosaic_decode",
    "_tiles": "gpu._tiles", "tpu_append": "tpu.append", "tpu_attention": "tpu.attention", "tpu_common": "tpu.common",
    "tpu_copy_pages": "tpu.copy_pages", "sm90": "offline.sm90", "sm90_compat": "offline.sm90_compat",
    "sm90_mosaic": "offline.sm90_mosaic", "sm90_variants": "offline.sm90_variants", "tpu_compile": "offline.tpu",
    "tpu_variants": "offline.tpu_variants",
}
STUDIES = ("append_cost", "code_bounds", "context_cost", "key_scales_sim", "layer_scaling", "prefix_run_ahead",
           "smooth_cost", "tpu_host_tier")  # fmt: skip
MOVED = [(f"pallas_kernels.{old}", f"pallas_kernels.{new}") for old, new in PALLAS.items()] + [
    (f"benchmarks.{name}", f"arena_jax.benchmarks.studies.{name}") for name in STUDIES] + [
    (f"arena_jax.benchmarks.{name}", f"arena_jax.benchmarks.studies.{name}") for name in STUDIES]


@pytest.mark.parametrize("old, new", MOVED, ids=[old for old, _ in MOVED])
def test_old_path_is_the_new_module(old, new):
    module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert sys.modules[old] is module
    assert module.__name__ == new and module.__spec__.name == new  # the module keeps its own identity
    package, _, leaf = old.rpartition(".")
    assert not (ROOT / package.removeprefix("arena_jax.") / f"{leaf}.py").exists()  # no flat shim file
    if old != "pallas_kernels.paged_attention":
        assert getattr(sys.modules[package], leaf) is module  # `from package import leaf`, `package.leaf`
    exec(f"import {old}", {})
    exec(f"from {package} import {leaf} as got", scope := {})
    assert scope["got"] is (module if old != "pallas_kernels.paged_attention" else pallas_kernels.paged_attention)


def test_package_names_stay():
    importlib.import_module("pallas_kernels.paged_attention")  # the module under the function's name
    assert callable(pallas_kernels.paged_attention) and pallas_kernels.paged_attention.__module__ == "pallas_kernels.gpu.attention"
    assert pallas_kernels.paged_append is importlib.import_module("pallas_kernels.append").paged_append
    with pytest.raises(AttributeError):
        pallas_kernels.no_such_module  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("benchmarks.no_such_study")
    assert benchmarks.code_bounds is importlib.import_module("benchmarks.studies.code_bounds")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_aliases_are_lazy_and_run_as_main():
    """`import pallas_kernels` imports none of the moved modules it did not import before (the
    TPU kernels, the offline tooling); an old path then imports on demand; `python -m` of an old
    path runs the moved module."""
    probe = ("import sys, pallas_kernels\n"
             "late = [m for m in sys.modules if m.startswith(('pallas_kernels.tpu', 'pallas_kernels.offline', "
             "'pallas_kernels.sm90', 'pallas_kernels.gpu.mosaic'))]\n"
             "assert not late, late\n"
             "assert pallas_kernels.tpu_common is sys.modules['pallas_kernels.tpu.common']\n"
             "print('ok')\n")  # fmt: skip
    proc = _run("-c", probe)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
    proc = _run("-m", "benchmarks.key_scales_sim", "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Which key-scale layout" in " ".join(proc.stdout.split())  # its own help, its own description
