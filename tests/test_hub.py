"""Issue 40, item 4: checkpoints by name. `load_pretrained("org/name")` (and `arena-generate
--model-dir org/name`) resolve a model already in the local Hugging Face cache, laid out here as
the hub client lays it out (blobs, snapshots of symlinks, refs); nothing is downloaded. A name
not in the cache is an error that says how to download it."""
from __future__ import annotations

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_folders import save_hf_folder

from arena_jax import models
from arena_jax.models import cli as generate_cli
from arena_jax.models import compile_cache

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _hub_cache(root, repo_id, folder, ref="main", commit=COMMIT):
    """`folder`'s files put in a hub cache at `root` as `huggingface_hub` stores a download of
    `repo_id`: models--org--name/blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/<sha256>,
    refs/<ref> holding the commit. Returns the snapshot folder."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name in sorted(os.listdir(folder)):
        data = (folder / name).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny():
    return models.init_random(models.presets.tiny(), seed=5)


@pytest.fixture
def hub(tmp_path, tiny, monkeypatch):
    """A hub cache holding "arena-test/tiny" (refs/main), as HF_HUB_CACHE names it."""
    from huggingface_hub import constants

    folder = tmp_path / "download"
    save_hf_folder(folder, tiny.config.to_hf(), models.export_hf_tensors(tiny))
    root = tmp_path / "hub"
    snapshot = _hub_cache(root, "arena-test/tiny", folder)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))  # what HF_HUB_CACHE=<root> sets at import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # and were anything to reach for the network, it could not
    return root, snapshot


def test_a_name_in_the_local_cache_loads_as_its_folder(hub, tiny):
    root, snapshot = hub
    assert models.checkpoint_dir("arena-test/tiny") == str(snapshot)
    loaded, tokenizer = models.load_pretrained("arena-test/tiny", dtype=jnp.float32)
    assert tokenizer is None and loaded.config == tiny.config
    for a, b in zip(jax.tree.leaves(nnx.state(loaded)), jax.tree.leaves(nnx.state(tiny)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_revision_resolves_through_its_ref(hub, tmp_path, tiny):
    root, _ = hub
    other = "fedcba9876543210fedcba9876543210fedcba98"
    folder = tmp_path / "v2"
    save_hf_folder(folder, tiny.config.to_hf(), models.export_hf_tensors(tiny))
    repo = root / "models--arena-test--tiny"
    (repo / "snapshots" / other).mkdir(parents=True)
    for name in os.listdir(folder):
        (repo / "snapshots" / other / name).write_bytes((folder / name).read_bytes())
    (repo / "refs" / "v2").write_text(other)
    assert models.checkpoint_dir("arena-test/tiny", revision="v2") == str(repo / "snapshots" / other)
    assert models.checkpoint_dir("arena-test/tiny") == str(repo / "snapshots" / COMMIT)


def test_a_name_not_in_the_cache_says_how_to_download_it(hub):
    root, _ = hub
    with pytest.raises(FileNotFoundError) as exc:
        models.load_pretrained("arena-test/absent")
    said = str(exc.value)
    assert "'arena-test/absent' is not in the local cache" in said and str(root) in said
    assert "hf download arena-test/absent" in said
    with pytest.raises(FileNotFoundError, match="revision 'v9' of the Hugging Face model"):
        models.checkpoint_dir("arena-test/tiny", revision="v9")


def test_folders_files_and_paths_that_are_not_names(tmp_path, hub):
    assert models.checkpoint_dir(tmp_path) == str(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(NotADirectoryError, match="is a file; a checkpoint is a folder"):
        models.checkpoint_dir(tmp_path / "weights.bin")
    for path in (tmp_path / "missing", "./missing", "../x/y", "a/b/c"):  # not a hub name: never looked up
        with pytest.raises(FileNotFoundError, match="no such folder \\(a checkpoint is a folder or a Hugging Face"):
            models.checkpoint_dir(path)
    with pytest.raises(ValueError, match="revision='v2' is for a Hugging Face name, not a folder"):
        models.checkpoint_dir(tmp_path, revision="v2")


def test_arena_generate_takes_a_name_and_refuses_one_not_in_the_cache(hub, capsys, monkeypatch):
    monkeypatch.setattr(compile_cache, "enable", lambda *args, **kwargs: None)
    with pytest.raises(SystemExit) as exc:
        generate_cli.main(["--model-dir", "arena-test/absent"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--model-dir arena-test/absent:" in err and "hf download arena-test/absent" in err
    assert generate_cli.main(["--model-dir", "arena-test/tiny", "--dtype", "float32", "--prompt", "1 2 3",
                              "--max-new-tokens", "2"]) in (0, None)  # fmt: skip
    assert "tokens/s" in capsys.readouterr().out
