"""A decoder of your own, on the paged cache: what `docs/integrate.md` walks through.

    python examples/tiny_decoder.py        # greedy tokens from both caches, and whether they agree

`TinyDecoder` is a small Flax NNX model written for this example (not one of `models/`): its own
projections, RoPE, RMSNorm, logit soft-cap and local/global layers. Its attention layers talk to
a cache through one method, `kv.attend(layer, q, k, v, **options) -> (kv, out)`, and read the
new tokens' positions from `kv.positions`. Two caches implement it:

- `DenseKV`: the dense cache such a model starts with (`[L, B, S, K, D]`, written with
  `dynamic_update_slice`, attention as a masked softmax written out by hand);
- `arena_jax.CacheStep`: the paged arena, from `aj.begin_step`.

Swapping one for the other is the whole integration; the lines marked `# arena` below are all
the cache code the paged loop needs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

import arena_jax as aj


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 97
    dim: int = 64
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    window: int = 6  # local layers see the last 6 tokens; every other layer is global
    soft_cap: float | None = 20.0  # attention logits: cap * tanh(s / cap)

    def layer_window(self, layer: int) -> int | None:
        return self.window if layer % 2 == 0 else None


def rope(x, positions):  # x [B, T, N, D], positions i32[B, T]
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    angle = positions[..., None, None].astype(jnp.float32) * freq  # [B, T, 1, D/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def rms_norm(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


class Layer(nnx.Module):
    def __init__(self, cfg: Config, index: int, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.2)
        d, n, k = cfg.head_dim, cfg.heads, cfg.kv_heads
        self.cfg, self.index = cfg, index
        self.wq = nnx.Param(init(rngs.params(), (cfg.dim, n, d)))
        self.wkv = nnx.Param(init(rngs.params(), (2, cfg.dim, k, d)))
        self.wo = nnx.Param(init(rngs.params(), (n, d, cfg.dim)))
        self.w1 = nnx.Param(init(rngs.params(), (cfg.dim, 4 * cfg.dim)))
        self.w2 = nnx.Param(init(rngs.params(), (4 * cfg.dim, cfg.dim)))
        self.norm1 = nnx.Param(jnp.ones((cfg.dim,)))
        self.norm2 = nnx.Param(jnp.ones((cfg.dim,)))

    def __call__(self, x, kv):
        h = rms_norm(x, self.norm1[...])
        q = rope(jnp.einsum("bte,end->btnd", h, self.wq[...]), kv.positions)
        k = rope(jnp.einsum("bte,ekd->btkd", h, self.wkv[0]), kv.positions)
        v = jnp.einsum("bte,ekd->btkd", h, self.wkv[1])
        options = dict(sliding_window=self.cfg.layer_window(self.index), logits_soft_cap=self.cfg.soft_cap)
        kv, o = kv.attend(self.index, q, k, v, **options)  # the one call into the cache
        x = x + jnp.einsum("btnd,nde->bte", o, self.wo[...])
        return x + jax.nn.gelu(rms_norm(x, self.norm2[...]) @ self.w1[...]) @ self.w2[...], kv


class TinyDecoder(nnx.Module):
    def __init__(self, cfg: Config, rngs: nnx.Rngs):
        self.embed = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (cfg.vocab, cfg.dim)))
        self.layers = nnx.List([Layer(cfg, i, rngs) for i in range(cfg.layers)])

    def __call__(self, tokens, kv):  # tokens i32[B, T] -> logits [B, T, V], kv
        x = self.embed[...][tokens]
        for layer in self.layers:
            x, kv = layer(x, kv)
        return x @ self.embed[...].T, kv


# ---- the cache the model was written with: dense, [L, B, S, K, D] -------------------------------------


@struct.dataclass
class DenseKV:
    k: jax.Array  # [L, B, S, K, D]
    v: jax.Array
    start: jax.Array  # i32[]: the position of this step's first token (all rows in step)
    positions: jax.Array  # i32[B, T]

    def attend(self, layer, q, k, v, *, sliding_window=None, logits_soft_cap=None):
        ks = jax.lax.dynamic_update_slice(self.k[layer], k, (0, self.start, 0, 0))  # [B, S, K, D]
        vs = jax.lax.dynamic_update_slice(self.v[layer], v, (0, self.start, 0, 0))
        b, t, n, d = q.shape
        group = n // k.shape[2]
        s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(b, t, -1, group, d), ks) * d**-0.5
        if logits_soft_cap is not None:
            s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
        key = jnp.arange(ks.shape[1])[None, :]
        query = self.positions[0][:, None]
        mask = key <= query
        if sliding_window is not None:
            mask &= key > query - sliding_window
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        out = jnp.einsum("bkgts,bskd->btkgd", p, vs).reshape(b, t, n, d)
        return self.replace(k=self.k.at[layer].set(ks), v=self.v.at[layer].set(vs)), out


@functools.partial(nnx.jit, donate_argnums=2)
def dense_step(model, tokens, kv):
    logits, kv = model(tokens, kv)
    return jnp.argmax(logits[:, -1], axis=-1), kv


def generate_dense(model, cfg: Config, prompts: np.ndarray, new: int) -> np.ndarray:
    """Greedy decoding of same-length prompts i32[B, P] with the dense cache."""
    b, p = prompts.shape
    shape = (cfg.layers, b, p + new, cfg.kv_heads, cfg.head_dim)
    kv = DenseKV(jnp.zeros(shape), jnp.zeros(shape), jnp.int32(0), jnp.broadcast_to(jnp.arange(p), (b, p)))
    token, kv = dense_step(model, jnp.asarray(prompts), kv)
    out = [token]
    for i in range(new - 1):
        kv = kv.replace(start=jnp.int32(p + i), positions=jnp.full((b, 1), p + i, jnp.int32))
        token, kv = dense_step(model, token[:, None], kv)
        out.append(token)
    return np.stack(out, axis=1)


# ---- the same model on the paged arena ------------------------------------------------------------------


@functools.partial(nnx.jit, donate_argnums=2)
def paged_step(model, tokens, cache, slots):
    n = jnp.full(slots.shape, tokens.shape[1], jnp.int32)
    step, ok = aj.begin_step(cache, slots, n, width=tokens.shape[1])  # arena: reserve, positions
    logits, step = model(tokens, step)
    return jnp.argmax(logits[:, -1], axis=-1), step.cache, ok  # arena: the updated cache


def generate_paged(model, cfg: Config, prompts: np.ndarray, new: int, page_size: int = 4) -> np.ndarray:
    b, p = prompts.shape
    layout = aj.KVLayout(num_layers=cfg.layers, num_kv_heads=cfg.kv_heads, head_dim=cfg.head_dim,  # arena
                         page_size=page_size, num_pages=b * -(-(p + new) // page_size), max_seqs=b,  # arena
                         max_pages_per_seq=-(-(p + new) // page_size), dtype="float32")  # arena  # fmt: skip
    cache = aj.create(layout)  # arena: allocated once
    slots = jnp.arange(b, dtype=jnp.int32)  # arena: row r uses slot r
    token, cache, ok = paged_step(model, jnp.asarray(prompts), cache, slots)
    out = [token]
    for _ in range(new - 1):
        token, cache, ok = paged_step(model, token[:, None], cache, slots)
        out.append(token)
    assert bool(ok.all())  # arena: every reservation was served (the arena holds every row)
    cache = aj.release(cache, slots)  # arena: pages back to the free stack
    return np.stack(out, axis=1)


if __name__ == "__main__":
    cfg = Config()
    model = TinyDecoder(cfg, nnx.Rngs(0))
    prompts = np.random.default_rng(0).integers(0, cfg.vocab, (3, 9))
    dense, paged = generate_dense(model, cfg, prompts, 12), generate_paged(model, cfg, prompts, 12)
    print("dense:", dense.tolist())
    print("paged:", paged.tolist())
    print("identical:", bool((dense == paged).all()))
