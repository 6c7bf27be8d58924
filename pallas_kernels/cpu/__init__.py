"""The CPU kernels: native code XLA's CPU backend calls through its FFI.

`allocate` (`reserve_pages`) is `reserve`'s table work as one C++ call, built on first use
against the installed jaxlib's FFI headers; its contract is `arena_jax.allocator`'s jnp ops,
the same as the GPU's Triton kernel (`pallas_kernels.gpu.allocate`). `plan` (`plan_rows`) is
a step's plan, `attention` (`decode_attention`) decode attention over a float arena's pages
(dispatched by `arena_jax.arena_ops.ATTEND_KERNEL`). All are built into one library (`_build`).
"""
