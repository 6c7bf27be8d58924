"""Paged attention for TPU (Mosaic): decode with GQA packing and (chunked) prefill, straight from the arena.

One program per (batch row b, block of `block_tokens` query tokens); it holds, for every KV
head h, the `rows = block_tokens x group` query rows of that head's group (GQA packing: the
group's query heads share each K/V tile; row r is token `r // group`, head `r % group`). The
row's page table, lengths and the layer live in SMEM (scalar prefetch); K/V stay in HBM
(`memory_space=ANY`) and the program streams them itself:

- The keys any of its queries may see are `[lo, hi)`: `hi` = the last query's position + 1,
  `lo` = the first query's window start (0 without a window). They are read in blocks of
  `block_k` keys (`block_k / page_size` whole pages, block-aligned from position 0); block j
  of head h is one async DMA per page, `k_arena[layer, h, page] -> kbuf[slot, i*S:(i+1)*S]`
  (page_size x head_dim elements each), and the same for V.
- One flat loop runs over (head, block) pairs, so the DMAs of the next pair (the next block,
  or the next head's first block) are in flight while this one computes: double buffering in
  VMEM across heads, not only within one head.
- A page wholly outside `[lo, hi)` (the window's first block, the last block past the
  last query) is not read at all; one inside it that is unmapped (-1) or past the page table
  is filled by DMA from a zero page. A per-page flag row (1 live, 0 dead, `[1, page_size]`
  float32, DMA'd beside the page) masks dead pages' keys; V rows outside `[lo, hi)` are
  selected to zero by position, so an unread slot's stale contents (NaN in interpret mode)
  never reach the output.
- Online softmax in float32, state carried through the loop, reset at each head's first block.

Dtype and masking rules are the reference's (`pallas_kernels.reference`): dots in q's dtype
(K/V converted to it, products accumulated in f32; f32 dots at full precision), scores /
soft-cap / mask / softmax in f32, the unnormalized weights rounded to q's dtype for P @ V.
A key a query does not attend to contributes nothing: masked scores are selected to -inf,
V rows outside `[lo, hi)` (or of dead pages) are selected to zero. Non-finite inputs: a query
attending to a key whose raw score is not finite, or whose V row (8-bit: its value scale) is
not finite, is NaN in every lane; the kernel keeps a per-row poison flag for that.

8-bit arenas: K/V values are converted to q's dtype (exact), the key scale multiplies the f32
score, the value scale the f32 weights (`(p * v_scale) @ vq`), or, with float16 q, the V tile
is dequantized (`vq * v_scale` rounded to fp16), as on the GPU. Scales `[L, Hkv, P, S]` come
by DMA one page row `[1, S]` at a time into `[block_k / S, S]` and are flattened to a
`[1, block_k]` lane row in VMEM.
Contract: `pallas_kernels.reference.paged_attention_reference`.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels._common import BlockSizes, check_arena, check_layer, check_rows, check_tokens
from pallas_kernels.quant import is_quantized
from pallas_kernels.tpu.common import check_smem_tables, resolve_tpu_interpret, tpu_unsupported_reason

__all__ = ["tpu_paged_attention", "TpuAttentionTiles"]

MAX_ROWS = 512  # query rows (tokens x group) per program in prefill (each row block re-reads the KV)
DEFAULT_BLOCK_K = 512  # keys per block: 128 KiB of bf16 K at head_dim 128
QO_VMEM_BYTES = 4 << 20  # q + output blocks of a prefill program (Mosaic's default scoped VMEM: 16 MiB on v5e)


@dataclasses.dataclass(frozen=True)
class TpuAttentionTiles:
    """Static tiling of one call: keys per block (whole pages) and query tokens per program."""

    block_k: int
    block_tokens: int

    @classmethod
    def choose(cls, *, tokens: int, group: int, page_size: int, max_pages: int, block_sizes: BlockSizes | None,
               num_kv_heads: int = 1, head_dim: int = 128, itemsize: int = 2):
        """Keys per block: whole pages, up to 512 keys (no more than the page table holds).
        Query tokens per program: up to 512 rows (tokens x group), fewer when the q and output
        blocks of all KV heads (double-buffered) would pass QO_VMEM_BYTES; several row blocks
        must be sublane-aligned (rows % 8 == 0)."""
        bs = block_sizes or BlockSizes()
        if bs.pages_per_block is not None:
            block_k = bs.pages_per_block * page_size
        elif bs.block_k is not None:
            block_k = bs.block_k
        else:  # whole pages, up to DEFAULT_BLOCK_K keys, no more than the page table holds
            want = min(DEFAULT_BLOCK_K, max(page_size, 1 << (max_pages * page_size - 1).bit_length()))
            block_k = max(1, want // page_size) * page_size
        if block_k % page_size:
            raise ValueError(f"block_k={block_k} must be a multiple of page_size={page_size} on TPU (whole pages per DMA block)")
        if tokens == 1:
            block_tokens = 1
        elif bs.block_tokens is not None:
            block_tokens = bs.block_tokens
        else:
            per_token = 4 * num_kv_heads * group * head_dim * itemsize  # q and out blocks, 2 buffers each
            block_tokens = max(1, min(MAX_ROWS // group, QO_VMEM_BYTES // per_token))
            block_tokens = 1 << (block_tokens.bit_length() - 1)  # a power of two
        # Several row blocks need sublane-aligned blocks (rows % 8 == 0); one block is the full dim.
        if block_tokens < tokens:
            align = 8 // math.gcd(group, 8)
            block_tokens = -(-block_tokens // align) * align
        block_tokens = min(block_tokens, tokens)
        return cls(block_k=block_k, block_tokens=block_tokens)


def _dot_t(a, b):
    """a [m, d] @ b [n, d]^T accumulated in f32 (f32 inputs at full precision)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _dot(a, b):
    """a [m, k] @ b [k, n] accumulated in f32."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)


def _attention_kernel(
    # scalar prefetch (SMEM)
    meta_ref,  # i32[2]: layer (clipped into range), sliding window (clipped into [0, M*S]; unused without one)
    lengths_ref,  # i32[B]
    num_tokens_ref,  # i32[B]
    page_map_ref,  # i32[B * M] (row-major page table)
    # inputs
    q_ref,  # [Hkv, rows, D] VMEM block: row b, row block rb, every KV head
    k_hbm,  # [L, Hkv, P, S, D] HBM
    v_hbm,  # [L, Hkv, P, S, D] HBM
    zero_page_hbm,  # [S, D] zeros in the arena dtype, HBM
    flags_hbm,  # f32[2, S]: row 0 zeros (dead), row 1 ones (live), HBM
    *refs,  # 8-bit: ks_hbm, vs_hbm f32[L, Hkv, P, S]; then o_ref [Hkv, rows, D]; then scratch
    quantized: bool,
    sm_scale: float,
    has_window: bool,
    soft_cap: float | None,
    block_tokens: int,
    group: int,
    tokens: int,
    max_pages: int,
    compute,
):
    if quantized:
        ks_hbm, vs_hbm, o_ref, kbuf, vbuf, okbuf, ksbuf, vsbuf, sem = refs
    else:
        o_ref, kbuf, vbuf, okbuf, sem = refs
        ks_hbm = vs_hbm = ksbuf = vsbuf = None
    b, rb = pl.program_id(0), pl.program_id(1)
    _, num_kv_heads, num_pages, page_size, head_dim = k_hbm.shape
    _, block_k, _ = kbuf.shape
    ppb = block_k // page_size
    rows = q_ref.shape[1]
    f32 = jnp.float32

    layer = meta_ref[0]
    length = lengths_ref[b]
    n_new = num_tokens_ref[b]
    n_valid = jnp.clip(n_new, 0, tokens)
    start = length - n_new  # position of new token 0
    t_first = rb * block_tokens
    t_last = jnp.minimum(t_first + block_tokens, n_valid) - 1
    hi = jnp.clip(jnp.minimum(start + t_last + 1, length), 0, max_pages * page_size)
    hi = jnp.where(t_first < n_valid, hi, 0)
    if has_window:
        window = meta_ref[1]
        lo = jnp.maximum(start + t_first - window + 1, 0)
    else:
        window = None
        lo = jnp.zeros_like(hi)
    lo = jnp.minimum(lo, hi)
    blk_lo = lax.div(lo, block_k)
    n_blocks = lax.div(hi + block_k - 1, block_k) - blk_lo
    total = num_kv_heads * n_blocks

    def pair(i):
        """Flat iteration i -> (KV head, block index)."""
        safe = jnp.maximum(n_blocks, 1)
        return lax.div(i, safe), blk_lo + lax.rem(i, safe)

    def copies(i, slot):
        """The DMAs of pair i into buffer slot `slot`, per page: (read, live, copies from the
        arena, copies from the zero page / zero row, the flag row); copies are built when used.
        A page in [lo, hi) is read from the arena if mapped (live), else from the zero page (a
        hole: its V rows must be zero); a page outside [lo, hi) is not read at all (its keys
        and V rows are masked by position), only its flag row (dead)."""
        h, j = pair(i)
        out = []
        for p in range(ppb):
            lp = j * ppb + p  # logical page
            page = page_map_ref[b * max_pages + jnp.minimum(lp, max_pages - 1)]
            read = (lp * page_size < hi) & ((lp + 1) * page_size > lo)
            live = read & (lp < max_pages) & (page >= 0)
            page = jnp.clip(page, 0, num_pages - 1)
            dst, row, sem_ = pl.ds(p * page_size, page_size), pl.ds(p, 1), sem.at[slot]

            def from_arena(page=page, dst=dst, row=row, sem_=sem_, h=h):
                out = [pltpu.make_async_copy(k_hbm.at[layer, h, page], kbuf.at[slot, dst], sem_),
                       pltpu.make_async_copy(v_hbm.at[layer, h, page], vbuf.at[slot, dst], sem_)]
                if quantized:
                    out += [pltpu.make_async_copy(ks_hbm.at[layer, h, pl.ds(page, 1)], ksbuf.at[slot, row], sem_),
                            pltpu.make_async_copy(vs_hbm.at[layer, h, pl.ds(page, 1)], vsbuf.at[slot, row], sem_)]
                return out

            def from_zeros(dst=dst, row=row, sem_=sem_):
                out = [pltpu.make_async_copy(zero_page_hbm, kbuf.at[slot, dst], sem_),
                       pltpu.make_async_copy(zero_page_hbm, vbuf.at[slot, dst], sem_)]
                if quantized:
                    out += [pltpu.make_async_copy(flags_hbm.at[pl.ds(0, 1)], ksbuf.at[slot, row], sem_),
                            pltpu.make_async_copy(flags_hbm.at[pl.ds(0, 1)], vsbuf.at[slot, row], sem_)]
                return out

            flag = pltpu.make_async_copy(flags_hbm.at[pl.ds(live.astype(jnp.int32), 1)], okbuf.at[slot, row], sem_)
            out.append((read, live, from_arena, from_zeros, flag))
        return out

    def start_copies(i, slot):
        for read, live, from_arena, from_zeros, flag in copies(i, slot):
            @pl.when(live)
            def _():
                for c in from_arena():
                    c.start()

            @pl.when(read & jnp.logical_not(live))
            def _():
                for c in from_zeros():
                    c.start()

            flag.start()

    def wait_copies(i, slot):
        for read, _, from_arena, _, flag in copies(i, slot):  # a wait counts bytes: both sources match
            @pl.when(read)
            def _():
                for c in from_arena():
                    c.wait()

            flag.wait()

    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)  # rows that see no key (and heads of a row without keys)

    # Per-row constants: token, position and validity of each query row.
    r = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
    t = t_first + lax.div(r, group)  # [rows, 1]
    q_pos = start + t
    row_ok = t < n_valid
    kk = lax.broadcasted_iota(jnp.int32, (1, block_k), 1)  # key offset in the block, lanes
    kk_col = lax.broadcasted_iota(jnp.int32, (block_k, 1), 0)  # the same, sublanes

    @pl.when(total > 0)
    def _():
        start_copies(0, 0)

    def body(i, carry):
        m_prev, l_prev, acc_prev, bad_prev = carry  # [rows, 1] x2, [rows, D], [rows, 1] (f32)
        slot = lax.rem(i, 2)
        h, j = pair(i)
        first = j == blk_lo
        m_prev = jnp.where(first, -jnp.inf, m_prev)
        l_prev = jnp.where(first, 0.0, l_prev)
        acc_prev = jnp.where(first, 0.0, acc_prev)
        bad_prev = jnp.where(first, 0.0, bad_prev)

        @pl.when(i + 1 < total)
        def _():
            start_copies(i + 1, 1 - slot)

        wait_copies(i, slot)
        kpos = j * block_k + kk  # [1, block_k]
        kpos_col = j * block_k + kk_col  # [block_k, 1]
        page_ok = okbuf[slot].reshape(1, block_k) > 0.5  # [1, block_k]: key's page live and read
        in_range = page_ok & (kpos >= lo) & (kpos < hi)  # keys this program's queries may attend
        in_range_col = (kpos_col >= lo) & (kpos_col < hi)  # (dead pages arrive as zeros)

        q = q_ref[h].astype(compute)  # [rows, D]
        k = kbuf[slot].astype(compute)  # [block_k, D]
        dots = _dot_t(q, k)  # [rows, block_k] f32
        if quantized:
            ks = ksbuf[slot].reshape(1, block_k)
            s = dots * (ks * sm_scale)
        else:
            s = dots * sm_scale
        s_ok = jnp.isfinite(s)
        if soft_cap is not None:
            s = jnp.tanh(s / soft_cap) * soft_cap
        mask = in_range & (kpos <= q_pos) & row_ok  # [rows, block_k]
        if window is not None:
            mask &= kpos > q_pos - window

        fold_v = quantized and compute != jnp.dtype(jnp.float16)
        if fold_v:  # 8-bit values are finite by construction: a row's poison is its scale
            vs = vsbuf[slot].reshape(1, block_k)
            v_ok = jnp.isfinite(vs)
            vs = jnp.where(in_range & v_ok, vs, 0.0)
            v = jnp.where(in_range_col, vbuf[slot].astype(compute), jnp.zeros((), compute))
            poison = mask & ~(s_ok & v_ok)
            bad_blk = jnp.max(jnp.where(poison, 1.0, 0.0), axis=1, keepdims=True)
        else:
            if quantized:  # fp16: dequantize the V tile (vq * scale may overflow fp16)
                vs_row = jnp.where(in_range, vsbuf[slot].reshape(1, block_k), 0.0)
                eye = lax.broadcasted_iota(jnp.int32, (block_k, block_k), 0) == lax.broadcasted_iota(
                    jnp.int32, (block_k, block_k), 1)
                vs_col = jnp.sum(jnp.where(eye, vs_row, 0.0), axis=1, keepdims=True)  # [block_k, 1], exact
                v = (vbuf[slot].astype(f32) * vs_col).astype(compute)
            else:
                v = vbuf[slot].astype(compute)  # [block_k, D]
            v_ok_col = jnp.min(jnp.where(jnp.isfinite(v.astype(f32)), 1.0, 0.0), axis=1, keepdims=True) > 0.5
            v = jnp.where(in_range_col & v_ok_col, v, jnp.zeros((), compute))
            bad_v = jnp.where(in_range_col & ~v_ok_col, 1.0, 0.0)  # [block_k, 1]
            bad_blk = jnp.maximum(
                jnp.max(jnp.where(mask & ~s_ok, 1.0, 0.0), axis=1, keepdims=True),
                jnp.where(_dot(jnp.where(mask, 1.0, 0.0), bad_v) > 0.5, 1.0, 0.0))  # [rows, 1]
        s = jnp.where(mask & s_ok, s, -jnp.inf)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that saw no key yet
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)  # 0 where masked
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        if fold_v:
            p = p * vs
        acc = acc_prev * alpha + _dot(p.astype(compute), v)
        bad = jnp.maximum(bad_prev, bad_blk)

        @pl.when(j == blk_lo + n_blocks - 1)
        def _():
            seen = l_next != 0  # a seen key adds exp(0) = 1 to its row's sum
            out = jnp.where(seen, acc / jnp.where(seen, l_next, 1.0), 0.0)
            out = jnp.where(bad > 0.5, jnp.nan, out)
            o_ref[h] = jnp.where(row_ok, out, 0.0).astype(o_ref.dtype)

        return m_next, l_next, acc, bad

    init = (jnp.full((rows, 1), -jnp.inf, f32), jnp.zeros((rows, 1), f32), jnp.zeros((rows, head_dim), f32),
            jnp.zeros((rows, 1), f32))
    lax.fori_loop(0, total, body, init)


def _window_value(sliding_window, max_keys: int):
    """The window as the kernel's int32 scalar, clipped into [0, max_keys] (same mask)."""
    if isinstance(sliding_window, int):
        return jnp.int32(max(0, min(sliding_window, max_keys)))
    return jnp.clip(jnp.asarray(sliding_window), 0, max_keys).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("sm_scale", "has_window", "window_bound", "soft_cap", "tiles", "interpret"))
def _tpu_attention_call(q, k_arena, v_arena, meta, page_map, lengths, num_tokens, k_scale, v_scale, *, sm_scale,
                        has_window, window_bound, soft_cap, tiles, interpret):
    batch, tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    max_pages = page_map.shape[1]
    block_k, block_tokens = tiles.block_k, tiles.block_tokens
    row_blocks = -(-tokens // block_tokens)
    rows = block_tokens * group
    quantized = k_scale is not None
    # [B, T, Hq, D] -> [B, Hkv, T_pad * G, D]: row r of a head's block is token r // G, head r % G.
    qg = q.reshape(batch, tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, row_blocks * block_tokens - tokens), (0, 0), (0, 0)))
    qg = qg.reshape(batch, num_kv_heads, row_blocks * rows, head_dim)

    compute = jnp.dtype(q.dtype)
    kernel = functools.partial(
        _attention_kernel, quantized=quantized, sm_scale=sm_scale, has_window=has_window, soft_cap=soft_cap,
        block_tokens=block_tokens, group=group, tokens=tokens, max_pages=max_pages, compute=compute)
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    q_spec = pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b, rb, *_: (b, 0, rb, 0))
    ppb = block_k // page_size
    scratch = [pltpu.VMEM((2, block_k, head_dim), k_arena.dtype), pltpu.VMEM((2, block_k, head_dim), k_arena.dtype),
               pltpu.VMEM((2, ppb, page_size), jnp.float32)]
    in_specs = [q_spec, hbm, hbm, hbm, hbm]
    extra = ()
    if quantized:
        scratch += [pltpu.VMEM((2, ppb, page_size), jnp.float32), pltpu.VMEM((2, ppb, page_size), jnp.float32)]
        in_specs += [hbm, hbm]
        extra = (k_scale, v_scale)
    scratch.append(pltpu.SemaphoreType.DMA((2,)))
    zero_page = jnp.zeros((page_size, head_dim), k_arena.dtype)
    flags = jnp.stack([jnp.zeros((page_size,), jnp.float32), jnp.ones((page_size,), jnp.float32)])
    name = f"tpu_paged_attention_bt{block_tokens}_g{group}_bk{block_k}_d{head_dim}"
    if quantized:
        name += f"_{jnp.dtype(k_arena.dtype).name}"
    # The DMA plan at its workload bound (every row at the page table's full length; with a
    # static window, the window's pages plus one for alignment), for XLA's scheduler and cost
    # analysis: pages read per (program, head), each K and V (and scale rows), plus flag rows.
    keys = max_pages * page_size if not has_window or window_bound is None else min(
        max_pages * page_size, window_bound + block_tokens - 1)
    pages_read = min(max_pages, -(-keys // page_size) + (1 if has_window else 0))
    n_blocks = -(-(pages_read * page_size) // block_k) + (1 if has_window else 0)
    page_bytes = 2 * page_size * head_dim * jnp.dtype(k_arena.dtype).itemsize + (2 * page_size * 4 if quantized else 0)
    programs = batch * row_blocks * num_kv_heads
    cost = pl.CostEstimate(
        flops=int(4 * programs * rows * n_blocks * block_k * head_dim),
        transcendentals=int(programs * rows * n_blocks * block_k),
        bytes_accessed=int(programs * (pages_read * page_bytes + n_blocks * ppb * page_size * 4)
                           + 2 * qg.size * qg.dtype.itemsize),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, row_blocks),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name=name,
        cost_estimate=cost,
    )(meta, lengths, num_tokens, page_map.reshape(-1), qg, k_arena, v_arena, zero_page, flags, *extra)
    out = out.reshape(batch, num_kv_heads, row_blocks * block_tokens, group, head_dim)[:, :, :tokens]
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, tokens, num_q_heads, head_dim)


def tpu_paged_attention(
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
    interpret=None,
    block_sizes: BlockSizes | None = None,
):
    """`pallas_kernels.paged_attention`'s contract, as a Mosaic TPU kernel.

    q: [B, T, Hq, D]; k_arena, v_arena: [L, Hkv, P, S, D]; layer: int or traced i32 scalar;
    page_map: i32[B, M] (-1 unmapped); lengths, num_tokens: i32[B]. `sliding_window`: None,
    an int >= 1, or a traced integer scalar (clipped into [0, M*S]: <= 0 admits no key).
    `logits_soft_cap`: None or a float > 0. 8-bit arenas take float32 `k_scale, v_scale`
    [L, Hkv, P, S]. `interpret`: None (compile on a TPU, TPU interpret mode elsewhere), True,
    or a `pltpu.InterpretParams`. `block_sizes`: `block_k` (or `pages_per_block`) and
    `block_tokens` are used; the GPU-only fields are ignored. Returns [B, T, Hq, D] in q's dtype.
    """
    num_layers, num_kv_heads, _, page_size, head_dim = check_arena(k_arena, v_arena, k_scale, v_scale)
    check_tokens("q", q, batch=None, heads=None, head_dim=head_dim)
    batch, tokens, num_q_heads, _ = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads, not a multiple of the arena's {num_kv_heads} KV heads")
    reason = tpu_unsupported_reason(head_dim=head_dim, page_size=page_size, dtype=k_arena.dtype,
                                    scale_dtype=None if k_scale is None else k_scale.dtype, q_dtype=q.dtype)
    if reason:
        raise ValueError(reason)
    layer = check_layer(layer, num_layers)
    page_map, lengths, num_tokens = check_rows(page_map, lengths, num_tokens, batch)
    check_smem_tables(f"page_map [{batch}, {page_map.shape[1]}]", page_map.size + 2 * batch + 2)
    max_keys = page_map.shape[1] * page_size
    has_window = sliding_window is not None
    if isinstance(sliding_window, (bool, float)) or (isinstance(sliding_window, int) and sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int, a traced integer scalar or None, got {sliding_window!r}")
    if has_window and not isinstance(sliding_window, int):
        w = jnp.asarray(sliding_window)
        if w.shape != () or not jnp.issubdtype(w.dtype, jnp.integer):
            raise ValueError(f"sliding_window must be an integer scalar, got shape {w.shape} dtype {w.dtype}")
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}")
    window = _window_value(sliding_window, max_keys) if has_window else jnp.int32(0)
    meta = jnp.stack([jnp.clip(layer[0], 0, num_layers - 1), window]).astype(jnp.int32)
    tiles = TpuAttentionTiles.choose(tokens=tokens, group=num_q_heads // num_kv_heads, page_size=page_size,
                                     max_pages=page_map.shape[1], block_sizes=block_sizes, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, itemsize=jnp.dtype(q.dtype).itemsize)
    return _tpu_attention_call(
        q, k_arena, v_arena, meta, page_map, lengths, num_tokens, k_scale, v_scale,
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale), has_window=has_window,
        window_bound=sliding_window if isinstance(sliding_window, int) else None,
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap), tiles=tiles,
        interpret=resolve_tpu_interpret(interpret),
    )
