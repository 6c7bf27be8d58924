"""`Llama`: the decoder (Llama, Mistral, Qwen 2 / 3, Gemma 2 / 3) in Flax NNX, reading and
writing the paged arena.

    model = Llama(LlamaConfig.tiny(), dtype=jnp.float32, rngs=nnx.Rngs(0))
    logits, cache = model(tokens, positions, cache, slots, num_tokens)

The cache must already hold reservations for the new tokens (`aj.reserve`); the model
appends their K/V layer by layer and attends over the pages. See `models.steps` for
the jitted steps that do reserve + forward + sample in one call.

Layers are one `Block` whose parameters carry a leading [num_layers] axis (`model.layers`;
`model.layer(i)` is layer i alone), run by `jax.lax.scan` carrying (x, cache): the step's
program holds ONE layer body whatever the depth, so compile time does not grow with it. The
per-layer data (layer index, window, RoPE frequencies) are scanned inputs, and the arena is
updated in place through the loop (tests/test_donation.py checks the compiled HLO).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax.plan import plan_and_commit
from arena_jax.sharding import shard_rows, slot_lengths
from arena_jax.models.checks import check_int, check_number
from arena_jax.models.config import LlamaConfig
from arena_jax.models.layers import (_FROM_CONFIG, MLP, Attention, Embedder, RMSNorm, layer_inv_freq, layer_windows,
                                     mixed_token_index, one_row_safe_einsum, take_tokens)

__all__ = ["Block", "Llama", "init_random", "token_positions", "layer_inputs", "run_layers", "default_scan_layers",
           "CPU_LIST_LAYER_BYTES"]

_List = getattr(nnx, "List", list)  # flax >= 0.12 wants nnx.List for lists of modules


class Block(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)). Gemma adds sandwich
    norms: x + post_attn_norm(attn(norm(x))), then x + post_mlp_norm(mlp(norm(x)))."""

    def __init__(self, config: LlamaConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        e, eps = config.hidden_size, config.rms_norm_eps
        style = "gemma" if config.gemma else "llama"
        norm = lambda: RMSNorm(e, eps, param_dtype=param_dtype, rngs=rngs, style=style)  # noqa: E731
        self.attn_norm = norm()
        self.attn = Attention(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(e, config.intermediate_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs, act=config.hidden_act)
        if config.gemma:
            self.post_attn_norm = norm()
            self.post_mlp_norm = norm()
        self.sandwich = config.gemma

    def finish(self, x, h):
        """The rest of the layer after attention: x [B, T, E] residual, h [B, T, E] attention output."""
        if self.sandwich:
            h = self.post_attn_norm(h)
        x = x + h
        m = self.mlp(self.mlp_norm(x))
        if self.sandwich:
            m = self.post_mlp_norm(m)
        return x + m

    def __call__(self, x, positions, cache, layer, slots, num_tokens, *, window=_FROM_CONFIG, inv_freq=None, plan=None):
        """One layer over the paged cache; `layer` an int or a traced i32[] (see `Attention`)."""
        h, cache = self.attn(self.attn_norm(x), positions, cache, layer, slots, num_tokens, window=window,
                             inv_freq=inv_freq, plan=plan)
        return self.finish(x, h), cache

    def last_token(self, x, positions, cache, layer, slots, num_tokens, last, *, window=_FROM_CONFIG, inv_freq=None,
                   plan=None):  # fmt: skip
        """The layer for a forward pass that needs one token a row past it, token last[b] of row
        b (i32[B]): every token's K/V appended, the rest for that token alone. x [B, T, E] ->
        ([B, 1, E], cache)."""
        h, cache = self.attn.last_token(self.attn_norm(x), positions, cache, layer, slots, num_tokens, last,
                                        window=window, inv_freq=inv_freq, plan=plan)  # fmt: skip
        return self.finish(take_tokens(x, last), h), cache

    def mixed(self, x, positions, cache, layer, groups, *, window=_FROM_CONFIG, inv_freq=None, last=None):
        """One layer over row groups packed flat (x [1, N, E]; see `Attention.mixed`). `last`: the
        one token a row the pass needs past this layer (`Attention.mixed`): out [1, M, E]."""
        h, cache = self.attn.mixed(self.attn_norm(x), positions, cache, layer, groups, window=window, inv_freq=inv_freq,
                                   last=last)  # fmt: skip
        if last is not None:
            x = x[:, mixed_token_index(groups, last)]
        return self.finish(x, h), cache


def layer_inputs(config: LlamaConfig) -> tuple[dict, dict]:
    """(scanned, fixed): the per-layer inputs of the layer scan. `scanned` holds arrays with a
    leading [L] axis (layer i32[L]; window i32[L] when the layers' windows differ; inv_freq
    f32[L, H/2] when their RoPEs differ); `fixed` the rest, the same for every layer."""
    scanned = {"layer": jnp.arange(config.num_layers, dtype=jnp.int32)}
    fixed = {}
    uniform, window = config.uniform_window()
    if uniform:
        fixed["window"] = window
    else:
        scanned["window"] = jnp.asarray(layer_windows(config))
    inv_freq = layer_inv_freq(config)
    if (inv_freq == inv_freq[0]).all():
        fixed["inv_freq"] = inv_freq[0]
    else:
        scanned["inv_freq"] = jnp.asarray(inv_freq)
    return scanned, fixed


# On a CPU, layers holding at least this many bytes of weights each run as a list of layers by
# default (`default_scan_layers`): XLA's CPU compiler copies a layer scan's weight slices out
# of the stack before each matmul, every step (the mid model, 11.5 MiB a layer: batch-1 decode
# 1.63x slower under the scan; tiny layers of ~150 KiB: no difference; benchmarks/RESULTS.md,
# "The layer scan's weight copies on a CPU").
CPU_LIST_LAYER_BYTES = 2**20


def default_scan_layers(config: LlamaConfig, param_dtype=jnp.float32, platform: str | None = None) -> bool:
    """Whether a model of `config` (weights stored in `param_dtype`) runs its layers by a scan
    by default on `platform` (default: JAX's default backend): yes, except on a CPU for layers of
    `CPU_LIST_LAYER_BYTES` or more each, which there run as a list of layers (read in place
    by their matmuls; the step's compile then grows with depth). `load_pretrained` asks it."""
    platform = jax.default_backend() if platform is None else platform
    return platform != "cpu" or config.layer_params() * jnp.dtype(param_dtype).itemsize < CPU_LIST_LAYER_BYTES


def run_layers(model: "Llama", x, carry, body, last_body=None):
    """Run `body(block, x, carry, layer, window, inv_freq) -> (x, carry)` over the model's layers;
    returns (x, carry). `last_body` (the same signature; its x may come back in another shape):
    what the last layer runs instead of `body`, for a list of layers only.

    Stacked layers (`scan_layers=True`): one `jax.lax.scan`, the per-layer data
    (`layer_inputs`) scanned with the parameters. A list of layers: a Python loop, each layer
    with its static index, window (None or an int) and RoPE frequencies (a constant)."""
    config = model.config
    if not model.scan_layers:
        windows, inv_freq = config.layer_windows(), layer_inv_freq(config)
        for i, block in enumerate(model.layers):
            fn = last_body if last_body is not None and i == len(model.layers) - 1 else body
            x, carry = fn(block, x, carry, i, windows[i], inv_freq[i])
        return x, carry
    if last_body is not None:
        # Outside the scan, the last layer's weights would be sliced out of the stacks: a copy of
        # them on a TPU, and a second layer body to compile.
        raise ValueError("last_body needs a list of layers (scan_layers=False)")
    graphdef, state = nnx.split(model.layers)
    scanned, fixed = layer_inputs(config)

    def step(c, xs):
        x, carry = c
        per_layer = dict(fixed, **{k: v for k, v in xs.items() if k != "state"})
        block = nnx.merge(graphdef, xs["state"])
        return body(block, x, carry, per_layer["layer"], per_layer["window"], per_layer["inv_freq"]), None

    (x, carry), _ = jax.lax.scan(step, (x, carry), dict(scanned, state=state))
    return x, carry


class Llama(nnx.Module):
    """Decoder-only LM. `dtype` is the compute dtype, `param_dtype` the stored weights' dtype.

    `scan_layers=True` (default): one Block with every parameter stacked [L, ...], run by
    `jax.lax.scan`: the step compiles one layer body whatever the depth. False: a list of L
    Blocks run by a Python loop (the program grows with depth; no per-layer weight slicing,
    see models/README or the module docstring for the trade-off)."""

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, param_dtype=None, rngs: nnx.Rngs,
                 scan_layers: bool = True):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a LlamaConfig, got {type(config).__name__}")
        dtype = jnp.dtype(dtype)  # canonical, so equal configs give equal (hashable) graphdefs
        param_dtype = dtype if param_dtype is None else jnp.dtype(param_dtype)
        self.config = config
        self.dtype = dtype
        scale = math.sqrt(config.hidden_size) if config.gemma else None
        self.embed = Embedder(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                              scale=scale)

        if not isinstance(scan_layers, bool):
            raise ValueError(f"scan_layers must be a bool, got {scan_layers!r}")
        self.scan_layers = scan_layers
        if scan_layers:

            @nnx.split_rngs(splits=config.num_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=config.num_layers)
            def stacked(rngs):
                return Block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

            self.layers = stacked(rngs)  # one Block, every parameter [L, ...]
        else:
            self.layers = _List([Block(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
                                 for _ in range(config.num_layers)])
        style = "gemma" if config.gemma else "llama"
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype, rngs=rngs, style=style)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            # [V, E], as transformers stores it: XLA's CPU dots read it 1.1-1.6x faster than [E, V]
            # at 2-32 rows, 0.83x at one row (benchmarks/RESULTS.md, session 45); drawn [E, V]
            # (its layout before) so that a seed gives the same weights.
            self.lm_head = nnx.Param(
                nnx.initializers.normal(0.02)(rngs.params(), (config.hidden_size, config.vocab_size), param_dtype).T
            )

    def layer(self, i: int) -> Block:
        """Layer i as a Block of its own (its parameters sliced out of the stack)."""
        i = check_int("i", i, 0, self.config.num_layers - 1)
        if not self.scan_layers:
            return self.layers[i]
        graphdef, state = nnx.split(self.layers)
        return nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))

    def hidden(self, tokens, positions, cache: aj.KVCache, slots, num_tokens, *, last_only: bool = False):
        """tokens i32[B, T] -> final-normed hidden states [B, T, E] and the updated cache.

        `last_only=True`: only each row's last new token's hidden state, [B, 1, E] (token
        max(num_tokens[b] - 1, 0) of row b: what a prefill samples from). With a list of layers
        the last layer then appends every token's K/V but runs its query, attention, output and
        MLP for that token alone, the model's last norm too: a T-token chunk skips (T - 1) / T
        of the last layer's dense work. Stacked layers run every layer in full (`run_layers`)
        and take the token before the last norm."""
        if not isinstance(last_only, bool):
            raise ValueError(f"last_only must be a bool, got {last_only!r}")
        x = shard_rows(self.embed(tokens), cache)  # a sharded cache: rows over data, replicated over tensor
        # Every layer's page bookkeeping, once, before the layers: the rows classified, the
        # watermarks and counters set where the layers' appends leave them (every layer appends
        # once, in this same jit: `deferred`).
        plan, cache = plan_and_commit(cache, slots, num_tokens, tokens.shape[1])

        def body(block, x, cache, layer, window, inv_freq):
            x, cache = block(x, positions, cache, layer, slots, num_tokens, window=window, inv_freq=inv_freq, plan=plan)
            return shard_rows(x, cache), cache

        def last_body(block, x, cache, layer, window, inv_freq):
            x, cache = block.last_token(x, positions, cache, layer, slots, num_tokens, last, window=window,
                                        inv_freq=inv_freq, plan=plan)  # fmt: skip
            return shard_rows(x, cache), cache

        last = jnp.maximum(num_tokens - 1, 0)
        last_only &= tokens.shape[1] > 1  # one token a row: the same pass either way
        x, cache = run_layers(self, x, cache, body, last_body if last_only and not self.scan_layers else None)
        if last_only and x.shape[1] > 1:  # stacked layers: the token taken before the (per-token) norm
            x = take_tokens(x, last)
        return self.norm(x), cache

    def hidden_mixed(self, groups, cache: aj.KVCache, *, last_only: bool = False):
        """A mixed step's forward: groups of rows, each (tokens i32[R, T], positions i32[R, T],
        slots i32[R], num_tokens i32[R]), e.g. decode rows (T = 1) and prefill chunks. Their
        tokens run packed flat through the dense parts (N = sum R * T tokens: the cost follows
        the tokens, not a [rows, widest] padding) and each group attends with its own kernel.
        Returns the final-normed hidden states per group ([R, T, E] each) and the updated cache.

        `last_only=True`: only each row's last new token's state, [R, 1, E] a group (token
        max(num_tokens[r] - 1, 0): what a mixed step samples from). With a list of layers the
        last layer appends every token's K/V and runs the rest for those tokens alone, as
        `hidden(..., last_only=True)` does; stacked layers run in full and take the tokens."""
        if not isinstance(last_only, bool):
            raise ValueError(f"last_only must be a bool, got {last_only!r}")
        shapes = [g[0].shape for g in groups]
        flat = lambda i: jnp.concatenate([g[i].reshape(1, -1) for g in groups], axis=1)  # noqa: E731
        x = shard_rows(self.embed(flat(0)), cache)  # [1, N, E]
        positions = flat(1)  # i32[1, N]
        meta = [(g[2], g[3], s[1]) for g, s in zip(groups, shapes)]
        last = [jnp.maximum(g[3] - 1, 0) for g in groups]

        def body(block, x, cache, layer, window, inv_freq):
            x, cache = block.mixed(x, positions, cache, layer, meta, window=window, inv_freq=inv_freq)
            return shard_rows(x, cache), cache

        def last_body(block, x, cache, layer, window, inv_freq):
            x, cache = block.mixed(x, positions, cache, layer, meta, window=window, inv_freq=inv_freq, last=last)
            return shard_rows(x, cache), cache

        last_only &= any(width > 1 for _, width in shapes)  # one token a row: the same pass either way
        x, cache = run_layers(self, x, cache, body, last_body if last_only and not self.scan_layers else None)
        if last_only and self.scan_layers:  # stacked layers: the tokens taken before the (per-token) norm
            x = x[:, mixed_token_index(meta, last)]
        x = self.norm(x)
        out, start = [], 0
        for rows, width in shapes:
            width = 1 if last_only else width
            out.append(x[0, start : start + rows * width].reshape(rows, width, -1))
            start += rows * width
        return out, cache

    def logits(self, x):
        """[B, T, E] -> float32 [B, T, V] (tied head: the embedding table; Gemma 2: soft-capped)."""
        if self.lm_head is None:
            logits = self.embed.decode(x)
        else:
            logits = one_row_safe_einsum("BTE,VE->BTV", x, self.lm_head[...].astype(x.dtype),
                                         preferred_element_type=jnp.float32)  # fmt: skip
        cap = self.config.final_logit_softcapping
        return logits if cap is None else jnp.tanh(logits / cap) * cap

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
    scan_layers: bool = True,
) -> Llama:
    """A random-weight `Llama` (`scan_layers`: see `Llama`): projections, biases and embeddings ~ N(0, std), norm scales at
    their neutral value (1; Gemma's (1 + w) norms 0).

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
        return Llama(config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed), scan_layers=scan_layers)

    graphdef, abstract = nnx.split(nnx.eval_shape(build))
    shardings = None
    if mesh is not None:
        from arena_jax.models.parallel import state_shardings

        shardings = state_shardings(abstract, config, mesh, tensor_axis=tensor_axis)
    if jax.default_backend() == "cpu":
        rng = np.random.default_rng(seed)
        neutral = 0.0 if config.gemma else 1.0

        def draw(path, leaf):
            if "['scale']" in jax.tree_util.keystr(path):
                return np.full(leaf.shape, neutral, leaf.dtype)
            if jax.tree_util.keystr(path).startswith("['lm_head']"):  # [V, E], drawn [E, V] as before (see Llama)
                return rng.normal(0.0, std, leaf.shape[::-1]).astype(np.float32).astype(leaf.dtype).T
            return rng.normal(0.0, std, leaf.shape).astype(np.float32).astype(leaf.dtype)

        host = jax.tree_util.tree_map_with_path(draw, abstract)
        if shardings is None:
            state = jax.tree.map(jnp.asarray, host)
        else:
            from arena_jax.models.parallel import place

            state = place(host, shardings)
    else:
        scale = std / 0.02  # the modules initialize with std 0.02
        state = jax.jit(lambda: jax.tree_util.tree_map_with_path(
            lambda p, x: x if "['scale']" in jax.tree_util.keystr(p) else (x * scale).astype(x.dtype),
            nnx.state(build()),
        ), out_shardings=shardings)()  # fmt: skip
    return nnx.merge(graphdef, state)
