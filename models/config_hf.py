"""`LlamaConfig` <-> Hugging Face `config.json` (`LlamaConfig.from_hf` / `to_hf`).

Reading goes through `arena_jax.hf.config.parse_hf_config` (transformers' defaults, types and
derivations per model_type); what our models cannot compute is refused by name here. Writing
gives each family's own keys, so that transformers reads the config back as the same model
(tests/test_models_parity.py builds transformers models from `to_hf` dicts).

It sits below `models.config` (whose `from_hf` / `to_hf` call it): `config_from_hf` builds the
class it is given (`LlamaConfig`), `config_to_hf` reads the config it is given.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from arena_jax.hf.config import parse_hf_config
from arena_jax.hf.schemas import FAMILIES
from arena_jax.models.config_fields import RopeScaling

__all__ = ["config_from_hf", "config_to_hf"]

_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_pytorch_tanh"}  # transformers: swish is SiLU
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def _scaling(where: str, what: str, rope_type: str, params) -> RopeScaling | None:
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return RopeScaling(**params)
    if rope_type == "linear":
        return RopeScaling(factor=params["factor"], rope_type="linear")
    raise ValueError(f"{where}: {what}rope_type={rope_type!r} is not supported; expected 'default', 'llama3' or 'linear'")


def config_from_hf(cls, config, *, generation_config=None):
    hf = parse_hf_config(config, generation_config=generation_config)
    where = hf.source
    if hf.hidden_act not in _ACTS:
        key = FAMILIES[hf.model_type].hidden_act_key  # Gemma's is `hidden_activation`
        raise ValueError(f"{where}: {key}={hf.hidden_act!r} is not supported; expected one of {sorted(_ACTS)}")
    if hf.mlp_bias:
        raise ValueError(f"{where}: mlp_bias=true is not supported (the MLP projections have no bias)")
    if hf.quantized:
        raise ValueError(f"{where}: quantization_config is set: quantized checkpoints are not supported")
    if hf.partial_rotary_factor not in (None, 1.0):
        raise ValueError(f"{where}: partial_rotary_factor={hf.partial_rotary_factor} is not supported (only 1.0)")
    if hf.use_bidirectional_attention:
        raise ValueError(f"{where}: use_bidirectional_attention=true is not supported (a causal decoder only)")
    scaling = _scaling(where, "", hf.rope_type, hf.rope_scaling)
    local_theta = None
    if hf.local_rope is not None:  # Gemma 3's sliding layers, when their RoPE differs from the global layers'
        if hf.local_rope.rope_type != "default" or hf.local_rope.partial_rotary_factor not in (None, 1.0):
            raise ValueError(f"{where}: the sliding layers' RoPE must be rope_type 'default' (unscaled), got "
                             f"{hf.local_rope.rope_type!r}")
        local_theta = hf.local_rope.rope_theta
    gemma = hf.gemma
    return cls(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=hf.num_attention_heads,
        num_kv_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        rope_theta=hf.rope_theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=hf.tie_word_embeddings,
        sliding_window=hf.sliding_window,
        eos_token_ids=hf.eos_token_ids,
        model_type=hf.model_type,
        hidden_act=_ACTS[hf.hidden_act],
        attention_bias=hf.attention_bias,
        layer_types=hf.layer_types,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar) if gemma else None,
        attn_logit_softcapping=hf.attn_logit_softcapping if gemma else None,
        final_logit_softcapping=hf.final_logit_softcapping if gemma else None,
    )


def _eos_json(ids: tuple[int, ...]):
    """config.json's `eos_token_id`: an int, a list, or null (no stop token: transformers'
    generate then runs to max_new_tokens, as ours does)."""
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def _rope_dict(theta: float, scaling: RopeScaling | None) -> dict:
    if scaling is None:
        return {"rope_type": "default", "rope_theta": theta}
    if scaling.rope_type == "linear":
        return {"rope_type": "linear", "factor": scaling.factor, "rope_theta": theta}
    fields = dataclasses.asdict(scaling)
    del fields["rope_type"]
    return {"rope_type": "llama3", **fields, "rope_theta": theta}


def config_to_hf(cfg) -> dict[str, Any]:
    kind = cfg.model_type
    out = {
        "architectures": [_ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_activation" if cfg.gemma else "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "eos_token_id": _eos_json(cfg.eos_token_ids),
    }
    if kind == "gemma3_text":
        # transformers 5 spelling, one RoPE per layer type (4.x reads rope_theta / rope_local_base_freq)
        local = cfg.layer_rope(cfg.resolved_layer_types.index("sliding_attention")) if "sliding_attention" in \
            cfg.resolved_layer_types else (cfg.rope_theta, cfg.rope_scaling)
        out["rope_parameters"] = {
            "full_attention": _rope_dict(cfg.rope_theta, cfg.rope_scaling),
            "sliding_attention": _rope_dict(*local),
        }
    else:
        out["rope_theta"] = cfg.rope_theta
        if cfg.rope_scaling is not None:
            rope = _rope_dict(cfg.rope_theta, cfg.rope_scaling)
            del rope["rope_theta"]
            out["rope_scaling"] = rope
    if kind in ("llama", "qwen3") or cfg.gemma:
        out["attention_bias"] = cfg.attention_bias
    if kind == "llama":
        out["mlp_bias"] = False
    if kind == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if kind in ("qwen2", "qwen3"):
        types = cfg.resolved_layer_types
        out.update(use_sliding_window="sliding_attention" in types, sliding_window=cfg.sliding_window,
                   max_window_layers=cfg.num_layers, layer_types=list(types))
    if cfg.gemma:
        scalar = cfg.head_dim if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar
        if scalar != int(scalar):
            raise ValueError(f"query_pre_attn_scalar={scalar} is not an integer: transformers' Gemma config takes an int")
        out.update(
            query_pre_attn_scalar=int(scalar),
            sliding_window=cfg.sliding_window,
            layer_types=list(cfg.resolved_layer_types),
            final_logit_softcapping=cfg.final_logit_softcapping,
            attn_logit_softcapping=cfg.attn_logit_softcapping,
        )
    return out
