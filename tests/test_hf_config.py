"""`arena_jax.hf.config`: config.json read as transformers reads it.

The oracle is the installed `transformers`: for Llama, Mistral, Qwen 2, Qwen 3, Gemma 2 and
Gemma 3 (text) configs with each key removed in turn and each key given a wrong type or an
out-of-range value, our parsed values equal what transformers computes from them (its config
class's `from_dict`, its rotary embedding's inverse frequencies per layer type, its layer-0
attention module's head_dim, scale, biases, q/k norms and soft-cap, the window of every
layer), or both refuse. Where we refuse and transformers accepts, its model must be
unusable on that config (building or running it fails, or its logits are not finite); the one
deliberate exception is an eos id outside the vocabulary (transformers only warns).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re


import pytest

import arena_jax as aj
from arena_jax import models
from arena_jax.hf.config import kv_geometry, parse_hf_config

def _without(cfg, *keys):
    return {k: v for k, v in cfg.items() if k not in keys}


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
_SMALL = {k: LLAMA[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "torch_dtype")}
QWEN2 = dict(_SMALL, model_type="qwen2", num_hidden_layers=3, hidden_act="silu", rope_theta=1000000.0,
             use_sliding_window=True, sliding_window=8, max_window_layers=1, tie_word_embeddings=False,
             eos_token_id=[1, 2])
GEMMA2 = dict(_SMALL, model_type="gemma2", num_hidden_layers=3, head_dim=16, hidden_activation="gelu_pytorch_tanh",
              rope_theta=10000.0, query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=30.0,
              attn_logit_softcapping=50.0, attention_bias=False, tie_word_embeddings=True, eos_token_id=1)
GEMMA3 = dict(_SMALL, model_type="gemma3_text", num_hidden_layers=4, head_dim=16, hidden_activation="gelu_pytorch_tanh",
              rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
              sliding_window_pattern=3, query_pre_attn_scalar=24, sliding_window=8, final_logit_softcapping=30.0,
              tie_word_embeddings=True, eos_token_id=[1, 106])
BASES.update({
    "qwen2_windows": QWEN2,
    "qwen2_layer_types": dict(_without(QWEN2, "max_window_layers"), layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen3": dict(_without(QWEN2, "use_sliding_window", "sliding_window", "max_window_layers"), model_type="qwen3",
                  head_dim=32, attention_bias=True),
    "gemma2": GEMMA2,
    "gemma3_v4_rope": GEMMA3,  # rope_theta / rope_local_base_freq / rope_scaling, sliding_window_pattern
    "gemma3_v5_rope": dict(  # one RoPE per layer type
        _without(GEMMA3, "rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern"),
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
})


# ---- unit cases (no transformers needed) -----------------------------------------------------------


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


def test_an_unsupported_activation_is_named_by_the_family_key():
    """Gemma's config names it `hidden_activation` (its `hidden_act` is ignored): the error did not."""
    for base in (GEMMA2, GEMMA3):
        with pytest.raises(ValueError, match=r": hidden_activation='relu' is not supported; expected one of"):
            models.LlamaConfig.from_hf(dict(base, hidden_activation="relu"))
    with pytest.raises(ValueError, match=r": hidden_act='relu' is not supported; expected one of"):
        models.LlamaConfig.from_hf(dict(LLAMA, hidden_act="relu"))


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
    phi = {"model_type": "phi3", "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
           "hidden_size": 3072, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}  # fmt: skip
    g = kv_geometry(phi)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.max_position_embeddings) == (32, 32, 96, 4096)
    with pytest.raises(ValueError, match="num_key_value_heads is required for model_type 'phi3'"):
        kv_geometry(_without(phi, "num_key_value_heads"))
    with pytest.raises(ValueError, match="num_hidden_layers must be a JSON integer"):
        kv_geometry(dict(phi, num_hidden_layers=28.0))
    with pytest.raises(ValueError, match="pass max_seq_len"):
        aj.KVLayout.from_hf_config(_without(phi, "max_position_embeddings"), num_pages=4)
    for parse in (parse_hf_config, models.LlamaConfig.from_hf):
        with pytest.raises(ValueError, match=r"model_type must be one of \['gemma2', .*'qwen3'\], got 'phi3'"):
            parse(phi)
    for bad in (None, 5, ["llama"], {"a": 1}):
        for parse in (parse_hf_config, kv_geometry):
            with pytest.raises(ValueError, match="model_type must be one of"):
                parse(dict(LLAMA, model_type=bad))
    # Known model types get transformers' defaults (Qwen 2: 32 KV heads unless given)
    qwen = {"model_type": "qwen2", "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "hidden_size": 3584}  # fmt: skip
    g = kv_geometry(qwen)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.max_position_embeddings) == (28, 4, 128, 32768)
    with pytest.raises(ValueError, match="num_key_value_heads = 32 must divide num_attention_heads = 28"):
        kv_geometry(_without(qwen, "num_key_value_heads"))
    with pytest.raises(ValueError, match="'gemma3' is the multimodal Gemma 3"):
        parse_hf_config({"model_type": "gemma3", "text_config": {"hidden_size": 2560}})


def test_family_derivations():
    """Windows, RoPE and what each family's modeling code fixes, as transformers derives them."""
    q = parse_hf_config(QWEN2)
    assert q.layer_types == ("full_attention", "sliding_attention", "sliding_attention") and q.sliding_window == 8
    assert (q.attention_bias, q.attention_output_bias, q.qk_norm, q.gemma) == (True, False, False, False)
    off = parse_hf_config(dict(QWEN2, use_sliding_window=False))
    assert off.sliding_window is None and set(off.layer_types) == {"full_attention"}
    g2 = parse_hf_config(_without(GEMMA2, "layer_types"))
    assert g2.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.query_pre_attn_scalar) == (50.0, 30.0, 24)
    g3 = parse_hf_config(dict(GEMMA3, num_hidden_layers=7, sliding_window_pattern=6))
    assert g3.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (g3.rope_type, g3.rope_theta, g3.rope_scaling) == ("linear", 1e6, {"factor": 8.0})
    assert (g3.local_rope.rope_type, g3.local_rope.rope_theta) == ("default", 1e4)
    assert g3.attn_logit_softcapping is None and g3.qk_norm and g3.gemma  # Gemma 3's attention ignores the cap
    defaults = parse_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 6})
    assert (defaults.rope_theta, defaults.local_rope.rope_theta, defaults.head_dim) == (1e6, 1e4, 256)
    with pytest.raises(ValueError, match="layer_types holds \\['chunked_attention'\\]"):
        parse_hf_config(dict(GEMMA2, layer_types=["chunked_attention"] * 3))
    with pytest.raises(ValueError, match="sliding_window is null .* but layer_types has sliding_attention layers"):
        parse_hf_config(dict(GEMMA2, sliding_window=None))
    with pytest.raises(ValueError, match="rope_parameters.full_attention is a RoPE per layer type"):
        parse_hf_config(dict(QWEN2, rope_parameters={"full_attention": {"rope_type": "default"}}))
    with pytest.raises(ValueError, match="use_bidirectional_attention=true is not supported"):
        models.LlamaConfig.from_hf(dict(GEMMA3, use_bidirectional_attention=True))


def test_family_configs_round_trip_and_refuse_mixtures():
    presets = [models.LlamaConfig.llama3_8b(), models.LlamaConfig.mistral_7b(), models.LlamaConfig.qwen2_5_7b(),
               models.LlamaConfig.qwen3_8b(), models.LlamaConfig.gemma2_9b(), models.LlamaConfig.gemma3_1b(),
               models.LlamaConfig.gemma3_4b_text()]  # fmt: skip
    tiny = [models.LlamaConfig.tiny_family(t) for t in models.config.MODEL_TYPES]
    for cfg in presets + tiny:
        assert models.LlamaConfig.from_hf(cfg.to_hf()) == cfg, cfg.model_type
    g3 = models.LlamaConfig.gemma3_1b()
    assert g3.layer_windows()[:6] == (512,) * 5 + (None,) and g3.layer_rope(5) == (1e6, None)
    assert g3.layer_rope(0) == (1e4, None) and g3.with_num_layers(8).layer_types[6:] == ("sliding_attention",) * 2
    assert models.LlamaConfig.tiny(sliding_window=8).model_type == "mistral"  # as before: a window means Mistral
    with pytest.raises(ValueError, match="attention_bias=False: Qwen 2 always has q, k and v biases"):
        models.LlamaConfig.tiny_family("qwen2", attention_bias=False)
    with pytest.raises(ValueError, match="attn_logit_softcapping is set but model_type is 'gemma3_text'"):
        models.LlamaConfig.tiny_family("gemma3_text", attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="query_pre_attn_scalar is set but model_type 'llama'"):
        models.LlamaConfig.tiny(query_pre_attn_scalar=16.0)
    with pytest.raises(ValueError, match="sliding_window is set but model_type is 'llama'"):
        models.LlamaConfig.tiny(model_type="llama", sliding_window=8)
    with pytest.raises(ValueError, match="layer_types has 2 entries but num_layers=3"):
        models.LlamaConfig.tiny_family("gemma2", num_layers=3)
    with pytest.raises(ValueError, match="hidden_act must be one of"):
        models.LlamaConfig.tiny(hidden_act="relu")


# ---- the transformers oracle ------------------------------------------------------------------------

from hf_reference import hf_reference, transformers  # noqa: E402,F401  (a fixture; None where not installed)

if transformers is not None:  # the oracle imports torch and transformers; without them its tests skip (fail in CI)
    from hf_oracle import HF, check_model_config, ours as our_values  # noqa: E402


def _wrong_values(value):
    """Wrong types and edge values for a key whose good value is `value`."""
    out = [None, "7", True, [value], {"x": 1}]
    if isinstance(value, bool):
        out += [0, 1, "true"]
    elif isinstance(value, int):
        out += [float(value), value + 0.5, 0, -1, 3, str(value)]  # 3: odd, below most sizes
    elif isinstance(value, float):
        out += [int(value) or 1, 0.0, -value, float("nan"), float("inf")]
    elif isinstance(value, list) and all(isinstance(v, str) for v in value):  # layer_types
        out += [value[:-1], ["chunked_attention"] * len(value), ["attention"] * len(value), value[::-1], [1] * len(value)]
    elif isinstance(value, list):
        out += [[float(v) for v in value], [True], 1.5]
    return out


def _dict_mutations(base, key, value):
    """A RoPE dict's keys removed and mistyped, one level down (Gemma 3's per-layer-type dicts too)."""
    for sub, subvalue in value.items():
        yield f"{key}.{sub} removed", dict(base, **{key: _without(value, sub)})
        if isinstance(subvalue, dict):
            for inner, wrong_base in _dict_mutations({}, sub, subvalue):
                yield f"{key}.{inner}", dict(base, **{key: dict(value, **wrong_base)})
            continue
        for wrong in _wrong_values(subvalue) if sub != "rope_type" else ["default", "yarn", "linear", None, 3]:
            yield f"{key}.{sub}={wrong!r}", dict(base, **{key: dict(value, **{sub: wrong})})


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
            if isinstance(value, dict):
                for what, cfg in _dict_mutations(base, key, value):
                    yield base_name, what, cfg


# Where we refuse what transformers accepts: range checks it does not make (it builds an empty or
# degenerate model, computes NaN, or fails later), and its untyped RoPE dict / dtype. Each rule
# must be hit by some mutation, so the list cannot outlive the checks.
STRICTER = {
    r"must be in \[[01], 2147483647\], got (0|-1)$": "sizes, layers, heads, context and window starts are positive",
    r"must be finite and > 0, got": "rms_norm_eps, rope_theta, soft-caps and RoPE factors are positive and finite",
    r"must divide num_attention_heads": "grouped-query attention needs whole groups",
    r"must be even \(RoPE": "RoPE rotates pairs (transformers refuses odd head_dim only above 4)",
    r"outside the vocabulary": "a stop token the model cannot produce (transformers warns)",
    r"(rope_scaling|rope_parameters)[.\w]*\.\w+ must be a JSON (number|integer), got (True|False|16\.0|16\.5)": (
        "transformers does not type-check the RoPE dict"
    ),
    r"^config: (rope_theta|rope_local_base_freq) must be a JSON number, got (True|False)": "nor a top-level base",
    r"sliding_window_pattern must be (a JSON integer|in)": "nor Gemma 3's sliding_window_pattern (6.0, true, -1 work)",
    r"torch_dtype must be one of": "the KV arena's dtypes (transformers converts only strings)",
    r"layer_types holds \['chunked_attention'\]": "layer types these models do not run (transformers fails at forward)",
    r"sliding_window is null .* but layer_types has sliding_attention": "transformers fails at forward (a sliding mask without a window)",
}


@pytest.mark.usefixtures("hf_reference")
def test_parsed_values_equal_transformers():
    transformers.logging.set_verbosity_error()
    counts = {"same": 0, "both refuse": 0, "model configs": 0}
    stricter = set()
    failures = []
    for base_name, what, cfg in _mutations():
        label = f"{base_name}: {what}"
        try:
            hf = HF(cfg)
            values = hf.values()
        except Exception:  # noqa: BLE001 - transformers refuses (TypeError, ValueError, KeyError, ...)
            hf = values = None
        try:
            ours = our_values(cfg)
        except ValueError as exc:
            ours = exc
        if values is None:
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
        elif ours != values:
            diff = {k: (ours[k], values[k]) for k in values if ours[k] != values[k]}
            failures.append(f"{label}: ours != transformers: {diff}")
        else:
            counts["same"] += 1
            ropes = {r[0] for r in values["ropes"].values()}
            local = values["ropes"].get("sliding_attention", ("default",))[0]
            supported = (values["hidden_act"] in ("silu", "gelu_pytorch_tanh") and not values["mlp_bias"]
                         and ropes <= {"default", "llama3", "linear"} and not values["use_bidirectional_attention"]
                         and (hf.model_type != "gemma3_text" or local == "default"))  # fmt: skip
            if supported:
                counts["model configs"] += 1
                problem = check_model_config(cfg, hf, values)
                if problem:
                    failures.append(f"{label}: {problem}")
    assert not failures, "\n".join(failures[:40])
    assert counts["same"] >= 150 and counts["both refuse"] >= 400 and counts["model configs"] >= 120, counts
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
    """config.json of Llama-3.1-8B, Mistral-7B-v0.1, Qwen2.5-7B-Instruct, Qwen3-8B, gemma-2-9b and
    gemma-3-1b-it as published (keys that matter): the presets, and transformers reads them alike."""
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
    qwen25 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
              "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02,
              "intermediate_size": 18944, "max_position_embeddings": 32768, "max_window_layers": 28,
              "model_type": "qwen2", "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064}  # fmt: skip
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
             "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
             "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
             "max_window_layers": 36, "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
             "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
             "use_sliding_window": False, "vocab_size": 151936}  # fmt: skip
    gemma2 = {"architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": 1,
              "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
              "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 3584, "initializer_range": 0.02,
              "intermediate_size": 14336, "max_position_embeddings": 8192, "model_type": "gemma2",
              "num_attention_heads": 16, "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
              "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
              "sliding_window_size": 4096, "torch_dtype": "float32", "use_cache": True, "vocab_size": 256000}  # fmt: skip
    gemma3 = {"architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
              "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid",
              "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
              "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
              "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
              "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
              "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
              "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
              "use_cache": True, "vocab_size": 262144}  # fmt: skip
    pairs = [(llama31, models.LlamaConfig.llama3_8b()), (mistral, models.LlamaConfig.mistral_7b()),
             (qwen25, models.LlamaConfig.qwen2_5_7b()), (qwen3, models.LlamaConfig.qwen3_8b()),
             (gemma2, models.LlamaConfig.gemma2_9b()), (gemma3, models.LlamaConfig.gemma3_1b())]  # fmt: skip
    transformers.logging.set_verbosity_error()
    for cfg, preset in pairs:
        ours = models.LlamaConfig.from_hf(cfg)
        eos = cfg["eos_token_id"]
        assert ours == dataclasses.replace(preset, eos_token_ids=tuple(eos) if isinstance(eos, list) else (eos,))
        hf = HF(cfg)
        assert our_values(cfg) == hf.values(), cfg["model_type"]
        assert check_model_config(cfg, hf, hf.values()) is None
    assert math.isclose(models.LlamaConfig.from_hf(llama31).rms_norm_eps, 1e-5)
