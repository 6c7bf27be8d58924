"""`KVLayout`: the static geometry of an arena (a hashable jit static argument)."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import numpy as np

from arena_jax.hf.config import kv_geometry, read_hf_config  # read_hf_config: re-exported

__all__ = ["KVLayout", "ROW_ALIGN_BYTES", "ARENA_DTYPES", "QUANTIZED_DTYPES", "EIGHT_BIT_DTYPES", "SCALE_DTYPES",
           "INT4_GROUP", "ROTATE_KEYS_DEFAULT", "SMOOTH_KEYS_DEFAULT", "read_hf_config"]

# One token of one head (head_dim * itemsize) is a whole number of 16-byte vectors. Why this
# rule and no other:
# - It is what the hardware asks of a row: 16 bytes is the widest vector load/store (LDG.128,
#   cp.async) and the stride TMA requires (cuTensorMapEncode: global strides are multiples
#   of 16 bytes), so every token row, and so every page, of every head starts 16-byte aligned
#   whatever the page size; a future TMA kernel can stream pages as they are.
# - A page-level rule (the former 256-byte pages) forbade small pages of real heads (page 1 of
#   head_dim 96 in bf16 is 192 bytes) for no correctness reason: the kernels gather every key
#   row by itself, so page alignment beyond the row's buys nothing.
# - No real model is excluded: head sizes are multiples of 8 (bf16/fp16: 16 bytes) and of 16
#   for 8-bit arenas. int4 rows are head_dim / 2 bytes: head_dim a multiple of 32 (which is
#   also whole scale groups): 32, 64, 96, 128, 160, 192, 224, 256 (not 80 or 112).
# Which geometries the Pallas kernels take is a separate question (head_dim a multiple of 8 up
# to 256): `pallas_kernels.unsupported_reason`, asked by arena_jax's backend choice.
ROW_ALIGN_BYTES = 16

# What an arena can hold (what `jnp.zeros(..., dtype)` really stores, on every backend).
# 8-bit arenas also hold one scale per (layer, KV head, page, token): `pallas_kernels.quant`.
# int4 arenas store two codes a byte (uint8 arrays, head_dim / 2 wide) and one scale per
# group of INT4_GROUP lanes of each token: `pallas_kernels.quant4`.
EIGHT_BIT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")
QUANTIZED_DTYPES = EIGHT_BIT_DTYPES + ("int4",)
ARENA_DTYPES = ("bfloat16", "float16", "float32") + QUANTIZED_DTYPES
SCALE_DTYPES = ("float32", "bfloat16")
INT4_GROUP = 32
# Keys divided by static per-channel factors (`arena_jax.key_factors`) and then rotated
# (`pallas_kernels.rotation`) before quantization unless the layout says otherwise: on for
# int8 and int4 (`arena-bench accuracy`, 4 key channels x20: int8 7.0% -> 0.99%, int4 42% ->
# 15%; no cost without outliers), off for fp8, whose plain keys measured better in the issue's
# geometry and in 4 of 6 end-to-end runs with outlier keys (pallas_kernels/README.md).
SMOOTH_KEYS_DEFAULT = {"int8": True, "int4": True, "float8_e4m3fn": False, "float8_e5m2": False}
# The rotation's default for keys that are NOT smoothed: on where it lowers attention error
# (int8: 4-6x less at x10-x50 key outliers, int4: 1.5-2.5x at x10-x20), off where it raises it
# (fp8, at every outlier scale). Smoothed keys are rotated by default in every format.
ROTATE_KEYS_DEFAULT = {"int8": True, "int4": True, "float8_e4m3fn": False, "float8_e5m2": False}


def _canonical_dtype(dtype, name: str = "dtype") -> np.dtype:
    import jax.numpy as jnp  # local: keeps `layout` importable for pure arithmetic

    try:
        return np.dtype(jnp.dtype(dtype))
    except TypeError as exc:
        raise ValueError(f"{name}={dtype!r} is not a dtype JAX knows") from exc


def _scale_dtype(dtype: np.dtype, scale_dtype) -> np.dtype | None:
    """The scale dtype of an arena of `dtype`: float32 (default) or bfloat16 for 8-bit arenas,
    bfloat16 (default) or float32 for int4 (bf16: 3.56x bf16's tokens at head_dim 128, f32:
    3.2x), None for float arenas (which have no scales)."""
    if dtype.name not in QUANTIZED_DTYPES:
        if scale_dtype is not None:
            raise ValueError(f"scale_dtype={scale_dtype!r} applies to quantized (8-bit, int4) arenas only; a "
                             f"{dtype.name} arena has no scales")
        return None
    default = "bfloat16" if dtype.name == "int4" else "float32"
    scale = _canonical_dtype(default if scale_dtype is None else scale_dtype, "scale_dtype")
    if scale.name not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype={scale.name} is not supported: scales are one of {', '.join(SCALE_DTYPES)}")
    return scale


def _key_option(name: str, value, default: bool, dtype: np.dtype) -> bool:
    """`rotate_keys` / `smooth_keys`: None takes `default`; True only for quantized arenas."""
    if value is None:
        return bool(default)
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True, False or None (the format's default), got {value!r}")
    if value and dtype.name not in QUANTIZED_DTYPES:
        raise ValueError(f"{name}=True applies to quantized (8-bit, int4) arenas only; a {dtype.name} arena stores "
                         "keys as given")
    return bool(value)


def _bits(dtype: np.dtype) -> int:
    return 4 if dtype.name == "int4" else 8 * dtype.itemsize


def _scale_groups(head_dim: int, dtype: np.dtype) -> int:
    """Scales per token row: 0 (float), 1 (8-bit), head_dim / 32 (int4)."""
    if dtype.name == "int4":
        return head_dim // INT4_GROUP
    return 1 if dtype.name in QUANTIZED_DTYPES else 0


def _bytes_per_token(num_layers, num_kv_heads, head_dim, dtype: np.dtype, scale_dtype: np.dtype | None) -> int:
    scale = _scale_groups(head_dim, dtype) * scale_dtype.itemsize if scale_dtype is not None else 0
    return 2 * num_layers * num_kv_heads * (head_dim * _bits(dtype) // 8 + scale)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Arena geometry. Only KV heads are stored: GQA/MQA size by `num_kv_heads`.

    Arena buffers `k`, `v` are each `[num_layers, num_kv_heads, num_pages, page_size, head_dim]`.
    `dtype`: bfloat16, float16, float32, an 8-bit format (int8, float8_e4m3fn, float8_e5m2) or
    int4. An 8-bit arena also holds `k_scale`, `v_scale`: `[num_layers, num_kv_heads,
    num_pages, page_size]` in `scale_dtype` (float32 by default, or bfloat16), one per token and
    KV head. An int4 arena stores `k`, `v` as uint8 `[..., head_dim / 2]` (two codes a byte)
    and one scale per group of 32 lanes, `k_scale`, `v_scale`: `[num_layers, num_kv_heads,
    num_pages, page_size, head_dim / 32]` (bfloat16 by default, or float32). Scales are in the
    same paged geometry as the values, so every page operation moves them together.
    `scale_dtype` is None for float arenas. Sizes (`bytes_per_token`, `page_bytes`,
    `arena_bytes`, `for_memory_budget`) count every scale.

    `rotate_keys` (quantized arenas): keys are rotated by a fixed randomized Hadamard transform
    before quantization and queries by the same one in attention (`pallas_kernels.rotation`),
    which spreads outlier channels over the whole row; scores are unchanged up to rounding.
    None: on for smoothed keys, else `ROTATE_KEYS_DEFAULT[dtype]` (int8, int4: on; fp8: off);
    float arenas: False.

    `smooth_keys` (quantized arenas): each layer's keys are divided by static per-channel
    factors (powers of two, fixed when the cache is created: `aj.create(layout, key_factors=)`,
    `arena_jax.key_factors`) before
    rotation and quantization, and queries multiplied by them, so outlier channels stop setting
    every token's scale; scores are unchanged (the factors are exact). The cache then carries
    `key_factors: f32[num_layers, num_kv_heads, head_dim]`. None takes
    `SMOOTH_KEYS_DEFAULT[dtype]` (int8, int4: on; fp8: off); float arenas: False.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    max_seqs: int
    max_pages_per_seq: int
    dtype: Any = "bfloat16"
    scale_dtype: Any = None
    rotate_keys: Any = None
    smooth_keys: Any = None

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "num_pages", "max_seqs", "max_pages_per_seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        dtype = _canonical_dtype(self.dtype)
        if dtype.name not in ARENA_DTYPES:
            raise ValueError(
                f"dtype={dtype.name} is not supported: the arena stores one of {', '.join(ARENA_DTYPES)}"
                + (" (JAX without jax_enable_x64 would store float64 as float32)" if dtype.name == "float64" else "")
            )
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "scale_dtype", _scale_dtype(dtype, self.scale_dtype))
        smooth = _key_option("smooth_keys", self.smooth_keys, SMOOTH_KEYS_DEFAULT.get(dtype.name, False), dtype)
        object.__setattr__(self, "smooth_keys", smooth)
        rotate = _key_option("rotate_keys", self.rotate_keys, smooth or ROTATE_KEYS_DEFAULT.get(dtype.name, False), dtype)
        object.__setattr__(self, "rotate_keys", rotate)
        if dtype.name == "int4":
            row = self.head_dim // 2
            if self.head_dim % (2 * ROW_ALIGN_BYTES):
                raise ValueError(
                    f"head_dim * 4 bits = {self.head_dim}*4 bits = {self.head_dim / 2:g} bytes must be a multiple of "
                    f"{ROW_ALIGN_BYTES} bytes (one token of one head: 16-byte vector loads and TMA strides); int4 "
                    f"arenas need head_dim a multiple of 32 (32, 64, 96, 128, ...), which is also whole groups of "
                    f"{INT4_GROUP} lanes per scale"
                )
        row = self.head_dim * _bits(dtype) // 8
        if row % ROW_ALIGN_BYTES:
            raise ValueError(
                f"head_dim * itemsize = {self.head_dim}*{dtype.itemsize} = {row} bytes must be a multiple of "
                f"{ROW_ALIGN_BYTES} bytes (one token of one head: 16-byte vector loads and TMA strides"
                + ("; 8-bit arenas need head_dim a multiple of 16)" if dtype.itemsize == 1 else ")")
            )
        if self.num_pages >= np.iinfo(np.int32).max or self.max_pages_per_seq * self.page_size >= np.iinfo(np.int32).max:
            raise ValueError("num_pages and max_pages_per_seq * page_size must fit in int32")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        """Bytes of one stored element (`dtype.itemsize`; int4 packs two codes in one byte: see `bits`)."""
        return self.dtype.itemsize

    @property
    def bits(self) -> int:
        """Bits of one value: 32, 16, 8, or 4 (int4)."""
        return _bits(self.dtype)

    @property
    def quantized(self) -> bool:
        """A quantized arena (8-bit or int4: values plus scales)."""
        return self.scale_dtype is not None

    @property
    def int4(self) -> bool:
        return self.dtype.name == "int4"

    @property
    def storage_dtype(self) -> np.dtype:
        """The dtype of the `k`, `v` arrays: `dtype`, or uint8 for int4 (two codes a byte)."""
        return np.dtype(np.uint8) if self.int4 else self.dtype

    @property
    def scale_groups(self) -> int:
        """Scales per token row of one head: 0 (float), 1 (8-bit), head_dim / 32 (int4)."""
        return _scale_groups(self.head_dim, self.dtype)

    @property
    def scale_bytes_per_token(self) -> int:
        """The scales' share of `bytes_per_token` (K and V, all layers and KV heads)."""
        if not self.quantized:
            return 0
        return 2 * self.num_layers * self.num_kv_heads * self.scale_groups * self.scale_dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers and KV heads, scales included:
        `2 * num_layers * num_kv_heads * (head_dim * bits / 8 + scale_groups * scale itemsize)`."""
        return _bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.scale_dtype)

    @property
    def page_bytes(self) -> int:
        """One page id spans all layers and heads, K and V."""
        return self.bytes_per_token * self.page_size

    @property
    def arena_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    @property
    def max_seq_len(self) -> int:
        return self.max_pages_per_seq * self.page_size

    @property
    def token_capacity(self) -> int:
        return self.num_pages * self.page_size

    @property
    def arena_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of `k` / `v`; the last axis is head_dim, or head_dim / 2 bytes for int4."""
        row = self.head_dim // 2 if self.int4 else self.head_dim
        return (self.num_layers, self.num_kv_heads, self.num_pages, self.page_size, row)

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Shape of `k_scale` / `v_scale`: one scale per token of each page and head (8-bit), or
        per group of 32 lanes of each token (int4: a trailing head_dim / 32 axis). On a TPU, an
        8-bit arena at pages of 16, 32 or 64 stores the same scales as rows of 128 lanes
        (`stores_scale_rows`, `scale_rows_shape`)."""
        shape = (self.num_layers, self.num_kv_heads, self.num_pages, self.page_size)
        return shape + (self.scale_groups,) if self.int4 else shape

    def stores_scale_rows(self, platform: str, pages: int | None = None) -> bool:
        """Whether an arena of this layout on `platform` stores its 8-bit scales as rows of 128
        lanes (`KVCache.scale_rows`): on a TPU, float32 scales at pages of 16, 32 or 64 whose
        kernels take them, with `pages` (a data shard's; default all) x page_size a multiple of 128."""
        from pallas_kernels.tpu.common import TPU_SCALE_ROW_PAGES, tpu_unsupported_reason

        pages = self.num_pages if pages is None else pages
        return (platform == "tpu" and self.quantized and not self.int4 and self.page_size in TPU_SCALE_ROW_PAGES
                and (pages * self.page_size) % 128 == 0
                and tpu_unsupported_reason(head_dim=self.head_dim, page_size=self.page_size, dtype=self.storage_dtype,
                                           scale_dtype=self.scale_dtype, scale_rows=True) is None)

    def scale_rows_shape(self, pages: int | None = None) -> tuple[int, int, int, int]:
        """The shape of scale rows (`stores_scale_rows`) over `pages` (default all)."""
        pages = self.num_pages if pages is None else pages
        return (self.num_layers, self.num_kv_heads, pages * self.page_size // 128, 128)

    @property
    def key_factors_shape(self) -> tuple[int, int, int]:
        """Shape of `key_factors` (`smooth_keys`): one factor per layer, KV head and channel."""
        return (self.num_layers, self.num_kv_heads, self.head_dim)

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.page_size)

    # ---- constructors --------------------------------------------------------------
    @classmethod
    def for_memory_budget(
        cls,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        budget_bytes: int,
        page_size: int = 16,
        max_seqs: int = 256,
        max_seq_len: int = 8192,
        dtype: Any = "bfloat16",
        scale_dtype: Any = None,
        rotate_keys: Any = None,
        smooth_keys: Any = None,
    ) -> "KVLayout":
        """As many pages as `budget_bytes` holds (K and V, all layers, every scale of a quantized arena included)."""
        dt = _canonical_dtype(dtype)
        sdt = _scale_dtype(dt, scale_dtype) if dt.name in ARENA_DTYPES else None  # others: __post_init__ says why
        per_page = _bytes_per_token(num_layers, num_kv_heads, head_dim, dt, sdt) * page_size
        num_pages = int(budget_bytes) // per_page
        if num_pages < 1:
            raise ValueError(f"budget_bytes={budget_bytes} holds no page: one page needs {per_page} bytes")
        return cls(
            num_layers=num_layers,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            num_pages=num_pages,
            max_seqs=max_seqs,
            max_pages_per_seq=-(-max_seq_len // page_size),
            dtype=dtype,
            scale_dtype=scale_dtype,
            rotate_keys=rotate_keys,
            smooth_keys=smooth_keys,
        )

    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any] | str | os.PathLike,
        *,
        page_size: int = 16,
        num_pages: int | None = None,
        budget_bytes: int | None = None,
        max_seqs: int = 256,
        max_seq_len: int | None = None,
        dtype: Any = None,
        scale_dtype: Any = None,
        rotate_keys: Any = None,
        smooth_keys: Any = None,
    ) -> "KVLayout":
        """Geometry from a Hugging Face `config.json` (a dict, the file, or its folder).

        Read by `arena_jax.hf.config` with transformers' defaults and strict types (Llama /
        Mistral; other model types must give their KV geometry explicitly).
        KV heads: `num_key_value_heads`, else `num_attention_heads`.
        head_dim: `head_dim`, else `hidden_size // num_attention_heads`.
        dtype: the config's `dtype` / `torch_dtype`, else bfloat16 (give e.g. "int8" for an 8-bit
        arena, "int4" for a 4-bit one; `scale_dtype` then float32 or bfloat16, `rotate_keys` and
        `smooth_keys` as in the class). max_seq_len: `max_position_embeddings`.
        Give exactly one of `num_pages` and `budget_bytes`.
        """
        if (num_pages is None) == (budget_bytes is None):
            raise ValueError("give exactly one of num_pages and budget_bytes")
        geometry = kv_geometry(config)
        if dtype is None:
            dtype = geometry.dtype or "bfloat16"
        if max_seq_len is None:
            if geometry.max_position_embeddings is None:
                raise ValueError("the config gives no max_position_embeddings: pass max_seq_len")
            max_seq_len = geometry.max_position_embeddings
        if budget_bytes is not None:
            return cls.for_memory_budget(
                geometry.num_layers,
                geometry.num_kv_heads,
                geometry.head_dim,
                budget_bytes=budget_bytes,
                page_size=page_size,
                max_seqs=max_seqs,
                max_seq_len=max_seq_len,
                dtype=dtype,
                scale_dtype=scale_dtype,
                rotate_keys=rotate_keys,
                smooth_keys=smooth_keys,
            )
        return cls(
            num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            page_size=page_size,
            num_pages=num_pages,
            max_seqs=max_seqs,
            max_pages_per_seq=math.ceil(max_seq_len / page_size),
            dtype=dtype,
            scale_dtype=scale_dtype,
            rotate_keys=rotate_keys,
            smooth_keys=smooth_keys,
        )
