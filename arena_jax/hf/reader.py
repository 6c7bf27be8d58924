"""JSON reading for `arena_jax.hf.config`: config.json / generation_config.json files, and
typed access to their values with errors that name the file, the key, the value and the
limit (transformers' `@strict` types: an int takes a JSON integer, a float a JSON float, ...).
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

from arena_jax.hf.schemas import Field

__all__ = ["INT32_MAX", "LAYER_TYPES", "read_hf_config", "read_generation_config"]

INT32_MAX = 2**31 - 1  # token ids, sizes and positions become int32 on the device
LAYER_TYPES = ("full_attention", "sliding_attention")
_LEGACY_LAYER_TYPES = {"attention": "full_attention"}  # transformers' remap_legacy_layer_types
_MISSING = object()


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

    def layer_types(self, key: str, value) -> tuple[str, ...]:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(key, f"must be a JSON list of strings, got {_describe(value)}")
        out = tuple(_LEGACY_LAYER_TYPES.get(v, v) for v in value)
        bad = sorted(set(out) - set(LAYER_TYPES))
        if bad:
            self.fail(key, f"holds {bad}: only {list(LAYER_TYPES)} layers are supported")
        return out

    def field(self, schema: Mapping[str, Field], key: str):
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
            return self.int(key, value, low=spec.low)
        if spec.kind == "float":
            return self.positive_float(key, value, allow_int=False)
        if spec.kind == "bool":
            return self.bool(key, value)
        if spec.kind == "str":
            return self.str(key, value)
        if spec.kind == "types":
            return self.layer_types(key, value)
        return self.ids(key, value)
