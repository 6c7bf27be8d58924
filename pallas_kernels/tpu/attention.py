"""Paged attention for TPU (Mosaic): decode with GQA packing and (chunked) prefill, straight from the arena.

One program per (batch row b, block of `block_tokens` query tokens); it holds, for every KV
head h, the `rows = block_tokens x group` query rows of that head's group (GQA packing: the
group's query heads share each K/V tile; row r is token `r // group`, head `r % group`). The
row's page table, lengths and the layer live in SMEM (scalar prefetch); K/V stay in HBM
(`memory_space=ANY`) and the program streams them itself:

- The keys any of its queries may see are `[lo, hi)`: `hi` = the last query's position + 1,
  `lo` = the first query's window start (0 without a window). They are read in blocks of
  `block_k` keys (`block_k / page_size` whole pages, block-aligned from position 0), each block
  of every KV head at once: page p of every head is `Hkv` equal chunks at a fixed stride in the
  arena `[L, Hkv, P, S, D]`, so one strided DMA a page and buffer moves them,
  `k_arena[layer, :, page] -> kbuf[slot][:, i*S:(i+1)*S]`, and the same for V: two DMAs a page
  for all heads (four with 8-bit scales), nothing else. (A DMA a page and head cost ~8 scalar
  ops of issue each; at 8-bit pages of 32 that, not the bytes, set the loop's length:
  benchmarks/RESULTS.md, "A page of every KV head in one DMA".) A block wholly inside
  `[lo, hi)` issues them unrolled with no branch and is waited for with one wait per buffer
  (the DMA semaphore counts bytes); the first and last blocks of a row issue only their pages
  inside `[lo, hi)`, in a loop, and wait page by page. A slot of K is `[Hkv, block_k, D]`
  (`KV_SLOT_BYTES` at most: fewer keys a block for many heads or wide rows).
- One loop runs over a row's blocks, so the DMAs of the next block are in flight while this
  one computes: double buffering in VMEM. Block i uses slot i % 2: in decode each slot of each
  buffer is an allocation of its own, named by a static number, so a DMA into one slot waits
  for no read of the other; in prefill both are one allocation (the slot traced: half the
  code). `Slots`. Within a block, decode unrolls its heads (up to `MAX_UNROLLED_HEADS`) and
  carries their softmax state through the loops; prefill (and decode over more heads) loops
  over the heads, their state in VMEM.
- The steady state runs in a loop of its own: while this block is whole and seen whole by
  every query row (no key past the first query's position, none before the last query's
  window), lies past the row's last hole (`hole_ends`) and the next block is whole, a block
  waits for its DMAs, attends with no mask, and only then starts the next block's DMAs,
  unrolled. In decode two blocks an iteration (an even block in slot 0), and the loop has no
  branch, so libtpu's VLIW scheduler issues the next block's scalar address work and DMA
  starts in the same bundles as this block's vector and MXU work (a branch ends a scheduling
  region); around it, the loop over blocks serves two blocks alone (even, then odd), each by
  the fast step when it may take it. In prefill a block an iteration, after a general step.
  The others (a row's first and last blocks, the block before a partial one, a chunk's
  diagonal blocks, a block before a hole, the last block) take the general step.
- A page outside `[lo, hi)` is not read. A hole (an unmapped entry, -1, inside it) reads some
  arena page all the same, without a branch; a block before the row's last hole checks its
  pages, and one that has a hole (rare) masks the hole's keys and overwrites its V rows with a
  zero page. V rows outside `[lo, hi)` (stale data, or a slot never written) are zeroed in
  place, 8-row-tile chunks, only in the blocks that have any; so no stale value (NaN in
  interpret mode) reaches the output.
- Online softmax in float32, each head's state from the row's first block to its output,
  written once after the last block.
- Every index the kernel forms is clipped into range, so Mosaic's runtime bounds checks (two
  per DMA) are turned off.

Dtype and masking rules are the reference's (`pallas_kernels.reference`): dots in q's dtype
(K/V converted to it, products accumulated in f32; f32 dots at full precision), scores /
soft-cap / mask / softmax in f32, the unnormalized weights rounded to q's dtype for P @ V.
A key a query does not attend to contributes nothing: masked scores are selected to -inf,
V rows outside `[lo, hi)` (or of dead pages) are selected to zero. Non-finite inputs: a query
attending to a key whose raw score is not finite, or whose V row (8-bit: its value scale) is
not finite, is NaN in every lane; the kernel keeps a per-row poison flag for that. In decode
(one query token per program) every row attends exactly the V rows in `[lo, hi)`, all others
being zero: the P @ V product itself carries a non-finite V row into the accumulator
(x * NaN = NaN, 0 * inf = NaN), checked once per head, at the end. This relies on the MXU's IEEE
products; interpret mode checks it, a TPU has not. Prefill rows differ in what they attend:
non-finite V rows are found per block and zeroed, and the rows attending them poisoned.

8-bit arenas: K/V values are converted to q's dtype (exact), the key scale multiplies the f32
score, the value scale the f32 weights (`(p * v_scale) @ vq`), or, with float16 q, the V tile
is dequantized (`vq * v_scale` rounded to fp16), as on the GPU. Scales `[L, Hkv, P, S]`
(`scale_views`) come by DMA, every head's page row `[1, S]` at a time, straight into its lanes
of a `[1, block_k]` row a head in VMEM (`scale_shape`; S of 128 or 256: whole lane tiles).
Pages of 16, 32 or 64 take scale rows `[L, Hkv, P * S / 128, 128]` (`scale_rows`): a page's DMA
moves the 512-byte row holding its scales, every head's, into a row of a `[pages, 128]` slot a
head, and `scale_lanes` makes a head's lane row of them (shifts precomputed by XLA,
`scale_shifts`). In decode over scale rows, a block whose pages are one run of consecutive
pages (`run_blocks`, a flag a block in SMEM) is read in one DMA a buffer (`start_run`: K and V
from the arena seen as rows, `row_pages`; the run's scale rows, laid side by side by
`run_lanes`), with a steady-state loop of its own beside the one for blocks read a DMA a page
(`RUNS`; the mixed call's chunks read every block by pages).
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
from pallas_kernels.tpu.common import check_smem_tables, logical_scales, resolve_tpu_interpret, tpu_unsupported_reason

__all__ = ["tpu_paged_attention", "TpuAttentionTiles"]

MAX_ROWS = 512  # query rows (tokens x group) per program in prefill (each row block re-reads the KV)
DEFAULT_BLOCK_K = 512  # keys per block: 128 KiB of bf16 K at head_dim 128
QO_VMEM_BYTES = 4 << 20  # q + output blocks of a prefill program (Mosaic's default scoped VMEM: 16 MiB on v5e)
KV_SLOT_BYTES = 1 << 20  # a slot of K (or V) for every KV head, [Hkv, block_k, D]: 4 MiB for K and V's two slots
MAX_UNROLLED_HEADS = 8  # decode unrolls a block's KV heads up to this many (more: a loop over heads)
FAST_LOOP = True  # the steady state (blocks every row sees whole) in a loop of its own (tests turn it off to compare)
FAST_BLOCKS = 2  # blocks an iteration of decode's steady-state loop (its kernels' names: `_bk<keys>x2_h<heads>_`; prefill 1)
RUNS = True  # decode over 8-bit scale rows reads a block of consecutive pages in one DMA a buffer (tests turn it off)
# 8-bit pages read as runs: every size that takes scale rows. Their arena seen as rows
# (`row_pages`) compiles to a bitcast, in a decode call and in a model step
# (`tests/test_compile_tpu.py`: no arena copy).
RUN_PAGE_SIZES = (16, 32, 64)


@dataclasses.dataclass(frozen=True)
class TpuAttentionTiles:
    """Static tiling of one call: keys per block (whole pages) and query tokens per program."""

    block_k: int
    block_tokens: int

    @classmethod
    def choose(cls, *, tokens: int, group: int, page_size: int, max_pages: int, block_sizes: BlockSizes | None,
               num_kv_heads: int = 1, head_dim: int = 128, itemsize: int = 2, arena_itemsize: int | None = None):
        """Keys per block: whole pages, up to 512 keys (no more than the page table holds), fewer
        when a slot of K for every KV head (`[Hkv, block_k, D]` of `arena_itemsize`, default
        `itemsize`) would pass KV_SLOT_BYTES.
        Query tokens per program: up to 512 rows (tokens x group), fewer when the q and output
        blocks of all KV heads (double-buffered) would pass QO_VMEM_BYTES; several row blocks
        must be sublane-aligned (rows % 8 == 0)."""
        bs = block_sizes or BlockSizes()
        if bs.pages_per_block is not None:
            block_k = bs.pages_per_block * page_size
        elif bs.block_k is not None:
            block_k = bs.block_k
        else:  # whole pages, up to DEFAULT_BLOCK_K keys and KV_SLOT_BYTES a slot, no more than the page table holds
            # (the same for any query tokens: a mixed call's parts share it)
            fits = KV_SLOT_BYTES // (num_kv_heads * head_dim * (arena_itemsize or itemsize))
            want = min(DEFAULT_BLOCK_K, 1 << max(fits, 1).bit_length() - 1,
                       max(page_size, 1 << (max_pages * page_size - 1).bit_length()))
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


def masked(mask, x):
    """`mask & x`; None is the mask of a block every row sees whole (no mask)."""
    return x if mask is None else mask & x


def _attention_kernel(
    # scalar prefetch (SMEM)
    meta_ref,  # i32[2]: layer (clipped into range), sliding window (clipped into [0, M*S]; unused without one)
    lengths_ref,  # i32[B]
    num_tokens_ref,  # i32[B]
    page_map_ref,  # i32[B * M] (row-major page table)
    hole_end_ref,  # i32[B]: where each row's last unmapped page below its length ends, in keys (0: none; `hole_ends`)
    # inputs
    q_ref,  # [Hkv, rows, D] VMEM block: row b, row block rb, every KV head
    k_hbm,  # [L, Hkv, P, S, D] HBM: page p of every head is one strided DMA (`k_hbm.at[layer, :, page]`)
    v_hbm,  # [L, Hkv, P, S, D] HBM
    zero_page_hbm,  # [Hkv, S, D] zeros in the arena dtype, HBM
    *refs,  # 8-bit: ks_hbm, vs_hbm (`scale_views`), pages under 128: then the row's scale shifts i32[blocks, ppb]
    # (`scale_shifts`, VMEM); then o_ref [Hkv, rows, D]; then scratch (`slot_scratch`, `state_scratch`, a semaphore)
    quantized: bool,
    sm_scale: float,
    has_window: bool,
    soft_cap: float | None,
    block_tokens: int,
    group: int,
    tokens: int,
    max_pages: int,
    compute,
    num_kv_heads: int,
    num_pages: int,
    row=None,
    row_block=None,
    fast_loop: bool | None = None,
    run_ref=None,
    row_views=None,
):
    """The kernel body (module docstring). `row`, `row_block`: the batch row (of the tables) and
    the block of query tokens this body serves; default the program's ids (a mixed call,
    `pallas_kernels.tpu.mixed`, runs two bodies in one kernel and names them). `run_ref`
    i32[B * blocks] (SMEM, `run_blocks`) and `row_views` (the K and V arenas as rows, `row_pages`):
    decode over 8-bit scale rows reads a block whose pages are a run in one DMA a buffer
    (`start_run`); None: every block a DMA a page."""
    page_size, head_dim = k_hbm.shape[3], k_hbm.shape[4]
    rows_per_page = page_size % 128 == 0  # 8-bit scales: a page's own row(s); else rows of 128 / S pages
    shifts_ref = None
    if quantized and not rows_per_page:
        ks_hbm, vs_hbm, shifts_ref, o_ref, *scratch = refs
    elif quantized:
        ks_hbm, vs_hbm, o_ref, *scratch = refs
    else:
        (o_ref, *scratch), ks_hbm, vs_hbm = refs, None, None
    *scratch, stats_ref, acc_ref, sem = scratch  # each head's softmax state (`slot_scratch`)
    one_token = block_tokens == 1  # decode: one query token per program
    kbuf, vbuf, ksbuf, vsbuf = Slots.of(scratch, static=one_token) + ([None, None] if not quantized else [])
    b = pl.program_id(0) if row is None else row
    rb = pl.program_id(1) if row_block is None else row_block
    block_k = kbuf[0].shape[1]
    ppb = block_k // page_size
    rows = q_ref.shape[1]
    f32, i32 = jnp.float32, jnp.int32
    row_shift = (128 // page_size).bit_length() - 1 if not rows_per_page else 0
    runs = run_ref is not None  # (decode over scale rows only: `run_blocks`)
    blocks_per_row = -(-max_pages // ppb)
    if runs:
        k_rows, v_rows = row_views  # [L, Hkv, P * S, D] HBM: the arena as rows (`row_pages`)
        run_scale_rows = block_k // 128 + 1  # the scale rows a run's pages may touch (128 / S pages a row)
        per_row = 128 // page_size

    layer = meta_ref[0]
    length = lengths_ref[b]
    hole_end = hole_end_ref[b]
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
    blk_end = lax.div(hi + block_k - 1, block_k)
    total = blk_end - blk_lo  # blocks, each of every KV head

    def page_range(j):
        """The pages of block j that hold keys in [lo, hi): [p0, p1) (the rest are not read;
        their keys are masked by position)."""
        first = j * block_k
        p0 = jnp.clip(lax.div(jnp.maximum(lo - first, 0), page_size), 0, ppb)
        p1 = jnp.clip(lax.div(jnp.maximum(hi - first + page_size - 1, 0), page_size), 0, ppb)
        return p0, jnp.maximum(p0, p1)

    def start_page(j, p, slot):
        """Start the DMAs of page p of block j into `slot`, every KV head in each: K and V (and
        their scale rows), one strided DMA each. A hole (-1, unmapped) reads an arena page all
        the same (any: its keys are masked and V rows zeroed in the block's body). The caller
        keeps p inside [lo, hi), which lies inside the page table."""
        entry = page_map_ref[b * max_pages + j * ppb + p]
        # One unsigned min clips both ways: a negative entry is a huge unsigned number.
        page = jnp.minimum(entry.astype(jnp.uint32), jnp.uint32(num_pages - 1)).astype(i32)
        dst = pl.ds(pl.multiple_of(p * page_size, page_size), page_size)
        pltpu.make_async_copy(k_hbm.at[layer, :, page], kbuf[slot].at[:, dst], sem.at[slot]).start()
        pltpu.make_async_copy(v_hbm.at[layer, :, page], vbuf[slot].at[:, dst], sem.at[slot]).start()
        if quantized:
            # Pages under 128 keys: the scale row holding the page (`scale_rows`), 128 / S pages a row.
            srow = page if rows_per_page else lax.shift_right_logical(page, row_shift)
            for hbm_, buf in ((ks_hbm, ksbuf), (vs_hbm, vsbuf)):
                pltpu.make_async_copy(hbm_.at[layer, :, pl.ds(srow, 1)], scale_dst(buf[slot], p, page_size),
                                      sem.at[slot]).start()

    def is_run(j):
        """Block j's pages are a run (`run_blocks`): a whole block of it is read by `start_run`
        and its scales laid out by `run_lanes`. False (static) without runs. (j clipped into the
        row's blocks: callers may ask past the last one.)"""
        return run_ref[b * blocks_per_row + jnp.minimum(j, blocks_per_row - 1)] != 0 if runs else False

    def run_offset(j):
        """Where block j's run starts in its first scale row, in lanes (`run_lanes`)."""
        return (page_map_ref[b * max_pages + j * ppb] & (per_row - 1)) * page_size

    def start_run(j, slot):
        """Start block j, a run of pages (`is_run`), every KV head: K and V one strided DMA each
        from the arena's rows, and the `run_scale_rows` scale rows from its first page's one DMA
        each into the first rows of the scale slots (they hold its pages in order, from
        `run_offset`). Indices clipped into range."""
        entry = page_map_ref[b * max_pages + j * ppb]
        page = jnp.minimum(entry.astype(jnp.uint32), jnp.uint32(num_pages - ppb)).astype(i32)
        src = pl.ds(pl.multiple_of(page * page_size, page_size), block_k)
        pltpu.make_async_copy(k_rows.at[layer, :, src], kbuf[slot], sem.at[slot]).start()
        pltpu.make_async_copy(v_rows.at[layer, :, src], vbuf[slot], sem.at[slot]).start()
        srow = jnp.minimum(lax.shift_right_logical(page, row_shift), ks_hbm.shape[2] - run_scale_rows)
        for hbm_, buf in ((ks_hbm, ksbuf), (vs_hbm, vsbuf)):
            pltpu.make_async_copy(hbm_.at[layer, :, pl.ds(srow, run_scale_rows)],
                                  buf[slot].at[:, pl.ds(0, run_scale_rows)], sem.at[slot]).start()

    def start_whole(j, slot, run=False):
        """Start every page of block j: a DMA a page and buffer, unrolled, with no branch; or,
        `run` (static, or traced: a branch), `start_run`."""
        if run is True:
            return start_run(j, slot)
        if run is not False:
            return lax.cond(run, lambda: start_run(j, slot), lambda: start_whole(j, slot))
        for p in range(ppb):
            start_page(j, p, slot)

    def start_block(j, slot, go):
        """Start the DMAs of block j's pages in range into `slot` (when `go`): a block wholly in
        range unrolled, with no branch; the first and last blocks of a row in a loop. Returns
        the pages read, int32."""
        p0, p1 = page_range(j)
        n_read = jnp.where(go, p1 - p0, 0)

        def part():
            lax.fori_loop(p0, p0 + n_read, lambda p, c: (start_page(j, p, slot), c)[1], 0)

        lax.cond(go & (n_read == ppb), lambda: start_whole(j, slot, is_run(j)), part)
        return n_read

    def wait_whole(slot, run=False):
        """Wait for a whole block started into `slot`: one wait per buffer (the semaphore counts
        bytes); `run` (static or traced): started by `start_run`, its scale rows fewer."""
        for buf in (kbuf, vbuf) + ((ksbuf, vsbuf) if quantized else ()):
            whole = buf[slot]
            if run is not False and buf in (ksbuf, vsbuf):
                part = buf[slot].at[:, pl.ds(0, run_scale_rows)]
                if run is True:
                    whole = part
                else:
                    pl.when(run)(lambda: pltpu.make_async_copy(part, part, sem.at[slot]).wait())
                    pl.when(~run)(lambda: pltpu.make_async_copy(whole, whole, sem.at[slot]).wait())
                    continue
            pltpu.make_async_copy(whole, whole, sem.at[slot]).wait()

    def wait_block(slot, n_read, run=False):
        """Wait for the `n_read` pages started into `slot`: the semaphore counts bytes, so a whole
        block is one wait per buffer (`run`: its scale rows a run's), a partial one a wait per page."""
        sem_ = sem.at[slot]
        pl.when(n_read == ppb)(lambda: wait_whole(slot, run))

        @pl.when(n_read < ppb)
        def _():
            def one(_, c):
                for buf in (kbuf, vbuf):
                    one_page = buf[slot].at[:, pl.ds(0, page_size)]
                    pltpu.make_async_copy(one_page, one_page, sem_).wait()
                if quantized:
                    for buf in (ksbuf, vsbuf):
                        one_page = scale_dst(buf[slot], 0, page_size)
                        pltpu.make_async_copy(one_page, one_page, sem_).wait()
                return c

            lax.fori_loop(0, n_read, one, 0)

    # Decode unrolls its heads (a block's work for the VLIW scheduler to interleave) and carries
    # their softmax state in the loops; prefill, whose rows are many, loops over the heads and
    # keeps it in VMEM (`slot_scratch`): running max, sum and poison flag in lanes 0-2 of
    # `stats_ref`, P @ V in `acc_ref`.
    unroll_heads = one_token and num_kv_heads <= MAX_UNROLLED_HEADS

    def stat(h, k):
        return stats_ref.at[h, :, pl.ds(k, 1)]  # [rows, 1]: k = 0 max, 1 sum, 2 poison

    if unroll_heads:  # (m, l, acc, bad) a head: [rows, 1], [rows, 1], [rows, D], [rows, 1]
        state0 = tuple((jnp.full((rows, 1), -jnp.inf, f32), jnp.zeros((rows, 1), f32),
                        jnp.zeros((rows, head_dim), f32), jnp.zeros((rows, 1), f32)) for _ in range(num_kv_heads))
    else:
        state0 = ()
        lane = lax.broadcasted_iota(i32, stats_ref.shape, 2)
        stats_ref[...] = jnp.where(lane == 0, -jnp.inf, 0.0).astype(f32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, f32)

    # Per-row constants: token, position and validity of each query row.
    r = lax.broadcasted_iota(i32, (rows, 1), 0)
    t = t_first + lax.div(r, group)  # [rows, 1]
    q_pos = start + t
    row_ok = t < n_valid
    kk = lax.broadcasted_iota(i32, (1, block_k), 1)  # key offset in the block, lanes
    kk_col = lax.broadcasted_iota(i32, (block_k, 1), 0)  # the same, sublanes
    # One query token per program (decode): every row sees the keys [lo, hi), no more, no fewer.
    # V rows zeroed in chunks of whole (8, 128) tiles: 8 rows of 4 bytes, 16 of 2, 32 of 1.
    chunk = math.gcd(block_k, 8 * 4 // jnp.dtype(vbuf[0].dtype).itemsize)
    fold_v = quantized and compute != jnp.dtype(jnp.float16)

    def for_each_head(state, body):
        """`body(h, head h's state)` for every head: unrolled over the carried state (a tuple
        of the new states), or a loop over heads whose state is in VMEM (())."""
        if unroll_heads:
            return tuple(body(h, state[h]) for h in range(num_kv_heads))
        lax.fori_loop(0, num_kv_heads, lambda h, c: (body(h, None), c)[1], 0)
        return ()

    n_read0 = start_block(blk_lo, 0, total > 0)

    def attend_head(h, st, j, slot, mask, in_range, in_range_col, run, offset):
        """Block j (in `slot`) of KV head h into that head's softmax state `st` (returns the new
        one), or (None) into its state in VMEM. `mask` [rows,
        block_k] (None: every row sees every key), `in_range` [1, block_k] and `in_range_col`
        [block_k, 1] the keys in [lo, hi) and not in a hole (None: all)."""
        q = q_ref[h].astype(compute)  # [rows, D]
        k = kbuf[slot][h].astype(compute)  # [block_k, D]
        dots = _dot_t(q, k)  # [rows, block_k] f32
        shifts = None if shifts_ref is None else shifts_ref[pl.ds(j, 1), :]  # [1, ppb] (`scale_shifts`)
        if quantized:
            ks = scale_row(ksbuf[slot].at[h], shifts, page_size, run, offset)
            s = dots * (ks * sm_scale)
        else:
            s = dots * sm_scale
        s_ok = jnp.isfinite(s)
        if soft_cap is not None:
            s = jnp.tanh(s / soft_cap) * soft_cap
        bad_s = jnp.max(jnp.where(masked(mask, ~s_ok), 1.0, 0.0), axis=1, keepdims=True)  # [rows, 1]
        if not quantized:
            v = vbuf[slot][h].astype(compute)  # [block_k, D] (stale rows zeroed by the caller)
        elif fold_v:  # int8 rows are finite and meet a zero weight; stale 8-bit floats may not be
            v = vbuf[slot][h].astype(compute)
            if jnp.issubdtype(vbuf[slot].dtype, jnp.floating) and in_range_col is not None:
                v = jnp.where(in_range_col, v, jnp.zeros((), compute))
        else:  # fp16 q: dequantize the V tile (vq * scale may overflow fp16)
            vs_row = scale_row(vsbuf[slot].at[h], shifts, page_size, run, offset)
            if in_range is not None:
                vs_row = jnp.where(in_range, vs_row, 0.0)
            eye = lax.broadcasted_iota(i32, (block_k, block_k), 0) == lax.broadcasted_iota(i32, (block_k, block_k), 1)
            vs_col = jnp.sum(jnp.where(eye, vs_row, 0.0), axis=1, keepdims=True)  # [block_k, 1], exact
            v = (vbuf[slot][h].astype(f32) * vs_col).astype(compute)
            if in_range_col is not None:
                v = jnp.where(in_range_col, v, jnp.zeros((), compute))
        if fold_v:  # 8-bit values are finite by construction: a row's poison is its scale
            vs = scale_row(vsbuf[slot].at[h], shifts, page_size, run, offset)
            v_ok = jnp.isfinite(vs)
            vs = jnp.where(masked(in_range, v_ok), vs, 0.0)
            bad_blk = jnp.maximum(bad_s, jnp.max(jnp.where(masked(mask, ~v_ok), 1.0, 0.0), axis=1, keepdims=True))
        elif one_token:  # every row attends exactly the V rows in range: P @ V itself finds a
            bad_blk = bad_s  # non-finite one (x * NaN = NaN, 0 * inf = NaN), checked at the end
        else:  # a V row may be attended by some rows only: zero non-finite rows, poison those rows
            v_ok_col = jnp.min(jnp.where(jnp.isfinite(v.astype(f32)), 1.0, 0.0), axis=1, keepdims=True) > 0.5
            v = jnp.where(v_ok_col, v, jnp.zeros((), compute))
            if mask is None:  # every row attends every V row: a non-finite one poisons them all
                bad_blk = jnp.maximum(bad_s, jnp.max(jnp.where(v_ok_col, 0.0, 1.0)))
            else:
                bad_v = jnp.where(in_range_col & ~v_ok_col, 1.0, 0.0).astype(jnp.bfloat16)  # [block_k, 1]
                hit = lax.dot_general(jnp.where(mask, 1.0, 0.0).astype(jnp.bfloat16), bad_v, (((1,), (0,)), ((), ())),
                                      preferred_element_type=f32)  # [rows, 1], exact: sums of 0 / 1 products
                bad_blk = jnp.maximum(bad_s, jnp.where(hit > 0.5, 1.0, 0.0))
        s = jnp.where(masked(mask, s_ok), s, -jnp.inf)
        m_prev, l_prev, acc_prev, bad_prev = st if st is not None else (
            stat(h, 0)[...], stat(h, 1)[...], acc_ref[h], stat(h, 2)[...])
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        m_safe = jnp.where(m_next == -jnp.inf, 0.0, m_next)  # rows that saw no key yet
        alpha = jnp.exp(m_prev - m_safe)
        p = jnp.exp(s - m_safe)  # 0 where masked
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        if fold_v:
            p = p * vs
        acc = acc_prev * alpha + _dot(p.astype(compute), v)
        bad = jnp.maximum(bad_prev, bad_blk)
        if st is not None:
            return m_next, l_next, acc, bad
        stat(h, 0)[...], stat(h, 1)[...], acc_ref[h], stat(h, 2)[...] = m_next, l_next, acc, bad

    def step(carry, fast: bool, slot, mode=None):
        """One block of every head, its buffers in `slot` (i % 2 for block i of the row: a static
        int in decode, traced in prefill, `Slots`): start the next block's DMAs, wait for this
        one's, attend. `fast`: the steady state (`in_fast`): this block seen whole by every
        query row and hole-free, the next one whole; no mask, the next block issued unrolled
        after this one's reads, so that the VLIW scheduler overlaps that issue with this
        block's vector work. Otherwise the general case: any block, the next issued page by
        page when partial, holes fixed, stale V rows zeroed, masks.
        `mode` (fast steps): "pages" or "runs", this block and the next both read so (`is_run`);
        None: each block as `is_run` says (a whole block only), a branch."""
        state, j, n_read, i = carry
        j_next = j + 1
        if not runs:
            run, run_next = False, False
        elif mode is not None:
            run = run_next = mode == "runs"
        else:
            run, run_next = is_run(j) & (n_read == ppb), is_run(j_next)
        if fast:
            wait_whole(slot, run)
        else:
            n_read_next = start_block(j_next, 1 - slot, i + 1 < total)
            wait_block(slot, n_read, run)
        kpos = j * block_k + kk  # [1, block_k]
        kpos_col = j * block_k + kk_col  # [block_k, 1]
        # Keys this program's queries may attend; None: all of the block's (a fast step's block is
        # whole, and every valid query row sees every key of it: no mask to build or apply).
        in_range = None if fast else (kpos >= lo) & (kpos < hi)

        def fix_hole(p, dead):
            """A hole's keys are masked and its V rows zeroed, every head's (its slot holds another page's)."""
            hole = page_map_ref[b * max_pages + j * ppb + p] < 0  # (p is inside [lo, hi): in the table)

            @pl.when(hole)
            def _():
                dst = vbuf[slot].at[:, pl.ds(pl.multiple_of(p * page_size, page_size), page_size)]
                copy = pltpu.make_async_copy(zero_page_hbm, dst, sem.at[slot])
                copy.start()
                copy.wait()

            return jnp.where(hole & (kk >= p * page_size) & (kk < (p + 1) * page_size), 1, dead)

        if not fast:
            p0, p1 = page_range(j)
            # Only a block before the row's last hole may hold one (`hole_end`).
            dead = lax.fori_loop(p0, jnp.where(j * block_k < hole_end, p1, p0), fix_hole, jnp.zeros((1, block_k), i32))
            in_range &= dead == 0
        in_range_col = None if fast else (kpos_col >= lo) & (kpos_col < hi)  # (holes' V rows are zeros)

        if fast:
            mask = None  # (rows past the row's tokens see every key too: their output is zeroed)
        elif one_token:
            mask = jnp.broadcast_to(in_range, (rows, block_k))
        else:
            mask = in_range & (kpos <= q_pos) & row_ok  # [rows, block_k]
            if window is not None:
                mask &= kpos > q_pos - window

        if not quantized and not fast:
            # Rows outside [lo, hi) hold stale data (or nothing): zero them, in place, every
            # head's, in the blocks that have any (a window's first block, a row's last).
            def zero_chunk(c, carry):
                r0 = pl.multiple_of(c * chunk, chunk)
                pos = j * block_k + r0 + lax.broadcasted_iota(i32, (chunk, 1), 0)
                keep = (pos >= lo) & (pos < hi)
                for h in range(num_kv_heads):
                    rows_v = vbuf[slot][h, pl.ds(r0, chunk)]
                    vbuf[slot][h, pl.ds(r0, chunk)] = jnp.where(keep, rows_v, jnp.zeros((), rows_v.dtype))
                return carry

            # The chunks holding a row at or past hi (a row's last block), then those holding
            # a row before lo (a window's first block); none in an interior block.
            tail = lax.div(jnp.clip(hi - j * block_k, 0, block_k), chunk)  # the first chunk past hi
            lax.fori_loop(0, block_k // chunk - tail, lambda c, carry: zero_chunk(tail + c, carry), 0)
            lax.fori_loop(0, lax.div(jnp.clip(lo - j * block_k, 0, block_k) + chunk - 1, chunk), zero_chunk, 0)

        offset = run_offset(j) if runs and run is not False else None  # (a run's scales: `run_lanes`)
        state = for_each_head(state, lambda h, st: attend_head(h, st, j, slot, mask, in_range, in_range_col, run, offset))
        if fast:
            # The next block (whole: `in_fast` said so), issued after this block's reads.
            start_whole(j_next, 1 - slot, run_next)
            n_read_next = jnp.int32(ppb)

        return state, j_next, n_read_next, i + 1

    # The blocks a fast step may serve: block j whole (every key inside [lo, hi)), j in
    # [j_whole, j_whole_end), and seen whole by every query row: no key past the first query's
    # position, none before the last query's window (decode: the same blocks); and the block
    # after j whole too (its DMAs are issued unrolled). So j in [fast_lo, fast_lo + fast_count).
    j_whole = lax.div(lo + block_k - 1, block_k)
    j_whole_end = jnp.maximum(lax.div(hi, block_k), j_whole)
    fast_lo = j_whole
    fast_end = jnp.minimum(j_whole_end, lax.div(jnp.maximum(start + t_first + 1, 0), block_k))
    if window is not None:
        fast_lo = jnp.maximum(fast_lo, lax.div(jnp.maximum(start + t_last - window + 1, 0) + block_k - 1, block_k))
    # A block holding a hole is not fast: none at or past the row's last hole (`hole_end`).
    fast_lo = jnp.maximum(fast_lo, lax.div(hole_end + block_k - 1, block_k))
    fast_count = jnp.maximum(jnp.minimum(fast_end, j_whole_end - 1) - fast_lo, 0).astype(jnp.uint32)

    use_fast_loop = FAST_LOOP if fast_loop is None else fast_loop

    def in_fast(j):
        """Block j may take the fast step (an unsigned compare)."""
        return (j - fast_lo).astype(jnp.uint32) < fast_count

    def fast_one(carry):
        """The next block may take the fast step (the block after it exists: `in_fast`)."""
        _, j, _, i = carry
        return in_fast(j) & (i + 1 < total)

    def fast_two(carry):
        """The next two blocks may take the fast step."""
        _, j, _, i = carry
        return in_fast(j) & in_fast(j + 1) & (i + 2 < total)

    def three_runs(carry, want: bool):
        """The next three blocks (an iteration of two reads two and starts the third) all are
        (`want`) or all are not runs (`is_run`)."""
        j = carry[1]
        flags = [is_run(j + d) for d in range(3)]
        return (flags[0] & flags[1] & flags[2]) if want else ~(flags[0] | flags[1] | flags[2])

    def lone_block(slot: int, carry):
        """Block i (i % 2 == slot) alone: the fast step when it may take it, else the general one."""
        if not use_fast_loop:
            return step(carry, False, slot)
        return lax.cond(fast_one(carry), lambda c: step(c, True, slot), lambda c: step(c, False, slot), carry)

    def static_slots(carry):
        """Decode (slots of their own, static numbers), from an even block i: blocks i and i + 1
        alone (slots 0 and 1), then the steady state, two blocks an iteration (slots 0 then 1)."""
        carry = lone_block(0, carry)
        carry = lax.cond(carry[-1] < total, functools.partial(lone_block, 1), lambda c: c, carry)
        if use_fast_loop and runs:  # blocks read a DMA a page, then blocks of runs
            for mode in ("pages", "runs"):
                carry = lax.while_loop(lambda c, m=mode: fast_two(c) & three_runs(c, m == "runs"),
                                       lambda c, m=mode: step(step(c, True, 0, m), True, 1, m), carry)
        elif use_fast_loop:
            carry = lax.while_loop(fast_two, lambda c: step(step(c, True, 0), True, 1), carry)
        return carry

    def traced_slots(carry):
        """Prefill (both slots one allocation: a block's slot is i % 2, traced): the general step,
        then the steady state, a block an iteration. Its code is half the static slots' (one
        general step, not one per slot), and a chunk's blocks are MXU-bound rather than
        issue-bound."""
        carry = step(carry, False, carry[-1] % 2)
        if use_fast_loop:
            carry = lax.while_loop(fast_one, lambda c: step(c, True, c[-1] % 2), carry)
        return carry

    state = lax.while_loop(lambda carry: carry[-1] < total, static_slots if one_token else traced_slots,
                           (state0, blk_lo, n_read0, jnp.int32(0)))[0]

    def write_out(h, st):
        _, l_h, acc, bad = st if st is not None else (None, stat(h, 1)[...], acc_ref[h], stat(h, 2)[...])
        seen = l_h != 0  # a seen key adds exp(0) = 1 to its row's sum
        out = jnp.where(seen, acc / jnp.where(seen, l_h, 1.0), 0.0)
        poisoned = bad > 0.5
        if one_token and not fold_v:
            poisoned |= jnp.max(jnp.where(jnp.isfinite(acc), 0.0, 1.0), axis=1, keepdims=True) > 0.5
        out = jnp.where(poisoned, jnp.nan, out)
        o_ref[h] = jnp.where(row_ok, out, 0.0).astype(o_ref.dtype)
        return st

    for_each_head(state, write_out)


def scale_views(scales, page_size: int | None = None):
    """An 8-bit arena's scales as the kernels index them (`[layer, :, page or row]`: every KV
    head's in one strided DMA). Pages of 128 or more: [L, Hkv, P, S] as they are. Smaller pages:
    scale rows [L, Hkv, P * S / 128, 128] (`scale_rows`), the rows themselves or made from
    [L, Hkv, P, S] (a reshape: on a TPU a relayout of the whole array). None stays None."""
    if scales is None or page_size is None or page_size % 128 == 0:
        return scales
    return scales.reshape(*scales.shape[:2], -1, 128)


def scale_bytes(page_size: int) -> int:
    """Bytes of K and V scales a page's DMAs move: its rows, or the two 512-byte scale rows holding it."""
    return 2 * 4 * (page_size if page_size % 128 == 0 else 128)


def scale_shape(block_k: int, page_size: int, num_kv_heads: int) -> tuple:
    """One slot of an 8-bit scale (K or V) in VMEM, every KV head's: a `[1, block_k]` lane row a
    head when a page's scales are whole lane tiles (page_size % 128 == 0), each page's row DMA'd
    straight into its lanes; else a scale row a page, `[pages, 128]` a head (`scale_rows`: each
    page's row holds it and 128 / S - 1 other pages' scales), its lanes taken out when read
    (`scale_lanes`)."""
    return (num_kv_heads,) + ((1, block_k) if page_size % 128 == 0 else (block_k // page_size, 128))


def scale_dst(buf, p, page_size: int):
    """Where page p of a block lands in a scale slot (`scale_shape`), every head's: its lanes of
    the lane rows, or its rows."""
    if page_size % 128 == 0:
        return buf.at[:, :, pl.ds(pl.multiple_of(p * page_size, page_size), page_size)]
    return buf.at[:, pl.ds(p, 1)]


def scale_row(buf, shifts, page_size: int, run=False, offset=None):
    """A scale slot's scales of one head (`scale_shape`, less its head dim) as one `[1, block_k]` lane row; scale rows
    (`scale_lanes`) need the block's `shifts`; `run` (static, or traced: both computed, one
    selected): the slot holds a run's scale rows from lane `offset` on (`run_lanes`)."""
    if page_size % 128 == 0:
        return buf[...]
    if run is True:
        return run_lanes(buf, page_size, offset)
    lanes = scale_lanes(buf[...], shifts, page_size)
    return lanes if run is False else jnp.where(run, run_lanes(buf, page_size, offset), lanes)


def run_lanes(buf, page_size: int, offset):
    """A scale slot `[pages, 128]` holding a run's scale rows in its first `n + 1` rows (`n =
    pages * S / 128`, `start_run`): side by side they hold the run's pages in order from lane
    `offset` (its first page's place in its row: (page % (128 / S)) * S, traced). The block's lane
    row `[1, pages * S]`: the rows rotated left by `offset` lanes (one rotation of n + 1 <= 8
    sublanes), lane row i taking row i's first 128 - offset lanes and row i + 1's last offset."""
    n = buf.shape[0] * page_size // 128
    rows = pltpu.roll(buf[pl.ds(0, n + 1), :], (128 - offset) % 128, 1)  # [n + 1, 128]
    own = lax.broadcasted_iota(jnp.int32, (1, 128), 1) < 128 - offset
    return jnp.concatenate([jnp.where(own, rows[r:r + 1], rows[r + 1:r + 2]) for r in range(n)], axis=1)


def run_blocks(page_map, page_size: int, num_pages: int, pages_per_block: int):
    """i32[B * blocks] (blocks = ceil(M / pages_per_block)): 1 where a row's block of
    `pages_per_block` table entries is a run: pages p0, p0 + 1, ..., p0 + ppb - 1, and the
    ppb * S / 128 + 1 scale rows from p0's inside the arena's (128 / S pages a row). The attention
    kernel reads such a block in one DMA a buffer (`start_run`); a trailing partial block is never
    a run."""
    rows, width = page_map.shape
    ppb, per_row = pages_per_block, 128 // page_size
    whole = width // ppb
    pm = page_map[:, :whole * ppb].astype(jnp.int32).reshape(rows, whole, ppb)
    first = pm[..., 0]
    run = jnp.all(pm == first[..., None] + jnp.arange(ppb, dtype=jnp.int32), axis=-1)
    run &= (first >= 0) & (first // per_row + ppb // per_row + 1 <= num_pages // per_row)
    run = jnp.pad(run, ((0, 0), (0, -(-width // ppb) - whole)))
    return run.astype(jnp.int32).reshape(-1)


def row_pages(arena):
    """[L, Hkv, P, S, D] -> [L, Hkv, P * S, D]: an arena as rows, where a run of pages is one
    slice a head (`start_run`). A bitcast on a TPU at `RUN_PAGE_SIZES`."""
    num_layers, num_kv_heads, num_pages, page_size, head_dim = arena.shape
    return arena.reshape(num_layers, num_kv_heads, num_pages * page_size, head_dim)


def scale_shifts(page_map, page_size: int, num_pages: int, pages_per_block: int):
    """i32[B, blocks, pages_per_block]: for scale rows (`scale_rows`), how far (in pages, mod
    128 / S) each page's scales must rotate within its row to sit at its place in a 128-lane row
    of the block's scales: (i % G - page % G) mod G for the block's page i (G = 128 / S; unmapped
    or padded entries read a clipped page, their keys are masked)."""
    per_row = 128 // page_size
    rows, width = page_map.shape
    blocks = -(-width // pages_per_block)
    pm = jnp.pad(page_map.astype(jnp.int32), ((0, 0), (0, blocks * pages_per_block - width)))
    page = jnp.minimum(pm.astype(jnp.uint32), jnp.uint32(num_pages - 1)).astype(jnp.int32)
    i = jnp.arange(blocks * pages_per_block, dtype=jnp.int32) % pages_per_block  # the page's place in its block
    return ((i - page) & (per_row - 1)).reshape(rows, blocks, pages_per_block)


def scale_lanes(rows, shifts, page_size: int):
    """rows f32[n, 128], row i the scale row of a block's page i (page p's scales at lanes
    (p % G) * S onward, G = 128 / S), shifts i32[1, n] (`scale_shifts`) -> f32[1, n * S], page
    i's scales at lanes [i * S, (i + 1) * S). Each row is rotated by its shift (a rotation by
    S, 2S, 4S, ... per bit of it), so that its page's lanes land at (i % G) * S; the other lanes
    are zeroed and each G rows summed into one row of 128 lanes (pages i to i + G - 1)."""
    n = rows.shape[0]
    per_row = 128 // page_size
    i32 = jnp.int32
    shift = jnp.transpose(shifts)  # [n, 1]
    out = rows
    for bit in range((per_row - 1).bit_length()):
        out = jnp.where((shift & (1 << bit)) != 0, pltpu.roll(out, (1 << bit) * page_size, 1), out)
    row = lax.broadcasted_iota(i32, (n, 128), 0)
    lane = lax.broadcasted_iota(i32, (n, 128), 1)
    out = jnp.where(lax.div(lane, page_size) == (row & (per_row - 1)), out, 0.0)
    sums = [jnp.sum(out[r:r + per_row], axis=0, keepdims=True) for r in range(0, n, per_row)]
    lanes = sums[0] if len(sums) == 1 else jnp.concatenate(sums, axis=1)
    return lanes if n % per_row == 0 else lanes[:, :n * page_size]


class Slots:
    """A buffer's two VMEM slots: `slots[s]` is slot s's ref. Either each slot an allocation of
    its own (s a static int: a DMA into one slot then waits for no read of the other; libtpu's
    scheduler orders the accesses of one allocation) or both one `[2, ...]` allocation (s may
    be traced)."""

    def __init__(self, refs):
        self.refs = refs  # a (slot 0, slot 1) tuple, or one ref [2, ...]

    def __getitem__(self, slot):
        return self.refs[slot] if isinstance(self.refs, tuple) else self.refs.at[slot]

    @staticmethod
    def of(scratch, static: bool) -> list:
        """`slot_scratch`'s buffers (K, V, then 8-bit scales) as Slots."""
        if static:
            return [Slots((scratch[i], scratch[i + 1])) for i in range(0, len(scratch), 2)]
        return [Slots(ref) for ref in scratch]


def slot_scratch(block_k: int, head_dim: int, dtype, page_size: int, quantized: bool, static: bool,
                 num_kv_heads: int, rows: int) -> list:
    """A kernel body's VMEM scratch: two slots of K and of V `[Hkv, block_k, D]` (8-bit: and of
    their scales, `scale_shape`; `Slots.of` reads them back), `static`: each slot an allocation
    of its own (decode: the slots are static numbers), else both slots one allocation; then each
    head's softmax state for `rows` query rows, float32: running max, sum and poison flag in lanes
    0-2 of `[Hkv, rows, 128]` (three `[rows, 1]` arrays would each take as much), P @ V
    `[Hkv, rows, D]`."""
    shapes = [(num_kv_heads, block_k, head_dim)] * 2 + ([scale_shape(block_k, page_size, num_kv_heads)] * 2
                                                         if quantized else [])
    dtypes = [dtype] * 2 + [jnp.float32] * 2
    if static:
        slots = [pltpu.VMEM(shape, dt) for shape, dt in zip(shapes, dtypes) for _ in range(2)]
    else:
        slots = [pltpu.VMEM((2, *shape), dt) for shape, dt in zip(shapes, dtypes)]
    state = [pltpu.VMEM((num_kv_heads, rows, d), jnp.float32) for d in (128, head_dim)]
    return slots + state


def hole_ends(page_map, lengths, page_size: int):
    """i32[B]: where each row's last unmapped page (-1) below its length ends, in keys; 0 when
    the row has none. The kernels' steady-state loop takes no block before it."""
    lp = jnp.arange(page_map.shape[1], dtype=jnp.int32)
    hole = (page_map < 0) & (lp * page_size < lengths[:, None])
    return jnp.max(jnp.where(hole, (lp + 1) * page_size, 0), axis=1).astype(jnp.int32)


def grouped(q, row_blocks: int, block_tokens: int, num_kv_heads: int):
    """[R, T, Hq, D] -> [R, Hkv, T_pad * G, D] (T_pad = row_blocks * block_tokens): row r of a
    head's block is token r // G, head r % G (GQA packing)."""
    rows, tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    qg = q.reshape(rows, tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, row_blocks * block_tokens - tokens), (0, 0), (0, 0)))
    return qg.reshape(rows, num_kv_heads, row_blocks * block_tokens * group, head_dim)


def ungrouped(out, tokens: int, num_q_heads: int):
    """`grouped`'s inverse: [R, Hkv, T_pad * G, D] -> [R, tokens, Hq, D]."""
    rows, num_kv_heads, padded, head_dim = out.shape
    group = num_q_heads // num_kv_heads
    out = out.reshape(rows, num_kv_heads, padded // group, group, head_dim)[:, :, :tokens]
    return out.transpose(0, 2, 1, 3, 4).reshape(rows, tokens, num_q_heads, head_dim)


def check_geometry(num_q_heads: int, k_arena, k_scale, q_dtype, scale_rows: bool = False) -> None:
    """A ValueError unless the TPU kernels take this q head count, arena and q dtype
    (`scale_rows`: the 8-bit scales come as rows of 128 lanes)."""
    _, num_kv_heads, _, page_size, head_dim = k_arena.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads, not a multiple of the arena's {num_kv_heads} KV heads")
    reason = tpu_unsupported_reason(head_dim=head_dim, page_size=page_size, dtype=k_arena.dtype,
                                    scale_dtype=None if k_scale is None else k_scale.dtype, q_dtype=q_dtype,
                                    scale_rows=scale_rows)
    if reason:
        raise ValueError(reason)


def _meta(layer, num_layers: int, sliding_window, logits_soft_cap, max_keys: int):
    """The kernel's i32[2] (layer clipped into range, window), after checking the options."""
    if isinstance(sliding_window, (bool, float)) or (isinstance(sliding_window, int) and sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int, a traced integer scalar or None, got {sliding_window!r}")
    if sliding_window is not None and not isinstance(sliding_window, int):
        w = jnp.asarray(sliding_window)
        if w.shape != () or not jnp.issubdtype(w.dtype, jnp.integer):
            raise ValueError(f"sliding_window must be an integer scalar, got shape {w.shape} dtype {w.dtype}")
    if logits_soft_cap is not None and not (isinstance(logits_soft_cap, (int, float)) and logits_soft_cap > 0):
        raise ValueError(f"logits_soft_cap must be a positive float or None, got {logits_soft_cap!r}")
    window = jnp.int32(0) if sliding_window is None else _window_value(sliding_window, max_keys)
    return jnp.stack([jnp.clip(layer[0], 0, num_layers - 1), window]).astype(jnp.int32)


def _window_value(sliding_window, max_keys: int):
    """The window as the kernel's int32 scalar, clipped into [0, max_keys] (same mask)."""
    if isinstance(sliding_window, int):
        return jnp.int32(max(0, min(sliding_window, max_keys)))
    return jnp.clip(jnp.asarray(sliding_window), 0, max_keys).astype(jnp.int32)


def reads_runs(*, quantized: bool, page_size: int, block_k: int, block_tokens: int, num_pages: int) -> bool:
    """Whether a call reads runs of pages one DMA a buffer (`run_blocks`): decode over
    8-bit scale rows at `RUN_PAGE_SIZES`, blocks of whole scale rows, an arena holding a run's
    pages and scale rows (a block's pages and a scale row's more: `start_run`'s clipped indices
    then stay in range)."""
    return (RUNS and quantized and block_tokens == 1 and page_size in RUN_PAGE_SIZES and block_k % 128 == 0
            and num_pages >= block_k // page_size + 128 // page_size)


@functools.partial(jax.jit, static_argnames=("sm_scale", "has_window", "window_bound", "soft_cap", "tiles", "interpret",
                                             "fast_loop", "runs"))
def _tpu_attention_call(q, k_arena, v_arena, meta, page_map, lengths, num_tokens, k_scale, v_scale, *, sm_scale,
                        has_window, window_bound, soft_cap, tiles, interpret, fast_loop=True, runs=False):
    batch, tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    max_pages = page_map.shape[1]
    block_k, block_tokens = tiles.block_k, tiles.block_tokens
    row_blocks = -(-tokens // block_tokens)
    rows = block_tokens * group
    quantized = k_scale is not None
    qg = grouped(q, row_blocks, block_tokens, num_kv_heads)  # [B, Hkv, T_pad * G, D]

    compute = jnp.dtype(q.dtype)
    kernel = functools.partial(
        _attention_kernel, quantized=quantized, sm_scale=sm_scale, has_window=has_window, soft_cap=soft_cap,
        block_tokens=block_tokens, group=group, tokens=tokens, max_pages=max_pages, compute=compute,
        num_kv_heads=num_kv_heads, num_pages=k_arena.shape[2], fast_loop=fast_loop)
    if runs:  # one more scalar table (`run_blocks`) and the arenas as rows (`row_pages`) after the scale shifts
        def kernel(meta_ref, lengths_ref, num_tokens_ref, page_map_ref, hole_end_ref, run_ref, *refs, body=kernel):
            # refs: q, K, V, zero page, K / V scale rows, scale shifts, K / V rows, then the output and scratch
            body(meta_ref, lengths_ref, num_tokens_ref, page_map_ref, hole_end_ref, *refs[:7], *refs[9:],
                 run_ref=run_ref, row_views=refs[7:9])
    hbm = pl.BlockSpec(memory_space=pl.ANY)
    q_spec = pl.BlockSpec((None, num_kv_heads, rows, head_dim), lambda b, rb, *_: (b, 0, rb, 0))
    scratch = slot_scratch(block_k, head_dim, k_arena.dtype, page_size, quantized, static=block_tokens == 1,
                           num_kv_heads=num_kv_heads, rows=rows)
    scratch.append(pltpu.SemaphoreType.DMA((2,)))
    in_specs = [q_spec, hbm, hbm, hbm]
    extra = ()
    if quantized:
        in_specs += [hbm, hbm]
        extra = (scale_views(k_scale, page_size), scale_views(v_scale, page_size))
        if page_size % 128:
            shifts = scale_shifts(page_map, page_size, k_arena.shape[2], block_k // page_size)
            in_specs.append(pl.BlockSpec((None, *shifts.shape[1:]), lambda b, rb, *_: (b, 0, 0)))
            extra += (shifts,)
    zero_page = jnp.zeros((num_kv_heads, page_size, head_dim), k_arena.dtype)
    prefetch = [meta, lengths, num_tokens, page_map.reshape(-1), hole_ends(page_map, lengths, page_size)]
    if runs:
        prefetch.append(run_blocks(page_map, page_size, k_arena.shape[2], block_k // page_size))
        in_specs += [hbm, hbm]
        extra += (row_pages(k_arena), row_pages(v_arena))
    blocks = FAST_BLOCKS if block_tokens == 1 else 1  # an iteration of the steady-state loop
    name = f"tpu_paged_attention_bt{block_tokens}_g{group}_bk{block_k}x{blocks}_h{num_kv_heads}_d{head_dim}"
    if quantized:
        name += f"_{jnp.dtype(k_arena.dtype).name}"
    if runs:
        name += "_runs"
    # The DMA plan at its workload bound (every row at the page table's full length; with a
    # static window, the window's pages plus one for alignment), for XLA's scheduler and cost
    # analysis: pages read per (program, head), each K and V (and scale rows).
    keys = max_pages * page_size if not has_window or window_bound is None else min(
        max_pages * page_size, window_bound + block_tokens - 1)
    pages_read = min(max_pages, -(-keys // page_size) + (1 if has_window else 0))
    n_blocks = -(-(pages_read * page_size) // block_k) + (1 if has_window else 0)
    page_bytes = 2 * page_size * head_dim * jnp.dtype(k_arena.dtype).itemsize + (scale_bytes(page_size) if quantized else 0)
    programs = batch * row_blocks * num_kv_heads
    cost = pl.CostEstimate(
        flops=int(4 * programs * rows * n_blocks * block_k * head_dim),
        transcendentals=int(programs * rows * n_blocks * block_k),
        bytes_accessed=int(programs * pages_read * page_bytes + 2 * qg.size * qg.dtype.itemsize),
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=(batch, row_blocks),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=scratch,
        ),
        out_shape=jax.ShapeDtypeStruct(qg.shape, q.dtype),
        # Every index the kernel forms is clipped into range (pages, heads, layer): Mosaic's
        # runtime bounds checks (two per DMA) would only cost issue slots.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"), disable_bounds_checks=True),
        interpret=interpret,
        name=name,
        cost_estimate=cost,
    )(*prefetch, qg, k_arena, v_arena, zero_page, *extra)
    return ungrouped(out, tokens, num_q_heads)


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
    [L, Hkv, P, S] at pages of 128 or 256; at pages of 16, 32 or 64 as scale rows
    [L, Hkv, P * S / 128, 128] (`scale_rows`), the only form a TPU DMA can read a page's
    scales from. `interpret`: None (compile on a TPU, TPU interpret mode elsewhere), True,
    or a `pltpu.InterpretParams`. `block_sizes`: `block_k` (or `pages_per_block`) and
    `block_tokens` are used; the GPU-only fields are ignored. Returns [B, T, Hq, D] in q's dtype.
    """
    (ks, rows_k), (vs, rows_v) = logical_scales(k_arena, k_scale), logical_scales(k_arena, v_scale)
    num_layers, num_kv_heads, _, page_size, head_dim = check_arena(k_arena, v_arena, ks, vs)
    check_tokens("q", q, batch=None, heads=None, head_dim=head_dim)
    batch, tokens, num_q_heads, _ = q.shape
    check_geometry(num_q_heads, k_arena, k_scale, q.dtype, scale_rows=rows_k and rows_v)
    layer = check_layer(layer, num_layers)
    page_map, lengths, num_tokens = check_rows(page_map, lengths, num_tokens, batch)
    meta = _meta(layer, num_layers, sliding_window, logits_soft_cap, page_map.shape[1] * page_size)
    tiles = TpuAttentionTiles.choose(tokens=tokens, group=num_q_heads // num_kv_heads, page_size=page_size,
                                     max_pages=page_map.shape[1], block_sizes=block_sizes, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, itemsize=jnp.dtype(q.dtype).itemsize,
                                     arena_itemsize=jnp.dtype(k_arena.dtype).itemsize)
    runs = reads_runs(quantized=k_scale is not None, page_size=page_size, block_k=tiles.block_k,
                      block_tokens=tiles.block_tokens, num_pages=k_arena.shape[2])
    run_flags = batch * -(-page_map.shape[1] // (tiles.block_k // page_size)) if runs else 0  # (`run_blocks`)
    check_smem_tables(f"page_map [{batch}, {page_map.shape[1]}]", page_map.size + 3 * batch + 2 + run_flags)
    return _tpu_attention_call(
        q, k_arena, v_arena, meta, page_map, lengths, num_tokens, k_scale, v_scale,
        sm_scale=float(head_dim**-0.5 if sm_scale is None else sm_scale), has_window=sliding_window is not None,
        window_bound=sliding_window if isinstance(sliding_window, int) else None,
        soft_cap=None if logits_soft_cap is None else float(logits_soft_cap), tiles=tiles,
        interpret=resolve_tpu_interpret(interpret), fast_loop=FAST_LOOP, runs=runs,
    )
