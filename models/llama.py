"""`Llama`: the Llama / Mistral decoder in Flax NNX, reading and writing the paged arena.

    model = Llama(LlamaConfig.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    logits, cache = model(tokens, positions, cache, slots, num_tokens)

The cache must already hold reservations for the new tokens (`aj.reserve`); the model
appends their K/V layer by layer and attends over the pages. See `models.generate` for
the jitted steps that do reserve + forward + sample in one call.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax.sharding import shard_rows, slot_lengths
from models.checks import check_int, check_number
from models.config import LlamaConfig
from models.layers import MLP, Attention, Embedder, RMSNorm

__all__ = ["Block", "Llama", "init_random", "token_positions"]

_List = getattr(nnx, "List", list)  # flax >= 0.12 wants nnx.List for lists of modules


class Block(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e = config.hidden_size
        self.attn_norm = RMSNorm(e, config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.attn = Attention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = RMSNorm(e, config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        self.mlp = MLP(e, config.intermediate_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x, positions, cache, layer: int, slots, num_tokens):
        h, cache = self.attn(self.attn_norm(x), positions, cache, layer, slots, num_tokens)
        x = x + h
        return x + self.mlp(self.mlp_norm(x)), cache


class Llama(nnx.Module):
    """Decoder-only LM. `dtype` is the compute dtype, `param_dtype` the stored weights' dtype."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a LlamaConfig, got {type(config).__name__}")
        dtype = jnp.dtype(dtype)  # canonical, so equal configs give equal (hashable) graphdefs
        param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
        self.config = config
        self.dtype = dtype
        self.embed = Embedder(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.layers = _List(
            [Block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs) for _ in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (config.hidden_size, config.vocab_size), param_dtype)
            )

    def hidden(self, tokens, positions, cache: aj.KVCache, slots, num_tokens):
        """tokens i32[B, T] -> final-normed hidden states [B, T, E] and the updated cache."""
        x = shard_rows(self.embed(tokens), cache)  # a sharded cache: rows over data, replicated over tensor
        for i, block in enumerate(self.layers):
            x, cache = block(x, positions, cache, i, slots, num_tokens)
            x = shard_rows(x, cache)
        return self.norm(x), cache

    def logits(self, x):
        """[B, T, E] -> float32 [B, T, V] (tied head: the embedding table)."""
        if self.lm_head is None:
            return self.embed.decode(x)
        return jnp.einsum("BTE,EV->BTV", x, self.lm_head[...].astype(x.dtype), preferred_element_type=jnp.float32)

    def __call__(self, tokens, positions, cache: aj.KVCache, slots, num_tokens):
        """Logits f32[B, T, V] of the new tokens, and the cache with their K/V appended."""
        x, cache = self.hidden(tokens, positions, cache, slots, num_tokens)
        return self.logits(x), cache


def token_positions(cache: aj.KVCache, slots, num_tokens, tokens: int):
    """Positions i32[B, T] of the new tokens of each row (after `aj.reserve`): the slot's last
    num_tokens[b] positions. Padded rows / tokens get position 0 (they are masked anyway)."""
    valid = slots >= 0
    if cache.sharding is not None:  # each data shard reads its own slots' lengths
        lengths = slot_lengths(cache, slots)
    else:
        lengths = jnp.where(valid, cache.table.lengths[jnp.maximum(slots, 0)], 0)
    t = jnp.arange(tokens, dtype=jnp.int32)[None, :]
    pos = (lengths - num_tokens)[:, None] + t
    live = valid[:, None] & (t < num_tokens[:, None])
    return jnp.where(live, pos, 0)


def init_random(
    config: LlamaConfig,
    *,
    seed: int = 0,
    std: float = 0.02,
    dtype=jnp.float32,
    param_dtype=None,
    mesh=None,
    tensor_axis: str | None = "tensor",
) -> Llama:
    """A random-weight `Llama`: projections and embeddings ~ N(0, std), norm scales 1.

    On CPU the weights are drawn with numpy (eager JAX would compile every initializer shape
    separately, seconds for a tiny model); elsewhere in one jitted call on the device.
    With a `mesh`, the weights are placed Megatron style over its `tensor_axis`
    (`models.parallel`), each device receiving only its part; the values are those of the
    single-device model with the same seed.
    """
    seed = check_int("seed", seed)  # in [0, 2**31 - 1]: numpy refuses negative seeds; one rule for every seed here
    std = check_number("std", std, low=0.0)
    param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)

    def build():
        return Llama(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed))

    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = None
    if mesh is not None:
        from models.parallel import state_shardings

        shardings = state_shardings(abstract, config, mesh, tensor_axis=tensor_axis)
    if jax.default_backend() == "cpu":
        rng = np.random.default_rng(seed)

        def draw(path, leaf):
            if "['scale']" in jax.tree_util.keystr(path):
                return np.ones(leaf.shape, leaf.dtype)
            return rng.normal(0.0, std, leaf.shape).astype(np.float32).astype(leaf.dtype)

        host = jax.tree_util.tree_map_with_path(draw, abstract)
        if shardings is None:
            state = jax.tree.map(jnp.asarray, host)
        else:
            from models.parallel import place

            state = place(host, shardings)
    else:
        scale = std / 0.02  # the modules initialize with std 0.02
        state = jax.jit(lambda: jax.tree_util.tree_map_with_path(
            lambda p, x: x if "['scale']" in jax.tree_util.keystr(p) else (x * scale).astype(x.dtype),
            nnx.state(build()),
        ), out_shardings=shardings)()  # fmt: skip
    return nnx.merge(graphdef, state)
