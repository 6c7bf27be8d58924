"""`arena_jax.hf_config`: config.json read as transformers reads it.

The oracle is the installed `transformers`: for Llama / Mistral configs with each key removed
in turn and each key given a wrong type or an out-of-range value, our parsed values equal
transformers' (`LlamaConfig` / `MistralConfig.from_dict`, the RoPE as its rotary embedding
reads it), or both refuse. Where we refuse and transformers accepts, its model must be
unusable on that config (building or running it fails, or its logits are not finite); the one
deliberate exception is an eos id outside the vocabulary (transformers only warns).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import re

import pytest

import arena_jax as aj
import models
from arena_jax.hf_config import kv_geometry, parse_hf_config

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
LLAMA = {
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "eos_token_id": [1, 2],
    "torch_dtype": "bfloat16",
}
BASES = {
    "llama_plain": LLAMA,
    "llama_v4_rope3": dict(LLAMA, rope_scaling=LLAMA3_ROPE),  # transformers-4 spelling
    "llama_v5_rope3": dict(  # transformers-5 spelling
        {k: v for k, v in LLAMA.items() if k != "rope_theta"}, rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0)
    ),
    "mistral": {
        **{k: v for k, v in LLAMA.items() if k not in ("attention_bias", "mlp_bias")},
        "model_type": "mistral",
        "sliding_window": 8,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
}


# ---- unit cases (no transformers needed) -----------------------------------------------------------


def _without(cfg, *keys):
    return {k: v for k, v in cfg.items() if k not in keys}


def test_missing_keys_take_transformers_defaults():
    assert parse_hf_config(_without(LLAMA, "rms_norm_eps")).rms_norm_eps == 1e-6  # not 1e-5
    assert models.LlamaConfig.from_hf(_without(LLAMA, "rms_norm_eps")).rms_norm_eps == 1e-6
    mistral = BASES["mistral"]
    assert parse_hf_config(_without(mistral, "sliding_window")).sliding_window == 4096
    assert models.LlamaConfig.from_hf(_without(mistral, "sliding_window")).sliding_window == 4096
    assert models.LlamaConfig.from_hf(dict(mistral, sliding_window=None)).sliding_window is None  # null: no window
    assert parse_hf_config(_without(mistral, "num_key_value_heads", "num_attention_heads", "hidden_size", "head_dim")).num_key_value_heads == 8
    assert parse_hf_config(_without(LLAMA, "num_key_value_heads")).num_key_value_heads == 4  # MHA
    assert parse_hf_config(dict(LLAMA, num_key_value_heads=None)).num_key_value_heads == 4
    assert parse_hf_config(_without(LLAMA, "head_dim", "rope_theta")).head_dim == 16
    assert parse_hf_config(_without(LLAMA, "rope_theta")).rope_theta == 10000.0
    assert parse_hf_config(_without(LLAMA, "max_position_embeddings")).max_position_embeddings == 2048
    assert parse_hf_config(_without(mistral, "max_position_embeddings")).max_position_embeddings == 131072


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(tie_word_embeddings="false"), "tie_word_embeddings must be a JSON bool"),
        (dict(num_key_value_heads=0), r"num_key_value_heads must be in \[1, 2147483647\], got 0"),
        (dict(num_key_value_heads=3), "num_key_value_heads = 3 must divide num_attention_heads = 4"),
        (dict(num_key_value_heads=2.0), "num_key_value_heads must be a JSON integer, got 2.0"),
        (dict(num_key_value_heads=True), "num_key_value_heads must be a JSON integer, got True"),
        (dict(vocab_size=2**31), r"vocab_size must be in \[1, 2147483647\]"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be finite and > 0, got nan"),
        (dict(rms_norm_eps="1e-5"), "rms_norm_eps must be a JSON float"),
        (dict(rope_theta="5e5"), "rope_theta must be a JSON number"),
        (dict(rope_scaling=_without(LLAMA3_ROPE, "low_freq_factor")), "rope_scaling with rope_type 'llama3' lacks 'low_freq_factor'"),
        (dict(rope_scaling=dict(LLAMA3_ROPE, factor="8")), "rope_scaling.factor must be a JSON number"),
        (dict(head_dim=15), "head_dim = 15 must be even"),
        (dict(eos_token_id=[1, "2"]), "eos_token_id must be a JSON integer, a list of them, or null"),
        (dict(eos_token_id=128), r"eos_token_id holds 128, outside the vocabulary \[0, vocab_size = 128\)"),
        (dict(torch_dtype="int8"), "torch_dtype must be one of"),
    ],
    ids=lambda x: ",".join(f"{k}={v!r}" for k, v in x.items()) if isinstance(x, dict) else "",
)
def test_bad_values_are_refused_by_name(change, key):
    parsers = [parse_hf_config, models.LlamaConfig.from_hf]
    if "outside the vocabulary" not in key:  # stop tokens do not shape a KV arena: KVLayout ignores them
        parsers.append(lambda c: aj.KVLayout.from_hf_config(c, num_pages=4))
    for parse in parsers:
        with pytest.raises(ValueError, match=key):
            parse(dict(LLAMA, **change))


def test_files_that_are_not_config_objects(tmp_path):
    path = tmp_path / "config.json"
    for text, message in [("{not json", "invalid JSON"), ("[1, 2]", "must hold a JSON object, got a JSON list"), ("", "invalid JSON")]:
        path.write_text(text)
        for parse in (parse_hf_config, models.LlamaConfig.from_hf, lambda c: aj.KVLayout.from_hf_config(c, num_pages=4)):
            with pytest.raises(ValueError, match=f"{path}.*{message}"):
                parse(tmp_path)
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match="not UTF-8"):
        parse_hf_config(path)
    path.write_text(json.dumps(LLAMA))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": ')
    with pytest.raises(ValueError, match="generation_config.json: invalid JSON"):
        models.LlamaConfig.from_hf(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, "8"]}')
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id must be"):
        models.LlamaConfig.from_hf(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [7, 8]}')
    assert models.LlamaConfig.from_hf(tmp_path).eos_token_ids == (7, 8)  # it wins over config.json's [1, 2]
    assert models.LlamaConfig.from_hf(path).eos_token_ids == (7, 8)  # the file path, too


def test_eos_and_to_hf_round_trip():
    assert models.LlamaConfig.from_hf(LLAMA).eos_token_ids == (1, 2)
    assert models.LlamaConfig.from_hf(dict(LLAMA, eos_token_id=5)).eos_token_ids == (5,)
    assert models.LlamaConfig.from_hf(dict(LLAMA, eos_token_id=None)).eos_token_ids == ()
    assert models.LlamaConfig.from_hf(_without(LLAMA, "eos_token_id")).eos_token_ids == ()  # as transformers' generate
    for eos in [(), (3,), (3, 9)]:
        cfg = models.LlamaConfig.tiny(eos_token_ids=eos)
        assert models.LlamaConfig.from_hf(cfg.to_hf()) == cfg
    with pytest.raises(ValueError, match=r"eos_token_ids must be integers in \[0, vocab_size=128\)"):
        models.LlamaConfig.tiny(eos_token_ids=(128,))
    with pytest.raises(ValueError, match="eos_token_ids must be integers"):
        models.LlamaConfig.tiny(eos_token_ids=(True,))


def test_kv_geometry_of_other_model_types():
    qwen = {"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "hidden_size": 3584, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}  # fmt: skip
    g = kv_geometry(qwen)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.max_position_embeddings) == (28, 4, 128, 32768)
    with pytest.raises(ValueError, match="num_key_value_heads is required for model_type 'qwen2'"):
        kv_geometry(_without(qwen, "num_key_value_heads"))
    with pytest.raises(ValueError, match="num_hidden_layers must be a JSON integer"):
        kv_geometry(dict(qwen, num_hidden_layers=28.0))
    with pytest.raises(ValueError, match="pass max_seq_len"):
        aj.KVLayout.from_hf_config(_without(qwen, "max_position_embeddings"), num_pages=4)
    for parse in (parse_hf_config, models.LlamaConfig.from_hf):
        with pytest.raises(ValueError, match=r"model_type must be one of \['llama', 'mistral'\], got 'qwen2'"):
            parse(qwen)
    for bad in (None, 5, ["llama"], {"a": 1}):
        for parse in (parse_hf_config, kv_geometry):
            with pytest.raises(ValueError, match="model_type must be one of"):
                parse(dict(LLAMA, model_type=bad))


# ---- the transformers oracle ------------------------------------------------------------------------

from hf_reference import hf_reference, transformers  # noqa: E402,F401  (a fixture; None where not installed)


def _wrong_values(value):
    """Wrong types and edge values for a key whose good value is `value`."""
    out = [None, "7", True, [value], {"x": 1}]
    if isinstance(value, bool):
        out += [0, 1, "true"]
    elif isinstance(value, int):
        out += [float(value), value + 0.5, 0, -1, 3, str(value)]  # 3: odd, below most sizes
    elif isinstance(value, float):
        out += [int(value) or 1, 0.0, -value, float("nan"), float("inf")]
    elif isinstance(value, list):
        out += [[float(v) for v in value], [True], 1.5]
    return out


def _mutations():
    for base_name, base in BASES.items():
        yield base_name, "unchanged", base
        for key, value in base.items():
            if key == "model_type":
                yield base_name, "model_type removed", _without(base, key)  # read as Llama
                continue
            yield base_name, f"{key} removed", _without(base, key)
            for wrong in _wrong_values(value) if not isinstance(value, dict) else [None, "llama3", [1], {}]:
                yield base_name, f"{key}={wrong!r}", dict(base, **{key: wrong})
            if isinstance(value, dict):  # the RoPE dicts, key by key
                for sub, subvalue in value.items():
                    yield base_name, f"{key}.{sub} removed", dict(base, **{key: _without(value, sub)})
                    for wrong in _wrong_values(subvalue) if sub != "rope_type" else ["default", "yarn", None, 3]:
                        yield base_name, f"{key}.{sub}={wrong!r}", dict(base, **{key: dict(value, **{sub: wrong})})


def _hf_config(cfg: dict):
    """transformers' config for `cfg`, checked as far as its rotary embedding; raises when it refuses."""
    model_type = cfg.get("model_type", "llama")
    cls = transformers.MistralConfig if model_type == "mistral" else transformers.LlamaConfig
    config = cls.from_dict(copy.deepcopy(cfg))
    module = transformers.models.mistral.modeling_mistral if model_type == "mistral" else transformers.models.llama.modeling_llama
    (module.MistralRotaryEmbedding if model_type == "mistral" else module.LlamaRotaryEmbedding)(config)
    return config


def _hf_values(config, model_type: str) -> dict:
    rope = config.rope_parameters
    eos = config.eos_token_id
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.attention_bias if model_type == "llama" else False,
        "mlp_bias": config.mlp_bias if model_type == "llama" else False,
        "sliding_window": config.sliding_window if model_type == "mistral" else None,  # Llama ignores the key
        "rope_type": rope["rope_type"],
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {k: rope[k] for k in LLAMA3_ROPE if k != "rope_type"} if rope["rope_type"] == "llama3" else None,
        "eos_token_id": () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
    }


COMPARED = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "hidden_act max_position_embeddings rms_norm_eps tie_word_embeddings attention_bias mlp_bias sliding_window "
    "rope_type rope_theta rope_scaling eos_token_id"
).split()


def _ours(cfg) -> dict:
    parsed = parse_hf_config(cfg)
    return {key: getattr(parsed, key) for key in COMPARED}


# Where we refuse what transformers accepts: range checks it does not make (it builds an empty or
# degenerate model, computes NaN, or fails later), and its untyped RoPE dict / dtype. Each rule
# must be hit by some mutation, so the list cannot outlive the checks.
STRICTER = {
    r"must be in \[1, 2147483647\], got (0|-1)$": "sizes, layers, heads and context are positive",
    r"must be finite and > 0, got": "rms_norm_eps, rope_theta and llama3 factors are positive and finite",
    r"must divide num_attention_heads": "grouped-query attention needs whole groups",
    r"must be even \(RoPE": "RoPE rotates pairs (transformers refuses odd head_dim only above 4)",
    r"outside the vocabulary": "a stop token the model cannot produce (transformers warns)",
    r"(rope_scaling|rope_parameters)\.\w+ must be a JSON (number|integer), got (True|False|16\.0|16\.5)": (
        "transformers does not type-check the RoPE dict"
    ),
    r"^config: rope_theta must be a JSON number, got (True|False)": "nor a top-level rope_theta",
    r"torch_dtype must be one of": "the KV arena's dtypes (transformers converts only strings)",
}


@pytest.mark.usefixtures("hf_reference")
def test_parsed_values_equal_transformers():
    transformers.logging.set_verbosity_error()
    counts = {"same": 0, "both refuse": 0}
    stricter = set()
    failures = []
    for base_name, what, cfg in _mutations():
        label = f"{base_name}: {what}"
        try:
            hf_config = _hf_config(cfg)
            hf = _hf_values(hf_config, cfg.get("model_type", "llama"))
        except Exception:  # noqa: BLE001 - transformers refuses (TypeError, ValueError, KeyError, ...)
            hf = None
        try:
            ours = _ours(cfg)
        except ValueError as exc:
            ours = exc
        if hf is None:
            if isinstance(ours, ValueError):
                counts["both refuse"] += 1
            else:
                failures.append(f"{label}: transformers refuses, we accept {ours}")
        elif isinstance(ours, ValueError):
            rules = [rule for rule in STRICTER if re.search(rule, str(ours))]
            if rules:
                stricter.update(rules)
            else:
                failures.append(f"{label}: we refuse ({ours}) but transformers accepts")
        elif ours != hf:
            diff = {k: (ours[k], hf[k]) for k in hf if ours[k] != hf[k]}
            failures.append(f"{label}: ours != transformers: {diff}")
        else:
            counts["same"] += 1
            supported = hf["hidden_act"] == "silu" and not hf["attention_bias"] and not hf["mlp_bias"]
            if supported and hf["rope_type"] in ("default", "llama3"):  # what models.LlamaConfig takes from them
                m = models.LlamaConfig.from_hf(cfg)
                got = (m.num_kv_heads, m.head_dim, m.rms_norm_eps, m.rope_theta, m.sliding_window, m.tie_word_embeddings)
                want = (hf["num_key_value_heads"], hf["head_dim"], hf["rms_norm_eps"], hf["rope_theta"],
                        hf["sliding_window"], hf["tie_word_embeddings"])  # fmt: skip
                if got != want:
                    failures.append(f"{label}: LlamaConfig.from_hf {got} != transformers {want}")
    assert not failures, "\n".join(failures[:40])
    assert counts["same"] >= 40 and counts["both refuse"] >= 100, counts  # the mutations exercise both sides
    assert stricter == set(STRICTER), f"rules no mutation needed: {set(STRICTER) - stricter}"


@pytest.mark.usefixtures("hf_reference")
def test_stop_tokens_equal_transformers_generation_config(tmp_path):
    """Which eos ids transformers' generate uses, for config.json / generation_config.json combinations."""
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**_without(LLAMA, "model_type", "torch_dtype"))
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    cases = [  # (config.json eos_token_id or "absent", generation_config.json or None)
        ("absent", None), (5, None), ([5, 6], None), (None, None),
        (5, {"eos_token_id": 7}), (5, {"bos_token_id": 1}), (5, {"eos_token_id": None}), ("absent", {"eos_token_id": [7, 8]}),
    ]  # fmt: skip
    for eos, generation in cases:
        cfg = _without(saved, "eos_token_id") if eos == "absent" else dict(saved, eos_token_id=eos)
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        gen_path = tmp_path / "generation_config.json"
        gen_path.unlink(missing_ok=True)
        if generation is not None:
            gen_path.write_text(json.dumps(generation))
        hf_eos = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).generation_config.eos_token_id
        want = () if hf_eos is None else tuple(hf_eos) if isinstance(hf_eos, list) else (hf_eos,)
        assert models.LlamaConfig.from_hf(tmp_path).eos_token_ids == want, (eos, generation)


@pytest.mark.usefixtures("hf_reference")
def test_real_checkpoint_configs_match_presets():
    """config.json of Llama-3.1-8B and Mistral-7B-v0.1 as published (keys that matter)."""
    llama31 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
               "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
               "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
               "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
               "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
               "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
               "vocab_size": 128256}  # fmt: skip
    mistral = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
               "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
               "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
               "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
               "vocab_size": 32000}  # fmt: skip
    for cfg, preset in [(llama31, models.LlamaConfig.llama3_8b()), (mistral, models.LlamaConfig.mistral_7b())]:
        ours = models.LlamaConfig.from_hf(cfg)
        assert ours == dataclasses.replace(preset, eos_token_ids=(cfg["eos_token_id"],))
        hf = _hf_values(_hf_config(cfg), cfg["model_type"])
        assert _ours(cfg) == hf
        assert math.isclose(ours.rms_norm_eps, 1e-5)
