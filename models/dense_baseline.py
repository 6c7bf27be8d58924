"""The same `Llama` (same modules, same weights, every family) with a conventional dense KV
cache: the baseline that the benchmarks compare the paged arena against.

The cache is what a well-written dense Flax sampler keeps, preallocated per batch row at full
length:

    k, v: [num_layers, batch, num_kv_heads, max_len, head_dim]   (heads-major)
    positions: i32[batch, max_len]   each cache slot's token position, -1 for an empty slot
    lengths: i32[batch]              tokens held per row
    end: i32[]                       slots used, the same for every row

A step of T tokens writes every row's K/V at slots [end, end + T) of its layer with ONE
`jax.lax.dynamic_update_slice` per layer (K and V) into the loop-carried cache: in place, no
scatter, no transpose of the cache (tests/test_model_families.py checks the compiled HLO).
Heads-major, as attention reads it (`BKSH`): a layer's keys of one head are contiguous, so
the step reads its layer without a transpose. (The layout was `[L, B, S, K, H]` until
2026-11-28: XLA then transposed each layer's K and V every step, and the baseline ran slower
than a dense cache can: benchmarks/RESULTS.md, "A heads-major dense baseline".) A row's
padding tokens occupy slots too, marked -1 in `positions` and never attended to; RoPE uses
each row's own positions (`lengths + t`). The layers run in the same `jax.lax.scan` as the
paged model (`models.llama.run_layers`), with each layer's window, RoPE, scale and soft-cap.
A static batch (no continuous batching), greedy decoding.

Step-level API (what a benchmark times):

    graphdef, state = nnx.split(model)
    cache = init_dense_cache(model.config, batch, max_len, dtype)        # DenseCache
    next_tokens, cache = dense_prefill(graphdef, state, cache, tokens, num_tokens)  # tokens i32[B, T]
    next_tokens, cache = dense_decode(graphdef, state, cache, next_tokens)          # tokens i32[B]

Both steps are jitted with the cache donated; `next_tokens` are greedy. Row b's real prompt
tokens are its first num_tokens[b] of the [B, T] chunk; the caller keeps `end + T <= max_len`
(dynamic_update_slice would otherwise clamp the write position).

Whole loop: `dense_generate(model, prompts, max_new_tokens, stop_tokens=()) -> list[list[int]]`.
"""
from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from arena_jax.models.checks import token_ids
from arena_jax.models.config import LlamaConfig
from arena_jax.models.layers import take_tokens
from arena_jax.models.llama import Llama, run_layers
from arena_jax.models.model_jit import model_jit
from arena_jax.models.sampling import first_argmax

__all__ = ["DenseCache", "init_dense_cache", "dense_prefill", "dense_decode", "dense_generate"]


@struct.dataclass
class DenseCache:
    k: jax.Array  # [L, B, K, S, H]
    v: jax.Array  # [L, B, K, S, H]
    lengths: jax.Array  # i32[B] tokens held per row
    positions: jax.Array  # i32[B, S] token position per slot, -1 empty
    end: jax.Array  # i32[] slots used (every row)


def init_dense_cache(config: LlamaConfig, batch: int, max_len: int, dtype=jnp.float32) -> DenseCache:
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    return DenseCache(
        k=jnp.zeros(shape, dtype),
        v=jnp.zeros(shape, dtype),
        lengths=jnp.zeros((batch,), jnp.int32),
        positions=jnp.full((batch, max_len), -1, jnp.int32),
        end=jnp.zeros((), jnp.int32),
    )


def _attention(q, k, v, q_pos, key_pos, window, sm_scale, soft_cap):
    """q [B, T, N, H], k/v [B, K, S, H], q_pos i32[B, T], key_pos i32[B, S] (-1: empty slot),
    window None or i32[] -> [B, T, N, H]. Query at position p sees keys at 0 <= j <= p (and
    j > p - window)."""
    b, t, n, h = q.shape
    kv_heads = k.shape[1]
    qg = q.reshape(b, t, kv_heads, n // kv_heads, h).astype(jnp.float32)
    scores = jnp.einsum("BTKGH,BKSH->BKGTS", qg, k.astype(jnp.float32)) * sm_scale
    if soft_cap is not None:
        scores = jnp.tanh(scores / soft_cap) * soft_cap
    keys = key_pos[:, None, :]  # [B, 1, S]
    mask = (keys >= 0) & (keys <= q_pos[:, :, None])  # [B, T, S]
    if window is not None:
        mask &= keys > q_pos[:, :, None] - window
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    weights = jnp.where(mask[:, None, None], weights, 0.0)  # rows with no key (padding) give 0, not NaN
    out = jnp.einsum("BKGTS,BKSH->BTKGH", weights, v.astype(jnp.float32))
    return out.reshape(b, t, n, h).astype(q.dtype)


def _forward(model: Llama, cache: DenseCache, tokens, num_tokens, last_only: bool = False):
    """tokens [B, T] at positions lengths + t; returns (hidden [B, T, E], cache). `last_only`:
    hidden [B, 1, E] of each row's last new token (a list of layers runs the last layer's query,
    attention and the rest for that token alone, as the paged model's `hidden(..., last_only=True)`)."""
    cfg = model.config
    t = tokens.shape[1]
    steps = jnp.arange(t, dtype=jnp.int32)[None, :]
    q_pos = cache.lengths[:, None] + steps  # [B, T]
    slot_pos = jnp.where(steps < num_tokens[:, None], q_pos, -1)
    key_pos = jax.lax.dynamic_update_slice(cache.positions, slot_pos, (0, cache.end))  # [B, S]
    zero = jnp.zeros((), jnp.int32)

    def body(block, x, kv, layer, window, inv_freq, last=None):
        k_all, v_all = kv
        h = block.attn_norm(x)
        q, k, v = block.attn.project(h, q_pos, inv_freq)
        q_at = q_pos
        if last is not None:  # row b's token last[b] alone past its K/V (XLA drops the unused q above)
            q_at = take_tokens(q_pos, last)  # [B, 1]
            q, _, _ = block.attn.project(take_tokens(h, last), q_at, inv_freq)
        at = (layer, zero, zero, cache.end, zero)
        heads_major = lambda x, like: jnp.swapaxes(x, 1, 2)[None].astype(like.dtype)  # noqa: E731  [B, T, K, H] -> [1, B, K, T, H]
        k_all = jax.lax.dynamic_update_slice(k_all, heads_major(k, k_all), at)
        v_all = jax.lax.dynamic_update_slice(v_all, heads_major(v, v_all), at)
        k_layer = jax.lax.dynamic_index_in_dim(k_all, layer, keepdims=False)  # [B, K, S, H]
        v_layer = jax.lax.dynamic_index_in_dim(v_all, layer, keepdims=False)
        o = _attention(q, k_layer, v_layer, q_at, key_pos, window, cfg.sm_scale, cfg.attn_logit_softcapping)
        return block.finish(x if last is None else take_tokens(x, last), block.attn.output(o)), (k_all, v_all)

    last = jnp.maximum(num_tokens - 1, 0)
    last_body = functools.partial(body, last=last) if last_only and t > 1 and not model.scan_layers else None
    x, (k_all, v_all) = run_layers(model, model.embed(tokens), (cache.k, cache.v), body, last_body)
    if last_only and x.shape[1] > 1:
        x = take_tokens(x, last)
    cache = DenseCache(k=k_all, v=v_all, lengths=cache.lengths + num_tokens, positions=key_pos, end=cache.end + t)
    return model.norm(x), cache


@model_jit(donate_argnames=("cache",))
def dense_prefill(graphdef, state, cache: DenseCache, tokens, num_tokens):
    """Greedy next token after each row's first num_tokens[b] tokens of tokens [B, T]."""
    model = nnx.merge(graphdef, state)
    x, cache = _forward(model, cache, tokens, num_tokens, last_only=True)  # [B, 1, E]: each row's last token
    return first_argmax(model.logits(x)[:, 0]), cache


@model_jit(donate_argnames=("cache",))
def dense_decode(graphdef, state, cache: DenseCache, tokens):
    """Feed tokens i32[B] (one per row), return the greedy next tokens."""
    model = nnx.merge(graphdef, state)
    x, cache = _forward(model, cache, tokens[:, None], jnp.ones_like(tokens))
    return first_argmax(model.logits(x)[:, 0]), cache


def dense_generate(
    model: Llama, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, stop_tokens=()
) -> list[list[int]]:
    """Greedy generation for all prompts as one static batch; returns the generated tokens.
    Token ids are checked as `generate` checks them: integers in [0, vocab_size)."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError("prompts is a string; pass a list of token-id lists")
    prompts = [token_ids(f"prompts[{i}]", p, model.config.vocab_size) for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        if not p:  # (it would be fed as one token 0 at position 0: no prompt to continue)
            raise ValueError(f"prompts[{i}] is empty")
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
