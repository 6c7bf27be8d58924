"""What transformers makes of a config.json, and ours, side by side (tests/test_hf_config.py's
oracle): transformers' config class, its rotary embedding's inverse frequencies per layer type
and its layer-0 attention module (built on the meta device: structure only), against
`arena_jax.hf.config.parse_hf_config` and `models.LlamaConfig.from_hf`."""
from __future__ import annotations

import copy

import numpy as np
import torch
import transformers

from arena_jax import models
from arena_jax.hf.config import parse_hf_config

__all__ = ["HF", "ours", "check_model_config", "HF_CLASSES"]

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


# model_type -> (config class, modeling module, class name prefix)
HF_CLASSES = {
    "llama": ("LlamaConfig", "llama", "Llama"),
    "mistral": ("MistralConfig", "mistral", "Mistral"),
    "qwen2": ("Qwen2Config", "qwen2", "Qwen2"),
    "qwen3": ("Qwen3Config", "qwen3", "Qwen3"),
    "gemma2": ("Gemma2Config", "gemma2", "Gemma2"),
    "gemma3_text": ("Gemma3TextConfig", "gemma3", "Gemma3"),
}


class HF:
    """What transformers makes of a config.json: its config, rotary embedding and layer-0 attention."""

    def __init__(self, cfg: dict):
        self.model_type = cfg.get("model_type", "llama")
        cls, module, prefix = HF_CLASSES[self.model_type]
        self.config = getattr(transformers, cls).from_dict(copy.deepcopy(cfg))
        modeling = getattr(getattr(transformers.models, module), f"modeling_{module}")
        self.rotary = getattr(modeling, f"{prefix}RotaryEmbedding")(self.config)
        with torch.device("meta"):  # its structure only: no weights allocated or drawn
            self.attention = getattr(modeling, f"{prefix}Attention")(self.config, 0)

    def layer_types(self) -> list[str]:
        c = self.config
        if self.model_type == "llama":
            return ["full_attention"] * c.num_hidden_layers
        if self.model_type == "mistral":
            return ["full_attention" if c.sliding_window is None else "sliding_attention"] * c.num_hidden_layers
        return list(c.layer_types)

    def ropes(self) -> dict:
        """layer type -> (rope_type, rope_theta, scaling) for the layer types the model has."""
        out = {}
        for t in sorted(set(self.layer_types())):
            rope = self.config.rope_parameters[t] if self.model_type == "gemma3_text" else self.config.rope_parameters
            keys = {"llama3": list(LLAMA3_KEYS), "linear": ["factor"]}.get(rope["rope_type"])
            out[t] = (rope["rope_type"], rope["rope_theta"], None if keys is None else {k: rope[k] for k in keys})
        return out

    def inv_freq(self, layer_type: str):
        name = f"{layer_type}_inv_freq" if self.model_type == "gemma3_text" else "inv_freq"
        return getattr(self.rotary, name).numpy()

    def values(self) -> dict:
        c, attn = self.config, self.attention
        eos = c.eos_token_id
        windows = [c.sliding_window if t == "sliding_attention" else None for t in self.layer_types()]
        return {
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": attn.head_dim,
            "hidden_act": c.hidden_activation if self.model_type.startswith("gemma") else c.hidden_act,
            "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": c.tie_word_embeddings,
            "attention_bias": attn.q_proj.bias is not None,
            "attention_output_bias": attn.o_proj.bias is not None,
            "mlp_bias": bool(getattr(c, "mlp_bias", False)),
            "windows": tuple(windows),
            "ropes": self.ropes(),
            "qk_norm": hasattr(attn, "q_norm"),
            "sm_scale": attn.scaling,
            "attn_logit_softcapping": attn.attn_logit_softcapping if self.model_type == "gemma2" else None,
            "final_logit_softcapping": c.final_logit_softcapping if self.model_type.startswith("gemma") else None,
            "use_bidirectional_attention": bool(getattr(c, "use_bidirectional_attention", False)),
            "eos_token_id": () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
        }


def ours(cfg) -> dict:
    p = parse_hf_config(cfg)
    full = (p.rope_type, p.rope_theta, p.rope_scaling)
    local = full if p.local_rope is None else (p.local_rope.rope_type, p.local_rope.rope_theta, p.local_rope.scaling)
    keys = ("vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
            "head_dim hidden_act max_position_embeddings rms_norm_eps tie_word_embeddings attention_bias "
            "attention_output_bias mlp_bias qk_norm attn_logit_softcapping final_logit_softcapping "
            "use_bidirectional_attention eos_token_id").split()
    out = {key: getattr(p, key) for key in keys}
    out["windows"] = tuple(p.sliding_window if t == "sliding_attention" else None for t in p.layer_types)
    out["ropes"] = {t: full if t == "full_attention" else local for t in sorted(set(p.layer_types))}
    out["sm_scale"] = (p.head_dim if p.query_pre_attn_scalar is None else p.query_pre_attn_scalar) ** -0.5
    return out


def check_model_config(cfg, hf: HF, values: dict) -> str | None:
    """What `models.LlamaConfig.from_hf` takes, against transformers' (None when equal)."""
    from arena_jax.models.layers import rope_frequencies

    m = models.LlamaConfig.from_hf(cfg)
    got = (m.num_kv_heads, m.head_dim, m.rms_norm_eps, m.layer_windows(), m.tie_word_embeddings, m.qkv_bias, m.o_bias,
           m.qk_norm, m.sm_scale, m.attn_logit_softcapping, m.final_logit_softcapping, m.hidden_act)
    want = (values["num_key_value_heads"], values["head_dim"], values["rms_norm_eps"], values["windows"],
            values["tie_word_embeddings"], values["attention_bias"], values["attention_output_bias"], values["qk_norm"],
            values["sm_scale"], values["attn_logit_softcapping"], values["final_logit_softcapping"],
            values["hidden_act"].replace("swish", "silu"))  # fmt: skip
    if got != want:
        return f"LlamaConfig.from_hf {got} != transformers {want}"
    for i, t in enumerate(hf.layer_types()):
        freq = rope_frequencies(m.head_dim, *m.layer_rope(i))
        if not np.allclose(freq, hf.inv_freq(t), rtol=1e-6, atol=0):
            return f"layer {i} ({t}) RoPE inverse frequencies differ: {freq} != {hf.inv_freq(t)}"
    return None
