"""The house's import rules, read from the source (no module is imported here).

- Layers, bottom up: `pallas_kernels` < `arena_jax` < `models` < `benchmarks`. A module may
  import its own package and the packages below it, never one above (docs/design.md, "Layers").
- No import circle anywhere in the four packages: every `import` counts, also one inside a
  function (a circle hidden in a function body is still a circle), except under
  `if TYPE_CHECKING:`.
- Every import of the project's own modules names a file that exists: code imports the new
  paths, not the old flat module names kept importable for users (tests/test_moved_modules.py),
  and the models and benchmarks by their installed names, `arena_jax.models` and
  `arena_jax.benchmarks` (never the bare `models` a user's own package may claim).
- Every folder opens with a docstring saying what it holds.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("pallas_kernels", "arena_jax", "models", "server", "benchmarks")  # bottom up


INSTALLED_AS = {"models": "arena_jax.models", "server": "arena_jax.server", "benchmarks": "arena_jax.benchmarks"}  # pyproject's package-dir


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    top, dot, rest = name.partition(".")
    return INSTALLED_AS.get(top, top) + dot + rest


def _layer(module: str) -> str:
    """The layer (LAYERS) a dotted module name belongs to: arena_jax.models.x is in `models`."""
    for folder, installed in INSTALLED_AS.items():
        if module == installed or module.startswith(installed + "."):
            return folder
    return module.split(".")[0]


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in LAYERS for p in sorted((ROOT / pkg).rglob("*.py"))}


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for child in node.body for n in ast.walk(child))
    return skipped


def _imported_names(name: str, path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of every import in the module, relative imports resolved; for
    `from a import b` both `a.b` and `a` are candidates (the caller keeps the one that exists)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out += [(f"{base}.{a.name}|{base}", node.lineno) for a in node.names]
    return out


@functools.cache
def _graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    unresolved = []
    for name, path in modules.items():
        for target, line in _imported_names(name, path):
            candidates = target.split("|")
            if candidates[0].split(".")[0] not in LAYERS:
                continue
            hit = next((c for c in candidates if c in modules), None)
            if hit is None:
                unresolved.append(f"{path.relative_to(ROOT)}:{line} imports {candidates[-1]} (no such file)")
            elif hit != name:
                edges[name].add(hit)
    return edges, unresolved


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_graph_is_read_from_every_module():
    modules = _modules()
    assert {"arena_jax", "pallas_kernels", "arena_jax.models", "arena_jax.benchmarks"} <= set(modules)
    edges, _ = _graph()
    assert sum(len(e) for e in edges.values()) > 100  # the reader found the imports


def test_internal_imports_name_existing_modules():
    _, unresolved = _graph()
    assert not unresolved, "\n".join(unresolved)


def test_no_import_circle():
    edges, _ = _graph()
    assert not _cycles(edges), "import circles:\n" + "\n".join(" <-> ".join(c) for c in _cycles(edges))


def test_no_upward_import():
    edges, _ = _graph()
    rank = {pkg: i for i, pkg in enumerate(LAYERS)}
    upward = [f"{a} -> {b}" for a, targets in edges.items() for b in targets
              if rank[_layer(b)] > rank[_layer(a)]]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("package", sorted(p.parent.relative_to(ROOT).as_posix()
                                           for pkg in LAYERS for p in (ROOT / pkg).rglob("__init__.py")))
def test_every_folder_says_what_it_holds(package):
    doc = ast.get_docstring(ast.parse((ROOT / package / "__init__.py").read_text()))
    assert doc and len(doc.split()) >= 8, f"{package}/__init__.py needs an opening docstring saying what it holds"


def test_the_cycle_finder_finds_a_planted_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(edges) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
