"""Old module paths kept importable after a move: `alias(package, table)`, `alias_tree(old, new)`.

`table` maps an old dotted path to the module's new one. Each old path then names the very same
module object: `import old.path`, `from package import leaf`, `package.leaf` and
`python -m old.path` all work, and nothing is imported before the old path is asked for (a
meta-path finder serves it on first import; the package's `__getattr__`, which `alias` returns,
serves attribute access). An old path whose new module is already imported is registered in
`sys.modules` at once, so an import of it never rebinds the package's attribute of that name
(`pallas_kernels.paged_attention` stays the function, as before the move).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys


class _OldPaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old path (after the ordinary finders missed it) and loads it as the new module."""

    def __init__(self):
        self.table: dict[str, str] = {}
        self.trees: dict[str, str] = {}  # old package -> new one: every old submodule path too
        self._specs: dict[str, object] = {}  # old path -> the new module's own spec, while it is loaded

    def new_path(self, name: str) -> str | None:
        if name in self.table:
            return self.table[name]
        for old, new in self.trees.items():
            if name.startswith(old + "."):
                return new + name[len(old):]
        return None

    def find_spec(self, name, path=None, target=None):
        new = self.new_path(name)
        if new is None:
            return None
        new_spec = importlib.util.find_spec(new)
        if new_spec is None:  # no such module under the new path either: the ordinary error
            return None
        return importlib.util.spec_from_loader(name, self, origin=new_spec.origin)

    def create_module(self, spec):
        module = importlib.import_module(self.new_path(spec.name))
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):  # the import system set __spec__ to the old path's: give it back
        module.__spec__ = self._specs.pop(module.__spec__.name)

    def get_code(self, name):  # `python -m old.path` (runpy) runs the new module's code
        spec = importlib.util.find_spec(self.new_path(name))
        return spec.loader.get_code(spec.name)


_FINDER = _OldPaths()
sys.meta_path.insert(0, _FINDER)  # first: a stale copy of an old file elsewhere on the path must not win


def alias(package: str, table: dict[str, str]):
    """Register `table`'s old paths (submodules of `package`); returns the package's `__getattr__`."""
    for old, new in table.items():
        _FINDER.table[old] = new
        if new in sys.modules:
            sys.modules.setdefault(old, sys.modules[new])

    def __getattr__(name: str):
        if f"{package}.{name}" in table:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def alias_tree(old: str, new: str) -> None:
    """Make package `old` and every `old.<path>` name the modules of package `new` (`sys.modules[old]`
    becomes `new`'s module). Called by a package's `__init__` when it finds itself imported by its
    old name; the old submodule paths are served on first import, as `alias`'s are."""
    module = importlib.import_module(new)
    _FINDER.trees[old] = new
    for name, loaded in list(sys.modules.items()):
        if name.startswith(new + "."):
            sys.modules.setdefault(old + name[len(new):], loaded)
    sys.modules[old] = module
