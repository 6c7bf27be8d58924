"""The presets' values: for each preset of `models.presets` (one real size of each family,
config.json values as published, the keys that shape the model, and tiny random-weight variants
per family for tests), the `LlamaConfig` fields as a dict. It answers "what is preset X made
of?" and sits below `models.config`, whose classmethods (`LlamaConfig.qwen3_8b()`, `.tiny()`, ...)
build configs from it; `models.presets` (above both) gives the same presets as functions.
"""
from __future__ import annotations

from arena_jax.models.config_fields import MODEL_TYPES, RopeScaling

__all__ = [
    "llama3_8b", "llama3_70b", "mistral_7b", "qwen2_5_7b", "qwen3_8b", "gemma2_9b", "gemma3_1b", "gemma3_4b_text",
    "tiny", "mid", "tiny_family", "alternating", "every_nth_global",
]


def alternating(num_layers: int) -> tuple[str, ...]:
    """Gemma 2's layer types: sliding, full, sliding, full, ..."""
    return tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers))


def every_nth_global(num_layers: int, n: int = 6) -> tuple[str, ...]:
    """Gemma 3's layer types: every n-th layer full, the others sliding (5 local : 1 global)."""
    return tuple("sliding_attention" if (i + 1) % n else "full_attention" for i in range(num_layers))


def llama3_8b() -> dict:
    """Meta-Llama-3.1-8B."""
    return dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192),
        max_position_embeddings=131072,
    )


def llama3_70b() -> dict:
    """Meta-Llama-3.1-70B."""
    return dict(
        llama3_8b(), hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64, head_dim=128
    )


def mistral_7b() -> dict:
    """Mistral-7B-v0.1 (sliding window 4096 on every layer)."""
    return dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768, sliding_window=4096,
    )


def qwen2_5_7b() -> dict:
    """Qwen2.5-7B-Instruct: q/k/v biases, no window (use_sliding_window false)."""
    return dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
        num_heads=28, num_kv_heads=4, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
    )


def qwen3_8b() -> dict:
    """Qwen3-8B: q/k RMSNorms, head_dim 128 (not hidden / heads)."""
    return dict(
        model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
        max_position_embeddings=40960,
    )


def gemma2_9b() -> dict:
    """gemma-2-9b: GeGLU, soft-caps 50 / 30, sliding window 4096 on every other layer."""
    return dict(
        model_type="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336, num_layers=42,
        num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
        sliding_window=4096, layer_types=alternating(42), query_pre_attn_scalar=256.0,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    )


def gemma3_1b() -> dict:
    """gemma-3-1b (model_type gemma3_text): 5 local (window 512, RoPE base 1e4) : 1 global
    (base 1e6) layers, q/k norms, one KV head."""
    return dict(
        model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_layers=26,
        num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_theta=10000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        hidden_act="gelu_pytorch_tanh", sliding_window=512, layer_types=every_nth_global(26),
        query_pre_attn_scalar=256.0,
    )


def gemma3_4b_text() -> dict:
    """The text decoder of gemma-3-4b: window 1024, global layers' RoPE linearly scaled by 8."""
    return dict(
        gemma3_1b(), vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_layers=34, num_heads=8,
        num_kv_heads=4, max_position_embeddings=131072, sliding_window=1024, layer_types=every_nth_global(34),
        rope_scaling=RopeScaling(factor=8.0, rope_type="linear"),
    )


def tiny(**overrides) -> dict:
    """A small random-weight Llama for tests and the CPU demo (GQA 4/2, head_dim 16)."""
    base = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        rms_norm_eps=1e-6, max_position_embeddings=512,
    )
    base.update(overrides)
    return base


def mid(**overrides) -> dict:
    """A mid-size random-weight Llama a CPU decodes in milliseconds a token (hidden 512, 8 layers,
    8 query / 2 KV heads, head_dim 64, vocab 32,000: the "mid" model of the benchmarks' studies,
    `benchmarks.studies.context_cost`)."""
    base = dict(
        vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=2,
        max_position_embeddings=8192,
    )
    base.update(overrides)
    return base


# What each tiny family switches on; the windows (8) are shorter than test sequences.
_TINY = {
    "llama": dict(),
    "mistral": dict(sliding_window=8),
    "qwen2": dict(rope_theta=1000000.0, sliding_window=8, layer_types=("full_attention", "sliding_attention")),
    "qwen3": dict(head_dim=32, rope_theta=1000000.0),
    "gemma2": dict(
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, sliding_window=8, layer_types=alternating(2),
        query_pre_attn_scalar=24.0, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    ),
    "gemma3_text": dict(
        num_layers=6, hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, sliding_window=8,
        layer_types=every_nth_global(6), rope_theta=1000000.0, rope_local_theta=10000.0,
        rope_scaling=RopeScaling(factor=8.0, rope_type="linear"), query_pre_attn_scalar=24.0,
    ),
}


def tiny_family(model_type: str, **overrides) -> dict:
    """A tiny model of `model_type` with its family's features on (see `_TINY`); `overrides`
    replace any field (give `layer_types` again when changing `num_layers` of a mixed model)."""
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}")
    base = dict(_TINY[model_type], model_type=model_type)
    base.update(overrides)
    return tiny(**base)
