"""Pallas kernels for the paged KV cache, each with a plain-jnp reference.

    paged_append(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens) -> (k_arena, v_arena)
    paged_attention(q, k_arena, v_arena, layer, page_map, lengths, num_tokens) -> out

Contract (shapes, masking, sliding window): `pallas_kernels.reference`. Which geometries the
kernels take: `unsupported_reason(head_dim=, page_size=, group=, dtype=)` (None when they can).
Compiling them for an H100 without a GPU: `pallas_kernels.sm90`. Where JAX has no Pallas Triton
lowering any more: `triton_lowering_problem()` says so, naming the backend to use. An
experimental Mosaic GPU decode kernel: `pallas_kernels.mosaic_decode` (opt-in, see README).
The Mosaic TPU kernels (same contract): `pallas_kernels.tpu_attention`, `pallas_kernels.tpu_append`
(`tpu_unsupported_reason` in `tpu_common`; compiling for TPU v5e / v6e without a TPU: `tpu_compile`).
"""
from pallas_kernels._common import BlockSizes, triton_lowering_problem, unsupported_reason
from pallas_kernels.append import paged_append
from pallas_kernels.paged_attention import paged_attention
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
