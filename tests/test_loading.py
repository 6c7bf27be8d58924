"""`models.load_pretrained` on broken checkpoints: every problem is a ValueError naming the file
and the tensors or keys (never a traceback from safetensors / tokenizers / json, never a silent
partial load). The same folders through `arena-generate --model-dir` exit 2 with the message.
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from arena_jax import models
from arena_jax.models import llama as llama_module
from arena_jax.models.cli import main as generate_main
from hf_folders import save_hf_folder


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(num_layers=1), seed=0)


@pytest.fixture(scope="module")
def tensors(model):
    return models.export_hf_tensors(model)


_save = save_hf_folder


def _load(path):
    return models.load_pretrained(path, dtype=jnp.float32)


def test_extra_tensors_are_refused_by_name(tmp_path, model, tensors):
    extra = dict(tensors, **{"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    path = _save(tmp_path / "extra", model.config.to_hf(), extra)
    with pytest.raises(ValueError, match=r"does not match its config.json: it holds 1 tensor\(s\) the config does not describe: "
                                         r"model\.layers\.0\.self_attn\.q_proj\.bias"):  # fmt: skip
        _load(path)


def test_missing_and_extra_are_both_listed(tmp_path, model, tensors):
    """A 2-layer config over a 1-layer checkpoint with a stray tensor: every name in one message."""
    config = dict(model.config.to_hf(), num_hidden_layers=2)
    path = _save(tmp_path / "deeper", config, dict(tensors, stray=np.zeros(3, np.float32)))
    with pytest.raises(ValueError, match=r"it lacks 9 tensor\(s\) the config needs: model\.layers\.1\..* and 1 more; "
                                         r"it holds 1 tensor\(s\) the config does not describe: stray"):  # fmt: skip
        _load(path)


def test_rotary_inv_freq_buffers_are_ignored_like_transformers(tmp_path, model, tensors):
    old = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)})
    loaded = _load(_save(tmp_path / "old", model.config.to_hf(), old)).model
    np.testing.assert_array_equal(np.asarray(loaded.lm_head[...]), np.asarray(model.lm_head[...]))
    # only that pattern: another buffer is still refused
    other = dict(tensors, **{"model.layers.0.self_attn.rotary_emb.original_inv_freq": np.ones(8, np.float32)})
    with pytest.raises(ValueError, match="original_inv_freq"):
        _load(_save(tmp_path / "other", model.config.to_hf(), other))


def test_tied_head_stored_anyway(tmp_path):
    tied = models.init_random(models.LlamaConfig.tiny(num_layers=1, tie_word_embeddings=True), seed=1)
    tensors = models.export_hf_tensors(tied)
    same = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"].copy()})
    _load(_save(tmp_path / "same", tied.config.to_hf(), same))  # an identical copy is harmless
    different = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"] + 1})
    with pytest.raises(ValueError, match="tie_word_embeddings true.*different lm_head.weight"):
        _load(_save(tmp_path / "different", tied.config.to_hf(), different))


def test_wrong_dtype(tmp_path, model, tensors):
    ints = dict(tensors, **{"model.norm.weight": np.ones(64, np.int32)})
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight' in .* has dtype I32"):
        _load(_save(tmp_path / "ints", model.config.to_hf(), ints))


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors(tmp_path, model, tensors, damage):
    path = _save(tmp_path, model.config.to_hf(), tensors, shards=2)
    shard = path / "model-00002-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes({"truncated": data[: len(data) - 100], "garbage": b"\x00" * 64, "empty": b""}[damage])
    with pytest.raises(ValueError, match=f"{shard}: not a readable safetensors file"):
        _load(path)


def test_bad_index_and_no_weights(tmp_path, model, tensors):
    path = _save(tmp_path / "idx", model.config.to_hf(), tensors, shards=2)
    index = path / "model.safetensors.index.json"
    index.write_text("{oops")
    with pytest.raises(ValueError, match=f"{index}: not a JSON object"):
        _load(path)
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": "model-00009-of-00009.safetensors"}}))
    with pytest.raises(ValueError, match="names shard files that are not in .*model-00009-of-00009"):
        _load(path)
    index.write_text(json.dumps([1]))
    with pytest.raises(ValueError, match="weight_map"):
        _load(path)
    other = tmp_path / "consolidated"  # Mistral's original format beside no HF weights
    other.mkdir()
    (other / "config.json").write_text(json.dumps(model.config.to_hf()))
    save_file({"tok_embeddings.weight": np.zeros((2, 2), np.float32)}, str(other / "consolidated.safetensors"))
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        _load(other)


def test_broken_tokenizer_json(tmp_path, model, tensors):
    path = _save(tmp_path, model.config.to_hf(), tensors)
    (path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(ValueError, match=f"{path / 'tokenizer.json'}: not a valid tokenizer.json"):
        _load(path)


@pytest.mark.parametrize(
    "config_text, message",
    [
        ("{", "config.json: invalid JSON"),
        ("[]", "config.json: config.json must hold a JSON object, got a JSON list"),
        (json.dumps({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
         "config.json: rope_scaling with rope_type 'llama3' lacks 'low_freq_factor', 'high_freq_factor'"),
        (json.dumps({"model_type": "llama", "tie_word_embeddings": "false"}), "config.json: tie_word_embeddings must be a JSON bool"),
    ],
)  # fmt: skip
def test_bad_config_json(tmp_path, model, tensors, config_text, message, capsys):
    path = _save(tmp_path, model.config.to_hf(), tensors)
    (path / "config.json").write_text(config_text)
    with pytest.raises(ValueError, match=message):
        _load(path)
    with pytest.raises(SystemExit) as exc:
        generate_main(["--model-dir", str(path), "--no-compile-cache"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--model-dir" in err and message.split(": ", 1)[1][:30] in err and "Traceback" not in err


def test_generation_config_gives_the_stop_tokens(tmp_path, model, tensors):
    path = _save(tmp_path, dict(model.config.to_hf(), eos_token_id=5), tensors)
    assert _load(path).model.config.eos_token_ids == (5,)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "bos_token_id": 1}))
    assert _load(path).model.config.eos_token_ids == (7, 9)


def test_a_checkpoint_of_big_layers_loads_as_a_list_on_a_cpu(tmp_path, monkeypatch):
    """`scan_layers=None` (the default): a scan, except on a CPU for layers of
    `CPU_LIST_LAYER_BYTES` or more (a layer scan there copies every layer's weights every step);
    True / False as asked; anything else a ValueError naming it. Both load the same weights and
    decode the same tokens."""
    src = models.init_random(models.LlamaConfig.tiny(num_layers=2), seed=5)
    path = _save(tmp_path / "two", src.config.to_hf(), models.export_hf_tensors(src))
    assert _load(path).model.scan_layers  # a tiny layer (~150 KiB): the scan
    layer_bytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(src.layer(0)))
    monkeypatch.setattr(llama_module, "CPU_LIST_LAYER_BYTES", layer_bytes)  # this layer is now "big"
    assert not models.default_scan_layers(src.config) and models.default_scan_layers(src.config, platform="gpu")
    listed = _load(path).model
    assert not listed.scan_layers and len(listed.layers) == 2
    assert models.load_pretrained(path, dtype=jnp.float32, scan_layers=True).model.scan_layers
    monkeypatch.setattr(llama_module, "CPU_LIST_LAYER_BYTES", layer_bytes + 1)
    assert _load(path).model.scan_layers
    with pytest.raises(ValueError, match="scan_layers must be a bool or None"):
        models.load_pretrained(path, dtype=jnp.float32, scan_layers="yes")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    assert models.generate(listed, prompts, 4).tokens == models.generate(src, prompts, 4).tokens
