"""Write a Hugging Face style checkpoint folder (config.json + safetensors, sharded or not)."""
from __future__ import annotations

import json

from safetensors.numpy import save_file


def save_hf_folder(path, config: dict, tensors: dict, shards: int = 1):
    """config.json plus `tensors` in one file or in `shards` files with an index; returns path."""
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::shards]}
        save_file(part, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
