"""CI runs exactly the README's test command, on two JAX lines; the HF parity tests skip only
where their reference stack is left out on purpose."""
from __future__ import annotations

import re
import subprocess
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


def test_the_lines_split_the_kernel_grids_without_losing_a_case():
    """ARENA_GRID_SHARE i/n parses strictly (bad values refused); the script sets one share per
    line; dealing by position puts each test on exactly one line."""
    import pytest
    from conftest import grid_share

    assert grid_share(None) is None and grid_share("") is None and grid_share("1/2") == (1, 2)
    for bad in ("2/2", "-1/2", "x", "1"):
        with pytest.raises(ValueError, match="ARENA_GRID_SHARE"):
            grid_share(bad)
    owners = [[i for i in range(2) if k % 2 == i] for k in range(200)]
    assert all(len(o) == 1 for o in owners) and {o[0] for o in owners} == {0, 1}
    script = (ROOT / "scripts" / "test_all.sh").read_text()
    assert "ARENA_GRID_SHARE=$i/$n" in script
