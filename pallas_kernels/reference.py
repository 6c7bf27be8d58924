"""Plain-jnp paged append and paged attention: the ground truth for the kernels.

Kernel-level contract (shared by `gpu/append.py`, `gpu/attention.py` and these
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
W, `j > p - W` (W counts the query's own token, as in Hugging Face Mistral); scores may
be soft-capped (Gemma 2). Masking selects with `jnp.where`; stale pages (NaN, huge
values) never reach the output, and neither does anything at a key a query does not
attend to. The dtype, masking and NaN rules are written in `paged_attention_reference`.

8-bit arenas (int8, float8_e4m3fn, float8_e5m2) come with their scales
`k_scale, v_scale: [num_layers, num_kv_heads, num_pages, page_size]` (float32 or
bfloat16): append quantizes each new token's row per KV head (`pallas_kernels.quant`,
the rules written there) and writes values and scale; attention applies the scales as the
kernel does (the key scale on the f32 score, the value scale on the weights). Stale scales
(NaN from an earlier tenant) are masked exactly like stale values.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.index_math import div_nonneg, rem_nonneg
from pallas_kernels.quant import quantize_rows
from pallas_kernels.quant4 import GROUP, arena_format, quantize_groups, unpack_codes
from pallas_kernels.scatter import set_at
from pallas_kernels.rotation import rotate_rows

__all__ = ["append_reference", "write_tokens", "paged_attention_reference", "token_positions"]


def token_positions(lengths, num_tokens, tokens: int):
    """Positions of the new tokens and their validity.

    lengths, num_tokens: i32[batch] -> (pos i32[batch, tokens], valid bool[batch, tokens])
    """
    t = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    start = (lengths - num_tokens)[:, None]
    valid = t < num_tokens[:, None]
    return start + t, valid


def append_reference(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens, *, k_scale=None, v_scale=None,
                     rotate_keys=False):
    """Scatter new K/V into their pages (in place when the arena is donated).

    k_arena, v_arena: [L, Hkv, P, S, D]; k, v: [B, T, Hkv, D]; page_map: i32[B, M];
    lengths, num_tokens: i32[B]. Returns the updated (k_arena, v_arena); for a quantized arena
    (k_scale, v_scale given) k, v are quantized and the updated (k_arena, v_arena, k_scale,
    v_scale) are returned: 8-bit, per token and head (`quant.quantize_rows`, scales
    [L, Hkv, P, S]); int4 (uint8 arenas [L, Hkv, P, S, D / 2]), per group of 32 lanes
    (`quant4.quantize_groups`, scales [L, Hkv, P, S, D / 32]). `rotate_keys`: keys are
    rotated first (`rotation.rotate_rows`: `(k @ M) * col_scale` in float32), then quantized.
    """
    _, _, num_pages, page_size, _ = k_arena.shape
    tokens = k.shape[1]
    pos, valid = token_positions(lengths, num_tokens, tokens)  # [B, T]
    pos_c = jnp.maximum(pos, 0)  # (negative positions are never ok; unsigned page arithmetic below)
    logical = jnp.minimum(div_nonneg(pos_c, page_size), page_map.shape[1] - 1)
    page = jnp.take_along_axis(page_map, logical, axis=1)  # [B, T]
    # Positions past the page table (pos >= M * page_size) are dropped, not clipped onto the last page.
    ok = valid & (page >= 0) & (pos >= 0) & (pos < page_map.shape[1] * page_size)
    return write_tokens(k_arena, v_arena, layer, k, v, page, pos_c, ok, k_scale=k_scale, v_scale=v_scale,
                        rotate_keys=rotate_keys)  # fmt: skip


def write_tokens(k_arena, v_arena, layer, k, v, page, pos, ok, *, k_scale=None, v_scale=None, rotate_keys=False):
    """The write half of `append_reference`, for callers that looked the pages up already: token
    (b, t) of k, v [B, T, Hkv, D] goes to page[b, t] at offset pos[b, t] % page_size where
    ok[b, t] (page i32[B, T] in range there, pos i32[B, T] >= 0); nothing elsewhere. Returns
    what `append_reference` returns (quantized and rotated the same way)."""
    num_pages, page_size = k_arena.shape[2], k_arena.shape[3]
    # An explicit out-of-range sentinel plus mode="drop": padded tokens write nothing.
    page = jnp.where(ok, page, num_pages)
    offset = jnp.where(ok, rem_nonneg(pos, page_size), 0)
    layer = jnp.asarray(layer, jnp.int32)
    # arena[layer][:, page, offset] <- k[b, t] for every (b, t): indices broadcast to [B, T],
    # the head axis is a slice, so the update is [B, T, Hkv, D] (int4: D / 2 bytes).
    if k_scale is None:
        k_arena = set_at(k_arena, (layer, slice(None), page, offset), k)
        v_arena = set_at(v_arena, (layer, slice(None), page, offset), v)
        return k_arena, v_arena
    int4 = arena_format(k_arena.dtype) == "int4"
    out = []
    for x, arena, scales, rotated in ((k, k_arena, k_scale, rotate_keys), (v, v_arena, v_scale, False)):
        x = rotate_rows(x) if rotated else x
        if int4:
            values, scale = quantize_groups(x, scales.dtype)  # [B, T, Hkv, D / 2], [B, T, Hkv, D / 32]
        else:
            values, scale = quantize_rows(x, arena.dtype, scales.dtype)  # [B, T, Hkv, D], [B, T, Hkv]
        out.append((set_at(arena, (layer, slice(None), page, offset), values),
                    set_at(scales, (layer, slice(None), page, offset), scale)))
    (k_arena, k_scale), (v_arena, v_scale) = out
    return k_arena, v_arena, k_scale, v_scale


def _window(sliding_window, max_keys: int):
    """None (no window), or W clipped into [0, max_keys]: the same mask as the given W, in int32
    (a window of max_keys or more excludes nothing; W <= 0 admits no key)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, int):
        return max(0, min(sliding_window, max_keys))
    return jnp.clip(sliding_window, 0, max_keys).astype(jnp.int32)


def _gather_rows(arena, layer, pages, batch, max_keys):
    """arena [L, Hkv, P, S, ...] -> the row's keys [B, M*S, Hkv, ...] (arena dtype)."""
    layer_arr = jax.lax.dynamic_index_in_dim(arena, layer, axis=0, keepdims=False)  # [Hkv, P, S, ...]
    x = layer_arr[:, pages]  # [Hkv, B, M, S, ...]
    x = jnp.moveaxis(x, 0, 3)  # [B, M, S, Hkv, ...]
    return x.reshape(batch, max_keys, *x.shape[3:])


def _scores_and_values(q, k_seq, v_seq, k_scale, v_scale, live, fmt, compute, sm_scale, group):
    """(s [B, Hkv, G, T, S] f32 before soft-cap and mask, v_ok bool[B, S, Hkv], weights_fn, v
    [B, S, Hkv, D] f32 as it meets the weights): the format-specific half of the reference.
    `weights_fn(p)` turns the f32 softmax weights into the P @ V operand and contracts it."""
    f32 = jnp.float32
    hi = jax.lax.Precision.HIGHEST
    batch, tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_seq.shape[2]
    qg = q.reshape(batch, tokens, num_kv_heads, group, head_dim).astype(compute).astype(f32)
    fold_v = fmt != "float" and compute != jnp.dtype(jnp.float16)
    if fmt == "int4":  # per group of 32 lanes: (q_g . codes_g) * (k_scale_g * sm_scale), summed over groups
        n = head_dim // GROUP
        k_c = unpack_codes(k_seq).astype(f32).reshape(*k_seq.shape[:3], n, GROUP)  # [B, S, Hkv, N, 32]
        dots = jnp.einsum("BTKGNL,BSKNL->BKGTSN", qg.reshape(*qg.shape[:4], n, GROUP), k_c, precision=hi)
        ks = (k_scale.astype(f32) * sm_scale).transpose(0, 2, 1, 3)[:, :, None, None]  # [B, Hkv, 1, 1, S, N]
        s = jnp.sum(dots * ks, axis=-1)
        v_codes = unpack_codes(v_seq).astype(f32).reshape(*v_seq.shape[:3], n, GROUP)  # [B, S, Hkv, N, 32]
        vs = v_scale.astype(f32)  # [B, S, Hkv, N]
        if fold_v:  # each group's scale on the weights: (p * v_scale_g) @ codes_g
            v_ok = jnp.all(jnp.isfinite(vs), axis=-1)
            vs = jnp.where((live & v_ok)[..., None], vs, 0.0)

            def weights(p):  # p [B, Hkv, G, T, S]
                pg = (p[..., None] * vs.transpose(0, 2, 1, 3)[:, :, None, None]).astype(compute).astype(f32)
                out = jnp.einsum("BKGTSN,BSKNL->BTKGNL", pg, v_codes, precision=hi)
                return out.reshape(*out.shape[:4], head_dim)

            return s, v_ok, weights
        v_c = (v_codes * vs[..., None]).astype(compute).reshape(v_seq.shape[:3] + (head_dim,))  # fp16: dequantized
    else:
        k_c = k_seq.astype(compute).astype(f32)
        dots = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k_c, precision=hi)
        if fmt == "8bit":
            ks = (k_scale.astype(f32) * sm_scale).transpose(0, 2, 1)[:, :, None, None, :]  # [B, Hkv, 1, 1, S]
            s = dots * ks
            vs = v_scale.astype(f32)  # [B, S, Hkv]
            if fold_v:  # a row's poison is its scale (8-bit values are finite by construction)
                v_ok = jnp.isfinite(vs)
                vs = jnp.where(live & v_ok, vs, 0.0)
                v_c = jnp.where(live[..., None], v_seq.astype(compute), jnp.zeros((), compute))

                def weights(p):
                    pv = (p * vs.transpose(0, 2, 1)[:, :, None, None, :]).astype(compute).astype(f32)
                    return jnp.einsum("BKGTS,BSKH->BTKGH", pv, v_c.astype(f32), precision=hi)

                return s, v_ok, weights
            v_c = (v_seq.astype(f32) * vs[..., None]).astype(compute)  # fp16: the dequantized row
        else:
            s = dots * sm_scale
            v_c = v_seq.astype(compute)
    v_ok = jnp.all(jnp.isfinite(v_c), axis=-1)  # [B, S, Hkv]
    v_c = jnp.where((live & v_ok)[..., None], v_c, jnp.zeros_like(v_c))  # select: dead or poisoned rows are 0

    def weights(p):
        return jnp.einsum("BKGTS,BSKH->BTKGH", p.astype(compute).astype(f32), v_c.astype(f32), precision=hi)

    return s, v_ok, weights


def paged_attention_reference(
    q, k_arena, v_arena, layer, page_map, lengths, num_tokens, *, sm_scale=None, sliding_window=None,
    logits_soft_cap=None, k_scale=None, v_scale=None, rotate_keys=False,
):
    """Attention of the new tokens over each row's pages: gather, then dense masked softmax.

    q: [B, T, Hq, D] with Hq a multiple of Hkv; returns [B, T, Hq, D] in q's dtype.
    `sliding_window`: None, an int >= 1, or a traced integer scalar (clipped into
    [0, M*S]: a value <= 0 admits no key, one >= M*S no window). `logits_soft_cap`: None or
    cap > 0. A quantized arena comes with k_scale, v_scale (8-bit: [L, Hkv, P, S]; int4, a
    uint8 arena [L, Hkv, P, S, D / 2]: [L, Hkv, P, S, D / 32]). `rotate_keys`: the arena's
    keys were rotated on append; q is rotated the same way first.

    The rules this function defines (the kernels follow them):

    Dtypes: the compute dtype is q's. K and V tiles are converted to it (8-bit values and
    int4 codes exactly; bf16 -> fp16 exactly within fp16's range; f32 -> bf16/fp16 rounds),
    products accumulate in float32 (`q . k`, exact for 16-bit inputs), and scores, soft-cap,
    mask and softmax (max, exp, sum) are float32. The softmax weights, unnormalized
    (`exp(s - max)`), are rounded to the compute dtype for the P @ V product (f32
    accumulation); the result is divided by the f32 sum and rounded to q's dtype once.
    8-bit arenas: the key scale multiplies the f32 score (`(q . kq) * (k_scale * sm_scale)`);
    the value scale multiplies the f32 weights before their rounding (`(p * v_scale) @ vq`),
    except with fp16 compute, where the value tile is dequantized instead (`(vq * v_scale)`
    rounded to fp16). int4 arenas, per group g of 32 lanes: `s = sum_g (q_g . codes_g) *
    (k_scale_g * sm_scale)` and `sum_g (p * v_scale_g) @ codes_g` (fp16: the dequantized
    tile `codes * v_scale_g` rounded to fp16).

    Rotated keys: q is rotated as the keys were, `(q @ M) * col_scale` (the product with M's
    +-1 entries exact, f32 sums), and rounded to the compute dtype; then everything above
    runs on the rotated q. Scores equal the unrotated ones up to that rounding.

    Scores: `s = (q . k) * sm_scale` (f32); with a soft cap, `s = cap * tanh(s / cap)`
    (Gemma 2, as Hugging Face transformers computes it), then the mask.

    Masks: query at position p attends to key j iff j is live (j < the row's length, j's page
    mapped), j <= p and, with a window W, j > p - W (W counts the query's own token, as in
    Hugging Face Mistral). A key a query does not attend to contributes exactly nothing,
    whatever it holds (NaN and inf included): masking selects (`where`), never multiplies by
    zero, and V rows are selected to zero where they cannot contribute.

    Non-finite inputs: a query row that attends to a key whose raw score `(q . k) * sm_scale`
    is not finite (NaN or inf in q or in the key's K row, a NaN key scale, an f32 overflow),
    or whose V row (as converted to the compute dtype, or its value scales) holds a NaN or
    inf in any lane, is NaN in every lane: one poisoned key poisons the whole output row of
    each query (head) that attends to it, in float and quantized arenas alike. In quantized
    arenas the poison is the scale: append stores a row with a NaN/inf input as NaN scales
    (8-bit: its one scale; int4: every group's), and quantized values are finite by
    construction (quantization saturates), so with bf16 / f32 compute only the scales are
    checked; with fp16 compute the dequantized row is (it can also overflow fp16). A row that
    attends to no key is 0.
    """
    batch, tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    max_keys = page_map.shape[1] * page_size
    compute = jnp.dtype(q.dtype)
    fmt = arena_format(k_arena.dtype)
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    layer = jnp.asarray(layer, jnp.int32)
    pages = jnp.maximum(page_map, 0)  # unmapped entries are masked below, never trusted
    k_seq = _gather_rows(k_arena, layer, pages, batch, max_keys)  # [B, S_total, Hkv, D] (int4: D / 2 bytes)
    v_seq = _gather_rows(v_arena, layer, pages, batch, max_keys)
    scales = [None, None]
    if fmt != "float":  # [B, S_total, Hkv] (int4: [B, S_total, Hkv, D / 32])
        scales = [_gather_rows(x, layer, pages, batch, max_keys) for x in (k_scale, v_scale)]

    key_pos = jnp.arange(max_keys, dtype=jnp.int32)  # [S_total]
    key_live = key_pos[None, :] < lengths[:, None]  # [B, S_total]
    key_live &= jnp.repeat(page_map >= 0, page_size, axis=1)
    live = key_live[:, :, None]  # [B, S_total, 1]: per key, for every KV head

    if rotate_keys:
        q = rotate_rows(q, compute)
    s, v_ok, weights = _scores_and_values(q, k_seq, v_seq, *scales, live, fmt, compute, sm_scale, group)
    s_ok = jnp.isfinite(s)
    if logits_soft_cap is not None:
        s = jnp.tanh(s / logits_soft_cap) * logits_soft_cap

    q_pos, q_valid = token_positions(lengths, num_tokens, tokens)  # [B, T]
    mask = key_live[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None])  # [B, T, S_total]
    window = _window(sliding_window, max_keys)
    if window is not None:
        mask &= key_pos[None, None, :] > (q_pos[:, :, None] - window)
    mask &= q_valid[:, :, None]
    mask = mask[:, None, None]  # [B, 1, 1, T, S_total]

    s = jnp.where(mask & s_ok, s, -jnp.inf)
    row_max = jnp.max(s, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(s - row_max)  # 0 where masked
    poisoned = mask & ~(s_ok & v_ok.transpose(0, 2, 1)[:, :, None, None, :])
    p = jnp.where(poisoned, jnp.nan, p)
    denom = jnp.sum(p, axis=-1)  # [B, Hkv, G, T]: 0 iff the row attends to no key, NaN if poisoned
    out = weights(p)  # [B, T, Hkv, G, D]
    denom = denom.transpose(0, 3, 1, 2)[..., None]  # [B, T, Hkv, G, 1]
    seen = denom != 0  # NaN != 0: a poisoned row stays NaN
    out = jnp.where(seen, out / jnp.where(seen, denom, 1.0), 0.0)
    out = jnp.where(q_valid[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, tokens, num_q_heads, head_dim).astype(q.dtype)
