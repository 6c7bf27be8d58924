"""`arena_jax.models` and `arena_jax.benchmarks`: the repository's `models/` and `benchmarks/`
folders under the arena_jax name, so that a user's own `models` or `benchmarks` package never
shadows ours (issue 40). An installed wheel holds them inside `arena_jax/` (pyproject's
package-dir); a source checkout keeps them beside it, and the finder below serves them from there.
Their old top-level names, `models` and `benchmarks`, still name the same modules where those
folders are on the path (a checkout: `pallas_kernels._moved.alias_tree`, from each `__init__`).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

SUBPACKAGES = ("models", "server", "benchmarks")
_HERE = Path(__file__).resolve().parent  # arena_jax/


class _BesideArenaJax(importlib.abc.MetaPathFinder):
    """Serves `arena_jax.<name>` from `<checkout>/<name>/` when arena_jax/ has no such folder."""

    def find_spec(self, name, path=None, target=None):
        package, _, leaf = name.rpartition(".")
        if package != "arena_jax" or leaf not in SUBPACKAGES or (_HERE / leaf).is_dir():
            return None
        folder = _HERE.parent / leaf
        if not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)])


def register() -> None:
    if not any(isinstance(finder, _BesideArenaJax) for finder in sys.meta_path):
        sys.meta_path.insert(0, _BesideArenaJax())
