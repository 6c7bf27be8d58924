"""Decode attention over a float arena's pages as one native call on a CPU (`attention.cc`,
through XLA's FFI).

`decode_attention` gives what `pallas_kernels.blockwise.paged_attention_blockwise` gives for one
query a row over a float32 or bfloat16 arena read by queries of the same dtype (`supports`), with
its mask, soft-cap and NaN rules, reading each attended key's K and V rows where they lie: no
gather of the pages, one call a layer. `arena_jax.arena_ops.ATTEND_KERNEL` dispatches it; its
references are that function and `paged_attention_reference` (tests/test_attention_native.py
compares them on random arenas).

Why: on a CPU the blockwise path is about eleven small kernels a layer (page gathers, the
score and P @ V dots, masks, the softmax's reductions), about 13 us a layer of a tiny model's
decode step, more than the dense cache's attention. This call takes 7-10 us there: the tiny
model's decode step runs 0.90-0.93x the dense step's tokens/s instead of 0.85-0.88x, and its
compile drops from 1.33-1.38x to 0.95-1.02x the dense step's (benchmarks/RESULTS.md, sessions
63-64). Past `worthwhile`'s keys read XLA's dots are as fast or faster, and the blockwise path
runs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu import _build
from pallas_kernels.reference import _window

__all__ = ["decode_attention", "decode_attention_rows", "supports", "worthwhile", "native_problem", "DTYPES", "MAX_KEYS_READ"]

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

# The most K elements a call may cover (batch x KV heads x capacity x head_dim) for the native call
# to be chosen (`worthwhile`): past about this, XLA's vectorized dots over gathered blocks are the
# faster on a CPU, as both near the memory's bandwidth (session 63, one thread, float32, per call:
# 4 rows x 2 KV heads x 64 keys x 16 lanes 17 us native against 30 us blockwise; 4 x 2 x 144 x 64
# (74K) 80 against 87 us; 8 x 2 x 144 x 64 (147K) 158 against 145 us; 32 x 2 x 144 x 16 (147K)
# 154 against 140 us; 8 x 2 x 1,040 x 64 1,075 against 978 us).
MAX_KEYS_READ = 2**17


def native_problem() -> str | None:
    """Why the native attention cannot run here (no compiler, a failed build), or None."""
    return _build.native_problem()


def supports(q, k_arena, v_arena, k_scale=None) -> bool:
    """Whether `decode_attention` takes these operands: one query a row, q, K and V all float32 or
    all bfloat16 (no scales: a float arena), whole query groups a KV head."""
    return (q.ndim == 4 and q.shape[1] == 1 and k_arena.ndim == 5 and k_scale is None
            and jnp.dtype(q.dtype) in DTYPES and q.dtype == k_arena.dtype == v_arena.dtype
            and q.shape[2] % k_arena.shape[1] == 0 and q.shape[3] == k_arena.shape[4])  # fmt: skip


def worthwhile(batch: int, kv_heads: int, capacity: int, head_dim: int) -> bool:
    """Whether the native call is chosen over the blockwise path for rows of `capacity` keys
    (`MAX_KEYS_READ`)."""
    return batch * kv_heads * capacity * head_dim <= MAX_KEYS_READ


def decode_attention(q, k_arena, v_arena, layer, page_map, lengths, num_tokens, *, sm_scale=None,
                     sliding_window=None, logits_soft_cap=None):
    """Attention of one query a row, q [B, 1, Hq, D], over arenas [L, Hkv, P, S, D] (q's dtype,
    float32 or bfloat16); layer i32[] (clipped), page_map i32[B, M], lengths, num_tokens i32[B],
    the keywords as `paged_attention_blockwise`'s (a window may be traced). Returns [B, 1, Hq, D]
    in q's dtype."""
    i32 = jnp.int32
    lengths, num_tokens = jnp.asarray(lengths, i32), jnp.asarray(num_tokens, i32)
    rows4 = jnp.stack([jnp.zeros_like(lengths), jnp.zeros_like(lengths), lengths, num_tokens], axis=-1)[None]
    return decode_attention_rows(q, k_arena, v_arena, layer, page_map, rows4, 0, sm_scale=sm_scale,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)


def decode_attention_rows(q, k_arena, v_arena, layer, page_map, rows4, index, *, sm_scale=None,
                          sliding_window=None, logits_soft_cap=None):
    """`decode_attention` with each row's lengths and query tokens read from rows4[index]
    (i32[R, B, 4]: entries 2 and 3, a `StepPlan`'s rows4; index i32[] clipped into [0, R); a row
    of num_tokens < 0 reads nothing). A step's plan and layer go in as they are: no kernel of
    XLA's picks them apart beside the call (in a scan of layers such kernels, independent of q,
    let XLA's CPU runtime run the loop's body on its thread pool; RESULTS.md, session 63)."""
    if not supports(q, k_arena, v_arena):
        raise ValueError(f"decode_attention takes one query a row and q, K, V all float32 or all bfloat16, got q "
                         f"{q.dtype}{list(q.shape)}, arenas {k_arena.dtype}{list(k_arena.shape)}, {v_arena.dtype}")
    problem = native_problem()
    if problem is not None:
        raise RuntimeError(f"the native attention is not available: {problem}")
    batch, _, num_q_heads, head_dim = q.shape
    max_keys = page_map.shape[1] * k_arena.shape[3]
    window = _window(sliding_window, max_keys)
    i32 = jnp.int32
    out = jax.ffi.ffi_call("arena_decode_attention", jax.ShapeDtypeStruct((batch, num_q_heads, head_dim), q.dtype))(
        q.reshape(batch, num_q_heads, head_dim), k_arena, v_arena, jnp.asarray(layer, i32), page_map.astype(i32),
        jnp.asarray(rows4, i32), jnp.asarray(index, i32), jnp.asarray(0 if window is None else window, i32),
        windowed=np.int64(window is not None), sm_scale=np.float32(head_dim**-0.5 if sm_scale is None else sm_scale),
        soft_cap=np.float32(0.0 if logits_soft_cap is None else logits_soft_cap))  # fmt: skip
    return out.reshape(q.shape)
