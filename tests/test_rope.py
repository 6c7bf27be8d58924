"""RoPE as the models apply it (`models.layers.rope_tables` + `rotate`): equal to the rotation
written out (cos and sin of the repeated angles, transformers' layout) on fresh random inputs,
and, for a pass of more than one token a row, compiled with each cos / sin evaluated at most
once per (token, lane), not once per head (XLA fused them into every head's rotation before:
benchmarks/RESULTS.md, session 48)."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models.layers import apply_rope, rope_frequencies, rope_tables, rotate
from arena_jax.models.llama import token_positions


def _written_out(x, positions, inv_freq):
    """The rotation as transformers writes it: angles repeated over both halves, then cos / sin."""
    angles = positions.astype(jnp.float32)[:, :, None] * jnp.asarray(inv_freq)[None, None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, H]
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tokens", [1, 7])
def test_rope_equals_the_rotation_written_out(dtype, tokens):
    rng = np.random.default_rng()
    seed = int(rng.integers(2**31))
    rng = np.random.default_rng(seed)
    head_dim = int(rng.choice([16, 64, 128]))
    inv_freq = rope_frequencies(head_dim, float(rng.choice([1e4, 5e5])))
    x = jnp.asarray(rng.standard_normal((3, tokens, 4, head_dim)), dtype)
    positions = jnp.asarray(rng.integers(0, 1 << 17, (3, tokens)), jnp.int32)
    want = jax.jit(_written_out)(x, positions, inv_freq)
    got = jax.jit(apply_rope)(x, positions, inv_freq)
    tables = jax.jit(rope_tables)(positions, inv_freq)
    assert tables[0].shape == (3, tokens, head_dim // 2) and tables[0].dtype == jnp.float32
    tol = 1e-6 if dtype == "float32" else 1e-2  # bf16: an ulp or two of rounding apart, at most
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol,
                               err_msg=f"seed {seed}")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(jax.jit(rotate)(x, *tables)), np.asarray(got), err_msg=f"seed {seed}")


def _result_elements(line: str) -> int:
    """The largest array (elements) in an HLO instruction's result type (a tuple: its largest)."""
    result = re.match(r"\s*(?:ROOT )?%\S+ = (.*?) [\w\-]+\(", line).group(1)
    return max(int(np.prod([int(d) for d in dims.split(",") if d])) for dims in re.findall(r"\[([\d,]*)\]", result))


def _trig_kernel_elements(hlo: str) -> list[int]:
    """For every kernel of the optimized HLO that evaluates a cosine or sine: its result's
    elements (a fused computation's root; an unfused instruction's own)."""
    sizes = []
    for block in hlo.split("\n\n"):
        lines = [line for line in block.splitlines() if " = " in line]
        trig = [line for line in lines if re.search(r" (cosine|sine)\(", line)]
        if not trig:
            continue
        if block.lstrip().startswith("ENTRY"):
            sizes += [_result_elements(line) for line in trig]
        else:
            sizes += [_result_elements(line) for line in lines if line.lstrip().startswith("ROOT")]
    return sizes


@pytest.mark.parametrize("scan", [False, True])
def test_a_chunk_evaluates_each_cos_and_sin_once_not_once_per_head(scan):
    """A prefill chunk's compiled forward pass: no kernel evaluating a cos or sin produces more
    than one value per (token, lane), B * T * H; the rotation fused per query head produced
    num_heads times that with a list of layers (8x here)."""
    config = dataclasses.replace(models.LlamaConfig.tiny(), num_heads=8, head_dim=32)
    model = models.init_random(config, seed=0, scan_layers=scan)
    graphdef, state = nnx.split(model)
    batch, tokens = 4, 64
    cache = aj.create(models.default_layout(model, batch, tokens + 16))
    slots, counts = jnp.arange(batch, dtype=jnp.int32), jnp.full((batch,), tokens, jnp.int32)

    def forward(state, cache, tokens):
        cache, _ = aj.reserve(cache, slots, counts)
        positions = token_positions(cache, slots, counts, tokens.shape[1])
        return nnx.merge(graphdef, state).hidden(tokens, positions, cache, slots, counts)

    hlo = jax.jit(forward).lower(state, cache, jnp.zeros((batch, tokens), jnp.int32)).compile().as_text()
    sizes = _trig_kernel_elements(hlo)
    assert sizes, "no cosine or sine found in the compiled forward pass"
    per_token_lane = batch * tokens * config.head_dim
    assert max(sizes) <= per_token_lane, (
        f"a kernel evaluating cos / sin produces {max(sizes)} elements, more than one per (token, lane) "
        f"({per_token_lane}): RoPE's tables are recomputed inside a consumer, once per head")
