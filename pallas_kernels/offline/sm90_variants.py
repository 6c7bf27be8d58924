"""The kernel variants `arena_jax` can dispatch, as shapes to compile for sm_90a (`pallas_kernels.offline.sm90`).

A variant is what `aj.append` / `aj.attend` would call with default tiles (`BlockSizes`
defaults chosen from the shapes), at serving-sized shapes: 8 KV heads, 4096-token contexts.

`CI_VARIANTS` is the matrix `tests/test_compile_sm90.py` compiles and `arena-bench kernels
--compile-report` prints. It is not the full product of its axes (kinds x dtypes x head sizes x
page sizes x GQA groups would be thousands of compiles); it covers every value of every axis at
least once, at the point where that value is riskiest, plus the combinations that set register
pressure and shared memory:
- every kind (decode with one split and with several, prefill, chunked prefill with a prefix,
  sliding window in decode and prefill, append in decode and prefill) in bf16, fp16 and fp32 at
  the widest tile (head_dim 256) and GQA group 8 (the most query rows);
- every head size (64, 80, 96, 112, 120, 128, 160, 192, 256) in decode and prefill (bf16,
  group 4, page 16), and in append;
- every page size (1 ... 256) in decode and prefill at head_dim 128 (and 256 for the two
  extremes), where page lookups per key are most (page 1) or a page spans several steps (256);
- GQA groups 1, 4, 5, 6, 8, 16 and 71 (Falcon-7B's multi-query attention: split over
  programs of 64 query heads, 16 in float32) in decode and prefill at awkward head sizes;
- 8-bit arenas (int8, float8_e4m3fn, float8_e5m2 values, float32 scales, bf16 q/k/v) at
  head_dim 256 and group 8: int8 in decode with one and several splits, prefill and both
  appends; e4m3 and e5m2 (which differ from int8 only in the conversion) in split decode,
  prefill and prefill append; and decode at head_dim 128 with fp32 (FMA dots, one pipeline
  stage) and fp16 (V tile dequantized) compute. The window and chunked kinds only move loop
  bounds, which 8-bit arenas do not touch;
- the attention options, where they add code: logit soft-capping (`cap`: a tanh per score)
  and traced windows (`wt`: the window read from memory, loop bounds computed from it) in
  split decode, prefill and 8-bit arenas (bf16 at head_dim 256 / group 8, the most rows and
  lanes) and in float32 prefill (FMA dots, whose register use is the most erratic);
- arenas of another dtype than q (`bf16/fp32`: the K/V tiles converted to q's dtype, the
  dots in q's dtype): a bf16 arena with float32 q (decode, split decode, prefill) and with
  float16 q (prefill);
- rotated keys (`rot`: the rotation as dots before quantization in append, and on q before
  the loop in attention) and int4 arenas (uint8 pages, bf16 group scales, group-by-group
  dots), each where it has its own tiles or code: int4 rotated in split decode, prefill and
  append-decode at head_dim 256 / group 8 (8 groups: the most parts and accumulators; 16 x 16
  prefill tiles, 64-token append blocks), prefill at 128 / group 4 (64 rows, 32 keys), decode
  and append at head_dim 96 (a Paley Hadamard, a padded tile), f32 (FMA) prefill and f16
  (dequantized V) decode, soft-cap and traced windows; int4 unrotated in prefill and append;
  int8 rotated in split decode, prefill and append-decode at 256 / 8, with f32 q (the exact
  three-dot split of q), and an f32 append (keys rotated by XLA first).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.gpu.append import paged_append
from pallas_kernels.gpu.attention import paged_attention

__all__ = ["Variant", "CI_VARIANTS", "KINDS", "HEAD_DIMS", "PAGE_SIZES", "GROUPS", "DTYPES", "QUANT_DTYPES", "QUANT_KINDS"]

KV_HEADS = 8
LAYERS = 2
CONTEXT = 4096  # tokens each row's page table can hold
KINDS = ("decode", "decode-split", "prefill", "chunked", "window-decode", "window-prefill", "append-decode",
         "append-prefill")
DTYPES = ("bfloat16", "float16", "float32")
# 8-bit arenas: q, k, v in bfloat16 (`Variant.compute`), the arena int8 / fp8 with float32 scales.
QUANT_DTYPES = ("int8", "float8_e4m3fn", "float8_e5m2", "int4")
QUANT_KINDS = ("decode", "decode-split", "prefill", "append-decode", "append-prefill")
HEAD_DIMS = (64, 80, 96, 112, 120, 128, 160, 192, 256)
PAGE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GROUPS = (1, 4, 5, 6, 8, 16, 71)  # 71: Falcon-7B (71 query heads, 1 KV head)

# kind -> (batch, new tokens per row, sliding window); decode batch 64 x 8 KV heads fills an H100
# in one split, batch 4 needs several; a chunk is 16 new tokens after a 4080-token prefix.
_SHAPES = {
    "decode": (64, 1, None),
    "decode-split": (4, 1, None),
    "prefill": (4, 128, None),
    "chunked": (4, 16, None),
    "window-decode": (4, 1, 1024),
    "window-prefill": (4, 128, 1024),
    "append-decode": (64, 1, None),
    "append-prefill": (4, 128, None),
}


@dataclasses.dataclass(frozen=True)
class Variant:
    kind: str
    dtype: str = "bfloat16"
    head_dim: int = 128
    page_size: int = 16
    group: int = 4  # query heads per KV head

    compute_dtype: str | None = None  # q's dtype (and k, v given to append): default the arena's, bf16 if 8-bit
    soft_cap: bool = False  # attention: logits_soft_cap=50.0
    traced_window: bool = False  # window kinds: the window passed as a traced int32 scalar
    rotate: bool = False  # quantized arenas: keys rotated (append) and q rotated (attention)

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANT_DTYPES

    @property
    def compute(self) -> str:
        """The dtype of q, k, v: `compute_dtype`, else the arena's (bfloat16 for 8-bit arenas)."""
        return self.compute_dtype or ("bfloat16" if self.quantized else self.dtype)

    @property
    def label(self) -> str:
        short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int8": "int8", "float8_e4m3fn": "e4m3",
                 "float8_e5m2": "e5m2", "int4": "int4"}
        dt = short[self.dtype] + (f"/{short[self.compute]}" if self.compute != self.dtype else "")
        g = "" if self.kind.startswith("append") else f" g{self.group}"
        options = (" cap" if self.soft_cap else "") + (" wt" if self.traced_window else "") + (" rot" if self.rotate else "")
        return f"{self.kind} {dt} d{self.head_dim} p{self.page_size}{g}{options}"

    def call(self):
        """(fn, args): `jax.jit(fn)(*args)` runs this variant; args are ShapeDtypeStructs."""
        batch, tokens, window = _SHAPES[self.kind]
        sds = jax.ShapeDtypeStruct
        dtype = jnp.dtype(jnp.uint8 if self.dtype == "int4" else self.dtype)
        compute = jnp.dtype(self.compute)
        max_pages = -(-CONTEXT // self.page_size)
        if self.dtype == "int4":  # uint8 pages (two codes a byte), bf16 scales per group of 32 lanes
            arena = sds((LAYERS, KV_HEADS, 1024, self.page_size, self.head_dim // 2), jnp.uint8)
            scales = sds((LAYERS, KV_HEADS, 1024, self.page_size, self.head_dim // 32), jnp.bfloat16)
        else:
            arena = sds((LAYERS, KV_HEADS, 1024, self.page_size, self.head_dim), dtype)
            scales = sds((LAYERS, KV_HEADS, 1024, self.page_size), jnp.float32) if self.quantized else None
        rows = (sds((batch, max_pages), jnp.int32), sds((batch,), jnp.int32), sds((batch,), jnp.int32))
        layer = sds((), jnp.int32)
        if self.kind.startswith("append"):
            kv = sds((batch, tokens, KV_HEADS, self.head_dim), compute)
            if self.quantized:
                def fn(ka, va, layer, k, v, pm, lengths, n, ks, vs):
                    return paged_append(ka, va, layer, k, v, pm, lengths, n, k_scale=ks, v_scale=vs,
                                        rotate_keys=self.rotate, interpret=False)

                return fn, (arena, arena, layer, kv, kv, *rows, scales, scales)
            fn = functools.partial(paged_append, interpret=False)
            return fn, (arena, arena, layer, kv, kv, *rows)
        q = sds((batch, tokens, KV_HEADS * self.group, self.head_dim), compute)
        cap = 50.0 if self.soft_cap else None
        traced = self.traced_window and window is not None
        extra = ((scales, scales) if self.quantized else ()) + ((sds((), jnp.int32),) if traced else ())

        def fn(q, ka, va, layer, pm, lengths, n, *extra):
            ks, vs = extra[:2] if self.quantized else (None, None)
            w = extra[-1] if traced else window
            return paged_attention(q, ka, va, layer, pm, lengths, n, k_scale=ks, v_scale=vs, sliding_window=w,
                                   logits_soft_cap=cap, rotate_keys=self.rotate, interpret=False)

        return fn, (q, arena, arena, layer, *rows, *extra)


def _ci_variants() -> tuple[Variant, ...]:
    out = []
    for dtype in DTYPES:  # every kind x dtype, widest tile, most rows
        out += [Variant(kind, dtype, head_dim=256, group=8) for kind in KINDS]
    for d in HEAD_DIMS:  # every head size
        out += [Variant("decode", head_dim=d), Variant("prefill", head_dim=d), Variant("append-prefill", head_dim=d)]
    for p in PAGE_SIZES:  # every page size
        out += [Variant("decode", head_dim=128, page_size=p, group=8), Variant("prefill", head_dim=128, page_size=p)]
    for p in (1, 256):
        out += [Variant("decode-split", head_dim=256, page_size=p, group=8),
                Variant("prefill", "float32", head_dim=256, page_size=p, group=8)]
    for d in (64, 96, 128):  # float32 at narrower heads (other tiles than 256)
        out += [Variant("decode", "float32", head_dim=d, group=4), Variant("prefill", "float32", head_dim=d, group=4)]
    for g in GROUPS:  # every GQA group; odd ones at odd head sizes
        out += [Variant("decode", head_dim=96, group=g), Variant("prefill", head_dim=80, group=g)]
    # 8-bit arenas (bf16 compute), widest tile, most rows: every kind they change in int8; the
    # fp8 formats differ from it only in the conversion, so split decode, prefill and append.
    out += [Variant(kind, "int8", head_dim=256, group=8) for kind in QUANT_KINDS]
    for dtype in QUANT_DTYPES[1:3]:  # (int4: below)
        out += [Variant(kind, dtype, head_dim=256, group=8) for kind in ("decode-split", "prefill", "append-prefill")]
    out += [Variant("decode", "int8", head_dim=128, group=4, compute_dtype="float32"),  # f32 models: FMA dots
            Variant("decode", "float8_e5m2", head_dim=128, group=4, compute_dtype="float16")]  # fp16: V tile dequantized
    out += [Variant("decode-split", "float16", head_dim=112, page_size=8, group=5),
            Variant("decode", "float32", head_dim=64, group=71), Variant("prefill", "float32", head_dim=64, group=71),
            Variant("chunked", "bfloat16", head_dim=160, page_size=32, group=6)]
    # Attention options where they add code: soft-cap and traced windows in split decode,
    # prefill, 8-bit arenas and fp32 FMA prefill; arenas of another dtype than q.
    out += [Variant("decode-split", head_dim=256, group=8, soft_cap=True),
            Variant("window-decode", head_dim=256, group=8, traced_window=True),
            Variant("window-decode", "float16", head_dim=256, group=8, soft_cap=True, traced_window=True),
            Variant("window-prefill", head_dim=256, group=8, soft_cap=True, traced_window=True),
            Variant("window-prefill", "float32", head_dim=256, group=8, soft_cap=True, traced_window=True),
            Variant("window-decode", "int8", head_dim=256, group=8, soft_cap=True, traced_window=True),
            Variant("window-prefill", "int8", head_dim=256, group=8, soft_cap=True, traced_window=True)]
    out += [Variant("decode", "bfloat16", head_dim=128, group=4, compute_dtype="float32"),
            Variant("decode-split", "bfloat16", head_dim=256, group=8, compute_dtype="float32"),
            Variant("prefill", "bfloat16", head_dim=128, group=4, compute_dtype="float32"),
            Variant("prefill", "bfloat16", head_dim=256, group=8, compute_dtype="float16")]
    # Rotated keys and int4 arenas (bf16 q unless said), each where it has its own tiles or code.
    out += [Variant(kind, "int4", head_dim=256, group=8, rotate=True) for kind in ("decode-split", "prefill",
                                                                                   "append-decode")]
    out += [Variant("prefill", "int4", head_dim=128, group=4, rotate=True),  # 64 rows, 32 keys
            Variant("decode", "int4", head_dim=96, group=4, rotate=True),  # a Paley Hadamard, a padded tile
            Variant("append-prefill", "int4", head_dim=96, rotate=True),
            Variant("prefill", "int4", head_dim=128, group=4, compute_dtype="float32", rotate=True),
            Variant("decode", "int4", head_dim=128, group=4, compute_dtype="float16", rotate=True),
            Variant("window-prefill", "int4", head_dim=256, group=8, soft_cap=True, traced_window=True, rotate=True),
            Variant("prefill", "int4", head_dim=256, group=8),  # unrotated
            Variant("append-prefill", "int4", head_dim=128)]
    out += [Variant(kind, "int8", head_dim=256, group=8, rotate=True) for kind in ("decode-split", "prefill",
                                                                                   "append-decode")]
    out += [Variant("decode", "int8", head_dim=128, group=4, compute_dtype="float32", rotate=True),
            Variant("append-prefill", "int8", head_dim=256, compute_dtype="float32", rotate=True)]
    seen, unique = set(), []
    for v in out:
        if v.kind.startswith("append"):  # append has no query heads: the group does not matter
            v = dataclasses.replace(v, group=1)
        if v not in seen:
            seen.add(v)
            unique.append(v)
    return tuple(unique)


CI_VARIANTS = _ci_variants()
