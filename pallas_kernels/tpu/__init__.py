"""The TPU kernels: which Pallas kernel writes and reads the paged arena on a TPU?

The Mosaic TPU kernels, on the contract of `pallas_kernels.reference`: `attention`
(`tpu_paged_attention`), `mixed` (`tpu_paged_attention_mixed`: decode rows and prompt chunks in
one call), `append` (`tpu_paged_append`, by DMA), `copy_pages` (`tpu_copy_pages`,
reserve's copy-on-write by DMA), and `common` (`tpu_unsupported_reason`, interpret mode, tile rules).
"""
