"""Flax NNX building blocks of the decoder families (Llama, Mistral, Qwen 2 / 3, Gemma 2 / 3).

Einsum axes (single letters, used the same way in every module):
    B batch   T new tokens   S key positions   E hidden (embedding)   F MLP hidden
    N query heads   K KV heads   G query heads per KV head   H head_dim   V vocabulary
    L layers

Kernels are stored JAX-style `[in, ..., out]` (Hugging Face stores `[out, in]`; the loader
transposes). The KV cache is never module state: `Attention.__call__` takes the cache
and returns the updated one. What differs per layer (window, RoPE frequencies) is data the
caller passes (`models.llama` scans the layers), with `layer_windows` / `layer_inv_freq` as
the per-layer tables; a module called alone reads its layer's entry from them.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax.models.config import NO_WINDOW, LlamaConfig, RopeScaling

__all__ = [
    "Embedder", "RMSNorm", "MLP", "Attention", "rope_frequencies", "apply_rope", "rope_tables", "rotate",
    "layer_inv_freq", "layer_windows", "take_tokens", "mixed_token_index",
]

_init = nnx.initializers.normal(stddev=0.02)
_FROM_CONFIG = object()  # "the layer's own window / RoPE, from the config"


def one_row_safe_einsum(spec: str, x, w, **kwargs):
    """`jnp.einsum(spec, x, w, **kwargs)` for x [B, T, ...] whose one row (B * T == 1) runs on a
    GPU as two, the second zero and dropped. For a one-row dot XLA's GPU compiler either rewrites
    it as a reduce over a transposed copy of the weight (the k / v projections) or converts the
    whole weight to float32 first (the float32 logits: 2 GiB at Llama-3-8B's vocabulary): 1.5 ms
    of a 7.3 ms Llama-3-8B decode step at batch 1 on an H200 (benchmarks/RESULTS.md, issue 39).
    With two rows it calls cuBLAS on the weight where it lies. Other platforms: the einsum as is
    (`lax.platform_dependent` lowers one branch)."""

    def plain(x, w):
        return jnp.einsum(spec, x, w, **kwargs)

    if x.shape[0] * x.shape[1] != 1:
        return plain(x, w)

    def two_rows(x, w):
        return plain(jnp.concatenate([x, jnp.zeros_like(x)]), w)[:1]

    return jax.lax.platform_dependent(x, w, cuda=two_rows, rocm=two_rows, default=plain)


def take_tokens(x, index):
    """x [B, T, ...] -> [B, 1, ...]: row b's token index[b] (i32[B])."""
    return jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)


def mixed_token_index(groups, last):
    """i32[M]: where token last[i][r] of row r of group i lies among a mixed step's tokens packed
    flat (groups: (slots i32[R_i], num_tokens, T_i) each, their [R_i, T_i] tokens one group after
    the other; M = sum R_i). An index past a row's T_i is clipped to its last token."""
    index, start = [], 0
    for (slots, _, width), idx in zip(groups, last):
        rows = slots.shape[0]
        index.append(start + jnp.arange(rows, dtype=jnp.int32) * width + jnp.clip(idx.astype(jnp.int32), 0, width - 1))
        start += rows * width
    return jnp.concatenate(index)


class Embedder(nnx.Module):
    """Token embedding table `[V, E]`; `decode` is the tied LM head. `scale` (Gemma:
    sqrt(hidden_size)) multiplies the embeddings, in the compute dtype, as transformers does."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype, param_dtype, rngs: nnx.Rngs, scale=None):
        self.embedding = nnx.Param(_init(rngs.params(), (vocab_size, hidden_size), param_dtype))
        self.dtype = dtype
        self.scale = scale

    def __call__(self, tokens):  # [B, T] -> [B, T, E]
        x = jnp.take(self.embedding[...], tokens, axis=0, mode="clip").astype(self.dtype)
        return x if self.scale is None else x * jnp.asarray(self.scale, self.dtype)

    def decode(self, x):  # [B, T, E] -> [B, T, V] float32
        return one_row_safe_einsum("BTE,VE->BTV", x, self.embedding[...].astype(x.dtype), preferred_element_type=jnp.float32)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, its statistics in float32.

    style "llama" (Llama, Mistral, Qwen): `scale * (x / rms(x))`, the normalized x cast back
    to x's dtype before the multiply; scale starts at 1.
    style "gemma": `(x / rms(x)) * (1 + scale)` all in float32, then cast; scale starts at 0.
    """

    def __init__(self, hidden_size: int, eps: float, *, param_dtype, rngs: nnx.Rngs, style: str = "llama"):
        del rngs
        if style not in ("llama", "gemma"):
            raise ValueError(f"style must be 'llama' or 'gemma', got {style!r}")
        init = jnp.zeros if style == "gemma" else jnp.ones
        self.scale = nnx.Param(init((hidden_size,), param_dtype))
        self.eps = eps
        self.style = style

    def __call__(self, x):  # [..., E]
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.style == "gemma":
            return (normed * (1.0 + self.scale[...].astype(jnp.float32))).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * normed.astype(x.dtype)


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP: down(act(x @ gate) * (x @ up)); act silu (SwiGLU) or tanh-GELU (GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, param_dtype, rngs: nnx.Rngs, act: str = "silu"):
        self.gate = nnx.Param(_init(rngs.params(), (hidden_size, intermediate_size), param_dtype))
        self.up = nnx.Param(_init(rngs.params(), (hidden_size, intermediate_size), param_dtype))
        self.down = nnx.Param(_init(rngs.params(), (intermediate_size, hidden_size), param_dtype))
        self.dtype = dtype
        self.act = act

    def __call__(self, x):  # [B, T, E] -> [B, T, E]
        gate = jnp.einsum("BTE,EF->BTF", x, self.gate[...].astype(self.dtype))
        up = jnp.einsum("BTE,EF->BTF", x, self.up[...].astype(self.dtype))
        return jnp.einsum("BTF,FE->BTE", _ACTIVATIONS[self.act](gate) * up, self.down[...].astype(self.dtype))


# ---- rotary position embedding -------------------------------------------------------------


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies f32[head_dim // 2], with Llama 3.1 or linear scaling when given (host-side numpy)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    inv_freq = inv_freq.astype(np.float32)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / np.float32(scaling.factor)).astype(np.float32)
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions, inv_freq):
    """RoPE's cos and sin at `positions` i32[B, T] for inv_freq f32[H/2]: f32[B, T, H/2] each,
    the halves' shared values (`rotate` repeats them over both halves and every head).

    Computed once for a layer's q and k (`Attention.project`), and for a pass of more than one
    token a row materialized (`lax.optimization_barrier`): computed in each `apply_rope` call, a
    cos or sin with one consumer was fused into it and evaluated once per head (a 32 x 128-token
    prefill of the mid model, layers as a list: the query's rotation and transpose ~19 ms a
    layer on a CPU, most of it trigonometry; benchmarks/RESULTS.md, session 48). One token a
    row keeps them fusible: a layer scan hoists them out of its loop as they are."""
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]  # [B, T, H/2]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if positions.shape[1] > 1:
        cos, sin = jax.lax.optimization_barrier((cos, sin))
    return cos, sin


def rotate(x, cos, sin):
    """Rotate halves (Hugging Face layout): x [B, T, N, H] by `rope_tables`' cos, sin f32[B, T, H/2]
    (rounded to x's dtype, as transformers rounds its cos and sin)."""
    cos, sin = (jnp.concatenate([a, a], axis=-1)[:, :, None, :].astype(x.dtype) for a in (cos, sin))  # [B, T, 1, H]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def apply_rope(x, positions, inv_freq):
    """Rotate halves (Hugging Face layout): x [B, T, N, H], positions i32[B, T], inv_freq f32[H/2]."""
    return rotate(x, *rope_tables(positions, inv_freq))


def layer_inv_freq(config: LlamaConfig) -> np.ndarray:
    """f32[L, H/2]: each layer's RoPE inverse frequencies (Gemma 3: two sets)."""
    return np.stack([rope_frequencies(config.head_dim, *config.layer_rope(i)) for i in range(config.num_layers)])


def layer_windows(config: LlamaConfig) -> np.ndarray:
    """i32[L]: each layer's sliding window, `NO_WINDOW` (INT32_MAX) for a full-attention layer."""
    return np.asarray([NO_WINDOW if w is None else w for w in config.layer_windows()], np.int32)


# ---- attention over the paged cache ------------------------------------------------------------


class Attention(nnx.Module):
    """Grouped-query attention; K/V go to the arena with `aj.append`, attention reads pages with `aj.attend`.

    Per family (from the config): q/k/v (and o) biases, an RMSNorm of each query / key head
    before RoPE (`qk_norm`), the score scale `config.sm_scale` and the soft-cap
    `config.attn_logit_softcapping`.
    """

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.q = nnx.Param(_init(rngs.params(), (e, n, h), param_dtype))
        self.k = nnx.Param(_init(rngs.params(), (e, k, h), param_dtype))
        self.v = nnx.Param(_init(rngs.params(), (e, k, h), param_dtype))
        self.o = nnx.Param(_init(rngs.params(), (n, h, e), param_dtype))
        if config.qkv_bias:
            self.q_bias = nnx.Param(_init(rngs.params(), (n, h), param_dtype))
            self.k_bias = nnx.Param(_init(rngs.params(), (k, h), param_dtype))
            self.v_bias = nnx.Param(_init(rngs.params(), (k, h), param_dtype))
        if config.o_bias:
            self.o_bias = nnx.Param(_init(rngs.params(), (e,), param_dtype))
        if config.qk_norm:
            style = "gemma" if config.gemma else "llama"
            self.q_norm = RMSNorm(h, config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs, style=style)
            self.k_norm = RMSNorm(h, config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs, style=style)
        self.config = config
        self.dtype = dtype

    def _weight(self, name):
        return getattr(self, name)[...].astype(self.dtype)

    def _layer_inv_freq(self, layer, inv_freq):
        if inv_freq is not None:
            return inv_freq
        table = layer_inv_freq(self.config)
        if (table == table[0]).all():
            return table[0]
        return jnp.asarray(table)[layer]

    def project(self, x, positions, inv_freq=None, *, layer=0):
        """x [B, T, E], positions i32[B, T] -> q [B, T, N, H], k, v [B, T, K, H] (biases, q/k
        norms and RoPE applied). inv_freq f32[H/2]: the layer's RoPE (default: `layer`'s)."""
        cfg = self.config
        q = jnp.einsum("BTE,ENH->BTNH", x, self._weight("q"))
        k = one_row_safe_einsum("BTE,EKH->BTKH", x, self._weight("k"))
        v = one_row_safe_einsum("BTE,EKH->BTKH", x, self._weight("v"))
        if cfg.qkv_bias:
            q, k, v = q + self._weight("q_bias"), k + self._weight("k_bias"), v + self._weight("v_bias")
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        tables = rope_tables(positions, self._layer_inv_freq(layer, inv_freq))  # once for q and k
        return rotate(q, *tables), rotate(k, *tables), v

    def output(self, o):  # [B, T, N, H] -> [B, T, E]
        out = jnp.einsum("BTNH,NHE->BTE", o, self._weight("o"))
        return out + self._weight("o_bias") if self.config.o_bias else out

    def attend_options(self, layer, window=_FROM_CONFIG) -> dict:
        """`aj.attend`'s sliding_window / sm_scale / logits_soft_cap for `layer` (a static window
        when every layer has the same one, else the layer's entry of `layer_windows`)."""
        cfg = self.config
        if window is _FROM_CONFIG:
            uniform, window = cfg.uniform_window()
            if not uniform:
                window = jnp.asarray(layer_windows(cfg))[layer]
        return dict(sliding_window=window, sm_scale=None if cfg.query_pre_attn_scalar is None else cfg.sm_scale,
                    logits_soft_cap=cfg.attn_logit_softcapping)

    def __call__(self, x, positions, cache: aj.KVCache, layer, slots, num_tokens, *, window=_FROM_CONFIG,
                 inv_freq=None, plan=None):
        """One layer's attention for tokens already reserved in `cache`.

        x [B, T, E]; positions i32[B, T]; slots i32[B] (PAD_SLOT rows do nothing);
        num_tokens i32[B] (row b's first num_tokens[b] tokens are real); layer: an int or a
        traced i32[]. `window` (None, an int or a traced i32[]; NO_WINDOW is none) and
        `inv_freq` f32[H/2] default to the layer's own; `plan`: the step's `aj.plan_step` for these
        slots and counts (the page bookkeeping done once for every layer). Returns (out [B, T, E], cache).
        """
        q, k, v = self.project(x, positions, inv_freq, layer=layer)
        if cache.k_scale is None:  # a float arena stores its own dtype; an 8-bit one quantizes k, v as computed
            k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        cache = aj.append(cache, layer, slots, k, v, num_tokens=num_tokens, plan=plan)
        o = aj.attend(q, cache, layer, slots, num_tokens=num_tokens, plan=plan, **self.attend_options(layer, window))
        return self.output(o), cache

    def last_token(self, x, positions, cache: aj.KVCache, layer, slots, num_tokens, last, *, window=_FROM_CONFIG,
                   inv_freq=None, plan=None):  # fmt: skip
        """`__call__` for a forward pass that needs one token a row past this layer, token last[b]
        (i32[B], its last new token) of row b: every token's K/V appended, the query, attention
        and output for that token alone. Returns (out [B, 1, E], cache)."""
        _, k, v = self.project(x, positions, inv_freq, layer=layer)  # (XLA drops the unused q and k / v below)
        q, _, _ = self.project(take_tokens(x, last), take_tokens(positions, last), inv_freq, layer=layer)  # [B, 1, N, H]
        if cache.k_scale is None:
            k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        cache = aj.append(cache, layer, slots, k, v, num_tokens=num_tokens, plan=plan)
        # Row b's one query is the last token written at this layer: its last new token.
        o = aj.attend(q, cache, layer, slots, num_tokens=jnp.minimum(num_tokens, 1),
                      plan=None if plan is None else plan.last_query(), **self.attend_options(layer, window))  # fmt: skip
        return self.output(o), cache

    def mixed(self, x, positions, cache: aj.KVCache, layer, groups, *, window=_FROM_CONFIG, inv_freq=None, last=None):
        """One layer's attention for a mixed step: the tokens of several row groups packed flat.

        x [1, N, E], positions i32[1, N]: the groups' [R_i, T_i] tokens flattened one after the
        other (N = sum R_i * T_i); groups: (slots i32[R_i], num_tokens i32[R_i], T_i) per group
        (e.g. decode rows, T = 1, and prefill rows, T = a chunk). The projections run once over
        the N tokens (one read of the weights); each group appends and attends as a batch of its
        own, so each takes its kernel (decode or chunked prefill; on a TPU both in one call,
        `aj.attend_mixed`). Every group appends before any
        attends (the groups' slots differ, so no group reads what another writes): the arena's
        writes form one chain that XLA updates in place, with no read between them that would
        make it copy the arena. Returns (out [1, N, E], cache).

        `last` (one i32[R_i] a group, or None): for a forward pass that needs one token a row past
        this layer, token last[i][r] of row r of group i (its last new token): every token's K/V
        appended, the query, attention and output for those tokens alone, out [1, M, E] (M = sum
        R_i, group after group; `mixed_token_index`).
        """
        q, k, v = self.project(x, positions, inv_freq, layer=layer)  # [1, N, ., H]
        if last is not None:  # (XLA drops the unused q above)
            index = mixed_token_index(groups, last)
            q, _, _ = self.project(x[:, index], positions[:, index], inv_freq, layer=layer)  # [1, M, N, H]
        if cache.k_scale is None:  # a float arena stores its own dtype; an 8-bit one quantizes k, v as computed
            k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
        parts, start, q_start = [], 0, 0
        for slots, num_tokens, width in groups:
            rows, size = slots.shape[0], slots.shape[0] * width
            q_width = width if last is None else 1
            q_part = q[0, q_start : q_start + rows * q_width].reshape(rows, q_width, *q.shape[2:])
            parts.append([q_part] + [a[0, start : start + size].reshape(rows, width, *a.shape[2:]) for a in (k, v)])
            start, q_start = start + size, q_start + rows * q_width
        for (_, k_part, v_part), (slots, num_tokens, _) in zip(parts, groups):
            cache = aj.append(cache, layer, slots, k_part, v_part, num_tokens=num_tokens)
        # One call for all groups: on the TPU kernels a decode group and a chunk group share one
        # kernel launch (`aj.attend_mixed`); elsewhere each group attends as a batch of its own.
        # With `last`, row r's one query is the last token written at this layer: its last new token.
        queries = [(q_part, slots, num_tokens if last is None else jnp.minimum(num_tokens, 1))
                   for (q_part, _, _), (slots, num_tokens, _) in zip(parts, groups)]  # fmt: skip
        outs = aj.attend_mixed(queries, cache, layer, **self.attend_options(layer, window))
        return self.output(jnp.concatenate([o.reshape(1, -1, *q.shape[2:]) for o in outs], axis=1)), cache
