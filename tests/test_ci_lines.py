"""CI runs exactly the README's test command, on two JAX lines; the HF parity tests skip only
where their reference stack is left out on purpose."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import hf_reference

ROOT = Path(__file__).resolve().parent.parent


def _commands(text: str) -> list[str]:
    """Shell command lines: no comments, no blank lines."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Run the tests \(this is exactly what `\.ci/run` does\):\s*```bash\n(.*?)```", readme, re.S)
    assert block, "README: the test command block after 'Run the tests (this is exactly what `.ci/run` does):'"
    (command,) = _commands(block.group(1))
    ci = _commands((ROOT / ".ci" / "run").read_text())
    assert ci[-1] == command, f".ci/run ends with {ci[-1]!r}, README says {command!r}"
    assert ci[:-1] == ["set -euo pipefail", 'cd "$(dirname "$0")/.."'], ci  # nothing else runs


def test_test_all_runs_both_lines_and_is_valid_bash():
    script = ROOT / "scripts" / "test_all.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert 'LINES=${ARENA_LINES:-"py311 py313"}' in text
    assert 'py311) python=$(interpreter 3.11) extra="test"' in text
    assert 'py313) python=$(interpreter 3.13) extra="test-jax"' in text
    assert "[[ $line == py313 ]] && env=(ARENA_HF_REFERENCE=absent)" in text  # only the line without torch


def test_hf_reference_gate():
    gate = hf_reference.gate
    for absent in (False, True):
        for ci in (False, True):
            assert gate(None, deliberately_absent=absent, in_ci=ci) is None  # installed: always run
    kind, why = gate("No module named 'torch'", deliberately_absent=True, in_ci=True)
    assert kind == "skip" and "deliberately not installed" in why and "3.11 line runs" in why
    kind, why = gate("No module named 'torch'", deliberately_absent=False, in_ci=True)
    assert kind == "fail" and "No module named 'torch'" in why
    kind, why = gate("No module named 'torch'", deliberately_absent=False, in_ci=False)
    assert kind == "skip" and ".[test]" in why


def test_the_suite_compiles_at_backend_optimization_level_0_unless_told_otherwise():
    """tests/conftest.py sets XLA's backend optimization level to 0 for the whole suite (child
    processes inherit it) unless XLA_FLAGS names a level already; the script deals no test files:
    each line runs every one (the compile grids' covering subsets: tests/test_compile_grid.py)."""
    import os

    from conftest import LEVEL_FROM_USER, TEST_XLA_FLAGS

    assert (TEST_XLA_FLAGS in os.environ["XLA_FLAGS"]) != LEVEL_FROM_USER
    script = (ROOT / "scripts" / "test_all.sh").read_text()
    assert "ARENA_GRID_SHARE" not in script and "-m pytest -p no:cacheprovider -rfEs \"$@\"" in script


def test_optimization_level_0_compiles_the_same_optimized_hlo(tmp_path):
    """Why the suite may compile at level 0 (tests/conftest.py): the level changes LLVM's code
    generation only. The tiny model's decode step (reserve, append, attend, sampling) compiled
    at level 0 and at XLA's default level 3 (compile options, over the process's XLA_FLAGS) has
    the same optimized HLO text, while the machine code differs (the level took effect)."""
    import jax.numpy as jnp
    from flax import nnx

    import arena_jax as aj
    from arena_jax import models
    from arena_jax.models.steps import bound_steps

    net = models.init_random(models.LlamaConfig.tiny(), seed=0)
    steps = bound_steps(*nnx.split(net))
    cache = aj.create(models.default_layout(net, 2, 32, page_size=8, dtype="float32"))
    slots = jnp.arange(2, dtype=jnp.int32)
    lowered = steps.decode_step.lower(steps.leaves, cache, jnp.zeros(2, jnp.int32), slots, slots, jnp.uint32(0),
                                      models.GREEDY.rows(2))  # fmt: skip
    hlo, code = {}, {}
    for level in (0, 3):
        dump = tmp_path / f"level{level}"
        hlo[level] = lowered.compile({"xla_backend_optimization_level": level, "xla_dump_to": str(dump)}).as_text()
        code[level] = b"".join(f.read_bytes() for f in sorted(dump.glob("*.o")))
    assert "dynamic-update-slice" in hlo[0] or "scatter" in hlo[0]  # a real step, appends included
    assert hlo[0] == hlo[3]
    assert code[0] and code[3] and code[0] != code[3]
