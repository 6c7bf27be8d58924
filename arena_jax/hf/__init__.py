"""Hugging Face config files: a decoder's `config.json` (and `generation_config.json`) read the
way `transformers` reads them, defaults, types and derivations included.

The question it answers: what shape and numerics does this checkpoint's config describe (its
KV geometry for `arena_jax.KVLayout.from_hf_config`, the rest for `models.LlamaConfig.from_hf`)?

    config.py   `parse_hf_config` -> `HFConfig`, `kv_geometry` -> `KVGeometry` (the rules, and why)
    reader.py   the JSON files and typed access to their values (errors name file, key, value, limit)
    schemas.py  transformers' config classes as data: per `model_type`, each field's type and default

The former `arena_jax.hf_config` / `hf_json` / `hf_schemas` are `arena_jax.hf.config` /
`.reader` / `.schemas` (the same module objects: `arena_jax._moved`).
"""
from arena_jax.hf.config import INT32_MAX, HFConfig, KVGeometry, RopeSpec, kv_geometry, parse_hf_config, read_hf_config
from arena_jax.hf.reader import read_generation_config

__all__ = ["HFConfig", "KVGeometry", "RopeSpec", "INT32_MAX", "read_hf_config", "read_generation_config",
           "parse_hf_config", "kv_geometry"]
