"""Paged attention in plain jnp whose work follows the context, not the arena's capacity.

`paged_attention_blockwise` has the signature and the rules of `paged_attention_reference`
(the oracle; its docstring states the dtype, mask, soft-cap, window and NaN rules, and this
path performs the same operations on the same values), but instead of gathering every row's
whole page list (`max_pages_per_seq * page_size` keys per row, whatever the row holds) it
loops over *blocks of pages*, up to the longest context the batch's queries can see:

    keys [lo, hi): hi = 1 + the last position of any valid query (causal: nothing later is
                   ever seen; rows with no query, e.g. padded rows, do not count),
                   lo = with a window W, the first key any valid query's window admits
                   (min over queries of pos - W + 1), else 0
    for block i in [lo // block_keys, ceil(hi / block_keys)):    one `lax.fori_loop`
        gather pages page_map[:, i*P : (i+1)*P] of every row (P pages, `block_keys` keys)
        scores, soft-cap, mask, NaN flags: exactly the reference's, on those keys
        online softmax in float32: running max m, sum l, accumulator acc (per query head)
    out = acc / l  (0 where l == 0: no key; NaN stays NaN: a poisoned row)

So a decode step costs O(batch * longest context) and a sliding window O(batch * window),
whatever `max_pages_per_seq` is: `generate`, which sizes its layout by the longest prompt +
`max_new_tokens`, no longer charges every step for the capacity.

A decode step (one query a row) computes its first big block straight-line, outside the loops,
which then start after it: a context that fits one block, a decode step's usual case whatever
the capacity, runs no loop iteration (at the tiny model, capacity 336, context 128, batch 8,
the step's tokens/s went from 1.09x to 1.16-1.20x the dense cache's, measured when the
one-block path below ended at 256 keys: benchmarks/RESULTS.md, "The first block
straight-line"). Over a float arena decode checks no V row in any block: the V rows outside
the row's one query's mask (window included) are zeroed, so a poisoned V row left leaves its
query heads non-finite through every rescale, and those heads are NaN'd whole at the end (as
the one-block path below does).

When a row's whole capacity fits one block (`one_block`: 256 keys, or up to 512 where the
batch's extra keys are few; `block_keys` when a caller gives it), there is no loop: one
straight-line block over every page (the keys no query sees masked). That compiles one block's
graph instead of the loops': the tiny model's decode step lost about a third of its HLO. On a
CPU a loop or conditional in a layer costs a small decode step more than a few hundred masked
keys (tiny model, one row, capacity 496, context 128: 1.00x the dense cache's tokens/s in one
block of 496 keys, 0.89x with the first block of 256 straight-line and the loops after it), a
large one less (mid model, 8 rows, capacity 384-496: 0.99-1.04x in one block against
1.07-1.23x in the loops; benchmarks/RESULTS.md, "The first block straight-line").
Over a float arena that block, past decode (several queries a row), checks its V rows for
poison (below) only when its output is not all finite (a conditional): a V row that is not
finite always reaches the output (a zero weight times inf or NaN is NaN), so a finite output
means the check would flag nothing; decode NaNs the heads as the loops do, with no conditional.

Design, and why:

- **One loop body, a dynamic trip count** (`lax.fori_loop` with traced bounds lowers to one
  `while`): one compiled body of fixed shapes serves every context length, so nothing
  recompiles as sequences grow, and compile time is one block's graph. Bucketed gathers (a
  `lax.switch` over gather sizes 128, 256, ... capacity) would compile log2(capacity / 128)
  copies of the whole attention graph per layer call site and still waste up to half of the
  largest bucket.
- **Blocks of `block_keys` keys (whole pages)**, shared by all rows of the batch (row b's
  block i is its logical pages [i*P, (i+1)*P)): a gather of [B, P] page ids per step, no
  per-row trip counts (XLA has no ragged loops; rows shorter than the batch's longest pay
  masked keys, as every dense batch does). A block is at least one page (`page_size` 256:
  256 keys) and at most the row's capacity. The default, `DEFAULT_BLOCK_KEYS` = 256, keeps
  the loop's fixed cost per step (a few microseconds of while-loop and gather setup on CPU)
  small against the gather of 256 keys while wasting at most 255 keys of work per call.
- **Online softmax, float32** (as the kernels do): state m, l [B, Hkv, G, T] and acc
  [B, Hkv, G, T, D]; each block rescales by `exp(m_old - m_new)`. A block's weights
  `exp(s - m)` are rounded to the compute dtype for P @ V relative to the running max, as in
  the kernels (the reference rounds relative to the global max): outputs agree with the
  reference to the kernels' tolerances (f32: summation order only).
- **The rules, unchanged.** Masking selects (`where`) on scores and V rows; a live key whose
  raw score is not finite, or whose V row is not (8-bit: whose value scale is not), flags the
  pairs that attend to it, their weight is NaN, and the NaN survives every later rescale
  (`alpha * NaN`), so the whole output row of that query head is NaN; masked pairs contribute
  exactly 0, so stale pages (NaN, huge values) change nothing, bit for bit, and (in the loop)
  a key that no query of the batch can see is never even gathered. The key scale multiplies the f32 score,
  the value scale the f32 weights (fp16 compute: the V rows are dequantized with
  `quant.dequantize_rows` and rounded to fp16), exactly as the reference.
- **8-bit, int4 and other stored formats** go through `_block_operands`, the only place that
  knows how a block's stored K / V rows become scores and P @ V; it dispatches on the arena
  dtype (`quant.is_quantized`, `quant4.arena_format`: int4 per group of 32 lanes, as the
  reference) and refuses (ValueError) a format it does not know rather than reading its bytes
  as numbers.
- **Total**: page-map entries < 0 are masked and never trusted (clamped to page 0 for the
  gather), the loop's range is clipped into [0, ceil(M / P)) blocks, a traced window is
  clipped as the reference clips it (`<= 0`: no key, zeros; the loop then runs 0 steps).

Not supported: reverse-mode differentiation (a `while` with a dynamic trip count has no
transpose rule); differentiate through `paged_attention_reference` (`backend="reference"`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.quant import dequantize_rows, is_quantized
from pallas_kernels.quant4 import GROUP, arena_format, unpack_codes
from pallas_kernels.reference import _window, token_positions

__all__ = ["paged_attention_blockwise", "DEFAULT_BLOCK_KEYS", "ONE_BLOCK_KEYS", "block_geometry", "one_block"]

DEFAULT_BLOCK_KEYS = 256
# One straight-line block, no loop, for capacities up to 256 keys a row, and up to 512 where the
# keys it reads past 256 (batch x KV heads x head_dim x keys) stay under ONE_BLOCK_EXTRA: on a CPU
# a loop in a layer costs a small decode step more than those keys (`one_block`).
ONE_BLOCK_KEYS = 512
ONE_BLOCK_EXTRA = 2**15
TAIL_FRACTION = 4
_FLOAT_ARENAS = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
_HIGHEST = lax.Precision.HIGHEST


def block_geometry(page_size: int, max_pages: int, block_keys: int | None = None,
                   tail_keys: int | None = None) -> tuple[int, int, int]:
    """(pages per big block, pages per tail block, page-map width padded to whole tail blocks).

    Big blocks hold about `block_keys` keys, tail blocks about `tail_keys` (default a quarter
    of a big block), both whole pages, at least one page, at most the row's `max_pages`; a
    big block is a whole number of tail blocks."""
    big = block_keys_or_default(block_keys)
    small = max(1, big // TAIL_FRACTION) if tail_keys is None else int(tail_keys)
    if big < 1 or small < 1:
        raise ValueError(f"block_keys={block_keys}, tail_keys={tail_keys}: keys per block must be >= 1")
    small_pages = max(1, min(max_pages, small // page_size))
    big_pages = max(small_pages, min(max_pages, big // page_size)) // small_pages * small_pages
    return big_pages, small_pages, -(-max_pages // small_pages) * small_pages


def one_block(capacity: int, batch: int, kv_heads: int, head_dim: int, block_keys: int | None = None) -> bool:
    """Whether attention over rows of `capacity` keys runs as one straight-line block (no loop):
    up to `block_keys` keys when a caller gives it; else up to `DEFAULT_BLOCK_KEYS`, and up to
    `ONE_BLOCK_KEYS` while the keys past `DEFAULT_BLOCK_KEYS` it reads, batch x kv_heads x
    head_dim x keys, stay under `ONE_BLOCK_EXTRA` (measured on a CPU, benchmarks/RESULTS.md,
    "The first block straight-line": the tiny model, one row, capacity 496, 1.00x the dense
    cache's tokens/s in one block against 0.89x in the loops; the mid model, 8 rows, capacity
    384-496, 0.99-1.04x against 1.07-1.23x)."""
    if block_keys is not None:
        return capacity <= int(block_keys)
    extra = batch * kv_heads * head_dim * (capacity - DEFAULT_BLOCK_KEYS)
    return capacity <= DEFAULT_BLOCK_KEYS or (capacity <= ONE_BLOCK_KEYS and extra <= ONE_BLOCK_EXTRA)


def block_keys_or_default(block_keys: int | None) -> int:
    """The keys per big block that `block_keys` asks for (None: `DEFAULT_BLOCK_KEYS`)."""
    return DEFAULT_BLOCK_KEYS if block_keys is None else int(block_keys)


def _gather_block(arena, layer, pages):
    """arena [L, Hkv, P_total, S, ...], pages i32[B, P] -> [B, Hkv, P*S, ...] (arena dtype):
    one gather of whole pages (no copy of the layer)."""
    num_layers, num_heads, num_pages = arena.shape[:3]
    heads = jnp.arange(num_heads, dtype=jnp.int32)
    if num_layers * num_heads * num_pages < 2**31:
        # One index into the arena viewed as [L * Hkv * P_total, S, ...] (a bitcast), each part
        # clipped as the gather below clips it: XLA's CPU backend fuses this index arithmetic into
        # the gathers, where the (layer, head, page) triples took a kernel of their own a layer.
        page = jnp.clip(pages, 0, num_pages - 1)[:, None, :]
        flat = arena.reshape(num_layers * num_heads * num_pages, *arena.shape[3:])
        x = flat[(jnp.clip(layer, 0, num_layers - 1) * num_heads + heads[None, :, None]) * num_pages + page]
    else:
        x = arena[layer, heads[None, :, None], pages[:, None, :]]  # [B, Hkv, P, S, ...]: contiguous pages
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], *x.shape[4:])


def _scores(qg, k):
    """q . k: qg f32 [B, Hkv, G, T, D], k f32 [B, Hkv, N, D] -> f32 [B, Hkv, G, T, N].

    Up to D queries a KV head (G * T <= D: decode, short verify chunks), K is the dot's left
    operand, so the dot reads its rows as gathered (D minor) and the result is transposed.
    Written as `einsum("BKGTD,BKND->BKGTN", qg, k)`, XLA's CPU backend fused the K gather with
    a transpose to [B, Hkv, D, N]: a strided gather that took longer than the dot
    (benchmarks/RESULTS.md, "One block of attention"). Past D queries (prefill chunks) the
    transposed scores, G * T a key, outgrow that transposed K, D a key: the einsum form
    (a 32 x 128-token prefill of the mid model 1.08-1.13x faster on a CPU; RESULTS.md, session 44)."""
    b, kh, g, t, d = qg.shape
    if g * t > d:
        return jnp.einsum("BKGTD,BKND->BKGTN", qg, k, precision=_HIGHEST)
    s = lax.dot_general(k, qg.reshape(b, kh, g * t, d), (((3,), (3,)), ((0, 1), (0, 1))),
                        precision=_HIGHEST)  # [B, Hkv, N, G*T]
    return jnp.swapaxes(s, 2, 3).reshape(b, kh, g, t, k.shape[2])


def _block_operands(k_arena, v_arena, k_scale, v_scale, layer, pages, live, compute, sm_scale, defer_v_check=False):
    """One block's stored rows -> (scores, v_ok, values): `scores(qg)` maps the queries
    f32 [B, Hkv, G, T, D] (compute-dtype values) to the f32 scores [B, Hkv, G, T, N] before
    soft-cap and mask; v_ok bool[B, Hkv, N] is False where a V row is poisoned; `values(p)` maps
    the f32 weights [B, Hkv, G, T, N] (zero where masked) to P @ V f32 [B, Hkv, G, T, D].

    `live` bool[B, 1, N]: the V rows kept (the key exists: below the row's length, page mapped;
    with one query a row, also in its mask). The reference's conversions, key for key
    (`paged_attention_reference`: "Dtypes").

    `defer_v_check` (float arenas; others ignore it): v_ok is instead a function giving
    (v_ok, values) as without it, and `values` zeroes only the rows not live (the one-block
    path of `paged_attention_blockwise` checks the V rows only when its output is not finite)."""
    f32 = jnp.float32
    dtype = jnp.dtype(k_arena.dtype)
    k_raw = _gather_block(k_arena, layer, pages)  # [B, Hkv, N, D] (int4: D / 2 bytes)
    v_raw = _gather_block(v_arena, layer, pages)
    zero = jnp.zeros((), compute)

    def dot_scores(k_c, scale):
        return lambda qg: _scores(qg, k_c) * scale

    def dot_values(v_c, weight_scale=None):
        def values(p):
            if weight_scale is not None:
                p = p * weight_scale
            return jnp.einsum("BKGTN,BKND->BKGTD", p.astype(compute).astype(f32), v_c.astype(f32), precision=_HIGHEST)

        return values

    if dtype in _FLOAT_ARENAS:
        v_c = v_raw.astype(compute)
        scores = dot_scores(k_raw.astype(compute).astype(f32), sm_scale)

        def checked():  # each V row's poison flag [B, Hkv, N], and P @ V over the live, finite rows
            v_ok = jnp.all(jnp.isfinite(v_c), axis=-1)
            return v_ok, dot_values(jnp.where((live & v_ok)[..., None], v_c, zero))

        if defer_v_check:
            return scores, checked, dot_values(jnp.where(live[..., None], v_c, zero))
        return scores, *checked()
    if arena_format(dtype) == "int4":
        return _int4_operands(k_raw, v_raw, k_scale, v_scale, layer, pages, live, compute, sm_scale)
    if not is_quantized(dtype):
        raise ValueError(f"paged_attention_blockwise: arena dtype {dtype.name} is not a format it reads "
                         "(float: bfloat16, float16, float32; 8-bit: pallas_kernels.quant; int4: pallas_kernels.quant4)")
    k_c = k_raw.astype(compute).astype(f32)
    ks = _gather_block(k_scale, layer, pages).astype(f32)  # [B, Hkv, N]
    vs = _gather_block(v_scale, layer, pages).astype(f32)
    scores = dot_scores(k_c, (ks * sm_scale)[:, :, None, None, :])  # the key scale on the f32 score
    if compute != jnp.dtype(jnp.float16):  # the value scale on the f32 weights; its poison is the scale
        v_ok = jnp.isfinite(vs)
        vs = jnp.where(live & v_ok, vs, 0.0)
        v_c = jnp.where(live[..., None], v_raw.astype(compute), zero)
        return scores, v_ok, dot_values(v_c, vs[:, :, None, None, :])
    v_c = dequantize_rows(v_raw, vs).astype(compute)  # fp16: the dequantized row (may overflow fp16)
    v_ok = jnp.all(jnp.isfinite(v_c), axis=-1)
    v_c = jnp.where((live & v_ok)[..., None], v_c, zero)
    return scores, v_ok, dot_values(v_c)


def _int4_operands(k_raw, v_raw, k_scale, v_scale, layer, pages, live, compute, sm_scale):
    """`_block_operands` for int4 pages (`quant4`: codes uint8 [B, Hkv, N, D / 2], a scale per
    group of 32 lanes): per group g, `s = sum_g (q_g . codes_g) * (k_scale_g * sm_scale)` and
    `P @ V = sum_g (p * v_scale_g) @ codes_g` (fp16 compute: the V rows dequantized and rounded
    to fp16), as the reference computes them."""
    f32 = jnp.float32
    head_dim = 2 * k_raw.shape[-1]
    n = head_dim // GROUP
    # The barrier keeps the unpacking on the gathered block: without it XLA (CPU) moved it onto
    # the whole layer's pages, loop-invariant, and the step's cost followed the capacity again.
    k_raw, v_raw = lax.optimization_barrier((k_raw, v_raw))
    k_codes = unpack_codes(k_raw).astype(f32).reshape(*k_raw.shape[:3], n, GROUP)  # [B, Hkv, N, n, 32]
    v_codes = unpack_codes(v_raw).astype(f32).reshape(*v_raw.shape[:3], n, GROUP)
    ks = _gather_block(k_scale, layer, pages).astype(f32) * sm_scale  # [B, Hkv, N, n]
    vs = _gather_block(v_scale, layer, pages).astype(f32)

    def scores(qg):  # [B, Hkv, G, T, D]
        dots = jnp.einsum("BKGTnL,BKNnL->BKGTNn", qg.reshape(*qg.shape[:4], n, GROUP), k_codes, precision=_HIGHEST)
        return jnp.sum(dots * ks[:, :, None, None], axis=-1)

    if compute != jnp.dtype(jnp.float16):  # each group's value scale on the f32 weights
        v_ok = jnp.all(jnp.isfinite(vs), axis=-1)  # [B, Hkv, N]
        vs = jnp.where((live & v_ok)[..., None], vs, 0.0)

        def values(p):  # [B, Hkv, G, T, N]
            pg = (p[..., None] * vs[:, :, None, None]).astype(compute).astype(f32)  # [B, Hkv, G, T, N, n]
            out = jnp.einsum("BKGTNn,BKNnL->BKGTnL", pg, v_codes, precision=_HIGHEST)
            return out.reshape(*out.shape[:4], head_dim)

        return scores, v_ok, values
    v_c = (v_codes * vs[..., None]).astype(compute).reshape(*v_raw.shape[:3], head_dim)  # fp16: dequantized
    v_ok = jnp.all(jnp.isfinite(v_c), axis=-1)
    v_c = jnp.where((live & v_ok)[..., None], v_c, jnp.zeros((), compute))

    def values(p):
        return jnp.einsum("BKGTN,BKND->BKGTD", p.astype(compute).astype(f32), v_c.astype(f32), precision=_HIGHEST)

    return scores, v_ok, values


def _varying_axes(x) -> set:
    """The manual mesh axes x varies over inside `shard_map` (empty outside): the aval's
    `manual_axis_type.varying` (JAX 0.10, 0.11), `vma` in earlier JAX."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return set(getattr(mat, "varying", None) or getattr(aval, "vma", None) or ())


def _varying_like(state, *inputs):
    """The loop's initial state, marked as varying over every manual mesh axis any input varies
    over: inside `shard_map` with `check_vma`, a `while` carry must keep one type, and the
    block results vary wherever q, the arena or the rows do. Outside shard_map: unchanged."""
    axes = set().union(*(_varying_axes(x) for x in inputs if x is not None))
    if not axes:
        return state
    return jax.tree.map(lambda a: lax.pcast(a, tuple(sorted(axes)), to="varying"), state)


def _key_range(q_pos, q_valid, window, max_keys):
    """[lo, hi): the keys any valid query of the batch may attend to (i32[] each, lo may be >= hi)."""
    hi = jnp.max(jnp.where(q_valid, q_pos + 1, 0), initial=0)
    hi = jnp.clip(hi, 0, max_keys)
    if window is None:
        return jnp.zeros((), jnp.int32), hi
    first = jnp.where(q_valid, q_pos - window + 1, max_keys)
    return jnp.clip(jnp.min(first, initial=max_keys), 0, max_keys), hi


def paged_attention_blockwise(
    q, k_arena, v_arena, layer, page_map, lengths, num_tokens, *, sm_scale=None, sliding_window=None,
    logits_soft_cap=None, k_scale=None, v_scale=None, block_keys: int | None = None, tail_keys: int | None = None,
):
    """Attention of the new tokens over each row's pages, block by block (module docstring).

    q: [B, T, Hq, D]; arenas [L, Hkv, P_total, S, D]; page_map i32[B, M]; lengths,
    num_tokens i32[B]; the keywords as `paged_attention_reference`'s, plus `block_keys`
    (static: keys per loop step, rounded to whole pages, default `DEFAULT_BLOCK_KEYS`).
    Returns [B, T, Hq, D] in q's dtype, equal to the reference's to the kernels' tolerances.
    """
    batch, tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    max_pages = page_map.shape[1]
    max_keys = max_pages * page_size
    compute = jnp.dtype(q.dtype)
    f32 = jnp.float32
    if sm_scale is None:
        sm_scale = head_dim**-0.5
    layer = jnp.asarray(layer, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)
    num_tokens = jnp.asarray(num_tokens, jnp.int32)
    big_pages, small_pages, width = block_geometry(page_size, max_pages, block_keys, tail_keys)
    big, small = big_pages * page_size, small_pages * page_size
    page_map = jnp.pad(page_map.astype(jnp.int32), ((0, 0), (0, width - max_pages)),
                       constant_values=-1)  # [B, width]: whole tail blocks, the padding unmapped

    q_pos, q_valid = token_positions(lengths, num_tokens, tokens)  # [B, T]
    window = _window(sliding_window, max_keys)
    lo, hi = _key_range(q_pos, q_valid, window, max_keys)
    start = lo // small * small
    keys = jnp.maximum(0, (hi + small - 1) // small * small - start)  # whole tail blocks from start

    # (static) One query a row: its mask is the row's, so the V rows outside it (past the query,
    # before its window) can be zeroed with the keys that do not exist: then every V row that
    # enters P @ V is one the query attends to (`poison_non_finite`).
    one_query = tokens == 1
    qg = q.reshape(batch, tokens, num_kv_heads, group, head_dim).astype(compute).astype(f32)
    qg = qg.transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    q_ok = q_valid[:, :, None]  # [B, T, 1]: the mask's key-independent part

    def block(first_key, num_pages, defer_v_check=False):
        """The block's masked scores s f32[B, Hkv, G, T, N] (-inf where masked or not finite),
        which pairs are poisoned (bool, same shape), its P @ V (`values`), and None; with
        `defer_v_check` over a float arena, the pairs poisoned by their scores only, and for the
        last `v_check() -> (bool[B, Hkv, G, T]: the query heads a poisoned V row reaches, the
        P @ V over the finite rows)`."""
        cols = lax.dynamic_slice_in_dim(page_map, first_key // page_size, num_pages, axis=1)  # [B, P]
        key_pos = first_key + jnp.arange(num_pages * page_size, dtype=jnp.int32)  # [N]
        key_live = (key_pos[None, :] < lengths[:, None]) & jnp.repeat(cols >= 0, page_size, axis=1)  # [B, N]
        mask = key_live[:, None, :] & (key_pos[None, None, :] <= q_pos[:, :, None]) & q_ok  # [B, T, N]
        if window is not None:
            mask &= key_pos[None, None, :] > (q_pos[:, :, None] - window)
        # The V rows kept, per key for every KV head [B, 1, N]: one query a row keeps only its
        # mask's (`one_query`), more keep every live key.
        live = mask if one_query else key_live[:, None, :]
        scores, v_ok, values = _block_operands(
            k_arena, v_arena, k_scale, v_scale, layer, jnp.maximum(cols, 0), live, compute, sm_scale, defer_v_check)
        s = scores(qg)  # [B, Hkv, G, T, N] f32
        s_ok = jnp.isfinite(s)
        if logits_soft_cap is not None:
            s = jnp.tanh(s / logits_soft_cap) * logits_soft_cap
        mask = mask[:, None, None]  # [B, 1, 1, T, N]

        s = jnp.where(mask & s_ok, s, -jnp.inf)
        if callable(v_ok):  # deferred: the V rows' flags only when asked (the one-block path)
            def v_check():
                ok, checked_values = v_ok()
                return jnp.any(mask & ~ok[:, :, None, None, :], axis=-1), checked_values

            return s, mask & ~s_ok, values, v_check
        return s, mask & ~(s_ok & v_ok[:, :, None, None, :]), values, None

    def weights(s, poisoned, m):
        """exp(s - m) (0 where masked, NaN where poisoned) and the max actually subtracted."""
        m_use = jnp.where(jnp.isfinite(m), m, 0.0)
        return jnp.where(poisoned, jnp.nan, jnp.exp(s - m_use[..., None])), m_use

    def step(first_key, num_pages, state, defer_v_check=False):
        m, l, acc = state  # [B, Hkv, G, T], same, [B, Hkv, G, T, D]
        s, poisoned, values, _ = block(first_key, num_pages, defer_v_check)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p, m_use = weights(s, poisoned, m_new)
        alpha = jnp.exp(m - m_use)  # 0 while nothing was seen (m = -inf); NaN * alpha stays NaN
        l = alpha * l + jnp.sum(p, axis=-1)
        return m_new, l, alpha[..., None] * acc + values(p)

    def poison_non_finite(l, acc):
        """A float arena, one query a row (`one_query`), its V rows unchecked (zeroed only
        outside the row's mask): every V row left is a key the query attends to (a row whose
        query is not valid is zeroed at the end) and has a weight (finite, or NaN where its score
        is poisoned; 0 * inf and 0 * NaN are NaN), so a poisoned V row leaves exactly the query
        heads of its KV head non-finite, through every rescale of the online softmax. NaN those
        heads whole, as a check of the V rows would, with no pass over them and no conditional
        (its branch and copies cost a tiny decode step ~3%: RESULTS.md, session 33; in windowed
        layers, 15 of the example decoder's 127 distinct kernels to compile: session 57). A head
        whose finite rows overflow f32 is NaN here, inf there."""
        bad = ~jnp.all(jnp.isfinite(acc), axis=-1)
        return jnp.where(bad, jnp.nan, l), jnp.where(bad[..., None], jnp.nan, acc)

    if one_block(max_pages * page_size, batch, num_kv_heads, head_dim, block_keys):
        # The whole capacity fits one block (`one_block`): one straight-line block over every
        # page (no loop: one block's graph against the loops' below, no control flow; the keys no
        # query sees are masked, contributing exactly nothing), and a plain softmax: `step`
        # from the empty state without its rescaling (alpha = 0) of a zero sum and accumulator.
        # The row's own `max_pages`, not the page map padded to whole tail blocks (at 10 pages
        # of 16 that padding gathered and scored 12).
        s, poisoned, values, v_check = block(0, max_pages, defer_v_check=True)
        p, _ = weights(s, poisoned, jnp.max(s, axis=-1))
        l, acc = jnp.sum(p, axis=-1), values(p)
        if v_check is not None and one_query:
            l, acc = poison_non_finite(l, acc)
        elif v_check is not None:
            # A float arena's V rows are checked only when the output may hold their poison.
            # Every live key's V row enters P @ V for every query (a masked pair with weight 0:
            # 0 * inf and 0 * NaN are NaN), so a live row that is not finite leaves a
            # non-finite output; an all-finite output means the check would flag nothing. The
            # check costs a pass over the block's V rows: at batch 8, 160 keys, a fifth of the
            # attention's time on a CPU (benchmarks/RESULTS.md, "One block of attention").
            # A query head a poisoned row reaches is NaN (its weight, hence l and acc, would
            # be); the others take P @ V over the finite rows (their weights are as computed).
            def checked():
                bad, values_v = v_check()
                return jnp.where(bad, jnp.nan, l), jnp.where(bad[..., None], jnp.nan, values_v(p))

            l, acc = lax.cond(jnp.all(jnp.isfinite(acc)), lambda: (l, acc), checked)
    else:
        # Decode: the first big block from `start` straight-line, then the loops over the rest (a
        # context that fits one block, a decode step's usual case, runs no loop iteration), and
        # over a float arena no V row checked (`poison_non_finite`). Longer queries loop from
        # `start` (a block more to compile, for their loop overhead against their work).
        unchecked_v = one_query and jnp.dtype(k_arena.dtype) in _FLOAT_ARENAS
        shape = (batch, num_kv_heads, group, tokens)
        state = (jnp.full(shape, -jnp.inf, f32), jnp.zeros(shape, f32), jnp.zeros((*shape, head_dim), f32))
        state = _varying_like(state, q, k_arena, v_arena, k_scale, v_scale, layer, page_map, lengths, num_tokens, window)
        first = start
        if tokens == 1:
            page_map = jnp.pad(page_map, ((0, 0), (0, big_pages)), constant_values=-1)  # the first block past `keys`
            state = step(start, big_pages, state, unchecked_v)
            first = start + big
        rest = jnp.maximum(start + keys - first, 0)
        num_big = rest // big if big > small else 0  # whole big blocks, then at most big / small - 1 tail blocks
        if big > small:
            state = lax.fori_loop(0, num_big, lambda j, st: step(first + j * big, big_pages, st, unchecked_v), state)
        tail = first + num_big * big
        _, l, acc = lax.fori_loop(0, (rest - num_big * big) // small,
                                  lambda j, st: step(tail + j * small, small_pages, st, unchecked_v), state)
        if unchecked_v:
            l, acc = poison_non_finite(l, acc)
    seen = (l != 0)[..., None]  # NaN != 0: a poisoned row stays NaN
    out = jnp.where(seen, acc / jnp.where(seen, l[..., None], 1.0), 0.0)  # [B, Hkv, G, T, D]
    out = out.transpose(0, 3, 1, 2, 4)  # [B, T, Hkv, G, D]
    out = jnp.where(q_valid[:, :, None, None, None], out, 0.0)
    return out.reshape(batch, tokens, num_q_heads, head_dim).astype(q.dtype)
