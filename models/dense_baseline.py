"""The same `Llama` (same modules, same weights) with a conventional dense KV cache: the
baseline that the benchmarks compare the paged arena against.

The cache is preallocated per batch row at full length, the usual JAX way:

    k, v: [num_layers, batch, max_len, num_kv_heads, head_dim]   lengths: i32[batch]

and each step writes its new K/V with `jax.lax.dynamic_update_slice` at each row's length.
A static batch (no continuous batching), greedy decoding.

Step-level API (what a benchmark times):

    graphdef, state = nnx.split(model)
    cache = init_dense_cache(model.config, batch, max_len, dtype)        # DenseCache
    next_tokens, cache = dense_prefill(graphdef, state, cache, tokens, num_tokens)  # tokens i32[B, T]
    next_tokens, cache = dense_decode(graphdef, state, cache, next_tokens)          # tokens i32[B]

Both steps are jitted with the cache donated; `next_tokens` are greedy. Row b's real prompt
tokens are its first num_tokens[b] of the [B, T] chunk; the caller keeps
`lengths + T <= max_len` (dynamic_update_slice would otherwise clamp the write position).

Whole loop: `dense_generate(model, prompts, max_new_tokens, stop_tokens=()) -> list[list[int]]`.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from models.config import LlamaConfig
from models.llama import Llama

__all__ = ["DenseCache", "init_dense_cache", "dense_prefill", "dense_decode", "dense_generate"]


@struct.dataclass
class DenseCache:
    k: jax.Array  # [L, B, S, K, H]
    v: jax.Array  # [L, B, S, K, H]
    lengths: jax.Array  # i32[B] tokens held per row


def init_dense_cache(config: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> DenseCache:
    shape = (config.num_layers, batch, max_len, config.num_kv_heads, config.head_dim)
    return DenseCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32))


def _write(buf, layer: int, new, start):
    """buf [L, B, S, K, H] <- new [B, T, K, H] at (layer, b, start[b]) per row."""

    def row(buf_b, new_b, s):  # [L, S, K, H], [T, K, H]
        return jax.lax.dynamic_update_slice(buf_b, new_b[None], (layer, s, 0, 0))

    return jax.vmap(row, in_axes=(1, 0, 0), out_axes=1)(buf, new, start)


def _attention(q, k, v, q_pos, total, sliding_window):
    """q [B, T, N, H], k/v [B, S, K, H], q_pos i32[B, T], total i32[B] -> [B, T, N, H]."""
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h).astype(jnp.float32)
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k.astype(jnp.float32)) * h**-0.5
    key_pos = jnp.arange(k.shape[1], dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    mask = (key_pos <= q_pos[:, :, None]) & (key_pos < total[:, None, None])  # [B, T, S]
    if sliding_window is not None:
        mask &= key_pos > q_pos[:, :, None] - sliding_window
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(mask[:, None, None], weights, 0.0)  # rows with no key (padding) give 0, not NaN
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights, v.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)


def _forward(model: Llama, cache: DenseCache, tokens, num_tokens):
    """tokens [B, T] at positions lengths + t; returns (hidden [B, T, E], cache)."""
    t = tokens.shape[1]
    start = cache.lengths
    q_pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    total = start + num_tokens
    k_all, v_all = cache.k, cache.v
    x = model.embed(tokens)
    for i, block in enumerate(model.layers):
        q, k, v = block.attn.project(block.attn_norm(x), q_pos)
        k_all = _write(k_all, i, k.astype(k_all.dtype), start)
        v_all = _write(v_all, i, v.astype(v_all.dtype), start)
        o = _attention(q, k_all[i], v_all[i], q_pos, total, model.config.sliding_window)
        x = x + block.attn.output(o)
        x = x + block.mlp(block.mlp_norm(x))
    return model.norm(x), DenseCache(k=k_all, v=v_all, lengths=total)


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def dense_prefill(graphdef, state, cache: DenseCache, tokens, num_tokens):
    """Greedy next token after each row's first num_tokens[b] tokens of tokens [B, T]."""
    model = nnx.merge(graphdef, state)
    x, cache = _forward(model, cache, tokens, num_tokens)
    last = jnp.maximum(num_tokens - 1, 0)
    logits = model.logits(jnp.take_along_axis(x, last[:, None, None], axis=1))[:, 0]
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


@functools.partial(jax.jit, static_argnames=("graphdef",), donate_argnames=("cache",))
def dense_decode(graphdef, state, cache: DenseCache, tokens):
    """Feed tokens i32[B] (one per row), return the greedy next tokens."""
    model = nnx.merge(graphdef, state)
    x, cache = _forward(model, cache, tokens[:, None], jnp.ones_like(tokens))
    return jnp.argmax(model.logits(x)[:, 0], axis=-1).astype(jnp.int32), cache


def dense_generate(
    model: Llama, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, stop_tokens=()
) -> list[list[int]]:
    """Greedy generation for all prompts as one static batch; returns the generated tokens."""
    if max_new_tokens < 1 or not prompts:
        return [[] for _ in prompts]
    batch = len(prompts)
    width = max(len(p) for p in prompts)
    tokens = np.zeros((batch, width), np.int32)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = p
    counts = np.asarray([len(p) for p in prompts], np.int32)
    graphdef, state = nnx.split(model)
    cache = init_dense_cache(model.config, batch, width + max_new_tokens, model.dtype)
    nxt, cache = dense_prefill(graphdef, state, cache, jnp.asarray(tokens), jnp.asarray(counts))
    out = [[] for _ in prompts]
    done = np.zeros(batch, bool)
    stop = set(stop_tokens)
    for step in range(max_new_tokens):
        host = np.asarray(nxt)
        for b in np.flatnonzero(~done):
            out[b].append(int(host[b]))
            done[b] |= int(host[b]) in stop
        if done.all() or step == max_new_tokens - 1:
            break
        nxt, cache = dense_decode(graphdef, state, cache, nxt)
    return out
