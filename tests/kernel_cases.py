"""What the kernel tests share: page tables, jitted references, and tolerances vs the reference."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import append_reference, paged_attention_reference

fill_ref = jax.jit(append_reference)
attention_ref = jax.jit(paged_attention_reference, static_argnames=("sm_scale", "sliding_window"))

# Attention tolerances vs the float32 reference, keyed by the dots' dtype. float32: the kernel
# and the reference differ only in summation order (online softmax, split merge). fp16/bf16:
# the kernel rounds the softmax weights to the input dtype before the P @ V matmul (as flash
# attention does) and rounds the output once; bf16 keeps 8 mantissa bits (2^-8 ~ 4e-3 relative
# per term), fp16 11 bits; outputs are O(1), so absolute and relative bounds are the same scale.
TOLERANCES = {
    jnp.dtype(jnp.float32): dict(atol=2e-5, rtol=2e-5),
    jnp.dtype(jnp.float16): dict(atol=4e-3, rtol=4e-3),
    jnp.dtype(jnp.bfloat16): dict(atol=3e-2, rtol=3e-2),
}


def on_device(x, dtype):
    """`x` (numpy or a Python value) as a device array of `dtype`, converted on the host exactly as
    `jnp.asarray(x, dtype)` converts it (float64 to float32 first, then to `dtype`, round to
    nearest even): one transfer and no compile. (`jnp.asarray` of float64 data to another dtype,
    `jnp.full` and `bitcast_convert_type` each compile a one-op program per shape and dtype:
    about half the programs the kernel tests' case builders compiled.)"""
    x = np.asarray(x)
    if x.dtype == np.float64:
        x = x.astype(np.float32)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def full(shape, value, dtype):
    """`jnp.full(shape, value, dtype)`, built on the host (`on_device`)."""
    return on_device(np.full(shape, value, np.float32 if jnp.issubdtype(dtype, jnp.floating) else dtype), dtype)


def random_bits(rng, shape, dtype):
    """Random bytes viewed as an 8-bit `dtype` (fp8: NaN and inf patterns included), on the host."""
    return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8).view(jnp.dtype(dtype)))


def scrambled_page_map(seed, lengths, page_size, max_pages, num_pages):
    """i32[rows, max_pages]: each row's pages drawn from a random permutation of the pool (numpy's,
    on the host); -1 beyond its length."""
    perm = np.random.default_rng(seed).permutation(num_pages)[: len(lengths) * max_pages]
    needed = -(-np.asarray(lengths) // page_size)
    pm = np.where(np.arange(max_pages)[None, :] < needed[:, None], perm.reshape(-1, max_pages), -1)
    return jnp.asarray(pm, jnp.int32)
