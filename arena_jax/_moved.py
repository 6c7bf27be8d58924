"""Module paths that moved into subpackages (issue 38), kept working: each former dotted path is
registered in `sys.modules` as the new module object, so `import arena_jax.host_api`,
`from arena_jax.hf_config import parse_hf_config` and `arena_jax.prefix_ops` still work and
`arena_jax.host_api is arena_jax.host.api`. New code imports the new paths.
"""
from __future__ import annotations

import sys

from arena_jax.hf import config as hf_config
from arena_jax.hf import reader as hf_reader
from arena_jax.hf import schemas as hf_schemas
from arena_jax.host import api as host_api
from arena_jax.host import ops as host_ops
from arena_jax.prefix import binding as prefix_binding
from arena_jax.prefix import checks as prefix_checks
from arena_jax.prefix import eviction as prefix_eviction
from arena_jax.prefix import ops as prefix_ops

__all__ = ["MOVED", "register"]

# former name under arena_jax -> the module it now is
MOVED = {
    "host_api": host_api,
    "host_ops": host_ops,
    "prefix_ops": prefix_ops,
    "prefix_host": prefix_eviction,
    "prefix_binding": prefix_binding,
    "prefix_checks": prefix_checks,
    "hf_config": hf_config,
    "hf_json": hf_reader,
    "hf_schemas": hf_schemas,
}


def register(package) -> None:
    """Make each former path of `package` (arena_jax) name its new module, as an import and as an attribute."""
    for old, module in MOVED.items():
        sys.modules[f"{package.__name__}.{old}"] = module
        setattr(package, old, module)
