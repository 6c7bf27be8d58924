"""`LlamaConfig`: one frozen, validated config for every decoder family the models run:
Llama 2 / 3, Mistral, Qwen 2 / 2.5, Qwen 3 (dense), Gemma 2 and Gemma 3 (text).

    cfg = LlamaConfig.from_hf("path/to/checkpoint")        # config.json, a dict, or its folder
    cfg = LlamaConfig.llama3_8b()                          # presets: models.presets (qwen3_8b, gemma2_9b, ...)
    cfg = LlamaConfig.tiny_family("gemma2")                # tiny per-family variants for tests
    layout = cfg.kv_layout(page_size=16, budget_bytes=8 << 30, max_seqs=64, max_seq_len=4096)

The defaults are Llama's. `model_type` names the family; what a family fixes in its
architecture follows from it (properties, not settable: no checkpoint mixes them, and
`to_hf` must write a config.json transformers reads the same way):

    gemma       (gemma2, gemma3_text): RMSNorm x * (1 + w) in float32, sandwich norms (after
                attention, before and after the MLP), embeddings * sqrt(hidden_size)
    qk_norm     (qwen3, gemma3_text): RMSNorm over head_dim of each query and key head
    qkv_bias / o_bias: Qwen 2 biases q, k, v (not o); Llama, Qwen 3 and Gemma all four
                with `attention_bias`; Mistral none

What varies within a family is a field: `hidden_act`, `attention_bias`, the RoPE bases and
scaling, the windows per layer (`layer_types`, `sliding_window`), `query_pre_attn_scalar`
and the soft-caps. The config is hashable (a frozen dataclass of scalars and tuples), so it
can sit in an NNX graphdef that is a static argument of `jax.jit`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import numpy as np

import arena_jax as aj
from arena_jax.models import preset_table
from arena_jax.models.config_fields import (_GEMMA, HIDDEN_ACTS, LAYER_TYPES, MODEL_TYPES, NO_WINDOW, RopeScaling,
                                  _optional_float, _positive_int, _positive_number)  # fmt: skip
from arena_jax.models.config_hf import config_from_hf, config_to_hf

__all__ = ["LlamaConfig", "RopeScaling", "MODEL_TYPES", "HIDDEN_ACTS", "NO_WINDOW"]

@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Architecture of a decoder of one of `MODEL_TYPES` (see the module docstring).

    `head_dim` defaults to hidden_size // num_heads; `num_kv_heads` < `num_heads` is GQA.
    Windows: `layer_types` (per layer "full_attention" / "sliding_attention"; None: every
    layer sliding when `sliding_window` is set, else every layer full, as Llama / Mistral) and
    `sliding_window` (a query sees the last `sliding_window` keys, itself included).
    RoPE: `rope_theta` / `rope_scaling` for every layer, except the sliding layers when
    `rope_local_theta` is set (Gemma 3: those use that base, unscaled).
    Attention: `sm_scale = query_pre_attn_scalar ** -0.5` (default head_dim ** -0.5);
    `attn_logit_softcapping` caps scores as `cap * tanh(s / cap)`, `final_logit_softcapping`
    the logits (in float32).
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
    model_type: str | None = None  # None: "mistral" when sliding_window is set, else "llama"
    hidden_act: str = "silu"  # the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    attention_bias: bool | None = None  # None: the family's (Qwen 2: True, others False)
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

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
        for name in ("rope_local_theta", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            _optional_float(self, name)
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
        self._check_family()

    def _check_family(self):
        """model_type, hidden_act, attention_bias and the windows: resolved and consistent."""
        if self.model_type is None:
            object.__setattr__(self, "model_type", "mistral" if self.sliding_window is not None else "llama")
        kind = self.model_type
        if kind not in MODEL_TYPES:
            raise ValueError(f"model_type must be one of {MODEL_TYPES} or None, got {kind!r}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.attention_bias is None:
            object.__setattr__(self, "attention_bias", kind == "qwen2")
        if not isinstance(self.attention_bias, bool):
            raise ValueError(f"attention_bias must be a bool or None, got {self.attention_bias!r}")
        if kind == "qwen2" and not self.attention_bias:
            raise ValueError("attention_bias=False: Qwen 2 always has q, k and v biases")
        if kind == "mistral" and self.attention_bias:
            raise ValueError("attention_bias=True: Mistral's projections have no biases")
        types = self.layer_types
        if types is not None:
            if isinstance(types, (str, bytes)) or not isinstance(types, (tuple, list)) or not all(t in LAYER_TYPES for t in types):
                raise ValueError(f"layer_types must be a tuple of {LAYER_TYPES} entries or None, got {types!r}")
            types = tuple(types)
            if len(types) != self.num_layers:
                raise ValueError(f"layer_types has {len(types)} entries but num_layers={self.num_layers}")
            if "sliding_attention" in types and self.sliding_window is None:
                raise ValueError("layer_types has sliding_attention layers but sliding_window is None")
            uniform = ("sliding_attention" if self.sliding_window is not None else "full_attention",) * self.num_layers
            object.__setattr__(self, "layer_types", None if types == uniform else types)  # one spelling per model
        if kind == "llama" and self.sliding_window is not None:
            raise ValueError("sliding_window is set but model_type is 'llama' (transformers' Llama has no window): "
                             "use model_type 'mistral' or None")
        if kind == "mistral" and self.layer_types is not None:
            raise ValueError("layer_types: Mistral windows every layer alike (use qwen2 / gemma model types for mixed layers)")
        if kind == "gemma3_text" and self.attn_logit_softcapping is not None:
            raise ValueError("attn_logit_softcapping is set but model_type is 'gemma3_text': Gemma 3's attention "
                             "(transformers 5) does not apply it")
        if self.rope_local_theta is not None and kind != "gemma3_text":
            raise ValueError(f"rope_local_theta is Gemma 3's (sliding layers' RoPE base), not {kind!r}'s")
        for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(self, name) is not None and not self.gemma:
                raise ValueError(f"{name} is set but model_type {kind!r} has no such key (Gemma 2 / 3 only)")

    # ---- what the family fixes ----------------------------------------------------------------
    @property
    def gemma(self) -> bool:
        """(1 + w) float32 RMSNorms, sandwich norms, embeddings scaled by sqrt(hidden_size)."""
        return self.model_type in _GEMMA

    @property
    def qk_norm(self) -> bool:
        """An RMSNorm over head_dim of each query and key head, before RoPE."""
        return self.model_type in ("qwen3", "gemma3_text")

    @property
    def qkv_bias(self) -> bool:
        return self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def sm_scale(self) -> float:
        """The attention's score scale: query_pre_attn_scalar ** -0.5, else head_dim ** -0.5."""
        return (self.head_dim if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar) ** -0.5

    @property
    def resolved_layer_types(self) -> tuple[str, ...]:
        if self.layer_types is not None:
            return self.layer_types
        return ("sliding_attention" if self.sliding_window is not None else "full_attention",) * self.num_layers

    def layer_windows(self) -> tuple[int | None, ...]:
        """Per layer: its sliding window, or None."""
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.resolved_layer_types)

    def uniform_window(self) -> tuple[bool, int | None]:
        """(every layer has the same window, that window): one static window for `aj.attend`."""
        windows = set(self.layer_windows())
        return len(windows) == 1, next(iter(windows)) if len(windows) == 1 else None

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """(theta, scaling) of a layer's RoPE."""
        if self.rope_local_theta is not None and self.resolved_layer_types[layer] == "sliding_attention":
            return self.rope_local_theta, None
        return self.rope_theta, self.rope_scaling

    def with_num_layers(self, num_layers: int) -> "LlamaConfig":
        """The same model with `num_layers` layers; mixed layer types continue their pattern
        (the shortest period of `layer_types`: Gemma 2's alternation, Gemma 3's 5:1)."""
        types = self.layer_types
        if types is None:
            return dataclasses.replace(self, num_layers=num_layers)
        period = next(p for p in range(1, len(types) + 1) if all(types[i] == types[i % p] for i in range(len(types))))
        return dataclasses.replace(self, num_layers=num_layers, layer_types=tuple(types[i % period] for i in range(num_layers)))

    def layer_params(self) -> int:
        """Parameters of one decoder layer (attention, MLP, norms)."""
        e, f, d, n, k = self.hidden_size, self.intermediate_size, self.head_dim, self.num_heads, self.num_kv_heads
        attn = e * d * (2 * n + 2 * k) + (self.qkv_bias and (n + 2 * k) * d) + (self.o_bias and e)
        norms = (4 if self.gemma else 2) * e + (2 * d if self.qk_norm else 0)
        return attn + 3 * e * f + norms

    def num_params(self) -> int:
        e = self.hidden_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * e
        return self.vocab_size * e + self.num_layers * self.layer_params() + e + head

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

    # ---- Hugging Face config.json (models.config_hf) --------------------------------------------
    @classmethod
    def from_hf(cls, config: Mapping[str, Any] | str | os.PathLike, *, generation_config=None) -> "LlamaConfig":
        """From a Hugging Face `config.json` (a dict, the file, or its folder).

        Read by `arena_jax.hf.config.parse_hf_config`: transformers' defaults per model_type,
        strict JSON types, both the transformers-4 spelling (`rope_theta`, `rope_scaling`) and
        the transformers-5 one (`rope_parameters`). `eos_token_ids` are the tokens
        transformers' `generate` stops at: `generation_config.json` beside a config path (or
        the `generation_config` dict given), else config.json's `eos_token_id`.
        """
        return config_from_hf(cls, config, generation_config=generation_config)

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face `config.json` dict that transformers reads as this config."""
        return config_to_hf(self)

    # ---- presets (models.presets) ---------------------------------------------------------------
    @classmethod
    def llama3_8b(cls) -> "LlamaConfig":
        """Meta-Llama-3.1-8B."""
        return cls(**preset_table.llama3_8b())

    @classmethod
    def llama3_70b(cls) -> "LlamaConfig":
        """Meta-Llama-3.1-70B."""
        return cls(**preset_table.llama3_70b())

    @classmethod
    def mistral_7b(cls) -> "LlamaConfig":
        """Mistral-7B-v0.1 (sliding window 4096 on every layer)."""
        return cls(**preset_table.mistral_7b())

    @classmethod
    def qwen2_5_7b(cls) -> "LlamaConfig":
        """Qwen2.5-7B-Instruct: q/k/v biases, no window (use_sliding_window false)."""
        return cls(**preset_table.qwen2_5_7b())

    @classmethod
    def qwen3_8b(cls) -> "LlamaConfig":
        """Qwen3-8B: q/k RMSNorms, head_dim 128 (not hidden / heads)."""
        return cls(**preset_table.qwen3_8b())

    @classmethod
    def gemma2_9b(cls) -> "LlamaConfig":
        """gemma-2-9b: GeGLU, soft-caps 50 / 30, sliding window 4096 on every other layer."""
        return cls(**preset_table.gemma2_9b())

    @classmethod
    def gemma3_1b(cls) -> "LlamaConfig":
        """gemma-3-1b (model_type gemma3_text): 5 local (window 512, RoPE base 1e4) : 1 global
        (base 1e6) layers, q/k norms, one KV head."""
        return cls(**preset_table.gemma3_1b())

    @classmethod
    def gemma3_4b_text(cls) -> "LlamaConfig":
        """The text decoder of gemma-3-4b: window 1024, global layers' RoPE linearly scaled by 8."""
        return cls(**preset_table.gemma3_4b_text())

    @classmethod
    def tiny(cls, **overrides) -> "LlamaConfig":
        """A small random-weight Llama for tests and the CPU demo (GQA 4/2, head_dim 16)."""
        return cls(**preset_table.tiny(**overrides))

    @classmethod
    def mid(cls, **overrides) -> "LlamaConfig":
        """A mid-size random-weight Llama for CPU benchmarks (hidden 512, 8 layers, GQA 8/2,
        head_dim 64, vocab 32,000; `arena-bench decode --model mid`)."""
        return cls(**preset_table.mid(**overrides))

    @classmethod
    def tiny_family(cls, model_type: str, **overrides) -> "LlamaConfig":
        """A tiny model of `model_type` with its family's features on (see `models.preset_table._TINY`);
        `overrides` replace any field (give `layer_types` again when changing `num_layers` of a mixed model)."""
        return cls(**preset_table.tiny_family(model_type, **overrides))
