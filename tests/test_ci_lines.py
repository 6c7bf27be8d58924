"""CI runs exactly the README's test command, on two JAX lines; the HF parity tests skip only
where their reference stack is left out on purpose."""
from __future__ import annotations

import json
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


def test_the_lines_deal_the_tests_by_cost_without_losing_one():
    """ARENA_GRID_SHARE i/n parses strictly (bad values refused); the script sets one share per
    line; `deal` puts each test on exactly one line, whatever the order it sees them in, and
    balances the lines' work (head starts included) to within the costliest test."""
    import random

    import pytest
    from conftest import DURATIONS, deal, grid_share

    assert grid_share(None) is None and grid_share("") is None and grid_share("1/2") == (1, 2)
    for bad in ("2/2", "-1/2", "x", "1"):
        with pytest.raises(ValueError, match="ARENA_GRID_SHARE"):
            grid_share(bad)
    rng = random.Random(0)
    tests = [f"t{k}" for k in range(300)]
    seconds = {t: rng.expovariate(0.5) for t in tests[:250]}  # 50 without a recorded cost
    head = {"0/2": 40.0, "1/2": 5.0}
    owner = deal(tests, 2, seconds, head)
    assert sorted(owner) == sorted(tests) and set(owner.values()) == {0, 1}
    assert deal(rng.sample(tests, len(tests)), 2, seconds, head) == owner  # order-free: every line agrees
    median = sorted(seconds.values())[125]
    load = [head[f"{i}/2"] + sum(seconds.get(t, median) for t in tests if owner[t] == i) for i in range(2)]
    assert abs(load[0] - load[1]) <= max(seconds.values()), load
    assert deal(tests, 3, {}, {}) and set(deal(tests, 3, {}, {}).values()) == {0, 1, 2}
    script = (ROOT / "scripts" / "test_all.sh").read_text()
    assert "ARENA_GRID_SHARE=$i/$n" in script and "ARENA_DURATIONS_OUT=" in script
    recorded = json.loads(DURATIONS.read_text())  # the committed costs: what scripts/ci_durations.py writes
    assert set(recorded["head_start"]) == {"0/2", "1/2"} and len(recorded["seconds"]) > 100


def test_a_test_left_to_a_line_that_ran_it_on_none_fails_the_run(tmp_path):
    """`scripts/ci_durations.py --check` (test_all.sh runs it after both lines): a test one line
    left to the other that no line ran is reported and exits 1; a clean deal exits 0."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ci_durations", ROOT / "scripts" / "ci_durations.py")
    ci_durations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ci_durations)
    clean = {"py311": {"seconds": {"a": 1.0, "both": 0.1}, "left_to_other_lines": ["b"]},
             "py313": {"seconds": {"b": 2.0, "both": 0.1}, "left_to_other_lines": ["a"]}}
    assert ci_durations.lost(clean) == []
    broken = {"py311": {"seconds": {"a": 1.0}, "left_to_other_lines": ["b", "c"]},
              "py313": {"seconds": {"b": 2.0}, "left_to_other_lines": ["a"]}}
    assert ci_durations.lost(broken) == ["c"]
    for line, record in broken.items():
        (tmp_path / f"{line}.durations.json").write_text(json.dumps(record))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "ci_durations.py"), "--check", str(tmp_path)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "run on none: c" in run.stdout and "1 LOST" in run.stdout
    assert 'python3 scripts/ci_durations.py --check "$LOGS" || status=1' in (ROOT / "scripts" / "test_all.sh").read_text()


def test_cheap_tests_run_on_both_lines_and_keep_their_record(tmp_path):
    """Tests recorded under ARENA_BOTH_LINES_BELOW seconds run on every line (test_all.sh sets
    0.5 s); unrecorded ones are dealt. scripts/ci_durations.py keeps the costlier line's seconds
    of the tests that ran on both, so they stay cheap in the next deal, and counts them in each
    line's head start."""
    import importlib.util

    from conftest import DURATIONS, cheap

    seconds = {"a": 0.4, "b": 3.0}
    assert cheap("a", seconds, 1.0) and not cheap("b", seconds, 1.0) and not cheap("new", seconds, 1.0)
    assert not cheap("a", seconds, 0)  # unset: everything dealt
    recorded = json.loads(DURATIONS.read_text())["seconds"]
    assert sum(cheap(t, recorded, 0.5) for t in recorded) > len(recorded) / 2  # most tests, on both lines
    assert "ARENA_BOTH_LINES_BELOW=${ARENA_BOTH_LINES_BELOW:-0.5}" in (ROOT / "scripts" / "test_all.sh").read_text()

    spec = importlib.util.spec_from_file_location("ci_durations", ROOT / "scripts" / "ci_durations.py")
    ci_durations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ci_durations)
    runs = {"py311": {"seconds": {"a": 1.0, "both": 0.2}, "left_to_other_lines": ["b"]},
            "py313": {"seconds": {"b": 2.0, "both": 0.3}, "left_to_other_lines": ["a"]}}
    for line, record in runs.items():
        (tmp_path / f"{line}.durations.json").write_text(json.dumps(record))
        (tmp_path / f"{line}.setup.log").write_text("setup rc=0 in 10 s\n")
    out = ci_durations.main(tmp_path)
    assert out["seconds"] == {"a": 1.0, "b": 2.0, "both": 0.3}
    assert out["head_start"] == {"0/2": 10.2, "1/2": 10.3}

