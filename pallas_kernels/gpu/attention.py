"""Paged attention straight from the arena: decode (flash-decoding) and (chunked) prefill.

One kernel family. A program owns (batch row b, KV head h and a block of its query heads,
query-token block, split) and holds `block_tokens x group_pad` query rows: the query heads
of the KV group (GQA, packed so K/V are read once per group; groups larger than `block_h`
heads, 64 or 16 in float32, are split over `cdiv(group, block_h)` programs) for
`block_tokens` new tokens; row r is token `r // group_pad`, head `r % group_pad` of the block.
Rows are padded up to Triton's 16-row minimum for `dot`: decode (one token) pads the group
(any size: 5 and 6 pad to 8, then 16); prefill packs tokens.

The program streams the row's K/V `block_k` tokens at a time (a power of two, whatever the
page size: several small pages per step, or a large page over several steps); each token
finds its own page (`page_map[b, pos // page_size]`), so page tables may be scrambled.
`head_dim` is padded to a power-of-two tile `head_tile` (>= 16): the padding lanes are
masked on every load and store, so nothing past a head's `head_dim` is read or written.
Online softmax in float32. The key range is bounded by loop limits, not masks:
it starts at the page holding the earliest key any of the program's queries may see
(sliding window: static, compiled in, or traced, read from `window_ref` with the same
arithmetic) and ends at the last query's position; split `s` of `num_splits` takes a
contiguous share of those blocks. Inside a block, keys past the length, in unmapped pages,
in the future (causal) or out of the window are masked with `where` before the softmax;
dead K/V lanes are never loaded (masked loads, `other=0`).

Dtypes: the dots run in q's dtype, whatever the arena's (K/V tiles converted in registers;
bf16/fp16: tensor cores, fp32: IEEE FMA), accumulating in float32; scores, soft-cap
(`cap * tanh(s / cap)`, a static `soft_cap`) and softmax in float32; the weights rounded to
q's dtype for the P @ V dot; the output rounded once.

Masked means masked (the reference's rules): a V row with a NaN / inf lane is selected to
zero and flagged (`v_ok`), as is a non-finite score (`s_ok`); a flagged (row, key) pair the
row attends to gets weight NaN, so that query's whole output row is NaN, while a masked pair
contributes exactly nothing (its weight is 0 and its V row finite). Selects, never products
with zero, so stale or NaN page contents never reach a query that does not attend to them.

With one split the kernel normalizes and writes the output; with several it writes
unnormalized partials plus the running max / sum per row, merged afterwards by a
log-sum-exp in plain jnp (`_merge_splits`). A row that saw no key has a running sum of
exactly 0 and gives 0; a poisoned row has a NaN sum and gives NaN, as in the reference (the
test is `l != 0`, not `l > 0`).

8-bit arenas (int8, float8_e4m3fn, float8_e5m2, with per-token scales `k_scale`, `v_scale`
[layers, kv_heads, pages, page_size]) are dequantized inside the kernel. Every 8-bit value
converts exactly to bf16, fp16 and f32 (int8 in [-127, 127]; e4m3 and e5m2 are narrower
floats), so only the scale multiplication rounds:
- K: the scale of key j multiplies every lane of its row, so it factors out of the QK^T
  contraction over head_dim: `s[r, j] = (q_r . kq_j) * k_scale[j] * sm_scale`, applied to the
  float32 score tile (block_k multiplies per row instead of block_k x head_dim, and exact).
- V: bf16 / f32 compute fold the scale into the softmax weights, `o += (p * v_scale) @ vq`
  (the same factoring over keys); fp16 compute dequantizes the V tile instead,
  `(vq * v_scale).astype(fp16)`, because p * v_scale could underflow fp16's range.
Scales are masked loads like the values: a dead key (past the length, unmapped) loads
neither its values nor its scale, so NaN-poisoned stale scales never reach the output. With
bf16 / f32 compute a row's poison is its value scale (8-bit values are finite by
construction): a non-finite one is zeroed and flagged, so `p * v_scale` is 0 for masked
pairs and NaN for attended ones; with fp16 compute the dequantized tile is checked. No fp8 tensor-core dot is used: q would have to be rounded to
fp8 too, and decode is bound by the bytes read, which the 8-bit loads already halve.
Contract: `pallas_kernels.reference.paged_attention_reference`.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    MIN_TILE,
    BlockSizes,
    cdiv,
    check_arena,
    check_layer,
    check_rotate,
    check_rows,
    check_sliding_window,
    check_static_positive,
    check_tokens,
    compiler_params,
    index_of,
    masked_load,
    masked_store,
    head_tile,
    next_pow2,
    resolve_block_k,
    resolve_interpret,
)
from pallas_kernels.gpu._tiles import dot, int4_group, lane_parts, part_lanes, part_width, rotated_part, rotation_inputs
from pallas_kernels.quant4 import GROUP, arena_format
from pallas_kernels.reference import paged_attention_reference, token_positions

__all__ = ["paged_attention", "paged_attention_reference", "BlockSizes"]

_F32_MAX = float(jnp.finfo(jnp.float32).max)


def _finite_rows(x):
    """x [n, lanes] -> bool[n]: every lane finite (x * 0 is 0, or NaN for NaN / inf; summed in f32)."""
    return jnp.sum(x.astype(jnp.float32) * 0, axis=1) == 0


def _attention_kernel(
    # inputs
    layer_ref,  # i32[1]
    lengths_ref,  # i32[batch]
    num_tokens_ref,  # i32[batch]
    page_map_ref,  # i32[batch, max_pages]
    # traced windows only: window_ref i32[1] (clipped into [0, max_pages * page_size]), then
    # q_ref [batch, tokens, q_heads, head_dim] (head_dim: any multiple of 8; tiles use tile_d lanes),
    # k_ref, v_ref [layers, kv_heads, pages, page_size, head_dim] (int4: head_dim / 2 bytes),
    # quantized arenas: k_scale_ref, v_scale_ref [layers, kv_heads, pages, page_size(, head_dim / 32)],
    # rotated keys: m_ref [head_dim, head_dim] (q's dtype), cs_ref f32[head_dim], then
    # outputs: normalized (num_splits == 1) or partial (num_splits > 1)
    *refs,  # o_ref [batch, tokens, q_heads, head_dim] (q dtype)
    #       | o_ref [batch, splits, tokens, q_heads, head_dim] f32, m_ref, l_ref [batch, splits, tokens, q_heads] f32
    fmt: str,
    rotate: bool,
    head_dim: int,
    part_width: int,
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    traced_window: bool,
    block_tokens: int,
    group: int,
    group_pad: int,
    head_blocks: int,
    block_k: int,
    tile_d: int,
    num_splits: int,
):
    if traced_window:
        window_ref, *refs = refs
    q_ref, k_ref, v_ref, *refs = refs
    quantized, int4 = fmt != "float", fmt == "int4"
    if quantized:
        k_scale_ref, v_scale_ref, *refs = refs
    if rotate:
        m_ref, cs_ref, *refs = refs
    out_refs = refs
    b, hj, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    h, hb = lax.div(hj, head_blocks), lax.rem(hj, head_blocks)  # KV head, block of its query heads
    tb, split = lax.div(j, num_splits), lax.rem(j, num_splits)
    num_layers, _, _, page_size, _ = k_ref.shape
    _, tokens, _, _ = q_ref.shape
    max_pages = page_map_ref.shape[1]
    rows = block_tokens * group_pad
    window = window_ref[0] if traced_window else sliding_window  # i32[] in [0, max keys], int or None

    layer = jnp.clip(layer_ref[0], 0, num_layers - 1)
    length = lengths_ref[b]
    n_new = num_tokens_ref[b]
    n_valid = jnp.clip(n_new, 0, tokens)
    start = length - n_new  # position of new token 0

    r = jnp.arange(rows, dtype=jnp.int32)
    t = tb * block_tokens + lax.div(r, group_pad)  # [rows] token of each row
    g = hb * group_pad + lax.rem(r, group_pad)  # [rows] head within the group
    row_live = (t < n_valid) & (g < group)
    q_pos = start + t  # [rows]
    head = h * group + jnp.minimum(g, group - 1)
    # Lanes d >= head_dim pad the tile: masked, never read or written (interpret mode clamps
    # such indices on loads and drops them on stores; Triton never touches memory there).
    d = jnp.arange(tile_d, dtype=jnp.int32)[None, :]  # [1, tile_d]
    d_live = d < head_dim if tile_d != head_dim else jnp.ones((1, tile_d), jnp.bool_)
    row_mask = row_live[:, None] & d_live  # [rows, tile_d]
    t_q = jnp.minimum(t, tokens - 1)[:, None]
    q_idx = index_of(b, t_q, head[:, None], d)
    q = masked_load(q_ref.at[q_idx], mask=row_mask, other=0)  # [rows, tile_d]
    # The dots run in q's dtype (the compute dtype): K / V tiles are converted to it in registers.
    compute = q_ref.dtype
    fold_v = compute != jnp.float16  # quantized V: scale folded into p (bf16/f32 range) or the tile (fp16)
    # Rows in parts (int4: its groups of 32 lanes; rotated 8-bit keys: blocks
    # of part_width lanes): q's parts, rotated (`(q @ M[:, part]) * col_scale`, rounded to
    # q's dtype) or loaded as they are.
    parts = lane_parts(head_dim, tile_d, int4=int4, width=part_width) if int4 or rotate else []
    if rotate:
        q_parts = [rotated_part(q, m_ref, cs_ref, part, head_dim, tile_d).astype(compute) for part in parts]
    else:
        q_parts = [masked_load(q_ref.at[index_of(b, t_q, head[:, None], part_lanes(part)[None, :])],
                               mask=row_live[:, None] & (part_lanes(part)[None, :] < head_dim), other=0)
                   for part in parts]

    # Keys any row of this program may see: [lo, hi), then whole blocks from lo's page.
    t_first = tb * block_tokens
    t_last = jnp.minimum(t_first + block_tokens, n_valid) - 1
    hi = jnp.clip(jnp.minimum(start + t_last + 1, length), 0, max_pages * page_size)
    hi = jnp.where(t_first < n_valid, hi, 0)
    lo = jnp.zeros_like(hi) if window is None else jnp.maximum(start + t_first - window + 1, 0)
    lo = jnp.minimum(lo, hi)
    align = min(page_size, block_k)  # whole pages per step, or whole steps per page
    kv_start = lax.div(lo, align) * align
    n_blocks = cdiv(hi - kv_start, block_k)
    per_split = cdiv(n_blocks, num_splits)
    blk_lo = jnp.minimum(split * per_split, n_blocks)
    blk_hi = jnp.minimum(blk_lo + per_split, n_blocks)

    kk = jnp.arange(block_k, dtype=jnp.int32)

    def body(i, carry):
        acc, m_prev, l_prev = carry  # acc: [rows, tile_d] (int4: a tuple of [rows, 32]), [rows], [rows]
        tok = kv_start + i * block_k + kk  # [block_k] key positions
        logical = lax.div(tok, page_size)
        in_range = (tok < hi) & (logical < max_pages)
        pm_idx = index_of(b, jnp.minimum(logical, max_pages - 1))
        page = masked_load(page_map_ref.at[pm_idx], mask=in_range, other=-1)  # [block_k]
        live = in_range & (page >= 0)
        page_c, offset = jnp.maximum(page, 0), lax.rem(tok, page_size)
        kv_idx = index_of(layer, h, page_c[:, None], offset[:, None], d)
        kv_mask = live[:, None] & d_live  # [block_k, tile_d]
        # Poison (NaN / inf) reaches only the queries that attend to it: a V row with a
        # non-finite lane (quantized, bf16/f32 compute: a non-finite value scale) is selected to
        # zero and flagged (v_ok), as is a non-finite score (s_ok); a flagged pair a query
        # attends to gets a NaN weight, which makes that query's whole row NaN.
        if int4:  # dead keys load no codes and no scales (other=0), so stale NaN scales stay out
            s = _int4_scores(k_ref, k_scale_ref, q_parts, layer, h, page_c, offset, live, head_dim, compute, sm_scale)
            # bf16 / f32: V's codes are loaded after the softmax (fewer live registers), its scales
            # now (they carry the rows' poison); fp16: the dequantized halves now.
            v_ok, v_parts, v_scales = _int4_values(v_ref, v_scale_ref, layer, h, page_c, offset, live, head_dim, compute,
                                                   fold_v, codes=not fold_v)
        elif quantized:  # dead keys load no value and no scale (other=0), so stale NaN scales stay out
            # `other` as a float: Triton casts it to the arena dtype, and has no int -> fp8 cast.
            v = masked_load(v_ref.at[kv_idx], mask=kv_mask, other=0.0)  # [block_k, tile_d] 8-bit
            s_idx = index_of(layer, h, page_c, offset)
            k_scale = masked_load(k_scale_ref.at[s_idx], mask=live, other=0.0).astype(jnp.float32)  # [block_k]
            v_scale = masked_load(v_scale_ref.at[s_idx], mask=live, other=0.0).astype(jnp.float32)  # [block_k]
            if fold_v:  # the row's poison is its scale (8-bit values are finite): zeroed, p * scale is 0
                v_ok = jnp.abs(v_scale) <= _F32_MAX  # [block_k]
                v_scale = jnp.where(v_ok, v_scale, 0.0)
                v = jnp.where(kv_mask, v.astype(compute), jnp.zeros((), compute))
            else:  # fp16: the dequantized tile itself (vq * scale may also overflow fp16)
                v = (v.astype(jnp.float32) * v_scale[:, None]).astype(compute)
                v_ok = _finite_rows(v)
                v = jnp.where(kv_mask & v_ok[:, None], v, jnp.zeros_like(v))
            if rotate:  # rotated q meets the stored (rotated) keys part by part
                s = None
                for part, q_part in zip(parts, q_parts):
                    lanes = part_lanes(part)[None, :]
                    k_part = masked_load(k_ref.at[index_of(layer, h, page_c[:, None], offset[:, None], lanes)],
                                         mask=live[:, None] & (lanes < head_dim), other=0.0).astype(compute)
                    term = dot(q_part, k_part, transpose_b=True)
                    s = term if s is None else s + term
            else:
                k = masked_load(k_ref.at[kv_idx], mask=kv_mask, other=0.0).astype(compute)  # [block_k, tile_d]
                s = dot(q, k, transpose_b=True)
            s = s * (k_scale * sm_scale)[None, :]  # [rows, block_k] f32
            v_parts = None
        else:
            k = masked_load(k_ref.at[kv_idx], mask=kv_mask, other=0).astype(compute)  # [block_k, tile_d]
            v = masked_load(v_ref.at[kv_idx], mask=kv_mask, other=0).astype(compute)  # [block_k, tile_d]
            s = dot(q, k, transpose_b=True) * sm_scale  # [rows, block_k] f32
            # V checked after the QK dot: this order keeps ptxas clear of spills (sm90 report).
            v_ok = _finite_rows(v)
            v = jnp.where(kv_mask & v_ok[:, None], v, jnp.zeros_like(v))
        s_ok = jnp.abs(s) <= _F32_MAX  # [rows, block_k]
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s * (1.0 / soft_cap))
        mask = live[None, :] & (tok[None, :] <= q_pos[:, None])
        if window is not None:
            mask &= tok[None, :] > q_pos[:, None] - window
        s = jnp.where(mask & s_ok, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that saw no key yet
        alpha = jnp.exp(m_prev - m_safe)
        poisoned = mask & ~(s_ok & v_ok[None, :])
        p = jnp.where(poisoned, jnp.nan, jnp.exp(s - m_safe[:, None]))  # exp(-inf) = 0 where masked
        l_next = alpha * l_prev + jnp.sum(p, axis=1)
        if int4:  # per group: (p * v_scale_g) @ codes (fp16: p @ the dequantized tile)
            new_acc = []
            for gi in range(len(acc)):  # bf16 / f32: each group's codes loaded just before its dot
                v_g = v_parts[gi] if v_parts is not None else int4_group(
                    v_ref, layer, h, page_c, offset, live, gi).astype(jnp.float32).astype(compute)  # [block_k, 32]
                pg = (p * v_scales[gi][None, :] if fold_v else p).astype(compute)
                new_acc.append(acc[gi] * alpha[:, None] + dot(pg, v_g))
            return tuple(new_acc), m_next, l_next
        if quantized and fold_v:
            p = p * v_scale[None, :]  # the V scale of key j factors out of the sum over keys
        acc = acc * alpha[:, None] + dot(p.astype(compute), v)
        return acc, m_next, l_next

    if int4:
        acc = tuple(jnp.zeros((rows, width), jnp.float32) for _, width in parts)
    else:
        acc = jnp.zeros((rows, tile_d), jnp.float32)
    m_i = jnp.full((rows,), -jnp.inf, jnp.float32)
    l_i = jnp.zeros((rows,), jnp.float32)
    acc, m_i, l_i = lax.fori_loop(blk_lo, blk_hi, body, (acc, m_i, l_i))

    # Rows outside [0, tokens) x [0, group) aim at token `tokens` (out of range): masked on
    # GPU, dropped when interpret mode discharges the store into a scatter.
    out_live = (t < tokens) & (g < group)
    t_out = jnp.where(out_live, t, tokens)
    out_parts = list(zip(acc, parts)) if int4 else [(acc, None)]
    if len(out_refs) == 1:
        (o_ref,) = out_refs
        # l_i == 0 exactly when the row saw no key (a seen key adds exp(0) = 1); NaN != 0, so a
        # poisoned row (NaN weight) reaches the output as NaN, as in the reference.
        seen = row_live & (l_i != 0)
        for a, part in out_parts:
            lanes = d if part is None else part_lanes(part)[None, :]
            out = jnp.where(seen[:, None], a / jnp.where(seen, l_i, 1.0)[:, None], 0.0)
            o_idx = index_of(b, t_out[:, None], head[:, None], lanes)
            masked_store(o_ref.at[o_idx], out.astype(o_ref.dtype), mask=out_live[:, None] & (lanes < head_dim))
    else:
        o_ref, m_ref, l_ref = out_refs
        for a, part in out_parts:
            lanes = d if part is None else part_lanes(part)[None, :]
            masked_store(o_ref.at[index_of(b, split, t_out[:, None], head[:, None], lanes)], a,
                         mask=out_live[:, None] & (lanes < head_dim))
        ml_idx = index_of(b, split, t_out, head)
        masked_store(m_ref.at[ml_idx], m_i, mask=out_live)
        masked_store(l_ref.at[ml_idx], l_i, mask=out_live)


def _int4_scores(k_ref, k_scale_ref, q_parts, layer, h, page, offset, live, head_dim, compute, sm_scale):
    """Scores of one block of keys of an int4 arena, group by group (32 lanes, one scale per key):
    s = sum_g (q_g . codes_g) * (k_scale_g * sm_scale), f32 [rows, block_k]."""
    s = None
    for gi in range(head_dim // GROUP):
        codes = int4_group(k_ref, layer, h, page, offset, live, gi).astype(jnp.float32).astype(compute)  # [block_k, 32]
        k_scale = masked_load(k_scale_ref.at[index_of(layer, h, page, offset, gi)], mask=live, other=0.0)
        term = dot(q_parts[gi], codes, transpose_b=True) * (k_scale.astype(jnp.float32) * sm_scale)[None, :]
        s = term if s is None else s + term
    return s


def _int4_values(v_ref, v_scale_ref, layer, h, page, offset, live, head_dim, compute, fold_v, *, codes=True,
                 scales=True):
    """V of one block of keys of an int4 arena: (v_ok bool[block_k] or None, V parts, one per
    group, [block_k, 32] in the compute dtype or None, value scales f32[block_k] per group or
    None). fold_v (bf16 / f32): parts are the codes, the scales are zeroed where not finite
    and flag the row (codes are finite by construction); fp16: parts are the dequantized groups
    `codes * scale_g` (which may overflow fp16), checked and selected to zero where not finite."""
    v_ok, parts, v_scales = None, [], []
    for gi in range(head_dim // GROUP):
        if scales or not fold_v:
            v_scale = masked_load(v_scale_ref.at[index_of(layer, h, page, offset, gi)], mask=live,
                                  other=0.0).astype(jnp.float32)  # [block_k]
            if fold_v:
                ok = jnp.abs(v_scale) <= _F32_MAX
                v_scales.append(jnp.where(ok, v_scale, 0.0))
                v_ok = ok if v_ok is None else v_ok & ok
        if codes:
            x = int4_group(v_ref, layer, h, page, offset, live, gi).astype(jnp.float32)  # [block_k, 32]
            if fold_v:
                parts.append(x.astype(compute))
            else:
                x = (x * v_scale[:, None]).astype(compute)
                ok = _finite_rows(x)
                v_ok = ok if v_ok is None else v_ok & ok
                parts.append(x)
    if codes and not fold_v:
        parts = [jnp.where(live[:, None] & v_ok[:, None], x, jnp.zeros_like(x)) for x in parts]
    return v_ok, (parts if codes else None), (v_scales if fold_v and scales else None)


def _merge_splits(o, m, l, valid, dtype):
    """Log-sum-exp merge of split partials.

    o: f32[B, splits, T, Hq, D]; m, l: f32[B, splits, T, Hq]; valid: bool[B, T] -> [B, T, Hq, D].
    A row that saw no key in any split has l_sum == 0 and gives 0; a NaN partial (NaN in the
    row's own inputs) makes l_sum NaN (NaN != 0) and the output NaN, as in the reference.
    """
    m_max = jnp.max(m, axis=1, keepdims=True)
    m_max = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    w = jnp.exp(m - m_max)  # 0 for splits that saw no key (m = -inf)
    l_sum = jnp.sum(w * l, axis=1)  # [B, T, Hq]
    o_sum = jnp.sum(w[..., None] * o, axis=1)  # [B, T, Hq, D]
    live = valid[:, :, None] & (l_sum != 0)
    out = o_sum / jnp.where(live, l_sum, 1.0)[..., None]
    return jnp.where(live[..., None], out, 0.0).astype(dtype)


@functools.partial(jax.jit, static_argnames=("sm_scale", "soft_cap", "sliding_window", "rotate_keys", "block_sizes",
                                             "interpret"))
def _paged_attention_call(
    q, k_arena, v_arena, layer, page_map, lengths, num_tokens, k_scale, v_scale, window, *, sm_scale, soft_cap,
    sliding_window, rotate_keys, block_sizes, interpret
):
    """`sliding_window`: a static window (or None); `window`: a traced one, i32[1], or None."""
    batch, tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    block_tokens = block_sizes.block_tokens
    num_splits = block_sizes.num_splits
    block_k = block_sizes.block_k
    block_h = min(block_sizes.block_h, next_pow2(group))
    head_blocks = cdiv(group, block_h)
    group_pad = max(block_h, MIN_TILE // block_tokens, 1)  # >= 16 rows for tl.dot
    grid = (batch, num_kv_heads * head_blocks, cdiv(tokens, block_tokens) * num_splits)
    quantized = k_scale is not None
    fmt = arena_format(k_arena.dtype)
    traced_window = window is not None
    tile_d = head_tile(head_dim)
    kernel = functools.partial(
        _attention_kernel,
        fmt=fmt,
        rotate=rotate_keys,
        head_dim=head_dim,
        part_width=part_width(tile_d, 2),
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        traced_window=traced_window,
        block_tokens=block_tokens,
        group=group,
        group_pad=group_pad,
        head_blocks=head_blocks,
        block_k=block_k,
        tile_d=tile_d,
        num_splits=num_splits,
    )
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((batch, num_splits, tokens, num_q_heads, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, tokens, num_q_heads), jnp.float32),
            jax.ShapeDtypeStruct((batch, num_splits, tokens, num_q_heads), jnp.float32),
        )
    name = f"paged_attention_bt{block_tokens}_g{group_pad}x{head_blocks}_bk{block_k}_d{head_tile(head_dim)}_s{num_splits}"
    name += "_cap" if soft_cap is not None else ""
    name += "_wt" if traced_window else ""
    if jnp.dtype(k_arena.dtype) != jnp.dtype(q.dtype):  # tiles converted to q's dtype (quantized: dequantized)
        name += "_int4" if fmt == "int4" else f"_{jnp.dtype(k_arena.dtype).name}"
    scales = (k_scale, v_scale) if quantized else ()
    windows = (window,) if traced_window else ()
    rotation = rotation_inputs(head_dim, q.dtype) if rotate_keys else ()
    name += "_rot" if rotate_keys else ""
    # No BlockSpecs: every ref is the whole array; the kernel gathers pages itself, and the
    # arena is passed whole with the layer as data (slicing a layer out would copy it).
    out = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        compiler_params=compiler_params(block_sizes.num_warps, block_sizes.num_stages),
        interpret=interpret,
        name=name,
    )(layer, lengths, num_tokens, page_map, *windows, q, k_arena, v_arena, *scales, *rotation)
    if num_splits == 1:
        return out
    _, valid = token_positions(lengths, num_tokens, tokens)
    return _merge_splits(*out, valid, q.dtype)


def paged_attention(
    q,
    k_arena,
    v_arena,
    layer,
    page_map,
    lengths,
    num_tokens,
    *,
    k_scale=None,
    v_scale=None,
    sm_scale: float | None = None,
    sliding_window=None,
    logits_soft_cap: float | None = None,
    rotate_keys: bool = False,
    interpret: bool | None = None,
    block_sizes: BlockSizes | None = None,
):
    """Attention of `q: [B, T, Hq, D]` (the last num_tokens[b] positions of each row) over its pages.

    k_arena, v_arena: [L, Hkv, P, S, D], Hq a multiple of Hkv; layer: int or traced i32 scalar;
    page_map: i32[B, M] (-1 unmapped); lengths, num_tokens: i32[B]. Causal within the new
    tokens; `sliding_window` W lets position p see keys j with p - W < j <= p: None, an int
    >= 1 (compiled in), or a traced integer scalar (passed as data, the loop bounds computed
    from it; clipped into [0, M*S]: a value <= 0 admits no key, so those queries give 0).
    `logits_soft_cap` (a number > 0, compiled in): scores `s = (q . k) * sm_scale` become
    `cap * tanh(s / cap)` before masking (Gemma 2). Padded tokens (t >= num_tokens[b]) give
    zeros. Returns [B, T, Hq, D] in q's dtype. 8-bit arenas (int8 / float8_e4m3fn /
    float8_e5m2) take their scales `k_scale, v_scale: [L, Hkv, P, S]`; int4 arenas (uint8
    [L, Hkv, P, S, D / 2], two codes a byte) theirs per group of 32 lanes, [L, Hkv, P, S,
    D / 32]. `rotate_keys` (quantized arenas whose keys were appended rotated): q is rotated
    the same way in the kernel. The dots run in q's dtype (bf16, fp16 or fp32) with f32
    accumulation, whatever the arena's dtype; the dtype, mask and NaN rules are
    `paged_attention_reference`'s.
    """
    num_layers, num_kv_heads, _, page_size, head_dim = check_arena(k_arena, v_arena, k_scale, v_scale)
    rotate_keys = check_rotate(rotate_keys, arena_format(k_arena.dtype))
    check_tokens("q", q, batch=None, heads=None, head_dim=head_dim)
    batch, tokens, num_q_heads, _ = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads, not a multiple of the arena's {num_kv_heads} KV heads")
    layer = check_layer(layer, num_layers)
    page_map, lengths, num_tokens = check_rows(page_map, lengths, num_tokens, batch)
    sliding_window, window = check_sliding_window(sliding_window, page_map.shape[1] * page_size)
    soft_cap = check_static_positive("logits_soft_cap", logits_soft_cap)
    sm_scale = check_static_positive("sm_scale", head_dim**-0.5 if sm_scale is None else sm_scale)
    quantized = arena_format(k_arena.dtype) != "float"
    defaults = BlockSizes.for_attention(
        batch=batch,
        tokens=tokens,
        num_kv_heads=num_kv_heads,
        group=num_q_heads // num_kv_heads,
        page_size=page_size,
        head_dim=head_dim,
        max_pages=page_map.shape[1],
        # Tiles follow the dots' element type, q's: an arena of another dtype (8-bit included)
        # is converted to it in registers.
        itemsize=jnp.dtype(q.dtype).itemsize,
        quantized=quantized,
        converted=jnp.dtype(k_arena.dtype) != jnp.dtype(q.dtype),
        int4=arena_format(k_arena.dtype) == "int4",
    )
    block_sizes = resolve_block_k(block_sizes or BlockSizes(), page_size).filled(defaults)
    return _paged_attention_call(
        q,
        k_arena,
        v_arena,
        layer,
        page_map,
        lengths,
        num_tokens,
        k_scale,
        v_scale,
        window,
        sm_scale=sm_scale,
        soft_cap=soft_cap,
        sliding_window=sliding_window,
        rotate_keys=rotate_keys,
        block_sizes=block_sizes,
        interpret=resolve_interpret(interpret),
    )
