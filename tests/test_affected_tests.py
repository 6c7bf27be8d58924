"""scripts/affected_tests.py (the fast loop's selection, scripts/test_changed.sh) on synthetic
repositories: changed test files, transitive importers through packages moved into
subpackages, child processes started on a file or module, the run-wide files, non-Python files,
and the budget."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("affected_tests", ROOT / "scripts" / "affected_tests.py")
affected_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(affected_tests)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


REPO = {
    "pkg/__init__.py": "from pkg.api import thing\n",
    "pkg/api.py": "from .core.ops import op\nthing = op\n",
    "pkg/core/__init__.py": "",
    "pkg/core/ops.py": "def op(): return 1\n",
    "pkg/old_ops.py": "from pkg.core.ops import *  # an alias left where a module moved from\n",
    "other/__init__.py": "",
    "other/cli.py": "def main(): pass\n",
    "other/lonely.py": "x = 1\n",
    "tests/conftest.py": "",
    "tests/helper.py": "import pkg.api\n",
    "tests/test_a.py": "import pkg\n",
    "tests/test_b.py": "from helper import *\n",
    "tests/test_c.py": "def test():\n    from pkg.old_ops import op\n",
    "tests/test_d.py": "import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'other.cli'])\n",
    "tests/test_e.py": "import subprocess\nsubprocess.run(['python', 'tests/child.py'])\n",
    "tests/child.py": "import other.lonely\n",
    "tests/test_f.py": "DOC = open('README.md').read()\n",
    "README.md": "hello\n",
    "pyproject.toml": "",
}


@pytest.fixture
def repo(tmp_path):
    return _tree(tmp_path, REPO)


def test_a_module_in_a_subpackage_selects_its_importers_nearest_first(repo):
    got = affected_tests.affected(["pkg/core/ops.py"], repo)
    # test_c imports the alias module (2 steps); test_a the package (pkg -> pkg.api -> pkg.core.ops: 3);
    # test_b through its helper (helper -> pkg.api -> ...: 3)
    assert {t: d for t, (d, _) in got.items()} == {"tests/test_c.py": 2, "tests/test_a.py": 3, "tests/test_b.py": 3}
    assert "imports pkg.old_ops" in got["tests/test_c.py"][1]


def test_a_changed_test_file_and_helper(repo):
    got = affected_tests.affected(["tests/test_b.py"], repo)
    assert got == {"tests/test_b.py": (0, "tests/test_b.py changed")}
    assert set(affected_tests.affected(["tests/helper.py"], repo)) == {"tests/test_b.py"}


def test_children_started_on_a_module_or_file(repo):
    assert set(affected_tests.affected(["other/cli.py"], repo)) == {"tests/test_d.py"}
    assert set(affected_tests.affected(["other/lonely.py"], repo)) == {"tests/test_e.py"}  # via tests/child.py


def test_run_wide_and_non_python_files(repo):
    every = {f"tests/test_{c}.py" for c in "abcdef"}
    assert set(affected_tests.affected(["pyproject.toml"], repo)) == every
    assert set(affected_tests.affected(["tests/conftest.py"], repo)) == every
    assert set(affected_tests.affected(["README.md"], repo)) == {"tests/test_f.py"}
    assert affected_tests.affected(["docs/unrelated.md"], repo) == {}


def test_the_budget_runs_what_fits_nearest_first():
    order = ["a", "b", "c", "d"]
    cost = {"a": 100, "b": 250, "c": 50}  # d: no record, the default cost
    assert affected_tests.plan(order, cost, 200) == [("a", True), ("b", False), ("c", True), ("d", True)]
    assert affected_tests.plan(order, cost, 0) == [(t, True) for t in order]
    assert affected_tests.plan(["b"], cost, 10) == [("b", True)]  # the nearest file always runs


def test_on_this_repository_and_from_git(tmp_path):
    """The real tree: a kernel module selects its kernel tests; the CLI works from a git change."""
    got = affected_tests.affected(["pallas_kernels/offline/sm90_variants.py"])
    assert {"tests/test_compile_sm90.py", "tests/test_compile_grid.py"} <= set(got)
    assert got["tests/test_compile_sm90.py"][0] == 1
    repo = _tree(tmp_path, REPO)
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True).stdout  # noqa: E731
    git("init", "-q")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "x", "--allow-empty")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "y")
    (repo / "other" / "cli.py").write_text("def main(): return 2\n")
    assert affected_tests.changed_files("HEAD", repo) == ["other/cli.py"]
    (repo / "tests" / "test_g.py").write_text("import other.cli\n")  # untracked files count too
    assert affected_tests.changed_files("HEAD", repo) == ["other/cli.py", "tests/test_g.py"]
    assert set(affected_tests.affected(affected_tests.changed_files("HEAD", repo), repo)) == {
        "tests/test_d.py", "tests/test_g.py"}
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "affected_tests.py"), "--files", "tests/test_ci_lines.py",
                          "--plan", "--budget", "100"], capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert out.splitlines()[0] == "run tests/test_ci_lines.py"  # the changed file first (this one names it too)
