"""The vocabulary a `LlamaConfig` is written in: the families (`MODEL_TYPES`), activations,
layer types, `NO_WINDOW` and `RopeScaling`. It answers "what values may a config's fields
take?" and sits below `models.config` (the config), `models.config_hf` (Hugging Face
config.json) and `models.preset_table` (the presets' values), which all use it; its names are
re-exported by `models.config`.
"""
from __future__ import annotations

import dataclasses
import math

from arena_jax.hf.config import INT32_MAX

__all__ = ["RopeScaling", "MODEL_TYPES", "HIDDEN_ACTS", "LAYER_TYPES", "NO_WINDOW"]

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# A layer without a window, in the per-layer int32 windows the layer scan carries: any value
# >= max_seq_len is no window to `aj.attend` (which clips it), and the dense baseline's
# `key > query - window` cannot overflow with it.
NO_WINDOW = INT32_MAX
_GEMMA = ("gemma2", "gemma3_text")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. rope_type "llama3" (Llama 3.1): low frequencies divided by
    `factor`, high frequencies kept, a smooth blend in between. "linear" (Gemma 3's global
    layers): every frequency divided by `factor` (the other fields are unused)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"

    def __post_init__(self):
        if self.rope_type not in ("llama3", "linear"):
            raise ValueError(f"rope_scaling.rope_type must be 'llama3' or 'linear', got {self.rope_type!r}")
        for name in ("factor", "low_freq_factor", "high_freq_factor"):
            value = getattr(self, name)
            if not _positive_number(value):
                raise ValueError(f"rope_scaling.{name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling.high_freq_factor={self.high_freq_factor} must exceed "
                f"low_freq_factor={self.low_freq_factor}"
            )
        _positive_int(self, "original_max_position_embeddings", prefix="rope_scaling.")


def _positive_int(obj, name: str, prefix: str = ""):
    value = getattr(obj, name)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= INT32_MAX:
        raise ValueError(f"{prefix}{name} must be an integer in [1, {INT32_MAX}], got {value!r}")


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _optional_float(obj, name: str):
    value = getattr(obj, name)
    if value is not None:
        if not _positive_number(value):
            raise ValueError(f"{name} must be a finite number > 0 or None, got {value!r}")
        object.__setattr__(obj, name, float(value))
