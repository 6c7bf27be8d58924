"""Paged decode attention written for Mosaic GPU (Pallas `plgpu`, Hopper: TMA + wgmma).

EXPERIMENTAL, opt-in (`backend="mosaic"`), never run on a GPU: what is and is not verified is
in pallas_kernels/README.md ("Mosaic GPU decode kernel"). Contract:
`pallas_kernels.reference.paged_attention_reference`, restricted to decode.

One program per (batch row b, KV head h), one warpgroup. The group's G query heads (GQA,
packed: K/V are read once per group) are padded to a 64-row tile, wgmma's M. A pipeline
(`plgpu.emit_pipeline`) streams the row's whole live pages, one page per step, `stages()` TMA
copies in flight: the step-i block of K and of V is page `page_map[b, i]` of the arena, read
by the BlockSpecs' index maps (the arena viewed as [layers * kv_heads * pages, page_size,
head_dim], a free reshape; the layer's offset is added to the page ids first). The pipeline's
grid is the row's count of whole live pages, so no page past the length is read.
Per step: s = q @ k^T (wgmma, f32 accumulator), online softmax in f32, p stored to shared
memory in q's dtype, o += p @ v (wgmma). An unmapped page (-1) inside the length reads a
stand-in page and its step is discarded with a select (stale NaN never reaches the output).
The partly live last page (length % page_size keys) is done in plain jnp (`_tail_page`, one
page per row: dead keys and values masked with `where`, since TMA copies whole pages and a
stale NaN must not meet a zero weight), and the two parts merge by log-sum-exp like the
Triton kernel's splits.

Takes (`mosaic_unsupported_reason`): decode (one query token per row), bfloat16 / float16
arenas with q in the same dtype, head_dim 64, 128, 192 or 256, page_size 16, 32, 64 or 128
(wgmma's contraction over a page: a 32/64/128-byte swizzle), up to 64 query heads per KV head.
Not: prefill, 8-bit arenas, float32, sliding windows, soft-capping (use backend="pallas" or
"reference").
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import check_arena, check_layer, check_rows, check_tokens
from pallas_kernels.gpu.attention import _merge_splits
from pallas_kernels.quant import is_quantized

try:  # the Mosaic GPU Pallas API (JAX >= 0.5; this kernel is written against 0.10 / 0.11)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover - very old JAX
    plgpu = None

__all__ = ["mosaic_paged_decode", "mosaic_unsupported_reason", "interpret_params", "interpret_available", "stages", "ROWS", "HEAD_DIMS",
           "PAGE_SIZES"]

ROWS = 64  # wgmma's M: the query tile, G real rows padded
MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
HEAD_DIMS = (64, 128, 192, 256)  # wgmma contracts q . k over head_dim in 64-element (128-byte) groups
PAGE_SIZES = (16, 32, 64, 128)  # p . v contracts over a page: a 32 / 64 / 128-byte swizzle
SMEM_BUDGET = 200 * 1024  # bytes per CTA the kernel plans for (an H100 allows 227 KiB)


def stages(page_size: int, head_dim: int, itemsize: int = 2) -> int:
    """Pages in flight per program (TMA double/triple buffering of K and V), within SMEM_BUDGET
    next to q, p and the float32 output tile."""
    fixed = ROWS * head_dim * (itemsize + 4) + ROWS * page_size * itemsize + 2 * ROWS * 4
    per_stage = 2 * page_size * head_dim * itemsize
    return max(1, min(3, (SMEM_BUDGET - fixed) // per_stage))


def mosaic_unsupported_reason(*, head_dim, page_size, group, dtype, tokens: int = 1, q_dtype=None,
                              quantized: bool = False, sharded: bool = False, interpret: bool | None = None,
                              **options) -> str | None:
    """Why backend="mosaic" cannot take this call (naming the backend that can), or None.

    `options` are the attention options of the call (sliding_window=, ...): any that is set
    (not None / False) is refused by name, so options added to `aj.attend` later are refused
    here until this kernel learns them. `interpret` (None: off a GPU) needs Mosaic GPU's
    interpret mode to run this kernel (`interpret_available`).
    """
    other = "use backend='pallas' or 'reference'"
    if plgpu is None:
        return f"this JAX ({jax.__version__}) has no Pallas Mosaic GPU API (jax.experimental.pallas.mosaic_gpu); {other}"
    if sharded:
        return f"backend='mosaic' does not take a sharded cache yet; {other}"
    if tokens != 1:
        return f"backend='mosaic' is decode only (one query token per row, got {tokens}); {other} for prefill"
    if quantized or jnp.dtype(dtype) not in MOSAIC_DTYPES:
        kind = "8-bit arenas" if quantized else f"{jnp.dtype(dtype).name} arenas"
        return f"backend='mosaic' takes bfloat16 / float16 arenas, not {kind}; {other}"
    if q_dtype is not None and jnp.dtype(q_dtype) != jnp.dtype(dtype):
        return (f"backend='mosaic' needs q in the arena's dtype {jnp.dtype(dtype).name}, got "
                f"{jnp.dtype(q_dtype).name}; {other}")
    for name, value in options.items():
        if value is not None and value is not False:
            return f"backend='mosaic' does not take {name}={value!r}; {other}"
    if head_dim not in HEAD_DIMS:
        return f"backend='mosaic' takes head_dim in {HEAD_DIMS}, got {head_dim}; {other}"
    if page_size not in PAGE_SIZES:
        return f"backend='mosaic' takes page_size in {PAGE_SIZES}, got {page_size}; {other}"
    if group is not None and not 1 <= group <= ROWS:
        return f"backend='mosaic' takes up to {ROWS} query heads per KV head, got {group}; {other}"
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if interpret and not interpret_available():
        return (f"backend='mosaic' off a GPU runs Mosaic GPU's interpret mode, which JAX {jax.__version__} cannot "
                f"run for this kernel (JAX >= 0.11 can); {other}")
    return None


def interpret_available() -> bool:
    """Whether Mosaic GPU's interpret mode runs this kernel: JAX >= 0.11 (where it is public as
    `plgpu.InterpretGPUParams`). JAX 0.10's interpreter has the class but cannot take the
    transposed K operand of q @ k^T (`TransposeTransform` has no `indices`)."""
    return plgpu is not None and hasattr(plgpu, "InterpretGPUParams")


def interpret_params():
    """Mosaic GPU's interpret mode (runs the kernel on CPU, simulating shared memory, TMA,
    barriers and wgmma): `plgpu.InterpretGPUParams()` (JAX >= 0.11, `interpret_available`)."""
    if not interpret_available():
        raise ValueError(f"JAX {jax.__version__} cannot run this kernel in Mosaic GPU's interpret mode (JAX >= 0.11 can)")
    return plgpu.InterpretGPUParams()


def _smem_transforms(contraction: int, itemsize: int):
    """Tiling + swizzle of a wgmma operand in shared memory whose contraction dimension has
    `contraction` elements: wgmma issues K in groups of swizzle / itemsize elements, so the
    swizzle is the largest (<= 128 bytes) that divides it: q and K (contraction head_dim >= 64)
    swizzle 128 bytes, V (contraction page_size) 32 bytes for 16-token pages."""
    swizzle = min(128, contraction * itemsize)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _decode_kernel(pages_ref, full_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, q_smem, p_smem, o_smem, ml_smem,
                   barrier, *,
                   sm_scale: float, num_pages: int, page_size: int, head_dim: int):
    # pages_ref: i32[B, M] (arena rows of this layer, -1 unmapped); full_ref: i32[B] (whole live
    # pages); q_ref: [B, Hkv, ROWS, D]; k_ref, v_ref: [L*Hkv*P, S, D]
    # out: o_ref f32[B, Hkv, ROWS, D] (unnormalized), m_ref, l_ref f32[B, Hkv, ROWS]
    b, h = lax.axis_index("b"), lax.axis_index("h")
    base = h * num_pages  # this head's rows of the flat arena (the layer's offset is in pages_ref)
    plgpu.copy_gmem_to_smem(q_ref.at[b, h], q_smem, barrier)
    plgpu.barrier_wait(barrier)

    def block_index(i):  # step i reads page_map[b, i]; an unmapped page reads a stand-in, discarded
        return (base + jnp.maximum(pages_ref[b, i], 0), 0, 0)

    def step(indices, k_smem, v_smem, carry):
        acc, m_i, l_i = carry
        (i,) = indices

        def scores(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.T)
            return acc_ref[...]

        s = pl.run_scoped(scores, plgpu.ACC((ROWS, page_size), jnp.float32)) * sm_scale  # [ROWS, S]
        m_new = jnp.maximum(m_i, s.max(axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_i - m_safe)
        p = jnp.exp(s - lax.broadcast_in_dim(m_safe, s.shape, [0]))
        l_new = l_i * alpha + p.sum(axis=1)

        # p goes through shared memory (wgmma could take it from registers, but Mosaic GPU's
        # interpret mode cannot: one kernel for both, at 64 x S x 2 bytes per step).
        p_smem[...] = p.astype(p_smem.dtype)
        plgpu.commit_smem()

        def values(acc_ref):  # a fresh accumulator (not `run_state(ACC.init(acc))`: interpret mode lacks it)
            plgpu.wgmma(acc_ref, p_smem, v_smem)
            return acc_ref[...]

        pv = pl.run_scoped(values, plgpu.ACC((ROWS, head_dim), jnp.float32))
        acc_new = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv
        mapped = pages_ref[b, i] >= 0  # an unmapped page adds nothing (its stand-in may hold NaN)
        pick = lambda new, old: jnp.where(lax.broadcast(mapped, new.shape), new, old)  # noqa: E731
        return pick(acc_new, acc), pick(m_new, m_i), pick(l_new, l_i)

    init = (jnp.zeros((ROWS, head_dim), jnp.float32), jnp.full((ROWS,), -jnp.inf, jnp.float32),
            jnp.zeros((ROWS,), jnp.float32))
    k_spec = plgpu.BlockSpec((None, page_size, head_dim), block_index, transforms=_smem_transforms(head_dim, 2))
    v_spec = plgpu.BlockSpec((None, page_size, head_dim), block_index, transforms=_smem_transforms(page_size, 2))
    acc, m_i, l_i = plgpu.emit_pipeline(step, grid=(full_ref[b],), in_specs=[k_spec, v_spec],
                                        max_concurrent_steps=stages(page_size, head_dim), init_carry=init)(k_ref, v_ref)
    o_smem[...] = acc
    ml_smem[0] = m_i
    ml_smem[1] = l_i
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[b, h])
    plgpu.copy_smem_to_gmem(ml_smem.at[0], m_ref.at[b, h])
    plgpu.copy_smem_to_gmem(ml_smem.at[1], l_ref.at[b, h])
    plgpu.wait_smem_to_gmem(0)


def _tail_page(q, k_arena, v_arena, layer, page_map, live_len, full, sm_scale):
    """The partly live last page of each row (keys full*S ... live_len - 1), in plain jnp:
    unnormalized (o f32[B, Hq, D], m, l f32[B, Hq]) in the kernel's terms. Dead keys are
    masked with `where` (values too: a stale NaN never meets a zero weight)."""
    batch, _, num_q_heads, head_dim = q.shape
    _, num_kv_heads, num_pages, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    idx = jnp.minimum(full, page_map.shape[1] - 1)
    page = jnp.take_along_axis(page_map, idx[:, None], axis=1)[:, 0]  # [B]
    live = jnp.where((page >= 0) & (full < page_map.shape[1]), live_len - full * page_size, 0)  # [B], < S
    page = jnp.clip(page, 0, num_pages - 1)
    k = jax.lax.dynamic_index_in_dim(k_arena, layer, axis=0, keepdims=False)[:, page]  # [Hkv, B, S, D]
    v = jax.lax.dynamic_index_in_dim(v_arena, layer, axis=0, keepdims=False)[:, page]
    key_live = jnp.arange(page_size)[None, :] < live[:, None]  # [B, S]
    qg = q.reshape(batch, num_kv_heads, group, head_dim).astype(jnp.float32)
    s = jnp.einsum("BKGD,KBSD->BKGS", qg, k.astype(jnp.float32)) * sm_scale
    s = jnp.where(key_live[:, None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    p = jnp.where(key_live[:, None, None], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None]), 0.0)
    v = jnp.where(key_live[None, :, :, None], v.astype(jnp.float32), 0.0)
    o = jnp.einsum("BKGS,KBSD->BKGD", p, v)
    return (o.reshape(batch, num_q_heads, head_dim), m.reshape(batch, num_q_heads),
            p.sum(-1).reshape(batch, num_q_heads))


def mosaic_paged_decode(q, k_arena, v_arena, layer, page_map, lengths, num_tokens, *, k_scale=None, v_scale=None,
                        sm_scale: float | None = None, interpret=None):
    """Decode attention of `q: [B, 1, Hq, D]` over each row's pages (Mosaic GPU kernel).

    The contract of `paged_attention_reference` with one query token per row: k_arena, v_arena
    [L, Hkv, P, S, D] bfloat16 / float16 (q the same dtype), layer an int or traced i32 scalar,
    page_map i32[B, M] (-1 unmapped), lengths, num_tokens i32[B] (num_tokens 0: a padded row,
    zeros); an 8-bit arena (with k_scale, v_scale) is refused with the backend to use.
    `interpret`: None interprets off a GPU and compiles on one; False compiles; True (or
    `interpret_params()`) runs Mosaic GPU's interpret mode (JAX >= 0.11) on any backend. Returns [B, 1, Hq, D] in q's dtype.
    """
    num_layers, num_kv_heads, num_pages, page_size, head_dim = check_arena(k_arena, v_arena, k_scale, v_scale)
    check_tokens("q", q, batch=None, heads=None, head_dim=head_dim)
    batch, tokens, num_q_heads, _ = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads, not a multiple of the arena's {num_kv_heads} KV heads")
    group = num_q_heads // num_kv_heads
    if interpret is None:  # like the Triton kernels: interpret off a GPU, compile on one
        interpret = jax.default_backend() != "gpu"
    reason = mosaic_unsupported_reason(head_dim=head_dim, page_size=page_size, group=group, dtype=k_arena.dtype,
                                       tokens=tokens, q_dtype=q.dtype, quantized=is_quantized(k_arena.dtype),
                                       interpret=bool(interpret))
    if reason is not None:
        raise ValueError(reason)
    layer = check_layer(layer, num_layers)
    page_map, lengths, num_tokens = check_rows(page_map, lengths, num_tokens, batch)
    sm_scale = float(head_dim**-0.5 if sm_scale is None else sm_scale)
    interpret = interpret_params() if interpret is True else (interpret or False)

    layer = jnp.asarray(layer, jnp.int32).reshape(())
    return _decode_call(q, k_arena, v_arena, layer, page_map, lengths, num_tokens, sm_scale=sm_scale,
                        interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "interpret"))
def _decode_call(q, k_arena, v_arena, layer, page_map, lengths, num_tokens, *, sm_scale, interpret):
    batch, _, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_pages, page_size, _ = k_arena.shape
    group = num_q_heads // num_kv_heads
    # The query (position lengths - num_tokens) sees keys up to its own; a padded row none.
    live_len = jnp.where(num_tokens > 0, jnp.clip(lengths - num_tokens + 1, 0, page_map.shape[1] * page_size), 0)
    full = live_len // page_size  # whole live pages: the kernel's; the partly live one: _tail_page's
    # Arena rows of this layer's pages (the flat view below); -1 (unmapped) stays negative and
    # ids past the arena are clamped to its last page, as the reference's gather does.
    rows = jnp.where(page_map >= 0, jnp.minimum(page_map, num_pages - 1) + layer * (num_kv_heads * num_pages), -1)
    q_tile = q.reshape(batch, num_kv_heads, group, head_dim)
    q_tile = jnp.pad(q_tile, ((0, 0), (0, 0), (0, ROWS - group), (0, 0)))  # [B, Hkv, ROWS, D]
    flat = (num_layers * num_kv_heads * num_pages, page_size, head_dim)
    kernel = functools.partial(_decode_kernel, sm_scale=sm_scale, num_pages=num_pages, page_size=page_size,
                               head_dim=head_dim)
    f32 = jnp.float32
    o, m, l = plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct((batch, num_kv_heads, ROWS, head_dim), f32),
                  jax.ShapeDtypeStruct((batch, num_kv_heads, ROWS), f32),
                  jax.ShapeDtypeStruct((batch, num_kv_heads, ROWS), f32)),
        scratch_types=(
            plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=_smem_transforms(head_dim, 2)),
            plgpu.SMEM((ROWS, page_size), q.dtype, transforms=_smem_transforms(page_size, 2)),
            plgpu.SMEM((ROWS, head_dim), f32),
            plgpu.SMEM((2, ROWS), f32),
            plgpu.Barrier(num_arrivals=1),
        ),
        grid=(batch, num_kv_heads),
        grid_names=("b", "h"),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
        kernel_name=f"mosaic_paged_decode_g{group}_p{page_size}_d{head_dim}",
    )(rows.astype(jnp.int32), full.astype(jnp.int32), q_tile, k_arena.reshape(flat), v_arena.reshape(flat))
    per_head = lambda x: x[:, :, :group].reshape(batch, num_q_heads, *x.shape[3:])  # noqa: E731
    tail = _tail_page(q, k_arena, v_arena, layer, page_map, live_len, full, sm_scale)
    # The two parts merge like two splits of the Triton kernel: [B, 2, T=1, Hq, ...].
    o, m, l = (jnp.stack([per_head(a), t], axis=1)[:, :, None] for a, t in zip((o, m, l), tail))
    return _merge_splits(o, m, l, (num_tokens > 0)[:, None], q.dtype)
