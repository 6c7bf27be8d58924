"""The GPU kernels: which Pallas kernel writes and reads the paged arena on an NVIDIA GPU?

`append` (`paged_append`) and `attention` (`paged_attention`) are the Triton-lowered kernels
`arena_jax` dispatches (backend "pallas" on a GPU; interpret mode on a CPU), `_tiles` their
shared in-kernel pieces; `mosaic_decode` is the experimental Mosaic GPU decode kernel (Hopper,
backend "mosaic", opt-in). The contract they follow is `pallas_kernels.reference`. `allocate`
(`reserve_pages`) is `reserve`'s table work as one kernel, its contract `arena_jax.allocator`'s
jnp ops (`arena_jax.allocator.RESERVE_KERNEL`, default "auto").
"""
