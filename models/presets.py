"""`LlamaConfig` presets: one real size of each family (config.json values as published, the
keys that shape the model) and tiny random-weight variants per family for tests.

    models.LlamaConfig.qwen3_8b()            # or models.presets.qwen3_8b()
    models.LlamaConfig.tiny_family("gemma3_text")

The values live in `models.preset_table` (below `models.config`, whose classmethods read it);
these functions, above `models.config`, return the configs.
"""
from __future__ import annotations

from models.config import MODEL_TYPES, LlamaConfig, RopeScaling  # noqa: F401  (the names models.presets had)
from models.preset_table import _TINY, alternating, every_nth_global  # noqa: F401  (re-exported)

__all__ = [
    "llama3_8b", "llama3_70b", "mistral_7b", "qwen2_5_7b", "qwen3_8b", "gemma2_9b", "gemma3_1b", "gemma3_4b_text",
    "tiny", "tiny_family", "alternating", "every_nth_global",
]


def llama3_8b() -> LlamaConfig:
    """Meta-Llama-3.1-8B."""
    return LlamaConfig.llama3_8b()


def llama3_70b() -> LlamaConfig:
    """Meta-Llama-3.1-70B."""
    return LlamaConfig.llama3_70b()


def mistral_7b() -> LlamaConfig:
    """Mistral-7B-v0.1 (sliding window 4096 on every layer)."""
    return LlamaConfig.mistral_7b()


def qwen2_5_7b() -> LlamaConfig:
    """Qwen2.5-7B-Instruct: q/k/v biases, no window (use_sliding_window false)."""
    return LlamaConfig.qwen2_5_7b()


def qwen3_8b() -> LlamaConfig:
    """Qwen3-8B: q/k RMSNorms, head_dim 128 (not hidden / heads)."""
    return LlamaConfig.qwen3_8b()


def gemma2_9b() -> LlamaConfig:
    """gemma-2-9b: GeGLU, soft-caps 50 / 30, sliding window 4096 on every other layer."""
    return LlamaConfig.gemma2_9b()


def gemma3_1b() -> LlamaConfig:
    """gemma-3-1b (model_type gemma3_text): 5 local (window 512, RoPE base 1e4) : 1 global
    (base 1e6) layers, q/k norms, one KV head."""
    return LlamaConfig.gemma3_1b()


def gemma3_4b_text() -> LlamaConfig:
    """The text decoder of gemma-3-4b: window 1024, global layers' RoPE linearly scaled by 8."""
    return LlamaConfig.gemma3_4b_text()


def tiny(**overrides) -> LlamaConfig:
    """A small random-weight Llama for tests and the CPU demo (GQA 4/2, head_dim 16)."""
    return LlamaConfig.tiny(**overrides)


def tiny_family(model_type: str, **overrides) -> LlamaConfig:
    """A tiny model of `model_type` with its family's features on (see `models.preset_table._TINY`);
    `overrides` replace any field (give `layer_types` again when changing `num_layers` of a mixed model)."""
    return LlamaConfig.tiny_family(model_type, **overrides)
