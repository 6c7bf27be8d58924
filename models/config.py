"""`LlamaConfig`: one frozen, validated config for Llama 2 / Llama 3 and Mistral.

    cfg = LlamaConfig.from_hf("path/to/checkpoint")        # config.json, a dict, or its folder
    cfg = LlamaConfig.llama3_8b()                          # presets: llama3_70b, mistral_7b, tiny
    layout = cfg.kv_layout(page_size=16, budget_bytes=8 << 30, max_seqs=64, max_seq_len=4096)

The config is hashable (a frozen dataclass of scalars), so it can sit in an NNX graphdef
that is a static argument of `jax.jit`.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import numpy as np

import arena_jax as aj
from arena_jax.hf_config import INT32_MAX, parse_hf_config

__all__ = ["LlamaConfig", "RopeScaling"]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 `rope_scaling` (rope_type "llama3"): low frequencies divided by `factor`,
    high frequencies kept, a smooth blend in between."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not _positive_number(value):
                raise ValueError(f"rope_scaling.{name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        _positive_int(self, "original_max_position_embeddings", prefix="rope_scaling.")


def _positive_int(obj, name: str, prefix: str = ""):
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT32_MAX:
        raise ValueError(f"{prefix}{name} must be an integer in [1, {INT32_MAX}], got {value!r}")


def _eos_json(ids: tuple[int, ...]):
    """config.json's `eos_token_id`: an int, a list, or null (no stop token: transformers'
    generate then runs to max_new_tokens, as ours does)."""
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a Llama-family decoder (Llama 2, Llama 3/3.1, Mistral).

    `head_dim` defaults to hidden_size // num_heads; `num_kv_heads` < `num_heads` is GQA.
    `sliding_window` (Mistral) limits each query to the last `sliding_window` keys, itself included.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # generation stops after one of these; random models have none

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            _positive_int(self, name)
        _positive_int(self, "max_position_embeddings")
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}; give head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        _positive_int(self, "head_dim")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not _positive_number(value):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if self.sliding_window is not None:
            _positive_int(self, "sliding_window")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        ids = self.eos_token_ids
        if isinstance(ids, (str, bytes)) or not isinstance(ids, (tuple, list)):
            raise ValueError(f"eos_token_ids must be a tuple of token ids, got {ids!r}")
        for t in ids:
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)) or not 0 <= t < self.vocab_size:
                raise ValueError(f"eos_token_ids must be integers in [0, vocab_size={self.vocab_size}), got {t!r}")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in ids))

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    def num_params(self) -> int:
        e, f, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = e * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        per_layer = attn + 3 * e * f + 2 * e
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.vocab_size * e + self.num_layers * per_layer + e + head

    # ---- the cache geometry for this model ------------------------------------------------
    def kv_layout(
        self,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        budget_bytes: int | None = None,
        max_seqs: int = 8,
        max_seq_len: int | None = None,
        dtype: Any = "bfloat16",
        scale_dtype: Any = None,
    ) -> aj.KVLayout:
        """An `arena_jax.KVLayout` sized by this model's KV heads (never its query heads).

        Give exactly one of `num_pages` and `budget_bytes`. `max_seq_len` defaults to
        `max_position_embeddings`. `dtype` is the arena's: a float dtype, or int8 /
        float8_e4m3fn / float8_e5m2 (8-bit values with per-token scales in `scale_dtype`,
        float32 by default; the model computes in its own dtype and the arena quantizes).
        """
        if (num_pages is None) == (budget_bytes is None):
            raise ValueError("give exactly one of num_pages and budget_bytes")
        max_seq_len = self.max_position_embeddings if max_seq_len is None else max_seq_len
        if budget_bytes is not None:
            return aj.KVLayout.for_memory_budget(
                self.num_layers,
                self.num_kv_heads,
                self.head_dim,
                budget_bytes=budget_bytes,
                page_size=page_size,
                max_seqs=max_seqs,
                max_seq_len=max_seq_len,
                dtype=dtype,
                scale_dtype=scale_dtype,
            )
        return aj.KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            page_size=page_size,
            num_pages=num_pages,
            max_seqs=max_seqs,
            max_pages_per_seq=-(-int(max_seq_len) // page_size),
            dtype=dtype,
            scale_dtype=scale_dtype,
        )

    # ---- Hugging Face config.json -------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | os.PathLike, *, generation_config=None) -> "LlamaConfig":
        """From a Hugging Face `config.json` (a dict, the file, or its folder).

        Read by `arena_jax.hf_config.parse_hf_config`: transformers' defaults per model_type,
        strict JSON types, both the transformers-4 spelling (`rope_theta`, `rope_scaling`) and
        the transformers-5 one (`rope_parameters`). `eos_token_ids` are the tokens
        transformers' `generate` stops at: `generation_config.json` beside a config path (or
        the `generation_config` dict given), else config.json's `eos_token_id`.
        """
        hf = parse_hf_config(config, generation_config=generation_config)
        where = hf.source
        if hf.hidden_act not in ("silu", "swish"):  # transformers: both name torch's SiLU
            raise ValueError(f"{where}: hidden_act={hf.hidden_act!r} is not supported; expected 'silu' (SwiGLU)")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(hf, flag):
                raise ValueError(f"{where}: {flag}=true is not supported (these projections have no bias)")
        if hf.quantized:
            raise ValueError(f"{where}: quantization_config is set: quantized checkpoints are not supported")
        if hf.partial_rotary_factor not in (None, 1.0):
            raise ValueError(f"{where}: partial_rotary_factor={hf.partial_rotary_factor} is not supported (only 1.0)")
        if hf.rope_type == "llama3":
            scaling = RopeScaling(**hf.rope_scaling)
        elif hf.rope_type == "default":
            scaling = None
        else:
            raise ValueError(f"{where}: rope_type={hf.rope_type!r} is not supported; expected 'default' or 'llama3'")
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
        )

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face `config.json` dict (transformers-4 spelling, which both 4 and 5 read)."""
        out = {
            "architectures": ["MistralForCausalLM" if self.sliding_window else "LlamaForCausalLM"],
            "model_type": "mistral" if self.sliding_window else "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "sliding_window": self.sliding_window,
            "eos_token_id": _eos_json(self.eos_token_ids),
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return out

    # ---- presets ----------------------------------------------------------------------------
    @classmethod
    def llama3_8b(cls) -> "LlamaConfig":
        """Meta-Llama-3.1-8B."""
        return cls(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
            max_position_embeddings=131072,
        )

    @classmethod
    def llama3_70b(cls) -> "LlamaConfig":
        """Meta-Llama-3.1-70B."""
        return dataclasses.replace(
            cls.llama3_8b(), hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, head_dim=128
        )

    @classmethod
    def mistral_7b(cls) -> "LlamaConfig":
        """Mistral-7B-v0.1 (sliding window 4096)."""
        return cls(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            max_position_embeddings=32768,
            sliding_window=4096,
        )

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A small random-weight model for tests and the CPU demo (GQA 4/2, head_dim 16)."""
        base = dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            rms_norm_eps=1e-6,
            max_position_embeddings=512,
        )
        base.update(overrides)
        return cls(**base)
