"""What the Mosaic TPU kernels share: which geometries they take, interpret mode, tile rules.

TPU memory is tiled: the last two dims of an array are stored in (sublane, lane) tiles of
(8, 128) 32-bit words; 16-bit types pack 2 rows per sublane word, 8-bit types 4. A DMA moves
whole rows of that layout, and Mosaic checks offsets along tiled dims against it. For our arena
`[L, Hkv, P, S, D]` one page of one head is a `[S, D]` slab, so the kernels move whole pages:

- attention DMAs one page per copy (`page_size x head_dim` elements) into a `[block_k, D]`
  VMEM buffer at row `i * S`; append writes aligned chunks of `append_chunk(S, dtype)` rows
  (8 rows of 32-bit, 16 of 16-bit, 32 of 8-bit: one (8, 128) tile of 32-bit words; the whole
  page when it is smaller) by HBM -> HBM DMA. Page sizes: multiples of 8 up to 256.
- The arrays must be in the TPU's *default* layout, the one every array the cache makes has.
  XLA's TPU default layout is row-major (a page contiguous) only when the minor dim is a
  multiple of 128; for a smaller minor dim it moves another dim (the pages) into the lanes
  (`{2,4,3,1,0}` for `[L, H, P, 16, 64]`), where no page-granular DMA can read a page, and XLA
  would relayout the whole arena on every call. Measured by compiling for v5e and v6e
  (`tests/test_compile_tpu.py`): hence head_dim 128 or 256, and for 8-bit arenas, whose
  scales `[L, Hkv, P, S]` have S as their minor dim, page sizes 128 or 256. Attention also
  takes 8-bit pages of 16, 32 or 64 with the scales as rows of 128 lanes (`scale_rows`,
  `scale_rows=True` below), which is how a TPU arena stores them (`KVCache.scale_rows`).
- 8-bit scales are DMA'd one page row `[1, S]` at a time (scale rows: the 512-byte row holding
  the page; a DMA's contiguous inner slice must be a multiple of 512 bytes), at a dynamic row:
  fine for float32 scales; bfloat16 scales pack 2 pages per sublane word and such a row is not
  addressable by one DMA, so the TPU kernels take float32 scales only.
- float16 has no Mosaic vector type on v5e / v6e (f16 vector loads and stores do not
  compile): the kernels take bfloat16 / float32 arenas and q, and the 8-bit dtypes.
"""
from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from pallas_kernels.quant import QUANTIZED_DTYPES

__all__ = ["tpu_unsupported_reason", "resolve_tpu_interpret", "target_platform", "check_smem_tables", "append_chunk",
           "row_packing", "scale_rows", "logical_scales", "TPU_PAGE_MULTIPLE"]

# float16 has no Mosaic vector type on TPU v5e / v6e (its loads and stores do not compile).
TPU_COMPUTE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
TPU_DTYPES = TPU_COMPUTE_DTYPES + QUANTIZED_DTYPES
TPU_PAGE_MULTIPLE = 8  # one sublane tile of 32-bit rows
TPU_QUANTIZED_PAGE_MULTIPLE = 128  # 8-bit scales [L, H, P, S]: row-major by default only when S % 128 == 0
TPU_SCALE_ROW_PAGES = (16, 32, 64)  # 8-bit pages whose scales come as rows of 128 lanes (`scale_rows`)
TPU_MAX_PAGE_SIZE = 256
TPU_HEAD_DIM_MULTIPLE = 128  # the arena is row-major by default only when head_dim % 128 == 0
TPU_MAX_HEAD_DIM = 256
# Scalar-prefetched tables (page tables, chunk lists) live in SMEM: 1 MiB per core on v5e / v6e.
# Measured: a 1 MiB page table fails to compile ("Ran out of memory in memory space smem"),
# 512 KiB compiles; the budget leaves room for the other scalars.
SMEM_TABLE_BYTES = 960 << 10


def row_packing(dtype) -> int:
    """Rows of `dtype` packed into one 32-bit sublane word (1, 2 or 4)."""
    return max(1, 4 // jnp.dtype(dtype).itemsize)


def append_chunk(page_size: int, dtype) -> int:
    """Rows per append DMA: one (8, 128)-word tile of rows (8 x packing), or the whole page."""
    return min(int(page_size), 8 * row_packing(dtype))


def _as_int(x) -> int | None:
    try:
        return None if isinstance(x, bool) else operator.index(x)
    except TypeError:
        return None


def tpu_unsupported_reason(*, head_dim, page_size=None, group=None, dtype=None, scale_dtype=None,
                           q_dtype=None, scale_rows: bool = False) -> str | None:
    """Why the Mosaic TPU kernels cannot take this geometry, or None when they can.

    head_dim: 128 or 256; page_size: a multiple of 8 up to 256 (one page is one DMA of
    page_size x head_dim), for 8-bit arenas 128 or 256; group: any >= 1; dtype (the arena's):
    bfloat16, float32, int8, float8_e4m3fn, float8_e5m2; scale_dtype (8-bit arenas): float32.
    q_dtype (attention's q, its compute dtype): bfloat16 or float32. `scale_rows`: an 8-bit
    arena's scales come as rows of 128 lanes (`scale_rows`, how a TPU arena stores them at those
    pages: `KVCache.scale_rows`), which the kernels (attention, append, the page copy) also take
    at pages of 16, 32 or 64. The module docstring says why each limit is there.
    """
    if dtype is not None and jnp.dtype(dtype) not in TPU_DTYPES:
        return (f"dtype={jnp.dtype(dtype).name}: the TPU kernels take bfloat16, float32, int8, float8_e4m3fn or "
                "float8_e5m2 arenas (float16 vectors do not compile for TPU v5e / v6e)")
    d = _as_int(head_dim)
    if d is None or not 0 < d <= TPU_MAX_HEAD_DIM or d % TPU_HEAD_DIM_MULTIPLE:
        return (f"head_dim={head_dim}: the TPU kernels take multiples of {TPU_HEAD_DIM_MULTIPLE} up to "
                f"{TPU_MAX_HEAD_DIM} (with a smaller minor dim the TPU's default layout puts the pages in the "
                "lanes, and no page-granular DMA can read a page)")
    quantized = dtype is not None and jnp.dtype(dtype) in QUANTIZED_DTYPES
    if page_size is not None:
        s = _as_int(page_size)
        multiple = TPU_QUANTIZED_PAGE_MULTIPLE if quantized else TPU_PAGE_MULTIPLE
        rows_ok = quantized and scale_rows and s in TPU_SCALE_ROW_PAGES
        if not rows_ok and (s is None or not 0 < s <= TPU_MAX_PAGE_SIZE or s % multiple):
            why = ("8-bit scales [L, H, P, page_size] are row-major in the TPU's default layout only when "
                   "page_size is a multiple of 128" if quantized else "one page is one DMA of whole (8, 128) tiles of rows")
            rows = (f"; the attention kernel takes pages of {', '.join(map(str, TPU_SCALE_ROW_PAGES))} with scales as "
                    "rows of 128 lanes, pallas_kernels.tpu.common.scale_rows" if quantized and not scale_rows else "")
            return (f"page_size={page_size}: the TPU kernels take multiples of {multiple} up to {TPU_MAX_PAGE_SIZE} "
                    f"({why}){rows}")
    if group is not None and not (_as_int(group) or 0) >= 1:
        return f"group={group}: must be a positive int"
    if q_dtype is not None and jnp.dtype(q_dtype) not in TPU_COMPUTE_DTYPES:
        return (f"q.dtype={jnp.dtype(q_dtype).name}: the TPU attention kernel computes in q's dtype, which must be "
                "bfloat16 or float32 (float16 vectors do not compile for TPU v5e / v6e)")
    if quantized and scale_dtype is not None and jnp.dtype(scale_dtype) != jnp.dtype(jnp.float32):
        return (f"scale_dtype={jnp.dtype(scale_dtype).name}: the TPU kernels take float32 scales (a bfloat16 "
                "page row of scales is not addressable by one DMA)")
    return None


def _default_device_platform() -> str:
    device = jax.config.jax_default_device
    if device is not None:
        return device if isinstance(device, str) else device.platform
    return jax.default_backend()


def target_platform() -> str:
    """The platform kernels are lowered for: the default device's (`jax.default_device`, which
    the deviceless TPU compile sets to a TPU device on a CPU host), else the default backend.
    What the cache's formats and dispatch follow (a test may stand a TPU in for it; whether a
    kernel runs compiled or interpreted follows the device itself, `resolve_tpu_interpret`)."""
    return _default_device_platform()


def check_smem_tables(what: str, num_ints: int) -> None:
    """ValueError when `num_ints` int32 scalars to prefetch exceed the SMEM budget."""
    if 4 * num_ints > SMEM_TABLE_BYTES:
        raise ValueError(f"{what}: {4 * num_ints:,} bytes of int32 tables to prefetch into SMEM, over the TPU "
                         f"kernels' {SMEM_TABLE_BYTES:,}-byte budget (SMEM is 1 MiB on v5e / v6e); use fewer rows "
                         "per call or larger pages")


def resolve_tpu_interpret(interpret):
    """None: compile on a TPU, TPU interpret mode elsewhere. True: TPU interpret mode, which
    models HBM/VMEM/SMEM, DMAs (executed when waited on) and semaphores, and fills
    uninitialized VMEM with NaN, so a kernel that reads a buffer before its DMA landed, or
    forgets a mask, shows it. An `InterpretParams` is passed through."""
    from jax.experimental.pallas import tpu as pltpu

    if interpret is None:
        interpret = _default_device_platform() != "tpu"
    if interpret is True:
        return pltpu.InterpretParams(dma_execution_mode="on_wait", uninitialized_memory="nan")
    return interpret or False


def scale_rows(scales):
    """[L, Hkv, P, S] -> [L, Hkv, P * S / 128, 128] (S < 128 dividing 128, P * S a multiple of 128):
    an 8-bit arena's scales as rows of 128 lanes, 128 / S pages a row (page p: row p // (128 / S),
    lanes (p % (128 / S)) * S onward). A TPU DMA moves whole 512-byte rows (its contiguous inner
    slice must be a multiple of 512 bytes), and this is the format whose rows it can move: the
    TPU's default layout of [..., P, S] puts the pages in the lanes instead."""
    num_layers, num_kv_heads, num_pages, page_size = scales.shape
    if 128 % page_size or (num_pages * page_size) % 128:
        raise ValueError(f"scale rows need a page_size dividing 128 and pages x page_size a multiple of 128, got "
                         f"{num_pages} pages of {page_size}")
    return scales.reshape(num_layers, num_kv_heads, num_pages * page_size // 128, 128)


def logical_scales(k_arena, scales):
    """(scales as `check_arena` sees them: [L, Hkv, P, S], whether they came as `scale_rows`).
    Scale rows are taken as given when their shape is exactly [L, Hkv, P * S / 128, 128]."""
    if scales is None or k_arena.ndim != 5 or getattr(scales, "ndim", None) != 4:
        return scales, False
    num_layers, num_kv_heads, num_pages, page_size = k_arena.shape[:4]
    if page_size >= 128 or scales.shape[-1] != 128 or (num_pages * page_size) % 128:
        return scales, False
    if tuple(scales.shape) != (num_layers, num_kv_heads, num_pages * page_size // 128, 128):
        return scales, False  # (check_arena names the shape it wants)
    return jax.ShapeDtypeStruct(k_arena.shape[:4], scales.dtype), True
