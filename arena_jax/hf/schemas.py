"""transformers 5.x config classes, as data: per `model_type`, the fields a decoder's shape and
numerics depend on (name -> type, default, nullable), copied from `models/<family>/configuration_*.py`
(`LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config`, `Gemma2Config`, `Gemma3TextConfig`).
Other keys are ignored, as there. `arena_jax.hf.config` reads config.json with them;
tests/test_hf_config.py checks every value against the installed transformers.
"""
from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Field", "SCHEMAS", "Family", "FAMILIES"]


@dataclasses.dataclass(frozen=True)
class Field:
    kind: str  # "int", "float", "bool", "str", "ids" (int | list[int]), "types" (list[str])
    default: Any
    nullable: bool = False  # transformers' annotation includes None
    low: int = 1  # the smallest integer accepted (sizes are positive)


def _common(**changes) -> dict[str, Field]:
    base = {
        "vocab_size": Field("int", 32000),
        "hidden_size": Field("int", 4096),
        "intermediate_size": Field("int", 11008),
        "num_hidden_layers": Field("int", 32),
        "num_attention_heads": Field("int", 32),
        "num_key_value_heads": Field("int", None, nullable=True),
        "head_dim": Field("int", None, nullable=True),
        "hidden_act": Field("str", "silu"),
        "max_position_embeddings": Field("int", 2048),
        "rms_norm_eps": Field("float", 1e-6),
        "eos_token_id": Field("ids", 2, nullable=True),
        "tie_word_embeddings": Field("bool", False),
    }
    base.update(changes)
    return {k: v for k, v in base.items() if v is not None}


_QWEN_WINDOWS = dict(
    use_sliding_window=Field("bool", False),
    sliding_window=Field("int", 4096, nullable=True),
    max_window_layers=Field("int", 28, low=0),  # layers from this index on are sliding
    layer_types=Field("types", None, nullable=True),
)
_GEMMA = dict(
    vocab_size=Field("int", 256000),
    hidden_size=Field("int", 2304),
    intermediate_size=Field("int", 9216),
    num_hidden_layers=Field("int", 26),
    num_attention_heads=Field("int", 8),
    num_key_value_heads=Field("int", 4),  # `int`: null is refused
    head_dim=Field("int", 256),
    hidden_act=None,  # Gemma reads `hidden_activation` (a `hidden_act` key is ignored)
    hidden_activation=Field("str", "gelu_pytorch_tanh"),
    max_position_embeddings=Field("int", 8192),
    eos_token_id=Field("ids", 1, nullable=True),
    tie_word_embeddings=Field("bool", True),
    attention_bias=Field("bool", False),
    query_pre_attn_scalar=Field("int", 256),
    sliding_window=Field("int", 4096, nullable=True),
    layer_types=Field("types", None, nullable=True),
    final_logit_softcapping=Field("float", 30.0, nullable=True),
    attn_logit_softcapping=Field("float", 50.0, nullable=True),
    use_bidirectional_attention=Field("bool", None, nullable=True),
)

SCHEMAS: dict[str, dict[str, Field]] = {
    "llama": _common(attention_bias=Field("bool", False), mlp_bias=Field("bool", False)),
    "mistral": _common(
        intermediate_size=Field("int", 14336),
        num_key_value_heads=Field("int", 8),  # `int`, not `int | None`: null is refused there
        max_position_embeddings=Field("int", 4096 * 32),
        sliding_window=Field("int", 4096, nullable=True),
        # no attention_bias / mlp_bias: Mistral's projections never have a bias (the keys are ignored)
    ),
    "qwen2": _common(
        vocab_size=Field("int", 151936),
        intermediate_size=Field("int", 22016),
        num_key_value_heads=Field("int", 32, nullable=True),
        # no head_dim field: the attention reads `getattr(config, "head_dim", hidden // heads)`,
        # so a given key counts (null breaks its attention: refused here)
        head_dim=Field("int", None),
        max_position_embeddings=Field("int", 32768),
        eos_token_id=Field("ids", None, nullable=True),
        **_QWEN_WINDOWS,
    ),
    "qwen3": _common(
        vocab_size=Field("int", 151936),
        intermediate_size=Field("int", 22016),
        num_key_value_heads=Field("int", 32, nullable=True),
        head_dim=Field("int", 128),
        max_position_embeddings=Field("int", 32768),
        eos_token_id=Field("ids", None, nullable=True),
        attention_bias=Field("bool", False),
        **_QWEN_WINDOWS,
    ),
    "gemma2": _common(**_GEMMA),
    "gemma3_text": _common(
        **dict(
            _GEMMA,
            vocab_size=Field("int", 262208),
            max_position_embeddings=Field("int", 131072),
            final_logit_softcapping=Field("float", None, nullable=True),
            attn_logit_softcapping=Field("float", None, nullable=True),
            use_bidirectional_attention=Field("bool", False, nullable=True),
        )
    ),
}


@dataclasses.dataclass(frozen=True)
class Family:
    """How a model type's modeling code uses its config (beyond the field defaults)."""

    hidden_act_key: str = "hidden_act"
    qkv_bias: str | bool = False  # a bool, or the config key that sets it
    o_bias: str | bool = False
    mlp_bias: str | bool = False
    hidden_multiple_of_heads: bool = False  # validate_architecture: hidden_size % num_attention_heads == 0
    windows: str = "none"  # "none" | "all" (Mistral) | "qwen" (use_sliding_window, max_window_layers) | "gemma2" | "gemma3"
    qk_norm: bool = False
    gemma: bool = False  # (1 + w) RMSNorms, sandwich norms, sqrt(hidden) embedding scale, query_pre_attn_scalar
    attn_softcap: bool = False  # the attention applies attn_logit_softcapping (Gemma 3's modeling ignores it)


FAMILIES: dict[str, Family] = {
    "llama": Family(qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias", hidden_multiple_of_heads=True),
    "mistral": Family(windows="all"),
    "qwen2": Family(qkv_bias=True, windows="qwen"),
    "qwen3": Family(qkv_bias="attention_bias", o_bias="attention_bias", windows="qwen", qk_norm=True),
    "gemma2": Family(hidden_act_key="hidden_activation", qkv_bias="attention_bias", o_bias="attention_bias",
                     hidden_multiple_of_heads=True, windows="gemma2", gemma=True, attn_softcap=True),
    "gemma3_text": Family(hidden_act_key="hidden_activation", qkv_bias="attention_bias", o_bias="attention_bias",
                          hidden_multiple_of_heads=True, windows="gemma3", qk_norm=True, gemma=True),
}
