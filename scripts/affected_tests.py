"""Which test files a change touches: changed test files, and test files that import a changed
module (transitively), from an import graph read with `ast` (no module is imported).

    python scripts/affected_tests.py [BASE]         the test files, nearest first, one a line
    python scripts/affected_tests.py --explain ...  with why each is selected

`scripts/test_changed.sh` runs them (docs/testing.md, "The fast loop"). The graph is rebuilt
from the tree on every call, so it follows modules that move into subpackages: a module is
named by its path (`arena_jax/host/tier.py` -> `arena_jax.host.tier`; `tests/` and `scripts/`
files by their own names, as the tests import their helpers), and an import names the modules
it executes: `import a.b.c` and `from a.b import c` run `a`, `a.b` and `a.b.c` (the packages'
`__init__`s). Imports inside functions count too. A test that starts a child on a file or
module (`"sharded_checks.py"`, `"-m", "benchmarks"`) depends on it as on an import.

A change to what every test runs under (`tests/conftest.py`, `pyproject.toml`) selects every
test file; a changed non-Python file selects the test files that name it (e.g. `README.md`,
`test_all.sh`).
"""
from __future__ import annotations

import argparse
import ast
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_DIRS = {".git", "build", "dist", "node_modules", "__pycache__"}
# Folders whose files are imported by their bare names (on sys.path when they run).
FLAT_DIRS = ("tests", "scripts")
# Folders installed under another name (pyproject's package-dir): models/x.py is arena_jax.models.x.
INSTALLED_AS = {"models": "arena_jax.models", "server": "arena_jax.server", "benchmarks": "arena_jax.benchmarks"}
# Changes that every test runs under.
EVERYTHING = ("tests/conftest.py", "pyproject.toml")


def python_files(root: Path = ROOT) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".venv")
                             and not d.startswith("."))
        out += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return out


def module_name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root)
    if rel.parts[0] in FLAT_DIRS and len(rel.parts) == 2:
        return rel.stem
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return installed_name(".".join(parts))


def installed_name(module: str) -> str:
    """The name a module is imported by: `models.llama` (a folder's old top-level name, still
    importable in a checkout) is `arena_jax.models.llama`."""
    top, dot, rest = module.partition(".")
    return INSTALLED_AS.get(top, top) + dot + rest


def is_test_file(rel: str) -> bool:
    p = Path(rel)
    return p.parts[0] == "tests" and p.name.startswith("test_") and p.suffix == ".py"


def _resolve_relative(module: str, level: int, name: str | None, is_package: bool) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, name] if name else base)


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The known modules that `path` executes by importing (ancestors' packages included), or
    names as a child process's file / module."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    except (SyntaxError, UnicodeDecodeError):
        return set()
    names: set[str] = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_relative(module, node.level, node.module, is_package) if node.level else node.module
            if base:
                names.add(base)
                names.update(f"{base}.{a.name}" for a in node.names if a.name != "*")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
        elif isinstance(node, (ast.List, ast.Tuple)):  # [sys.executable, "-m", "benchmarks", ...]
            elts = node.elts
            for a, b in zip(elts, elts[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant) and isinstance(b.value, str):
                    names.add(b.value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".py"):
            names.add(Path(node.value).stem)  # a child started on a file: "sharded_checks.py"
    out = set()
    for name in names:  # a.b.c executes a, a.b and a.b.c
        parts = installed_name(name).split(".")
        out.update(m for m in (".".join(parts[: i + 1]) for i in range(len(parts))) if m in known)
    out.discard(module)
    return out


def graph(root: Path = ROOT) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(module -> repo-relative path, module -> modules it imports)."""
    files = python_files(root)
    paths: dict[str, str] = {}
    for f in files:
        paths.setdefault(module_name(f, root), f.relative_to(root).as_posix())
    known = set(paths)
    edges = {m: imports_of(root / p, m, known) for m, p in paths.items()}
    return paths, edges


def affected(changed: list[str], root: Path = ROOT) -> dict[str, tuple[int, str]]:
    """test file -> (distance, why): 0 for a changed test file, else the number of import steps
    from the test file to a changed module (1: it imports the module itself)."""
    paths, edges = graph(root)
    by_path = {p: m for m, p in paths.items()}
    tests = {p for p in paths.values() if is_test_file(p)}
    changed = [c for c in changed if c]
    out: dict[str, tuple[int, str]] = {}
    if any(c in EVERYTHING for c in changed):
        why = next(c for c in changed if c in EVERYTHING)
        return {t: (1, f"{why} changed: every test runs under it") for t in sorted(tests)}
    importers: dict[str, set[str]] = collections.defaultdict(set)
    for m, deps in edges.items():
        for d in deps:
            importers[d].add(m)
    seen: dict[str, tuple[int, str]] = {}
    queue: collections.deque = collections.deque()
    for c in changed:
        if c in by_path:
            seen[by_path[c]] = (0, f"{c} changed")
            queue.append(by_path[c])
        elif (root / c).is_file() or not c.endswith(".py"):  # a non-Python file: the tests that name it
            name = Path(c).name
            for t in tests:
                if name in (root / t).read_text(encoding="utf-8", errors="replace"):
                    out.setdefault(t, (1, f"names {c}"))
    while queue:  # breadth first: each module's distance is its fewest import steps
        m = queue.popleft()
        dist, why = seen[m]
        for imp in sorted(importers[m]):
            if imp not in seen:
                seen[imp] = (dist + 1, f"imports {m}" + (f" ({why})" if dist else ""))
                queue.append(imp)
    for m, (dist, why) in seen.items():
        p = paths[m]
        if is_test_file(p) and (p not in out or out[p][0] > dist):
            out[p] = (dist, why)
    return out


def git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def default_base(root: Path = ROOT) -> str:
    for ref in ("origin/main", "main"):
        if subprocess.run(["git", "-C", str(root), "rev-parse", "-q", "--verify", ref], capture_output=True).returncode == 0:
            return git("merge-base", "HEAD", ref, root=root).strip()
    return "HEAD"


def changed_files(base: str, root: Path = ROOT) -> list[str]:
    """Files changed since `base`: committed, staged, unstaged, and untracked (not ignored)."""
    diff = git("diff", "--name-only", base, root=root).split()
    untracked = git("ls-files", "--others", "--exclude-standard", root=root).split()
    return sorted(set(diff) | set(untracked))


def costs(line: str, root: Path = ROOT) -> dict[str, float]:
    """Seconds per test file: the last CI run's (`.ci-logs/<line>.durations.json`, written by
    scripts/test_all.sh), else tests/file_costs.json (measured, committed), else none."""
    for p in (root / ".ci-logs" / f"{line}.durations.json", root / "tests" / "file_costs.json"):
        if p.is_file():
            data = json.loads(p.read_text())
            data = data.get(line) or data.get("py313") or data  # (file_costs.json: per line)
            return {k: float(v) for k, v in data.items() if not k.startswith("_")}
    return {}


DEFAULT_COST = 10.0  # seconds, for a test file with no recorded duration


def plan(order: list[str], cost: dict[str, float], budget: float) -> list[tuple[str, bool]]:
    """(file, runs) in `order`: a file runs if it fits in what the budget has left (the first
    always runs); one that does not is left for later, and cheaper files after it still run."""
    out, spent = [], 0.0
    for t in order:
        c = cost.get(t, DEFAULT_COST)
        runs = budget <= 0 or not out or spent + c <= budget
        spent += c if runs else 0.0
        out.append((t, runs))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("base", nargs="?", help="git revision to diff against (default: merge-base with origin/main or main)")
    ap.add_argument("--files", nargs="*", help="treat these repo-relative paths as the change (no git)")
    ap.add_argument("--explain", action="store_true", help="print distance, estimated seconds and why")
    ap.add_argument("--line", default="py313", help="whose recorded durations to use (default py313)")
    ap.add_argument("--budget", type=float, default=0, help="estimated seconds to plan for (0: no budget)")
    ap.add_argument("--plan", action="store_true", help="print 'run FILE' / 'later FILE' rows within --budget")
    args = ap.parse_args(argv)
    changed = args.files if args.files is not None else changed_files(args.base or default_base())
    sel = affected(changed)
    cost = costs(args.line)
    order = sorted(sel, key=lambda t: (sel[t][0], cost.get(t, DEFAULT_COST), t))
    if args.plan:
        for t, runs in plan(order, cost, args.budget):
            print(("run " if runs else "later ") + t)
        return 0
    for t in order:
        if args.explain:
            dist, why = sel[t]
            print(f"{t}\t{dist}\t{cost.get(t, float('nan')):.0f}\t{why}")
        else:
            print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
