"""The TPU kernel variants `arena_jax` can dispatch, as shapes to compile for v5e / v6e (`tpu_compile`).

A variant is what `aj.append` / `aj.attend` would call (default tiles) at serving-sized shapes:
8 KV heads, 4096-token page tables, an arena of 2 layers x 2048 pages. `CI_VARIANTS` covers every
kind (decode, prefill, chunked prefill, static and traced windows, soft-cap, both appends), both
head sizes (128, 256), page sizes 8 to 256, GQA groups 1 / 4 / 8, bf16 and f32 arenas and every
8-bit dtype (pages 128 / 256, float32 scales, bf16 or f32 q), each at least once: the geometries
`tpu_unsupported_reason` admits. `tests/test_compile_tpu.py` compiles them for v5e (and a subset
for v6e); `arena-bench kernels --compile-report --target tpu-v5e` prints their facts.

`kv_bytes` is what the call must move at its workload (every row at the page table's full
length, or its window): the KV (and scales) attention reads, the new rows append writes.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.tpu.append import tpu_paged_append
from pallas_kernels.tpu.attention import tpu_paged_attention

__all__ = ["TpuVariant", "CI_VARIANTS", "V6E_VARIANTS", "KINDS"]

KV_HEADS = 8
LAYERS = 2
PAGES = 2048
CONTEXT = 4096
WINDOW = 1024
SOFT_CAP = 50.0
KINDS = ("decode", "prefill", "chunked", "window-decode", "traced-window", "softcap-decode", "append-decode",
         "append-prefill")
# kind -> (batch, new tokens per row)
_SHAPES = {"decode": (32, 1), "prefill": (4, 256), "chunked": (4, 16), "window-decode": (32, 1),
           "traced-window": (4, 256), "softcap-decode": (32, 1), "append-decode": (32, 1), "append-prefill": (4, 256)}
QUANT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2")


@dataclasses.dataclass(frozen=True)
class TpuVariant:
    kind: str
    dtype: str = "bfloat16"
    head_dim: int = 128
    page_size: int = 16
    group: int = 4
    compute_dtype: str | None = None  # q (and k, v for append) of an 8-bit arena; default bfloat16

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANT_DTYPES

    @property
    def compute(self) -> str:
        return (self.compute_dtype or "bfloat16") if self.quantized else self.dtype

    @property
    def label(self) -> str:
        short = {"bfloat16": "bf16", "float32": "fp32", "int8": "int8", "float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}
        dt = short[self.dtype] + (f"/{short[self.compute]}" if self.quantized else "")
        g = "" if self.kind.startswith("append") else f" g{self.group}"
        return f"{self.kind} {dt} d{self.head_dim} p{self.page_size}{g}"

    @property
    def batch_tokens(self) -> tuple[int, int]:
        return _SHAPES[self.kind]

    def kv_bytes(self) -> int:
        """Bytes the call must move: attention reads every visible key's K and V (and scales)
        at full context (or window); append writes the new tokens' rows (and scales)."""
        batch, tokens = self.batch_tokens
        row = 2 * KV_HEADS * (self.head_dim * jnp.dtype(self.dtype).itemsize + (4 if self.quantized else 0))
        if self.kind.startswith("append"):
            return batch * tokens * row
        keys = min(CONTEXT, WINDOW + tokens - 1) if self.kind in ("window-decode", "traced-window") else CONTEXT
        return batch * keys * row

    def arena_bytes(self) -> int:
        return LAYERS * KV_HEADS * PAGES * self.page_size * self.head_dim * jnp.dtype(self.dtype).itemsize

    def call(self):
        """(fn, args, donate_argnums): `jax.jit(fn, donate_argnums=...)(*args)` runs this variant."""
        batch, tokens = self.batch_tokens
        sds = jax.ShapeDtypeStruct
        compute = jnp.dtype(self.compute)
        arena = sds((LAYERS, KV_HEADS, PAGES, self.page_size, self.head_dim), jnp.dtype(self.dtype))
        scale = sds((LAYERS, KV_HEADS, PAGES, self.page_size), jnp.float32)
        rows = (sds((batch, CONTEXT // self.page_size), jnp.int32), sds((batch,), jnp.int32), sds((batch,), jnp.int32))
        layer = sds((), jnp.int32)
        quantized = self.quantized
        if self.kind.startswith("append"):
            kv = sds((batch, tokens, KV_HEADS, self.head_dim), compute)

            def append(ka, va, layer, k, v, pm, lengths, n, *scales):
                kw = dict(k_scale=scales[0], v_scale=scales[1]) if quantized else {}
                return tpu_paged_append(ka, va, layer, k, v, pm, lengths, n, interpret=False, **kw)

            extra = (scale, scale) if quantized else ()
            donate = (0, 1, 8, 9) if quantized else (0, 1)
            return append, (arena, arena, layer, kv, kv, *rows, *extra), donate
        q = sds((batch, tokens, KV_HEADS * self.group, self.head_dim), compute)
        window = WINDOW if self.kind == "window-decode" else None
        cap = SOFT_CAP if self.kind == "softcap-decode" else None
        traced = self.kind == "traced-window"

        def attend(q, ka, va, layer, pm, lengths, n, *rest):
            kw = dict(k_scale=rest[0], v_scale=rest[1]) if quantized else {}
            w = rest[-1] if traced else window
            return tpu_paged_attention(q, ka, va, layer, pm, lengths, n, sliding_window=w, logits_soft_cap=cap,
                                       interpret=False, **kw)

        extra = ((scale, scale) if quantized else ()) + ((sds((), jnp.int32),) if traced else ())
        return attend, (q, arena, arena, layer, *rows, *extra), ()


def _ci_variants() -> tuple[TpuVariant, ...]:
    v = TpuVariant
    return (
        v("decode"),  # bf16, head 128, page 16, GQA 4: Llama-3-8B decode
        v("decode", head_dim=256, page_size=256, group=8),
        v("decode", "float32", page_size=8, group=1),
        v("prefill"),
        v("prefill", "float32", head_dim=256, page_size=64, group=8),
        v("chunked", page_size=32),
        v("window-decode"),
        v("traced-window", group=1),
        v("softcap-decode", head_dim=256, group=2),
        v("append-decode"),
        v("append-prefill", head_dim=256, page_size=256),
        v("append-decode", "float32", page_size=8),
        v("decode", "int8", page_size=128),
        v("prefill", "float8_e4m3fn", page_size=256, group=8),
        v("decode", "float8_e5m2", head_dim=256, page_size=128, group=1, compute_dtype="float32"),
        v("append-prefill", "int8", page_size=128),
        v("append-decode", "float8_e4m3fn", head_dim=256, page_size=256),
    )


CI_VARIANTS = _ci_variants()
# v6e: the same kernels; one of each family (float attention, 8-bit attention, append).
V6E_VARIANTS = tuple(CI_VARIANTS[i] for i in (0, 12, 15))
