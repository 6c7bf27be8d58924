"""Every Python block in README.md and docs/ runs as written (issue 40, item 2).

Each fenced ```python block is one test: executed alone (a fresh namespace, as a reader pastes
it) in a folder where "path/to/checkpoint" is a small checkpoint with text
(tests/text_checkpoint.py). An HTML comment on the line before a block changes how it runs:

    <!-- docs-test: fresh process (why) -->     run in a new Python process (e.g. it sets XLA_FLAGS)
    <!-- docs-test: not run: why -->           not run; the reason is required and shown as the skip
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from text_checkpoint import write_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!--\s*docs-test:\s*(fresh process|not run)(?::\s*(.*?))?\s*(?:\((.*?)\))?\s*-->\s*$")


def _blocks() -> list[tuple[str, str, str, str]]:
    """(id "file:line", code, mode "run" | "fresh process" | "not run", reason) per block."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            mode = mark.group(1) if mark else "run"
            reason = (mark.group(2) or mark.group(3) or "").strip() if mark else ""
            out.append((f"{path.relative_to(ROOT)}:{line}", m.group(1), mode, reason))
    return out


BLOCKS = _blocks()


def test_the_blocks_are_found():
    names = {b[0].split(":")[0] for b in BLOCKS}
    assert {"README.md", "docs/integrate.md", "docs/cache.md", "docs/models.md", "docs/serving.md"} <= names
    assert len(BLOCKS) >= 14
    for name, _, mode, reason in BLOCKS:
        assert mode == "run" or reason, f"{name}: a docs-test mark needs its reason"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("docs")
    write_checkpoint(folder / "path" / "to" / "checkpoint")
    return folder


@pytest.mark.parametrize("name, code, mode, reason", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_runs_as_written(name, code, mode, reason, workdir, monkeypatch):
    if mode == "not run":
        pytest.skip(f"{name}: {reason}")
    monkeypatch.chdir(workdir)
    if mode == "fresh process":
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        proc = subprocess.run([sys.executable, "-c", code], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-4000:]}"
        return
    exec(compile(code, name, "exec"), {"__name__": "__main__"})  # noqa: S102 - the documentation's own code
