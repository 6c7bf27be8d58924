"""Old module paths kept importable after a move: `alias(package, table)`.

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
        self._specs: dict[str, object] = {}  # old path -> the new module's own spec, while it is loaded

    def find_spec(self, name, path=None, target=None):
        new = self.table.get(name)
        if new is None:
            return None
        return importlib.util.spec_from_loader(name, self, origin=importlib.util.find_spec(new).origin)

    def create_module(self, spec):
        module = importlib.import_module(self.table[spec.name])
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):  # the import system set __spec__ to the old path's: give it back
        module.__spec__ = self._specs.pop(module.__spec__.name)

    def get_code(self, name):  # `python -m old.path` (runpy) runs the new module's code
        spec = importlib.util.find_spec(self.table[name])
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
