"""`LlamaConfig` presets: one real size of each family (config.json values as published, the
keys that shape the model) and tiny random-weight variants per family for tests.

    models.LlamaConfig.qwen3_8b()            # or models.presets.qwen3_8b()
    models.LlamaConfig.tiny_family("gemma3_text")

The values live in `models.preset_table` (below `models.config`, whose classmethods read it);
these functions, above `models.config`, return the configs.
"""
from __future__ import annotations

from arena_jax.models.config import MODEL_TYPES, LlamaConfig, RopeScaling  # noqa: F401  (the names models.presets had)
from arena_jax.models.preset_table import _TINY, alternating, every_nth_global  # noqa: F401  (re-exported)

__all__ = [
    "llama3_8b", "llama3_70b", "mistral_7b", "qwen2_5_7b", "qwen3_8b", "gemma2_9b", "gemma3_1b", "gemma3_4b_text",
    "tiny", "mid", "tiny_family", "alternating", "every_nth_global",
]

# Module-level names for the presets (the classmethods of `LlamaConfig`, bound).
llama3_8b = LlamaConfig.llama3_8b
llama3_70b = LlamaConfig.llama3_70b
mistral_7b = LlamaConfig.mistral_7b
qwen2_5_7b = LlamaConfig.qwen2_5_7b
qwen3_8b = LlamaConfig.qwen3_8b
gemma2_9b = LlamaConfig.gemma2_9b
gemma3_1b = LlamaConfig.gemma3_1b
gemma3_4b_text = LlamaConfig.gemma3_4b_text
tiny = LlamaConfig.tiny
mid = LlamaConfig.mid
tiny_family = LlamaConfig.tiny_family
