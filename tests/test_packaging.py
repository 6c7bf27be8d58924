"""Namespacing (issue 40): the models and the benchmark CLI are `arena_jax.models` and
`arena_jax.benchmarks`, so a user's own `models` / `benchmarks` package (a common name) neither
shadows ours nor is shadowed by it; pyproject installs exactly the repository's folders."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTALLED_AS = {"models": "arena_jax.models", "server": "arena_jax.server", "benchmarks": "arena_jax.benchmarks"}

USER_MAIN = """\
import models, benchmarks                       # the project's own packages
from arena_jax import models as arena_models    # ours
import arena_jax.benchmarks.cli
assert models.MINE == "user models" and benchmarks.MINE == "user benchmarks"
model = arena_models.init_random(arena_models.LlamaConfig.tiny(), seed=0)
result = arena_models.generate(model, [[1, 2, 3]], max_new_tokens=4)
import sys
assert sys.modules["models"] is models and "models.llama" not in sys.modules  # ours never took the name
print(len(result.tokens[0]))
"""


def test_pyproject_installs_every_package_folder_under_its_name():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = set()
    for top in ("arena_jax", "pallas_kernels", *INSTALLED_AS):
        for init in (ROOT / top).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT).parts
            folders.add(".".join((INSTALLED_AS.get(parts[0], parts[0]), *parts[1:])))
    assert set(config["packages"]) == folders
    assert config["package-dir"] == {name: folder for folder, name in INSTALLED_AS.items()}
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert all(target.startswith(tuple(f"{name}." for name in INSTALLED_AS.values())) for target in scripts.values())


def test_a_user_project_with_its_own_models_package_uses_ours(tmp_path):
    for name in INSTALLED_AS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f'MINE = "user {name}"\n')
    (tmp_path / "main.py").write_text(USER_MAIN)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))  # the script's folder comes first
    proc = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "4"


def test_the_old_top_level_names_are_the_same_modules_in_a_checkout():
    probe = ("import models, models.llama, benchmarks, arena_jax.models as m, arena_jax.benchmarks as b\n"
             "from models.scheduler import loop\n"
             "import arena_jax.models.scheduler.loop as loop2\n"
             "assert models is m and models.llama is m.llama and benchmarks is b and loop is loop2\n"
             "assert m.llama.__name__ == 'arena_jax.models.llama'\n"
             "print('ok')\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
