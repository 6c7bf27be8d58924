"""Hugging Face `config.json` of a decoder, read the way `transformers` reads it.

The one reader behind `arena_jax.KVLayout.from_hf_config` and `models.LlamaConfig.from_hf`:

    cfg = parse_hf_config("path/to/checkpoint")     # a folder, its config.json, or a dict
    cfg.num_key_value_heads, cfg.head_dim, cfg.layer_types, cfg.rope_theta, cfg.eos_token_ids, ...

Model types: llama, mistral, qwen2, qwen3, gemma2, gemma3_text (a missing `model_type` reads
as Llama, as `LlamaConfig.from_pretrained` does).

- Defaults are transformers' own, per `model_type` (`arena_jax.hf.schemas`: its config classes
  as data). tests/test_hf_config.py checks every value here against the installed transformers.
- Types are strict, as transformers' `@strict` config dataclasses check them: an int field
  takes a JSON integer (not 2.0, "2" or true), a bool field a JSON bool, a float field a JSON
  float. `null` is allowed where transformers allows it and means its fallback:
  `num_key_value_heads` -> `num_attention_heads` (Llama, Qwen), `head_dim` ->
  `hidden_size // num_attention_heads`, `sliding_window` -> no window.
- Derivations as transformers makes them: `layer_types` (per layer "full_attention" or
  "sliding_attention") default to Gemma 2's alternation (sliding first), Gemma 3's
  `sliding_window_pattern` (default 6: every 6th layer full), and for Qwen sliding layers from
  `max_window_layers` on when `use_sliding_window` (else no window at all); Mistral windows
  every layer, Llama none. `sliding_window` is the window of the sliding layers.
- RoPE as transformers 5 standardizes it: a non-empty `rope_scaling` replaces
  `rope_parameters`; a `rope_theta` inside them wins over the top-level one (default 10000);
  `type` is the old spelling of `rope_type`; llama3's `original_max_position_embeddings`
  defaults to `max_position_embeddings` and its other keys are required; linear needs
  `factor`. Gemma 3 has one set per layer type: `rope_parameters.{full,sliding}_attention`,
  or the older keys `rope_theta` (full, default 1e6), `rope_local_base_freq` (sliding,
  default 1e4) and `rope_scaling` (full layers only).
- Stop tokens as transformers' `generate` finds them: `generation_config.json`'s
  `eos_token_id` when that file sits beside config.json, else config.json's own
  `eos_token_id` key (an absent key means none: generate does not fall back to the class
  default).
- What the modeling code computes: Qwen 2 has q/k/v biases (not o), Llama / Qwen 3 / Gemma
  bias all four with `attention_bias`; Gemma 3's attention does not apply
  `attn_logit_softcapping` (transformers 5 ignores the key there), so it reads as None.
- Beyond transformers (which accepts these and fails later, or computes garbage): sizes must
  be integers in [1, 2**31 - 1], `num_key_value_heads` must divide `num_attention_heads`,
  `rms_norm_eps`, `rope_theta` and soft-caps must be finite and > 0, `head_dim` even, eos ids
  inside the vocabulary, layer types only "full_attention" / "sliding_attention".

Every problem is a ValueError naming the file, the key, the value and the limit.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from arena_jax.hf.reader import (  # noqa: F401 - read_hf_config is re-exported (arena_jax.layout)
    INT32_MAX,
    LAYER_TYPES,
    _config_path,
    _describe,
    _is_int,
    _Reader,
    read_generation_config,
    read_hf_config,
)
from arena_jax.hf.schemas import FAMILIES, SCHEMAS

__all__ = ["HFConfig", "KVGeometry", "RopeSpec", "INT32_MAX", "read_hf_config", "parse_hf_config", "kv_geometry"]


DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}  # Gemma3TextConfig.default_theta
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# transformers' other RoPE types and the keys its validators require (ours computes linear and llama3)
_ROPE_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
                  "longrope": ("short_factor", "long_factor"), "proportional": ()}
_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """One RoPE: its type, base and scaling parameters (llama3: factor, low/high_freq_factor,
    original_max_position_embeddings; linear: factor; others: None)."""

    rope_type: str
    rope_theta: float
    scaling: Mapping[str, Any] | None
    partial_rotary_factor: float | None


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """A decoder's config.json with transformers' defaults applied and every value checked."""

    model_type: str  # one of arena_jax.hf.schemas.SCHEMAS
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str  # Gemma: its `hidden_activation`
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v projections have biases
    attention_output_bias: bool  # o projection has a bias
    mlp_bias: bool
    sliding_window: int | None  # the window of "sliding_attention" layers; None: no layer has one
    layer_types: tuple[str, ...]  # per layer: "full_attention" | "sliding_attention"
    rope_type: str  # full-attention layers' RoPE (every layer's, but Gemma 3's sliding ones)
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # llama3 / linear parameters (RopeSpec.scaling)
    partial_rotary_factor: float | None
    local_rope: RopeSpec | None  # Gemma 3: the sliding layers' RoPE; None: the same as the full layers'
    qk_norm: bool  # RMSNorm of each query / key head (Qwen 3, Gemma 3)
    gemma: bool  # Gemma numerics: (1 + w) RMSNorms, sandwich norms, embeddings * sqrt(hidden)
    query_pre_attn_scalar: int | None  # Gemma: sm_scale = query_pre_attn_scalar ** -0.5
    attn_logit_softcapping: float | None  # as the attention applies it (None for Gemma 3)
    final_logit_softcapping: float | None
    use_bidirectional_attention: bool  # Gemma: not a causal decoder when true
    eos_token_id: tuple[int, ...]  # config.json's `eos_token_id` as transformers' config holds it
    eos_token_ids: tuple[int, ...]  # what transformers' generate stops at (see the module docstring)
    dtype: str | None  # "float32" | "float16" | "bfloat16" from `dtype` / `torch_dtype`, None if absent
    quantized: bool  # a `quantization_config` is present
    source: str


@dataclasses.dataclass(frozen=True)
class KVGeometry:
    """What a KV arena needs from a config.json (any decoder model type)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int | None
    dtype: str | None


# ---- parsing ------------------------------------------------------------------------------------


def _source(config) -> str:
    return "config" if isinstance(config, Mapping) else _config_path(config)


def _model_type(r: _Reader) -> str:
    model_type = r.data.get("model_type", "llama")
    if model_type == "gemma3" and isinstance(r.data.get("text_config"), Mapping):
        r.fail("model_type", "'gemma3' is the multimodal Gemma 3: only its text model (model_type 'gemma3_text', "
                             "e.g. gemma-3-1b) is supported")
    if not isinstance(model_type, str) or model_type not in SCHEMAS:
        r.fail("model_type", f"must be one of {sorted(SCHEMAS)}, got {model_type!r}")
    return model_type


def _rope_spec(r: _Reader, key: str, params: Mapping, theta_key: str, default_theta, max_position_embeddings: int,
               partial) -> RopeSpec:
    """One standardized RoPE dict -> RopeSpec (`key` names it in errors; the base is its
    `rope_theta`, else the top-level `theta_key`, else `default_theta`)."""
    if "rope_theta" in params:
        theta_key, theta = f"{key}.rope_theta", params["rope_theta"]
    else:
        theta = r.data.get(theta_key, default_theta)
    theta = r.positive_float(theta_key, theta, allow_int=True)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        r.fail(f"{key}.rope_type", f"must be a JSON string, got {_describe(rope_type)}")
    partial = params.get("partial_rotary_factor", partial)
    if partial is not None:
        partial = r.positive_float("partial_rotary_factor", partial, allow_int=True)
    scaling = None
    if rope_type == "llama3":
        params = dict(params)
        params.setdefault("original_max_position_embeddings", max_position_embeddings)
        missing = [k for k in _LLAMA3_KEYS if k not in params]
        if missing:
            r.fail(key, f"with rope_type 'llama3' lacks {', '.join(map(repr, missing))} (required by transformers)")
        scaling = {k: r.positive_float(f"{key}.{k}", params[k], allow_int=True) for k in _LLAMA3_KEYS[:3]}
        scaling["original_max_position_embeddings"] = r.int(
            f"{key}.original_max_position_embeddings", params["original_max_position_embeddings"]
        )
        if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
            r.fail(
                f"{key}.high_freq_factor",
                f"= {scaling['high_freq_factor']} must exceed low_freq_factor = {scaling['low_freq_factor']}",
            )
    elif rope_type != "default":
        if rope_type not in _ROPE_REQUIRED:
            r.fail(f"{key}.rope_type", f"= {rope_type!r} is not a RoPE transformers knows ({sorted(_ROPE_REQUIRED)})")
        missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in params]
        if missing:
            r.fail(key, f"with rope_type {rope_type!r} lacks {', '.join(map(repr, missing))} (required by transformers)")
        if rope_type == "linear":
            scaling = {"factor": r.positive_float(f"{key}.factor", params["factor"], allow_int=True)}
    return RopeSpec(rope_type, theta, scaling, partial)


def _rope_dict(r: _Reader, key: str):
    value = r.data.get(key)
    if value is not None and not isinstance(value, Mapping):
        r.fail(key, f"must be a JSON object or null, got {_describe(value)}")
    return value


def _rope(r: _Reader, max_position_embeddings: int, layer_types: tuple[str, ...] | None) -> RopeSpec:
    """The one RoPE of every layer, as transformers 5 standardizes it. `layer_types`: those of a
    config class that has them (a RoPE dict keyed by them is then per layer type, which these
    model types do not read: refused); None for Llama / Mistral (such keys are ignored)."""
    for key in ("rope_scaling", "rope_parameters"):
        _rope_dict(r, key)
    # transformers: `rope_parameters = rope_scaling or rope_parameters` (an empty rope_scaling is ignored)
    key = "rope_scaling" if r.data.get("rope_scaling") else "rope_parameters"
    params = dict(r.data.get(key) or {})
    nested = sorted(k for k in params if k in (layer_types or ()))
    if nested:  # transformers would then look for one set per layer type, which these models do not read
        r.fail(f"{key}.{nested[0]}", "is a RoPE per layer type: this model type has one RoPE for every layer")
    return _rope_spec(r, key, params, "rope_theta", DEFAULT_ROPE_THETA, max_position_embeddings,
                      r.data.get("partial_rotary_factor"))


def _gemma3_rope(r: _Reader, max_position_embeddings: int, layer_types) -> dict[str, RopeSpec]:
    """Gemma 3: one RoPE per layer type present (`Gemma3TextConfig.convert_rope_params_to_dict`)."""
    scaling, params = _rope_dict(r, "rope_scaling"), _rope_dict(r, "rope_parameters")
    if params is None:
        params = {t: {"rope_type": "default"} for t in LAYER_TYPES}
    params = {k: dict(v) if isinstance(v, Mapping) else v for k, v in params.items()}
    for t in LAYER_TYPES:
        if params.get(t) is not None and not isinstance(params[t], dict):
            r.fail(f"rope_parameters.{t}", f"must be a JSON object or null, got {_describe(params[t])}")
    if scaling is not None:  # the old key scales the full-attention layers
        if "full_attention" not in params:
            r.fail("rope_scaling", "is given but rope_parameters has no 'full_attention' entry to apply it to")
        if params["full_attention"] is None:
            r.fail("rope_parameters.full_attention", "is null but rope_scaling is given")
        params["full_attention"].update(scaling)
    old_keys = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}
    out = {}
    for t in LAYER_TYPES:
        entry = params.get(t) or {"rope_type": "default"}
        if t in layer_types:  # transformers standardizes and builds only the layer types present
            out[t] = _rope_spec(r, f"rope_parameters.{t}", entry, old_keys[t], GEMMA3_THETA[t], max_position_embeddings,
                                r.data.get("partial_rotary_factor"))
    return out


def _dtype(r: _Reader) -> str | None:
    # transformers: `dtype` wins over the older `torch_dtype` when both are given.
    key = "dtype" if r.data.get("dtype") is not None else "torch_dtype"
    value = r.data.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or value not in _DTYPES:
        r.fail(key, f"must be one of {sorted(_DTYPES)} (a KV arena dtype), got {_describe(value)}")
    return _DTYPES[value]


def _stop_tokens(r: _Reader, generation_config: Mapping | None, vocab_size: int) -> tuple[int, ...]:
    """The eos ids transformers' `generate` stops at. When generation_config.json exists it
    alone counts (transformers loads it as the model's GenerationConfig); otherwise generate's
    config is built from config.json's raw keys, so an absent `eos_token_id` means none."""
    if generation_config is not None:
        where = "generation_config" if r.source == "config" else os.path.join(os.path.dirname(r.source), "generation_config.json")
        r = _Reader(generation_config, where)
    ids = r.ids("eos_token_id", r.data.get("eos_token_id"))
    for token in ids:
        if not 0 <= token < vocab_size:
            r.fail("eos_token_id", f"holds {token}, outside the vocabulary [0, vocab_size = {vocab_size})")
    return ids


def _windows(r: _Reader, model_type: str, v: dict) -> tuple[int | None, tuple[str, ...]]:
    """(sliding_window, layer_types) as the model type derives them."""
    layers, rule = v["num_hidden_layers"], FAMILIES[model_type].windows
    window = v.get("sliding_window")
    given = v.get("layer_types")
    if rule == "none":
        return None, ("full_attention",) * layers
    if rule == "all":
        return window, (("sliding_attention" if window is not None else "full_attention"),) * layers
    if rule == "qwen":
        window = window if v["use_sliding_window"] else None
        derived = tuple("sliding_attention" if window is not None and i >= v["max_window_layers"] else "full_attention"
                        for i in range(layers))
    elif rule == "gemma2":
        derived = tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers))
    else:  # gemma3
        if v["use_bidirectional_attention"] and window is not None:
            window = window // 2 + 1  # transformers' exclusive bound for its bidirectional mask
        pattern = r.data.get("sliding_window_pattern", 6)
        if given is None:
            pattern = r.int("sliding_window_pattern", pattern)
        derived = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))
    types = derived if given is None else given
    if len(types) != layers:
        r.fail("layer_types", f"has {len(types)} entries but num_hidden_layers = {layers}")
    if window is None and "sliding_attention" in types:
        r.fail("sliding_window", "is null (or use_sliding_window false) but layer_types has sliding_attention layers")
    return (window if "sliding_attention" in types else None), types


def _flag(v: dict, rule) -> bool:
    return rule if isinstance(rule, bool) else bool(v[rule])


def parse_hf_config(config: Mapping[str, Any] | str | os.PathLike, *, generation_config: Mapping | None = None) -> HFConfig:
    """Read and check a decoder's `config.json` (a dict, the file, or its folder).

    For a path, `generation_config.json` beside it (if any) gives the stop tokens; for a dict,
    pass its contents as `generation_config` (else config.json's `eos_token_id` key does).
    """
    data = read_hf_config(config)
    source = _source(config)
    if generation_config is None:
        generation_config = read_generation_config(config)
    r = _Reader(data, source)
    model_type = _model_type(r)
    schema, family = SCHEMAS[model_type], FAMILIES[model_type]
    v = {key: r.field(schema, key) for key in schema}
    heads = v["num_attention_heads"]
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = heads
    if heads % v["num_key_value_heads"]:
        r.fail("num_key_value_heads", f"= {v['num_key_value_heads']} must divide num_attention_heads = {heads}")
    if family.hidden_multiple_of_heads and v["hidden_size"] % heads:  # transformers' validate_architecture
        r.fail("hidden_size", f"= {v['hidden_size']} must be a multiple of num_attention_heads = {heads}")
    if v["head_dim"] is None:
        v["head_dim"] = v["hidden_size"] // heads
        if v["head_dim"] < 1:
            r.fail("hidden_size", f"= {v['hidden_size']} is smaller than num_attention_heads = {heads}")
    if v["head_dim"] % 2:
        r.fail("head_dim", f"= {v['head_dim']} must be even (RoPE rotates pairs of dimensions)")
    v["use_bidirectional_attention"] = bool(v.get("use_bidirectional_attention"))
    sliding_window, layer_types = _windows(r, model_type, v)
    if model_type == "gemma3_text":
        ropes = _gemma3_rope(r, v["max_position_embeddings"], layer_types)
        full = ropes.get("full_attention") or ropes["sliding_attention"]
        local = ropes.get("sliding_attention")
        local = None if local is None or local == full else local
    else:
        has_types = FAMILIES[model_type].windows not in ("none", "all")
        full, local = _rope(r, v["max_position_embeddings"], layer_types if has_types else None), None
    eos_ids = _stop_tokens(r, generation_config, v["vocab_size"])
    eos_attr = v["eos_token_id"]  # absent: the class default (an int or None); null: None; else a tuple
    return HFConfig(
        model_type=model_type,
        vocab_size=v["vocab_size"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_hidden_layers=v["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=v["num_key_value_heads"],
        head_dim=v["head_dim"],
        hidden_act=v[family.hidden_act_key],
        max_position_embeddings=v["max_position_embeddings"],
        rms_norm_eps=v["rms_norm_eps"],
        tie_word_embeddings=v["tie_word_embeddings"],
        attention_bias=_flag(v, family.qkv_bias),
        attention_output_bias=_flag(v, family.o_bias),
        mlp_bias=_flag(v, family.mlp_bias),
        sliding_window=sliding_window,
        layer_types=layer_types,
        rope_type=full.rope_type,
        rope_theta=full.rope_theta,
        rope_scaling=full.scaling,
        partial_rotary_factor=full.partial_rotary_factor,
        local_rope=local,
        qk_norm=family.qk_norm,
        gemma=family.gemma,
        query_pre_attn_scalar=v.get("query_pre_attn_scalar"),
        attn_logit_softcapping=v["attn_logit_softcapping"] if family.attn_softcap else None,
        final_logit_softcapping=v.get("final_logit_softcapping"),
        use_bidirectional_attention=v["use_bidirectional_attention"],
        eos_token_id=() if eos_attr is None else (eos_attr,) if _is_int(eos_attr) else eos_attr,
        eos_token_ids=eos_ids,
        dtype=_dtype(r),
        quantized=data.get("quantization_config") is not None,
        source=source,
    )


def kv_geometry(config: Mapping[str, Any] | str | os.PathLike) -> KVGeometry:
    """KV layers, heads, head_dim, context and dtype of a decoder's config.json.

    The model types of `arena_jax.hf.schemas` (or no `model_type`) are read by
    `parse_hf_config`, transformers' defaults included. Other model types: this module knows
    none of their defaults, so `num_hidden_layers`, `num_attention_heads` and
    `num_key_value_heads` must be given; `head_dim` falls back to `hidden_size // num_attention_heads`.
    """
    data = read_hf_config(config)
    model_type = data.get("model_type", "llama")
    if not isinstance(model_type, str) or model_type in SCHEMAS:  # a non-string is refused by parse_hf_config
        cfg = parse_hf_config(config, generation_config={})  # stop tokens do not shape a KV arena
        return KVGeometry(
            cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings, cfg.dtype
        )
    r = _Reader(data, _source(config))

    def required(key):
        if data.get(key) is None:
            r.fail(key, f"is required for model_type {model_type!r} (its transformers default is not known here)")
        return r.int(key, data[key])

    layers, heads, kv_heads = required("num_hidden_layers"), required("num_attention_heads"), required("num_key_value_heads")
    if heads % kv_heads:
        r.fail("num_key_value_heads", f"= {kv_heads} must divide num_attention_heads = {heads}")
    head_dim = data.get("head_dim")
    if head_dim is None:
        head_dim = required("hidden_size") // heads
        if head_dim < 1:
            r.fail("hidden_size", f"= {data['hidden_size']} is smaller than num_attention_heads = {heads}")
    else:
        head_dim = r.int("head_dim", head_dim)
    mpe = data.get("max_position_embeddings")
    return KVGeometry(layers, kv_heads, head_dim, None if mpe is None else r.int("max_position_embeddings", mpe), _dtype(r))
