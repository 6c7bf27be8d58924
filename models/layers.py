"""Flax NNX building blocks of a Llama-family decoder.

Einsum axes (single letters, used the same way in every module):
    B batch   T new tokens   S key positions   E hidden (embedding)   F MLP hidden
    N query heads   K KV heads   G query heads per KV head   H head_dim   V vocabulary

Kernels are stored JAX-style `[in, ..., out]` (Hugging Face stores `[out, in]`; the loader
transposes). The KV cache is never module state: `Attention.__call__` takes the cache
and returns the updated one.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from models.config import LlamaConfig, RopeScaling

__all__ = ["Embedder", "RMSNorm", "MLP", "Attention", "rope_frequencies", "apply_rope"]

_init = nnx.initializers.normal(stddev=0.02)


class Embedder(nnx.Module):
    """Token embedding table `[V, E]`; `decode` is the tied LM head."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.embedding = nnx.Param(_init(rngs.params(), (vocab_size, hidden_size), param_dtype))
        self.dtype = dtype

    def __call__(self, tokens):  # [B, T] -> [B, T, E]
        return jnp.take(self.embedding[...], tokens, axis=0, mode="clip").astype(self.dtype)

    def decode(self, x):  # [B, T, E] -> [B, T, V] float32
        return jnp.einsum("BTE,VE->BTV", x, self.embedding[...].astype(x.dtype), preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """x / rms(x) * scale, the statistics in float32 (as Hugging Face Llama)."""

    def __init__(self, hidden_size: int, eps: float, *, param_dtype, rngs: nnx.Rngs):
        del rngs
        self.scale = nnx.Param(jnp.ones((hidden_size,), param_dtype))
        self.eps = eps

    def __call__(self, x):  # [..., E]
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.gate = nnx.Param(_init(rngs.params(), (hidden_size, intermediate_size), param_dtype))
        self.up = nnx.Param(_init(rngs.params(), (hidden_size, intermediate_size), param_dtype))
        self.down = nnx.Param(_init(rngs.params(), (intermediate_size, hidden_size), param_dtype))
        self.dtype = dtype

    def __call__(self, x):  # [B, T, E] -> [B, T, E]
        gate = jnp.einsum("BTE,EF->BTF", x, self.gate[...].astype(self.dtype))
        up = jnp.einsum("BTE,EF->BTF", x, self.up[...].astype(self.dtype))
        return jnp.einsum("BTF,FE->BTE", jax.nn.silu(gate) * up, self.down[...].astype(self.dtype))


# ---- rotary position embedding -------------------------------------------------------------


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies f32[head_dim // 2], with Llama 3.1 scaling when given (host-side numpy)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if scaling is None:
        return inv_freq
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotate halves (Hugging Face layout): x [B, T, N, H], positions i32[B, T], inv_freq f32[H/2]."""
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, H/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# ---- attention over the paged cache ------------------------------------------------------------


class Attention(nnx.Module):
    """Grouped-query attention; K/V go to the arena with `aj.append`, attention reads pages with `aj.attend`."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q = nnx.Param(_init(rngs.params(), (e, n, h), param_dtype))
        self.k = nnx.Param(_init(rngs.params(), (e, k, h), param_dtype))
        self.v = nnx.Param(_init(rngs.params(), (e, k, h), param_dtype))
        self.o = nnx.Param(_init(rngs.params(), (n, h, e), param_dtype))
        self.inv_freq = tuple(float(f) for f in rope_frequencies(h, config.rope_theta, config.rope_scaling))
        self.sliding_window = config.sliding_window
        self.dtype = dtype

    def project(self, x, positions):
        """x [B, T, E], positions i32[B, T] -> q [B, T, N, H], k, v [B, T, K, H] (RoPE applied to q, k)."""
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        q = jnp.einsum("BTE,ENH->BTNH", x, w(self.q))
        k = jnp.einsum("BTE,EKH->BTKH", x, w(self.k))
        v = jnp.einsum("BTE,EKH->BTKH", x, w(self.v))
        inv_freq = np.asarray(self.inv_freq, np.float32)
        return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

    def output(self, o):  # [B, T, N, H] -> [B, T, E]
        return jnp.einsum("BTNH,NHE->BTE", o, self.o[...].astype(self.dtype))

    def __call__(self, x, positions, cache: aj.KVCache, layer: int, slots, num_tokens):
        """One layer's attention for tokens already reserved in `cache`.

        x [B, T, E]; positions i32[B, T]; slots i32[B] (PAD_SLOT rows do nothing);
        num_tokens i32[B] (row b's first num_tokens[b] tokens are real). Returns (out [B, T, E], cache).
        """
        q, k, v = self.project(x, positions)
        if cache.k_scale is None:  # a float arena stores its own dtype; an 8-bit one quantizes k, v as computed
            k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        cache = aj.append(cache, layer, slots, k, v, num_tokens=num_tokens)
        o = aj.attend(q, cache, layer, slots, num_tokens=num_tokens, sliding_window=self.sliding_window)
        return self.output(o), cache
