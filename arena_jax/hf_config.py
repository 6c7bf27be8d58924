"""Hugging Face `config.json` for Llama and Mistral, read the way `transformers` reads it.

The one reader behind `arena_jax.KVLayout.from_hf_config` and `models.LlamaConfig.from_hf`:

    cfg = parse_hf_config("path/to/checkpoint")     # a folder, its config.json, or a dict
    cfg.num_key_value_heads, cfg.head_dim, cfg.rope_theta, cfg.eos_token_ids, ...

- Defaults are transformers' own, per `model_type` (`LlamaConfig`, `MistralConfig` in
  transformers 5.x `models/{llama,mistral}/configuration_*.py`); a missing `model_type` reads
  as Llama (as `LlamaConfig.from_pretrained` does). tests/test_hf_config.py checks every value
  here against the installed transformers.
- Types are strict, as transformers' `@strict` config dataclasses check them: an int field
  takes a JSON integer (not 2.0, "2" or true), a bool field a JSON bool, a float field a JSON
  float. `null` is allowed where transformers allows it and means its fallback:
  `num_key_value_heads` -> `num_attention_heads` (Llama only), `head_dim` ->
  `hidden_size // num_attention_heads`, Mistral's `sliding_window` -> no window.
- RoPE as transformers 5 standardizes it: a non-empty `rope_scaling` replaces
  `rope_parameters`; a `rope_theta` inside them wins over the top-level one (default 10000);
  `type` is the old spelling of `rope_type`; llama3's `original_max_position_embeddings`
  defaults to `max_position_embeddings` and its other keys are required.
- Stop tokens as transformers' `generate` finds them: `generation_config.json`'s
  `eos_token_id` when that file sits beside config.json, else config.json's own
  `eos_token_id` key (an absent key means none: generate does not fall back to the class
  default 2).
- Beyond transformers (which accepts these and fails later, or computes garbage): sizes must
  be integers in [1, 2**31 - 1], `num_key_value_heads` must divide `num_attention_heads`,
  `rms_norm_eps` and `rope_theta` must be finite and > 0, `head_dim` even, eos ids inside
  the vocabulary.

Every problem is a ValueError naming the file, the key, the value and the limit.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

__all__ = ["HFConfig", "KVGeometry", "INT32_MAX", "read_hf_config", "parse_hf_config", "kv_geometry"]

INT32_MAX = 2**31 - 1  # token ids, sizes and positions become int32 on the device

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class _Field:
    kind: str  # "int", "float", "bool", "str", "ids" (int | list[int])
    default: Any
    nullable: bool = False  # transformers' annotation includes None


# transformers 5.x `LlamaConfig` / `MistralConfig`: the fields a decoder's shape and numerics
# depend on (name: type, default, nullable). Other keys are ignored, as there.
_LLAMA = {
    "vocab_size": _Field("int", 32000),
    "hidden_size": _Field("int", 4096),
    "intermediate_size": _Field("int", 11008),
    "num_hidden_layers": _Field("int", 32),
    "num_attention_heads": _Field("int", 32),
    "num_key_value_heads": _Field("int", None, nullable=True),
    "head_dim": _Field("int", None, nullable=True),
    "hidden_act": _Field("str", "silu"),
    "max_position_embeddings": _Field("int", 2048),
    "rms_norm_eps": _Field("float", 1e-6),
    "eos_token_id": _Field("ids", 2, nullable=True),
    "tie_word_embeddings": _Field("bool", False),
    "attention_bias": _Field("bool", False),
    "mlp_bias": _Field("bool", False),
}
_MISTRAL = {
    "vocab_size": _Field("int", 32000),
    "hidden_size": _Field("int", 4096),
    "intermediate_size": _Field("int", 14336),
    "num_hidden_layers": _Field("int", 32),
    "num_attention_heads": _Field("int", 32),
    "num_key_value_heads": _Field("int", 8),  # `int`, not `int | None`: null is refused there
    "head_dim": _Field("int", None, nullable=True),
    "hidden_act": _Field("str", "silu"),
    "max_position_embeddings": _Field("int", 4096 * 32),
    "rms_norm_eps": _Field("float", 1e-6),
    "eos_token_id": _Field("ids", 2, nullable=True),
    "tie_word_embeddings": _Field("bool", False),
    "sliding_window": _Field("int", 4096, nullable=True),
    # no attention_bias / mlp_bias: Mistral's projections never have a bias (the keys are ignored)
}
SCHEMAS = {"llama": _LLAMA, "mistral": _MISTRAL}
DEFAULT_ROPE_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_DTYPES = {"float32": "float32", "float": "float32", "float16": "float16", "half": "float16", "bfloat16": "bfloat16"}


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """A Llama / Mistral config.json with transformers' defaults applied and every value checked."""

    model_type: str  # "llama" | "mistral"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_act: str
    max_position_embeddings: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # Mistral only; Llama ignores the key, as transformers' Llama does
    rope_type: str
    rope_theta: float
    rope_scaling: Mapping[str, Any] | None  # llama3: factor, low/high_freq_factor, original_max_position_embeddings
    partial_rotary_factor: float | None
    eos_token_id: tuple[int, ...]  # config.json's `eos_token_id` as transformers' config holds it (default 2)
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


# ---- reading files ----------------------------------------------------------------------------


def _load_json_object(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: invalid JSON ({exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {what} must hold a JSON object, got a JSON {type(data).__name__}")
    return data


def _config_path(config) -> str:
    path = os.fspath(config)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def read_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> Mapping[str, Any]:
    """The raw `config.json` object (a dict, the file, or its folder); ValueError unless it is a JSON object."""
    if isinstance(config, Mapping):
        return config
    if isinstance(config, (str, os.PathLike)):
        return _load_json_object(_config_path(config), "config.json")
    raise ValueError(f"config must be a dict, a config.json path or its folder, got {type(config).__name__}")


def read_generation_config(config: Mapping[str, Any] | str | os.PathLike) -> dict | None:
    """`generation_config.json` beside a config.json path (None for a dict, or when absent)."""
    if isinstance(config, Mapping):
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(_config_path(config))), "generation_config.json")
    if not os.path.exists(path):
        return None
    return _load_json_object(path, "generation_config.json")


# ---- typed values -----------------------------------------------------------------------------


def _describe(value) -> str:
    return f"{value!r} (a JSON {_json_type(value)})"


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, Mapping):
        return "object"
    return type(value).__name__


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Reader:
    """Typed access to one JSON object, with errors that name the source and the key."""

    def __init__(self, data: Mapping[str, Any], source: str):
        self.data, self.source = data, source

    def fail(self, key: str, message: str):
        raise ValueError(f"{self.source}: {key} {message}")

    def int(self, key: str, value, *, low: int = 1, high: int = INT32_MAX) -> int:
        if not _is_int(value):
            self.fail(key, f"must be a JSON integer, got {_describe(value)}")
        if not low <= value <= high:
            self.fail(key, f"must be in [{low}, {high}], got {value}")
        return value

    def positive_float(self, key: str, value, *, allow_int: bool) -> float:
        ok = isinstance(value, float) or (allow_int and _is_int(value))
        if not ok:
            want = "a JSON number" if allow_int else "a JSON float (e.g. 1e-06)"
            self.fail(key, f"must be {want}, got {_describe(value)}")
        if not (math.isfinite(value) and value > 0):
            self.fail(key, f"must be finite and > 0, got {value}")
        return float(value)

    def bool(self, key: str, value) -> bool:
        if not isinstance(value, bool):
            self.fail(key, f"must be a JSON bool (true/false), got {_describe(value)}")
        return value

    def str(self, key: str, value) -> str:
        if not isinstance(value, str):
            self.fail(key, f"must be a JSON string, got {_describe(value)}")
        return value

    def ids(self, key: str, value) -> tuple[int, ...]:
        """int | list[int] | null -> tuple (null: no ids)."""
        if value is None:
            return ()
        items = value if isinstance(value, list) else [value]
        if not all(_is_int(v) for v in items):
            self.fail(key, f"must be a JSON integer, a list of them, or null, got {_describe(value)}")
        return tuple(items)

    def field(self, schema: Mapping[str, _Field], key: str):
        """The value of a schema field: its default when absent, None where null is allowed."""
        spec = schema[key]
        value = self.data.get(key, _MISSING)
        if value is _MISSING:
            return spec.default
        if value is None:
            if spec.nullable:
                return None
            self.fail(key, f"must not be null (transformers' {key} is a non-optional {spec.kind})")
        if spec.kind == "int":
            return self.int(key, value)
        if spec.kind == "float":
            return self.positive_float(key, value, allow_int=False)
        if spec.kind == "bool":
            return self.bool(key, value)
        if spec.kind == "str":
            return self.str(key, value)
        return self.ids(key, value)


# ---- parsing ------------------------------------------------------------------------------------


def _source(config) -> str:
    return "config" if isinstance(config, Mapping) else _config_path(config)


def _model_type(r: _Reader) -> str:
    model_type = r.data.get("model_type", "llama")
    if not isinstance(model_type, str) or model_type not in SCHEMAS:
        r.fail("model_type", f"must be one of {sorted(SCHEMAS)}, got {model_type!r}")
    return model_type


def _rope(r: _Reader, max_position_embeddings: int) -> tuple[str, float, dict | None, float | None]:
    """(rope_type, rope_theta, llama3 params or None, partial_rotary_factor) as transformers 5 standardizes them."""
    data = r.data
    for key in ("rope_scaling", "rope_parameters"):
        if data.get(key) is not None and not isinstance(data[key], Mapping):
            r.fail(key, f"must be a JSON object or null, got {_describe(data[key])}")
    # transformers: `rope_parameters = rope_scaling or rope_parameters` (an empty rope_scaling is ignored)
    key = "rope_scaling" if data.get("rope_scaling") else "rope_parameters"
    params = dict(data.get(key) or {})
    top_theta = data.get("rope_theta", DEFAULT_ROPE_THETA)
    theta_key = f"{key}.rope_theta" if "rope_theta" in params else "rope_theta"
    theta = r.positive_float(theta_key, params.get("rope_theta", top_theta), allow_int=True)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if not isinstance(rope_type, str):
        r.fail(f"{key}.rope_type", f"must be a JSON string, got {_describe(rope_type)}")
    partial = params.get("partial_rotary_factor", data.get("partial_rotary_factor"))
    if partial is not None:
        partial = r.positive_float("partial_rotary_factor", partial, allow_int=True)
    scaling = None
    if rope_type == "llama3":
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
    return rope_type, theta, scaling, partial


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


def parse_hf_config(config: Mapping[str, Any] | str | os.PathLike, *, generation_config: Mapping | None = None) -> HFConfig:
    """Read and check a Llama / Mistral `config.json` (a dict, the file, or its folder).

    For a path, `generation_config.json` beside it (if any) gives the stop tokens; for a dict,
    pass its contents as `generation_config` (else config.json's `eos_token_id` key does).
    """
    data = read_hf_config(config)
    source = _source(config)
    if generation_config is None:
        generation_config = read_generation_config(config)
    r = _Reader(data, source)
    model_type = _model_type(r)
    schema = SCHEMAS[model_type]
    v = {key: r.field(schema, key) for key in schema}
    heads = v["num_attention_heads"]
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = heads
    if heads % v["num_key_value_heads"]:
        r.fail("num_key_value_heads", f"= {v['num_key_value_heads']} must divide num_attention_heads = {heads}")
    if model_type == "llama" and v["hidden_size"] % heads:  # transformers' LlamaConfig.validate_architecture
        r.fail("hidden_size", f"= {v['hidden_size']} must be a multiple of num_attention_heads = {heads}")
    if v["head_dim"] is None:
        v["head_dim"] = v["hidden_size"] // heads
        if v["head_dim"] < 1:
            r.fail("hidden_size", f"= {v['hidden_size']} is smaller than num_attention_heads = {heads}")
    if v["head_dim"] % 2:
        r.fail("head_dim", f"= {v['head_dim']} must be even (RoPE rotates pairs of dimensions)")
    rope_type, rope_theta, rope_scaling, partial = _rope(r, v["max_position_embeddings"])
    eos_ids = _stop_tokens(r, generation_config, v["vocab_size"])
    eos_attr = v.pop("eos_token_id")  # absent: the class default 2 (an int); null: None; else a tuple
    fields = {"attention_bias": False, "mlp_bias": False, "sliding_window": None, **v}
    return HFConfig(
        model_type=model_type,
        **fields,
        rope_type=rope_type,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        partial_rotary_factor=partial,
        eos_token_id=() if eos_attr is None else (eos_attr,) if _is_int(eos_attr) else eos_attr,
        eos_token_ids=eos_ids,
        dtype=_dtype(r),
        quantized=data.get("quantization_config") is not None,
        source=source,
    )


def kv_geometry(config: Mapping[str, Any] | str | os.PathLike) -> KVGeometry:
    """KV layers, heads, head_dim, context and dtype of a decoder's config.json.

    Llama / Mistral (or no `model_type`) are read by `parse_hf_config`, transformers' defaults
    included. Other model types: this module knows none of their defaults, so
    `num_hidden_layers`, `num_attention_heads` and `num_key_value_heads` must be given;
    `head_dim` falls back to `hidden_size // num_attention_heads`.
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
