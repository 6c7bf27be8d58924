"""Model presets known to `arena-bench` and the KV layout report built from them."""
from __future__ import annotations

from arena_jax.models.config import LlamaConfig

__all__ = ["PRESETS", "CPU_PRESETS", "LAYOUT_MODELS", "preset", "default_dtype", "layout_report"]

def tiny_gqa() -> LlamaConfig:
    """The tiny model with 8 query / 2 KV heads: it shards over any tensor degree up to 8 (KV heads
    split on tp=2, replicated from tp=4 on), for `arena-bench decode --mesh` on host devices."""
    return LlamaConfig.tiny(num_heads=8, num_kv_heads=2)


def _tiny(model_type: str):
    def make() -> LlamaConfig:
        return LlamaConfig.tiny_family(model_type)

    make.__doc__ = f"A tiny random {model_type} (models.presets.tiny_family): its family's features, window 8."
    return make


PRESETS = {
    "tiny": LlamaConfig.tiny,
    "mid": LlamaConfig.mid,
    "tiny-gqa": tiny_gqa,
    "tiny-mistral": _tiny("mistral"),
    "tiny-qwen2": _tiny("qwen2"),
    "tiny-qwen3": _tiny("qwen3"),
    "tiny-gemma2": _tiny("gemma2"),
    "tiny-gemma3": _tiny("gemma3_text"),
    "mistral-7b": LlamaConfig.mistral_7b,
    "llama3-8b": LlamaConfig.llama3_8b,
    "llama3-70b": LlamaConfig.llama3_70b,
    "qwen2.5-7b": LlamaConfig.qwen2_5_7b,
    "qwen3-8b": LlamaConfig.qwen3_8b,
    "gemma2-9b": LlamaConfig.gemma2_9b,
    "gemma3-1b": LlamaConfig.gemma3_1b,
    "gemma3-4b-text": LlamaConfig.gemma3_4b_text,
}
LAYOUT_MODELS = ("mistral-7b", "llama3-8b", "llama3-70b")
# The presets a CPU runs whole (random weights, float32 by default): the tiny ones and "mid"
# (hidden 512, 8 layers: the model of issue 39's mid goals, `benchmarks/RESULTS.md`).
CPU_PRESETS = tuple(name for name in PRESETS if name.startswith("tiny") or name == "mid")


def preset(name: str) -> LlamaConfig:
    return PRESETS[name]()


def default_dtype(name: str) -> str:
    """A preset's compute dtype when none is given: float32 for `CPU_PRESETS`, else bfloat16."""
    return "float32" if name in CPU_PRESETS else "bfloat16"


def layout_report(budget_bytes: int, *, page_size: int = 16, dtype: str = "bfloat16", models=LAYOUT_MODELS) -> list[dict]:
    """Per model: the `arena_jax.KVLayout` for `budget_bytes` of KV (bf16 by default; quantized
    arenas count their scales in every byte figure: 8-bit one float32 per token and KV head, int4
    one bf16 per 32 lanes)."""
    rows = []
    for name in models:
        cfg = preset(name)
        layout = cfg.kv_layout(page_size=page_size, budget_bytes=budget_bytes, max_seqs=256, max_seq_len=8192, dtype=dtype)
        rows.append(
            {
                "model": name,
                "layers": cfg.num_layers,
                "q_heads": cfg.num_heads,
                "kv_heads": cfg.num_kv_heads,
                "head_dim": cfg.head_dim,
                "kv_dtype": layout.dtype.name,
                "bytes_per_token": layout.bytes_per_token,
                "scale_bytes_per_token": layout.scale_bytes_per_token,
                # What a cache sized by query heads would need: the GQA factor wasted.
                "bytes_per_token_if_q_heads": layout.bytes_per_token * cfg.num_heads // cfg.num_kv_heads,
                "page_bytes": layout.page_bytes,
                "num_pages": layout.num_pages,
                "token_capacity": layout.token_capacity,
            }
        )
    return rows
