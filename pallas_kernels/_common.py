"""Shared pieces of the Pallas kernels: version shims, tile sizes, argument checks.

Version notes (the kernels use the Triton lowering of `pl.pallas_call`):
- JAX >= 0.7 exposes masked loads/stores as `plgpu.load(ref.at[idx], mask=, other=)` /
  `plgpu.store(ref.at[idx], val, mask=)` (`jax.experimental.pallas.triton`); older JAX had
  `pl.load(ref, idx, ...)` / `pl.store(ref, idx, ...)`.
- The compiler params class is `plgpu.CompilerParams` (JAX >= 0.6); older JAX called it
  `plgpu.TritonCompilerParams` / `pl.TritonCompilerParams`.
- Interpret mode (`interpret=True`) discharges every kernel into plain XLA on any backend.
  There, an indexer that mixes slices with integer arrays is not supported, so the kernels
  index every axis with (broadcast) integer arrays; the Triton lowering turns the same
  indexers into pointer arithmetic with `make_range`, which keeps loads contiguous.
"""
from __future__ import annotations

import dataclasses
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.quant import QUANTIZED_DTYPES, SCALE_DTYPES
from pallas_kernels.quant4 import GROUP, INT4, PACKED_DTYPE, arena_format

try:  # the Triton-specific Pallas API
    from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - very old JAX
    plgpu = None

__all__ = ["BlockSizes", "unsupported_reason", "triton_lowering_problem", "head_tile", "masked_load", "masked_store",
           "compiler_params", "resolve_interpret", "arena_format"]

# What q, k, v (the compute dtypes) may be, and what an arena may store.
SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# int4 arenas store two codes a byte: their arrays are uint8, `head_dim / 2` bytes a row.
ARENA_DTYPES = SUPPORTED_DTYPES + QUANTIZED_DTYPES + (PACKED_DTYPE,)
# Triton's tensor dims must be powers of two, and tl.dot needs every dim >= 16: the kernels pad
# head_dim to HEAD_TILE(head_dim) = next power of two >= 16 and mask the padding lanes.
MIN_TILE = 16
HEAD_DIM_MULTIPLE = 8  # one token row of one head is whole 16-byte vectors in bf16/fp16
MAX_HEAD_DIM = 256  # the largest tile the sm_90a compile checks cover without spills


# ---- version shims ---------------------------------------------------------------------------


def masked_load(ref_view, *, mask, other):
    """`ref_view` is `ref.at[idx]`; lanes where `mask` is False read `other` and touch no memory."""
    if plgpu is not None and hasattr(plgpu, "load"):
        return plgpu.load(ref_view, mask=mask, other=other)
    return pl.load(ref_view, (), mask=mask, other=other)  # pragma: no cover - JAX < 0.7


def masked_store(ref_view, value, *, mask):
    """`ref_view` is `ref.at[idx]`; lanes where `mask` is False write nothing."""
    if plgpu is not None and hasattr(plgpu, "store"):
        return plgpu.store(ref_view, value, mask=mask)
    return pl.store(ref_view, (), value, mask=mask)  # pragma: no cover - JAX < 0.7


def _triton_params_class():
    for owner, name in ((plgpu, "CompilerParams"), (plgpu, "TritonCompilerParams"), (pl, "TritonCompilerParams")):
        cls = getattr(owner, name, None) if owner is not None else None
        if cls is not None:
            return cls
    return None


def triton_lowering_problem() -> str | None:
    """Why this JAX cannot run the Pallas (Triton) kernels, naming the backend to use; None
    when it can. JAX 0.11 deprecates the Triton lowering of `pallas_call` (removal announced);
    where it is gone (`jax.experimental.pallas.triton` or its CompilerParams missing), the
    "pallas" backend is unavailable (pallas_kernels/README.md, "JAX versions and backends")."""
    if _triton_params_class() is not None:
        return None
    return (f"this JAX ({jax.__version__}) has no Pallas Triton lowering (jax.experimental.pallas.triton); "
            "use backend='mosaic' (decode attention, experimental), backend='xla' (jnp, in blocks of pages) "
            "or backend='reference'")


def compiler_params(num_warps: int, num_stages: int):
    """Triton compiler params; passing them also selects the Triton lowering on GPU."""
    cls = _triton_params_class()
    if cls is None:
        raise ValueError(triton_lowering_problem())
    return cls(num_warps=num_warps, num_stages=num_stages)


def resolve_interpret(interpret: bool | None) -> bool:
    """None: interpret on CPU (no Pallas GPU lowering there), compile on GPU."""
    if interpret is None:
        return jax.default_backend() == "cpu"
    return bool(interpret)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def cdiv(a, b):
    """Ceil division of non-negative ints (python or traced int32)."""
    if isinstance(a, int) and isinstance(b, int):
        return -(-a // b)
    return lax.div(a + (b - 1), b)


def num_sms() -> int:
    """Streaming multiprocessors of the default device (132 on an H100 SXM when unknown)."""
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


# ---- tile sizes --------------------------------------------------------------------------------


def head_tile(head_dim: int) -> int:
    """The kernels' tile along head_dim: the next power of two >= 16 (lanes >= head_dim are masked)."""
    return max(MIN_TILE, next_pow2(head_dim))


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes for the Pallas kernels; None fields take a default chosen from the shapes.

    block_k: keys streamed per inner-loop step of attention, a power of two >= 16, whatever
        the page size: a step covers several small pages (block_k > page_size) or part of a
        large one (block_k < page_size); every key looks up its own page.
    pages_per_block: the older way to say block_k, as pages per step
        (block_k = pages_per_block * page_size); give at most one of the two.
    num_splits: programs that split one row's context (split-K / flash-decoding; their
        partial results are merged with a log-sum-exp). Decode default: enough programs to
        fill the device twice over; prefill default: 1.
    block_tokens: query tokens per program (prefill), new tokens per program (append); a
        power of two. In attention a program holds block_tokens x block_h rows (query heads
        of one KV head, padded to a power of two; at least 16 rows in all).
    block_h: query heads of one KV group per program, a power of two; a larger group is
        split over several programs (each reads the group's K/V). Default: the whole group
        up to 64 heads (16 in float32).
    num_warps, num_stages: Triton launch parameters.
    """

    pages_per_block: int | None = None
    num_splits: int | None = None
    block_tokens: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    block_k: int | None = None
    block_h: int | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"BlockSizes.{field.name} must be a positive int or None, got {value!r}")
        if self.block_tokens is not None and not is_pow2(self.block_tokens):
            raise ValueError(f"BlockSizes.block_tokens must be a power of two, got {self.block_tokens}")
        if self.block_h is not None and not is_pow2(self.block_h):
            raise ValueError(f"BlockSizes.block_h must be a power of two, got {self.block_h}")
        if self.block_k is not None and (not is_pow2(self.block_k) or self.block_k < MIN_TILE):
            raise ValueError(f"BlockSizes.block_k must be a power of two >= {MIN_TILE}, got {self.block_k}")

    @classmethod
    def for_attention(
        cls, *, batch: int, tokens: int, num_kv_heads: int, group: int, page_size: int, head_dim: int, max_pages: int,
        itemsize: int = 2, quantized: bool = False, converted: bool | None = None, int4: bool = False,
    ) -> "BlockSizes":
        """Defaults per shape, chosen so that every shape compiles for sm_90a without spills
        (tests/test_compile_sm90.py; `arena-bench kernels --compile-report` prints the facts).

        Decode streams K/V tiles of 16 KiB (64 keys of a 128-wide bf16 head, 32 of a 256-wide
        one, at most 128 keys): ~165 registers and 3 CTAs per SM, where 32 KiB tiles sit at the
        255-register cap (2 CTAs/SM) and spill through the plugin's Triton route. It splits the
        context until the device holds about two waves of programs. bf16/fp16 prefill packs 64
        query rows (tokens x GQA group, tensor cores: wgmma) and takes 64 keys per step (32 for
        heads wider than 128). float32 dots are exact IEEE FMA loops whose register use ptxas
        handles erratically (larger tiles spill by hundreds of bytes to kilobytes): 16 query rows
        and 16 keys per step, 4 warps, for every head size. Groups of more than 64 query
        heads (16 in float32) are split over programs (block_h) rather than growing the tile.

        `itemsize` is the dots' (q's) element size, whatever the arena's dtype: an arena of
        another dtype (`converted`; 8-bit arenas always) has its K/V tiles converted to q's
        dtype in registers, and its tiles are those of an arena of q's dtype. With float32 q
        (FMA dots) a converted arena runs one pipeline stage: with two, ptxas keeps the
        converted K/V tiles of both stages in registers and spills (8-bit: 255 registers,
        ~300 B of spills at head_dim 128), with one it needs ~60.

        int4 arenas (`int4`) keep one accumulator, one q part and one V code tile per group of
        32 lanes: bf16/fp16 prefill takes 32 keys per step (64 rows at head_dim 128: 64 keys
        spill ~100 B), and at head_dim > 128 (8 groups) 16 rows and 16 keys (64 rows spill
        50-100 B at any block_k; 16 x 16 compiles to 128 registers, no spills).
        """
        converted = quantized if converted is None else converted or quantized
        decode = tokens == 1
        tile_d = head_tile(head_dim)
        narrow = int4 and not decode and itemsize < 4 and tile_d > 128  # int4 prefill, 8+ groups
        max_rows = MIN_TILE if itemsize >= 4 or narrow else 64
        block_h = min(next_pow2(group), max_rows)
        if decode:
            block_tokens = 1
        else:
            block_tokens = min(next_pow2(tokens), max(1, max_rows // block_h))
        rows = max(block_tokens * block_h, MIN_TILE)
        if itemsize >= 4:
            block_k = MIN_TILE
        elif decode:  # 16 KiB K tiles, and a [rows, block_k] score tile of at most 64 x 64
            block_k = min(128, max(MIN_TILE, 16384 // (tile_d * itemsize)), max(MIN_TILE, 4096 // rows))
        elif int4:
            block_k = MIN_TILE if narrow else 32
        else:
            block_k = 64 if tile_d <= 128 else 32
        if decode:
            programs = batch * num_kv_heads * cdiv(group, block_h)
            max_blocks = max(1, cdiv(max_pages * page_size, block_k))
            num_splits = max(1, min(64, max_blocks, cdiv(2 * num_sms(), programs)))
        else:
            num_splits = 1
        return cls(
            block_k=block_k,
            block_h=block_h,
            num_splits=num_splits,
            block_tokens=block_tokens,
            num_warps=4 if rows * tile_d <= 64 * 128 or itemsize >= 4 else 8,
            num_stages=1 if converted and itemsize >= 4 else 2,
        )

    @classmethod
    def for_append(cls, *, tokens: int, head_dim: int, rotate: bool = False, int4: bool = False) -> "BlockSizes":
        """Append: up to 64 tokens x head_dim per program; a rotated append (keys rotated by a
        dot before quantization) at least 16 (Triton's smallest dot), and at head_dim > 128
        always 64: as 16- or 32-row mma.sync the rotation dots spill (int4's 16 narrow dots
        150-460 B; int8 4 B under JAX 0.11's 128-register cap), as 64-row wgmma they compile to
        116-120 (int4) / 163-179 (int8) registers. (`int4` is accepted for the record; the rule is the same.)"""
        block = min(next_pow2(tokens), 64)
        if rotate:
            block = 64 if head_tile(head_dim) > 128 else max(block, MIN_TILE)
        return cls(block_tokens=block,
                   num_warps=4 if head_tile(head_dim) <= 128 else 8, num_stages=1)

    def filled(self, defaults: "BlockSizes") -> "BlockSizes":
        """Self with None fields taken from `defaults`."""
        return dataclasses.replace(
            self, **{f.name: getattr(defaults, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is None}
        )


def resolve_block_k(block_sizes: BlockSizes, page_size: int) -> BlockSizes:
    """`block_k` from `pages_per_block` when only the latter is given; checks both agree."""
    ppb, block_k = block_sizes.pages_per_block, block_sizes.block_k
    if ppb is None:
        return block_sizes
    keys = ppb * page_size
    if not is_pow2(keys) or keys < MIN_TILE:
        raise ValueError(
            f"pages_per_block * page_size = {ppb} * {page_size} = {keys} must be a power of two "
            f">= {MIN_TILE} (Triton tile limits); or give BlockSizes.block_k instead"
        )
    if block_k is not None and block_k != keys:
        raise ValueError(f"BlockSizes.block_k={block_k} and pages_per_block * page_size = {keys} disagree; give one")
    return dataclasses.replace(block_sizes, block_k=keys)


def _as_int(x) -> int | None:
    try:
        return None if isinstance(x, bool) else operator.index(x)
    except TypeError:
        return None


def _gpu_compute_capability() -> float | None:
    """The default device's compute capability (8.9, 9.0, ...) on an NVIDIA GPU, else None."""
    if jax.default_backend() != "gpu":
        return None
    try:
        return float(getattr(jax.devices()[0], "compute_capability", None))
    except (TypeError, ValueError):
        return None


def unsupported_reason(*, head_dim, page_size=None, group=None, dtype=None) -> str | None:
    """Why the Pallas kernels cannot take this geometry, or None when they can.

    head_dim: any multiple of 8 up to 256 (padded in-kernel to a power-of-two tile, the
    padding masked; int4 arenas: a multiple of 32, whole scale groups); page_size: any >= 1
    (attention steps over keys, each key finds its own page); group (query heads per KV
    head): any >= 1; dtype (the arena's): bfloat16, float16, float32, int8, float8_e5m2,
    float8_e4m3fn (on a GPU: compute capability 8.9 or newer, where Triton converts it) and
    int4 (or its packed storage, uint8). `arena_jax` asks this before choosing the Pallas backend.
    """
    if dtype is not None and jnp.dtype(dtype) not in ARENA_DTYPES + (INT4,):
        return (f"dtype={jnp.dtype(dtype).name}: the Pallas kernels take bfloat16, float16, float32, int8, "
                "float8_e4m3fn, float8_e5m2 or int4")
    if dtype is not None and jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn):
        cc = _gpu_compute_capability()
        if cc is not None and cc < 8.9:
            return f"dtype=float8_e4m3fn needs compute capability >= 8.9 (Triton's conversion); this GPU has {cc}"
    d = _as_int(head_dim)
    if d is None or not 0 < d <= MAX_HEAD_DIM or d % HEAD_DIM_MULTIPLE:
        return f"head_dim={head_dim}: the Pallas kernels take multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
    if dtype is not None and arena_format(dtype) == "int4" and d % GROUP:
        return f"head_dim={head_dim}: int4 arenas take multiples of {GROUP} (whole scale groups)"
    for name, value in (("page_size", page_size), ("group", group)):
        if value is not None and not (_as_int(value) or 0) >= 1:
            return f"{name}={value}: must be a positive int"
    return None


# ---- argument checks ---------------------------------------------------------------------------


def check_arena(k_arena, v_arena, k_scale=None, v_scale=None):
    """Returns (L, Hkv, P, S, D) after checking both arenas (D: the head size; an int4 arena,
    uint8, stores D / 2 bytes a row), and the scales of a quantized arena (given exactly when
    the arena is int8 / fp8: [L, Hkv, P, S]; int4: [L, Hkv, P, S, D / 32]; float32 or bfloat16)."""
    for name, arr in (("k_arena", k_arena), ("v_arena", v_arena)):
        if getattr(arr, "ndim", None) != 5:
            raise ValueError(f"{name} must be 5-D [layers, kv_heads, pages, page_size, head_dim], got shape {getattr(arr, 'shape', None)}")
        if jnp.dtype(arr.dtype) not in ARENA_DTYPES:
            raise ValueError(f"{name}.dtype must be one of bfloat16/float16/float32/int8/float8_e4m3fn/float8_e5m2/"
                             f"uint8 (packed int4), got {arr.dtype}")
    if k_arena.shape != v_arena.shape or k_arena.dtype != v_arena.dtype:
        raise ValueError(f"k_arena {k_arena.shape} {k_arena.dtype} and v_arena {v_arena.shape} {v_arena.dtype} must match")
    fmt = arena_format(k_arena.dtype)
    shape = tuple(k_arena.shape)
    if fmt == "int4":
        shape = shape[:4] + (2 * shape[4],)
    reason = unsupported_reason(head_dim=shape[4], dtype=k_arena.dtype)
    if reason:
        raise ValueError(f"k_arena {reason}")
    quantized = fmt != "float"
    if quantized != (k_scale is not None) or quantized != (v_scale is not None):
        raise ValueError(
            f"k_scale and v_scale must be given exactly when the arena is 8-bit or int4 (quantized): the arena is "
            f"{k_arena.dtype}, k_scale {'given' if k_scale is not None else 'None'}, v_scale "
            f"{'given' if v_scale is not None else 'None'}"
        )
    if quantized:
        want = shape[:4] + ((shape[4] // GROUP,) if fmt == "int4" else ())
        axes = "[layers, kv_heads, pages, page_size" + (", head_dim / 32]" if fmt == "int4" else "]")
        for name, arr in (("k_scale", k_scale), ("v_scale", v_scale)):
            if tuple(getattr(arr, "shape", ())) != want:
                raise ValueError(f"{name} must be {axes} = {want}, got shape {getattr(arr, 'shape', None)}")
            if jnp.dtype(arr.dtype) not in SCALE_DTYPES:
                raise ValueError(f"{name}.dtype must be float32 or bfloat16, got {arr.dtype}")
        if k_scale.dtype != v_scale.dtype:
            raise ValueError(f"k_scale {k_scale.dtype} and v_scale {v_scale.dtype} must have the same dtype")
    return shape


def check_rotate(rotate_keys, fmt: str) -> bool:
    """rotate_keys: a bool, and only for quantized arenas (a float arena stores keys as given)."""
    if not isinstance(rotate_keys, (bool, np.bool_)):
        raise ValueError(f"rotate_keys must be True or False, got {rotate_keys!r}")
    if rotate_keys and fmt == "float":
        raise ValueError("rotate_keys=True applies to quantized arenas (int8, fp8, int4) only")
    return bool(rotate_keys)


def check_layer(layer, num_layers: int):
    """A python int must lie in [0, num_layers); a traced one must be an integer scalar."""
    if isinstance(layer, bool):
        raise ValueError(f"layer must be an int, got {layer!r}")
    if isinstance(layer, int):
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer={layer} out of range [0, {num_layers})")
        return jnp.full((1,), layer, jnp.int32)
    layer = jnp.asarray(layer)
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got shape {layer.shape} dtype {layer.dtype}")
    return layer.astype(jnp.int32).reshape(1)


def check_rows(page_map, lengths, num_tokens, batch: int):
    """page_map i32[batch, M], lengths / num_tokens i32[batch]; returns int32 copies."""
    if getattr(page_map, "ndim", None) != 2 or page_map.shape[0] != batch:
        raise ValueError(f"page_map must be [batch={batch}, max_pages_per_seq], got shape {getattr(page_map, 'shape', None)}")
    if page_map.shape[1] < 1:
        raise ValueError("page_map must have at least one column (max_pages_per_seq >= 1)")
    out = [page_map]
    for name, arr in (("lengths", lengths), ("num_tokens", num_tokens)):
        arr = jnp.asarray(arr)
        if arr.shape != (batch,):
            raise ValueError(f"{name} must have shape ({batch},) (the batch), got {arr.shape}")
        out.append(arr)
    for name, arr in zip(("page_map", "lengths", "num_tokens"), out):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {arr.dtype}")
    return tuple(jnp.asarray(a).astype(jnp.int32) for a in out)


def check_tokens(name: str, x, *, batch: int | None, heads: int | None, head_dim: int):
    """x: [batch, tokens, heads, head_dim] in a supported float dtype."""
    if getattr(x, "ndim", None) != 4:
        raise ValueError(f"{name} must be 4-D [batch, tokens, heads, head_dim], got shape {getattr(x, 'shape', None)}")
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}.dtype must be one of bfloat16/float16/float32, got {x.dtype}")
    b, t, h, d = x.shape
    if batch is not None and b != batch:
        raise ValueError(f"{name} batch {b} != {batch}")
    if t < 1:
        raise ValueError(f"{name} must hold at least one token, got tokens={t}")
    if heads is not None and h != heads:
        raise ValueError(f"{name} has {h} heads, the arena holds {heads} KV heads")
    if d != head_dim:
        raise ValueError(f"{name} head_dim {d} != arena head_dim {head_dim}")


def check_sliding_window(sliding_window, max_keys: int):
    """(static window, traced window): an int >= 1 or None compiled into the kernel, or an
    i32[1] array passed as data. `max_keys` = max_pages * page_size, the most keys a row holds.

    Python / NumPy integers and concrete 0-d integer arrays must be >= 1 (ValueError); a
    window >= max_keys excludes nothing and becomes None. A traced integer scalar is passed as
    data, clipped into [0, max_keys] (the same mask, and no int32 overflow): a traced value
    <= 0 admits no key, so those queries give zeros.
    """
    if sliding_window is None:
        return None, None
    if isinstance(sliding_window, jax.core.Tracer):
        dtype = sliding_window.dtype
        if sliding_window.shape != () or dtype == jnp.bool_ or not jnp.issubdtype(dtype, jnp.integer):
            raise ValueError(f"sliding_window must be a positive int, None or a traced integer scalar, got a traced "
                             f"{dtype} of shape {sliding_window.shape}")
        return None, jnp.clip(sliding_window, 0, max_keys).astype(jnp.int32).reshape(1)
    value = _as_int(sliding_window) if getattr(sliding_window, "ndim", 0) == 0 else None
    if isinstance(sliding_window, (jax.Array, np.ndarray)) and sliding_window.dtype == np.bool_:
        value = None
    if value is None or value < 1:
        raise ValueError(f"sliding_window must be a positive int, None or a traced integer scalar, got {sliding_window!r}")
    return (None if value >= max_keys else value), None


def check_static_positive(name: str, value) -> float | None:
    """None, or a finite number > 0 known on the host (it is compiled into the kernel)."""
    if value is None:
        return None
    if isinstance(value, jax.core.Tracer):
        raise ValueError(f"{name} must be a concrete number (it is compiled into the kernel), got a traced value")
    number = None
    if not isinstance(value, (bool, np.bool_)) and np.ndim(value) == 0:
        try:
            number = float(np.asarray(value).item())
        except (TypeError, ValueError):
            number = None
    if number is None or not math.isfinite(number) or number <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return number


def index_of(*idx):
    """Broadcast integer index arrays (and scalars) to one common shape, as interpret mode needs."""
    shape = jnp.broadcast_shapes(*(jnp.shape(i) for i in idx))
    return tuple(jnp.broadcast_to(i, shape) for i in idx)

