"""Pallas kernels for the paged KV cache, each with a plain-jnp reference: how does the cache write
and read its pages on a GPU or TPU, and by which rules must every backend do it?

    paged_append(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens) -> (k_arena, v_arena)
    paged_attention(q, k_arena, v_arena, layer, page_map, lengths, num_tokens) -> out

Here, shared by every backend: the contract (shapes, masking, sliding window: `reference`), the
blockwise jnp path (`blockwise`), the 8-bit and int4 rules (`quant`, `quant4`), the key rotation
(`rotation`), in-place writes (`scatter`), and `_common` (`BlockSizes`; which geometries the
kernels take: `unsupported_reason(head_dim=, page_size=, group=, dtype=)`, None when they can;
where JAX has no Pallas Triton lowering any more: `triton_lowering_problem()` says so, naming the
backend to use). Below:

    gpu/      the Triton kernels (`gpu.append`, `gpu.attention`) and the experimental Mosaic GPU
              decode kernel (`gpu.mosaic_decode`, opt-in, see README)
    tpu/      the Mosaic TPU kernels, same contract (`tpu.attention`, `tpu.append`, `tpu.copy_pages`;
              `tpu_unsupported_reason` in `tpu.common`)
    offline/  compiling the kernels for a device this host does not have: an H100 (`offline.sm90`),
              TPU v5e / v6e (`offline.tpu`); optional installs, never imported from here

The flat paths of before (`pallas_kernels.tpu_attention`, `pallas_kernels.sm90`, ...) still name
the same modules (`_moved`, below): imported when asked for, not with the package.
"""
from pallas_kernels._common import BlockSizes, triton_lowering_problem, unsupported_reason
from pallas_kernels._moved import alias
from pallas_kernels.gpu.append import paged_append
from pallas_kernels.gpu.attention import paged_attention
from pallas_kernels.reference import append_reference, paged_attention_reference

__all__ = [
    "paged_append",
    "paged_attention",
    "BlockSizes",
    "unsupported_reason",
    "triton_lowering_problem",
    "append_reference",
    "paged_attention_reference",
]

# old module path -> new one (issue 38: the kernels split into gpu/, tpu/ and offline/)
__getattr__ = alias(__name__, {
    "pallas_kernels.append": "pallas_kernels.gpu.append",
    "pallas_kernels.paged_attention": "pallas_kernels.gpu.attention",
    "pallas_kernels.mosaic_decode": "pallas_kernels.gpu.mosaic_decode",
    "pallas_kernels._tiles": "pallas_kernels.gpu._tiles",
    "pallas_kernels.tpu_append": "pallas_kernels.tpu.append",
    "pallas_kernels.tpu_attention": "pallas_kernels.tpu.attention",
    "pallas_kernels.tpu_common": "pallas_kernels.tpu.common",
    "pallas_kernels.tpu_copy_pages": "pallas_kernels.tpu.copy_pages",
    "pallas_kernels.sm90": "pallas_kernels.offline.sm90",
    "pallas_kernels.sm90_compat": "pallas_kernels.offline.sm90_compat",
    "pallas_kernels.sm90_mosaic": "pallas_kernels.offline.sm90_mosaic",
    "pallas_kernels.sm90_variants": "pallas_kernels.offline.sm90_variants",
    "pallas_kernels.tpu_compile": "pallas_kernels.offline.tpu",
    "pallas_kernels.tpu_variants": "pallas_kernels.offline.tpu_variants",
})
del alias
