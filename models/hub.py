"""Where a checkpoint lives: a folder, or a Hugging Face name ("org/name") already in the local
Hugging Face cache. Nothing is downloaded here.

    models.checkpoint_dir("path/to/Meta-Llama-3.1-8B")        # that folder
    models.checkpoint_dir("meta-llama/Llama-3.1-8B")           # its snapshot in the local cache
    models.load_pretrained("meta-llama/Llama-3.1-8B")          # the same, loaded

A name is resolved by `huggingface_hub` with local files only, as `transformers`'
`from_pretrained(name, local_files_only=True)` resolves it: the cache folder is
`HF_HUB_CACHE` (default `~/.cache/huggingface/hub`, or `$HF_HOME/hub`), the revision the
cache's `refs/main` (or the `revision` given). A name not in the cache raises
FileNotFoundError saying how to download it (`hf download org/name`).
"""
from __future__ import annotations

import os
import re

__all__ = ["checkpoint_dir"]

# A hub repository id: "name" or "org/name" of letters, digits, "-", "_", "." (huggingface_hub's rule).
_REPO_ID = re.compile(r"^(?:[\w.-]+/)?[\w.-]+$")


def checkpoint_dir(name_or_dir, *, revision: str | None = None) -> str:
    """The folder of a checkpoint: `name_or_dir` itself when it is a folder, else the snapshot of
    the Hugging Face repository `name_or_dir` ("org/name") in the local cache."""
    path = os.fspath(name_or_dir)
    if os.path.isdir(path):
        if revision is not None:
            raise ValueError(f"revision={revision!r} is for a Hugging Face name, not a folder ({path})")
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"{path} is a file; a checkpoint is a folder (config.json, *.safetensors)")
    if not _REPO_ID.match(path) or path.startswith((".", "/")) or ".." in path:
        raise FileNotFoundError(f"{path}: no such folder (a checkpoint is a folder or a Hugging Face name 'org/name')")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(path, revision=revision, local_files_only=True)
    except LocalEntryNotFoundError:
        where = f"revision {revision!r} of " if revision else ""
        raise FileNotFoundError(
            f"{path}: no such folder, and {where}the Hugging Face model {path!r} is not in the local cache "
            f"({constants.HF_HUB_CACHE}); nothing is downloaded here: download it first with `hf download {path}` "
            "(pip install huggingface_hub), or pass the checkpoint's folder"
        ) from None
