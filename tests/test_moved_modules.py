"""Module paths that moved into subpackages (issue 38) keep working: each former path is the new
module object (`arena_jax._moved`), no flat shim file stands in for it, and every public name of
the package and of the former modules still resolves."""
import importlib
import os
import subprocess
import sys

import pytest

import arena_jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# former module under arena_jax -> (its module now, the public names it defined)
MOVED = {
    "host_api": ("host.api", ["swap_out", "swap_in", "offload_pages", "drop_host_pages"]),
    "host_ops": ("host.ops", ["move_pages", "move_pages_reference", "swap_out_impl", "swap_in_impl",
                              "offload_pages_impl", "drop_host_pages_impl"]),
    "prefix_ops": ("prefix.ops", ["page_fill", "hold_pages_impl", "drop_pages_impl", "fork_pages_impl", "_page_rows"]),
    "prefix_host": ("prefix.eviction", ["Eviction", "evict_plan"]),
    "prefix_binding": ("prefix.binding", ["Binding"]),
    "prefix_checks": ("prefix.checks", ["check_tag", "count", "token_ids", "page_ids", "common_prefix"]),
    "hf_config": ("hf.config", ["DEFAULT_ROPE_THETA", "GEMMA3_THETA", "RopeSpec", "HFConfig", "KVGeometry",
                                "parse_hf_config", "kv_geometry", "INT32_MAX", "read_hf_config"]),
    "hf_json": ("hf.reader", ["INT32_MAX", "LAYER_TYPES", "read_hf_config", "read_generation_config"]),
    "hf_schemas": ("hf.schemas", ["Field", "Family", "SCHEMAS", "FAMILIES"]),
}
# the former single modules that are packages now: every public name they defined
PACKAGES = {
    "host": ["page_arrays", "HostArena", "WORD_LANES", "words_fit", "packs_as_words", "host_page_format", "is_words",
             "words_as_pages", "host_pages_view", "check_pair", "create_host", "free_host_pages", "host_layout_bytes"],
    "prefix": ["MAX_HOST_PAGES", "PrefixHit", "Insertion", "PrefixCache", "Eviction", "evict_plan", "Binding"],
}
STATE = ["PAD_SLOT", "PAD_PAGE", "PageTable", "new_arena_id", "CacheStats", "KVCache", "warn_if_writes_copy", "create"]


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_former_module_path_is_the_moved_module(old):
    new, names = MOVED[old]
    module = importlib.import_module(f"arena_jax.{new}")
    assert importlib.import_module(f"arena_jax.{old}") is module
    assert sys.modules[f"arena_jax.{old}"] is module
    assert getattr(arena_jax, old) is module  # `from arena_jax import host_ops`, `arena_jax.host_ops.X`
    for name in names:
        assert hasattr(module, name), f"arena_jax.{old}.{name}"
    # no flat file stands in for it
    assert not os.path.exists(os.path.join(ROOT, "arena_jax", f"{old}.py"))


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_a_former_module_that_became_a_package_exports_its_names(package):
    module = importlib.import_module(f"arena_jax.{package}")
    assert os.path.basename(module.__file__) == "__init__.py"
    missing = [name for name in PACKAGES[package] if not hasattr(module, name)]
    assert not missing, f"arena_jax.{package} lacks {missing}"
    assert set(module.__all__) <= set(dir(module))


def test_state_keeps_its_names_and_they_are_the_packages():
    from arena_jax import kv_cache, state

    for name in STATE:
        assert hasattr(state, name), f"arena_jax.state.{name}"
    assert state.KVCache is kv_cache.KVCache is arena_jax.KVCache
    assert state.create is arena_jax.create


def test_every_public_name_of_the_package_resolves():
    missing = [name for name in arena_jax.__all__ if not hasattr(arena_jax, name)]
    assert not missing
    assert arena_jax.host_api.swap_out is arena_jax.swap_out
    assert arena_jax.prefix.PrefixCache is arena_jax.PrefixCache


def test_former_paths_work_as_the_first_import_of_a_fresh_process():
    code = ("import arena_jax.host_api, arena_jax.prefix_ops\n"
            "from arena_jax.hf_config import parse_hf_config\n"
            "from arena_jax.prefix_checks import token_ids\n"
            "from arena_jax import host_ops, hf_schemas\n"
            "import arena_jax\n"
            "assert arena_jax.host_api is arena_jax.host.api and host_ops is arena_jax.host.ops\n"
            "assert parse_hf_config is arena_jax.hf.config.parse_hf_config and hf_schemas is arena_jax.hf.schemas\n"
            "assert arena_jax.prefix_ops is arena_jax.prefix.ops and token_ids is arena_jax.prefix.checks.token_ids\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), JAX_PLATFORMS="cpu")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
