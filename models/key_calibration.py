"""Smoothed keys' factors from the model itself, before any request (`arena_jax.key_factors`).

An 8-bit or 4-bit arena with `smooth_keys` divides every key by static per-channel factors.
They are fixed when the cache is created (`aj.create(layout, key_factors=...)`), so what a key
is stored as never depends on which requests came first or how the scheduler wrote them: the
same greedy tokens in every scheduling mode and for every tenant (issue 37). This module
finds them with a calibration pass over the model's own keys:

    factors = models.calibrate_key_factors(model)                    # a fixed built-in sample
    factors = models.calibrate_key_factors(model, tokens=[[...], ...])  # text of your own, tokenized
    cache = aj.create(layout, key_factors=factors)

The pass runs the model once over the sample (`models.dense_baseline.dense_prefill`: the same
modules and weights, a dense float32 cache), takes each layer's keys as the model computes
them (after RoPE and any key norm, before smoothing or rotation) and calibrates per layer, KV
head and channel (`arena_jax.key_factors.from_keys`). The built-in sample is
`CALIBRATION_TOKENS` token ids drawn with a fixed seed over the vocabulary: the keys'
outlier channels are a property of the key projection's weights, which any tokens expose.
Results are kept per (model fingerprint, tokens), so `generate` calls on one model pay the
pass once. `models.generate` calibrates this way whenever it creates a smoothed arena; a
cache you pass keeps the factors you created it with.
"""
from __future__ import annotations

import hashlib

import numpy as np
from flax import nnx

from arena_jax import key_factors as factors_lib
from arena_jax.models.checks import token_ids

__all__ = ["CALIBRATION_TOKENS", "calibration_tokens", "calibrate_key_factors"]

CALIBRATION_TOKENS = 128
_FOUND: dict[tuple[str, str], np.ndarray] = {}  # (fingerprint, tokens digest) -> f32[L, K, D]
_KEEP = 16  # results kept


def calibration_tokens(vocab_size: int, num: int = CALIBRATION_TOKENS) -> list[int]:
    """The built-in sample: `num` token ids in [0, vocab_size), the same on every call."""
    return np.random.default_rng(0).integers(0, vocab_size, num).tolist()


def calibrate_key_factors(model, tokens=None) -> np.ndarray:
    """f32[num_layers, num_kv_heads, head_dim]: the model's smoothed-key factors for
    `aj.create(layout, key_factors=...)`. `tokens`: None (the built-in sample), a list of
    token ids, or a list of such lists (each at most the model's max_position_embeddings)."""
    from arena_jax.models.dense_baseline import dense_prefill, init_dense_cache
    from arena_jax.models.fingerprint import fingerprint

    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "vocab_size"):
        raise ValueError(f"model must be a models.Llama, got {type(model).__name__}")
    if tokens is None:
        rows = [calibration_tokens(cfg.vocab_size, min(CALIBRATION_TOKENS, cfg.max_position_embeddings))]
    else:
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__") or len(tokens) == 0:
            raise ValueError("tokens must be a non-empty list of token ids (or of token-id lists)")
        nested = all(hasattr(t, "__len__") and not isinstance(t, (str, bytes)) for t in tokens)
        rows = [token_ids(f"tokens[{i}]", t, cfg.vocab_size) for i, t in enumerate(tokens)] if nested else [
            token_ids("tokens", tokens, cfg.vocab_size)]
        for i, row in enumerate(rows):
            if not row or len(row) > cfg.max_position_embeddings:
                raise ValueError(f"tokens[{i}] has {len(row)} tokens: give 1 to max_position_embeddings="
                                 f"{cfg.max_position_embeddings}")
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int32)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    key = (fingerprint(model), hashlib.sha256(ids.tobytes() + str(ids.shape).encode()).hexdigest())
    if key not in _FOUND:
        lengths = np.asarray([len(r) for r in rows], np.int32)
        graphdef, state = nnx.split(model)
        _, dense = dense_prefill(graphdef, state, init_dense_cache(cfg, len(rows), width), ids, lengths)
        k = np.asarray(dense.k).transpose(0, 1, 3, 2, 4)  # [L, B, K, T, D] -> [L, B, T, K, D] float32
        k = np.where((np.arange(width)[None, :] < lengths[:, None])[None, :, :, None, None], k, 0.0)  # padding: zeros
        if len(_FOUND) >= _KEEP:
            _FOUND.pop(next(iter(_FOUND)))
        _FOUND[key] = np.asarray(factors_lib.from_keys(k), np.float32)
    return _FOUND[key].copy()
