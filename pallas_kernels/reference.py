"""Plain-jnp paged append and paged attention: the ground truth for the kernels.

Kernel-level contract (shared by `append.py`, `paged_attention.py` and these
references). Kernels know nothing of slots or owners; the caller gathers each
batch row's page-table row and lengths:

    k_arena, v_arena : [num_layers, num_kv_heads, num_pages, page_size, head_dim]
    layer            : i32[] (python int or traced scalar)
    page_map         : i32[batch, max_pages_per_seq]  physical page per logical page, -1 unmapped
    lengths          : i32[batch]  tokens held by the row *after* the new ones were reserved
    num_tokens       : i32[batch]  new tokens of the row (0 for a padded row)

The new tokens of row b are its last `num_tokens[b]` positions:
token t (t < num_tokens[b]) sits at position `lengths[b] - num_tokens[b] + t`.
Inputs `k, v, q` are `[batch, tokens, heads, head_dim]`; positions t >= num_tokens[b]
are padding: they are never written, and their attention output is zero.

Attention: query at position p sees key j iff `j <= p` and, with a sliding window
W, `j > p - W` (W counts the query's own token, as in Hugging Face Mistral).
Masking selects with `jnp.where`; stale pages (NaN, huge values) never reach
the output.

8-bit arenas (int8, float8_e4m3fn, float8_e5m2) come with their scales
`k_scale, v_scale: [num_layers, num_kv_heads, num_pages, page_size]` (float32 or
bfloat16): append quantizes each new token's row per KV head (`pallas_kernels.quant`,
the rules written there) and writes values and scale; attention dequantizes
(`values * scale`, float32) and runs the same float32 attention. Stale scales (NaN from an
earlier tenant) are masked exactly like stale values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.quant import dequantize_rows, is_quantized, quantize_rows

__all__ = ["append_reference", "paged_attention_reference", "token_positions"]


def token_positions(lengths, num_tokens, tokens: int):
    """Positions of the new tokens and their validity.

    lengths, num_tokens: i32[batch] -> (pos i32[batch, tokens], valid bool[batch, tokens])
    """
    t = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    start = (lengths - num_tokens)[:, None]
    valid = t < num_tokens[:, None]
    return start + t, valid


def append_reference(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens, *, k_scale=None, v_scale=None):
    """Scatter new K/V into their pages (in place when the arena is donated).

    k_arena, v_arena: [L, Hkv, P, S, D]; k, v: [B, T, Hkv, D]; page_map: i32[B, M];
    lengths, num_tokens: i32[B]. Returns the updated (k_arena, v_arena); for an 8-bit arena
    (k_scale, v_scale: [L, Hkv, P, S] given) k, v are quantized per token and head and the
    updated (k_arena, v_arena, k_scale, v_scale) are returned.
    """
    _, _, num_pages, page_size, _ = k_arena.shape
    tokens = k.shape[1]
    pos, valid = token_positions(lengths, num_tokens, tokens)  # [B, T]
    logical = jnp.clip(pos // page_size, 0, page_map.shape[1] - 1)
    page = jnp.take_along_axis(page_map, logical, axis=1)  # [B, T]
    # Positions past the page table (pos >= M * page_size) are dropped, not clipped onto the last page.
    ok = valid & (page >= 0) & (pos >= 0) & (pos < page_map.shape[1] * page_size)
    # An explicit out-of-range sentinel plus mode="drop": padded tokens write nothing.
    page = jnp.where(ok, page, num_pages)
    offset = jnp.where(ok, pos % page_size, 0)
    layer = jnp.asarray(layer, jnp.int32)
    # arena[layer][:, page, offset] <- k[b, t] for every (b, t): indices broadcast to [B, T],
    # the head axis is a slice, so the update is [B, T, Hkv, D].
    if k_scale is None:
        k_arena = k_arena.at[layer, :, page, offset].set(k.astype(k_arena.dtype), mode="drop")
        v_arena = v_arena.at[layer, :, page, offset].set(v.astype(v_arena.dtype), mode="drop")
        return k_arena, v_arena
    out = []
    for x, arena, scales in ((k, k_arena, k_scale), (v, v_arena, v_scale)):
        values, scale = quantize_rows(x, arena.dtype, scales.dtype)  # [B, T, Hkv, D], [B, T, Hkv]
        out.append((arena.at[layer, :, page, offset].set(values, mode="drop"),
                    scales.at[layer, :, page, offset].set(scale, mode="drop")))
    (k_arena, k_scale), (v_arena, v_scale) = out
    return k_arena, v_arena, k_scale, v_scale


def paged_attention_reference(
    q, k_arena, v_arena, layer, page_map, lengths, num_tokens, *, sm_scale=None, sliding_window=None, k_scale=None,
    v_scale=None,
):
    """Attention of the new tokens over each row's pages: gather then dense masked softmax.

    q: [B, T, Hq, D] with Hq a multiple of Hkv; returns [B, T, Hq, D] in q's dtype. An 8-bit
    arena comes with k_scale, v_scale [L, Hkv, P, S]: keys and values are dequantized to float32.
    """
    batch, tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    max_pages = page_map.shape[1]
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    layer = jnp.asarray(layer, jnp.int32)
    k_layer = jax.lax.dynamic_index_in_dim(k_arena, layer, axis=0, keepdims=False)  # [Hkv, P, S, D]
    v_layer = jax.lax.dynamic_index_in_dim(v_arena, layer, axis=0, keepdims=False)
    pages = jnp.maximum(page_map, 0)  # unmapped entries are masked below, never trusted
    # [Hkv, B, M, S, D] -> [B, M*S, Hkv, D]
    k_seq = k_layer[:, pages].transpose(1, 2, 3, 0, 4).reshape(batch, max_pages * page_size, num_kv_heads, head_dim)
    v_seq = v_layer[:, pages].transpose(1, 2, 3, 0, 4).reshape(batch, max_pages * page_size, num_kv_heads, head_dim)
    if is_quantized(k_arena.dtype):
        seq = []
        for scales in (k_scale, v_scale):  # [L, Hkv, P, S] -> [B, M*S, Hkv]
            s_layer = jax.lax.dynamic_index_in_dim(scales, layer, axis=0, keepdims=False)
            seq.append(s_layer[:, pages].transpose(1, 2, 3, 0).reshape(batch, max_pages * page_size, num_kv_heads))
        k_seq, v_seq = dequantize_rows(k_seq, seq[0]), dequantize_rows(v_seq, seq[1])  # f32; stale rows masked below

    key_pos = jnp.arange(max_pages * page_size, dtype=jnp.int32)  # [S_total]
    key_live = key_pos[None, :] < lengths[:, None]  # [B, S_total]
    key_live &= jnp.repeat(page_map >= 0, page_size, axis=1)
    v_seq = jnp.where(key_live[:, :, None, None], v_seq, 0)  # stale V must not meet a zero weight

    q_pos, q_valid = token_positions(lengths, num_tokens, tokens)  # [B, T]
    mask = key_live[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, T, S_total]
    if sliding_window is not None:
        mask &= key_pos[None, None, :] > (q_pos[:, :, None] - sliding_window)
    mask &= q_valid[:, :, None]

    qg = q.reshape(batch, tokens, num_kv_heads, group, head_dim).astype(jnp.float32)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k_seq.astype(jnp.float32)) * sm_scale
    logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask[:, None, None], jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("BKGTS,BSKH->BTKGH", weights, v_seq.astype(jnp.float32))
    out = jnp.where(q_valid[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, tokens, num_q_heads, head_dim).astype(q.dtype)
