"""Pallas kernels for the paged KV cache, each with a plain-jnp reference."""
from pallas_kernels.reference import append_reference, paged_attention_reference

__all__ = ["append_reference", "paged_attention_reference"]
