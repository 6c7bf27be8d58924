"""`KVLayout`: the static geometry of an arena (a hashable jit static argument)."""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import numpy as np

from arena_jax.hf_config import kv_geometry, read_hf_config  # read_hf_config: re-exported

__all__ = ["KVLayout", "ROW_ALIGN_BYTES", "ARENA_DTYPES", "read_hf_config"]

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
#   for 8-bit arenas.
# Which geometries the Pallas kernels take is a separate question (head_dim a multiple of 8 up
# to 256): `pallas_kernels.unsupported_reason`, asked by arena_jax's backend choice.
ROW_ALIGN_BYTES = 16

# What an arena can hold (what `jnp.zeros(..., dtype)` really stores, on every backend).
ARENA_DTYPES = ("bfloat16", "float16", "float32")


def _canonical_dtype(dtype) -> np.dtype:
    import jax.numpy as jnp  # local: keeps `layout` importable for pure arithmetic

    try:
        return np.dtype(jnp.dtype(dtype))
    except TypeError as exc:
        raise ValueError(f"dtype={dtype!r} is not a floating dtype JAX knows") from exc


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """Arena geometry. Only KV heads are stored: GQA/MQA size by `num_kv_heads`.

    Arena buffers `k`, `v` are each `[num_layers, num_kv_heads, num_pages, page_size, head_dim]`.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    num_pages: int
    max_seqs: int
    max_pages_per_seq: int
    dtype: Any = "bfloat16"

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
        row = self.head_dim * dtype.itemsize
        if row % ROW_ALIGN_BYTES:
            raise ValueError(
                f"head_dim * itemsize = {self.head_dim}*{dtype.itemsize} = {row} bytes must be a multiple of "
                f"{ROW_ALIGN_BYTES} bytes (one token of one head: 16-byte vector loads and TMA strides)"
            )
        if self.num_pages >= np.iinfo(np.int32).max or self.max_pages_per_seq * self.page_size >= np.iinfo(np.int32).max:
            raise ValueError("num_pages and max_pages_per_seq * page_size must fit in int32")

    # ---- derived sizes -------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token across all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

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
        return (self.num_layers, self.num_kv_heads, self.num_pages, self.page_size, self.head_dim)

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
    ) -> "KVLayout":
        """As many pages as `budget_bytes` holds (K and V, all layers)."""
        per_page = 2 * num_layers * num_kv_heads * head_dim * _canonical_dtype(dtype).itemsize * page_size
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
    ) -> "KVLayout":
        """Geometry from a Hugging Face `config.json` (a dict, the file, or its folder).

        Read by `arena_jax.hf_config` with transformers' defaults and strict types (Llama /
        Mistral; other model types must give their KV geometry explicitly).
        KV heads: `num_key_value_heads`, else `num_attention_heads`.
        head_dim: `head_dim`, else `hidden_size // num_attention_heads`.
        dtype: the config's `dtype` / `torch_dtype`, else bfloat16. max_seq_len: `max_position_embeddings`.
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
        )
