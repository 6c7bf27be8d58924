"""Every family through the same code: the layer scan against an unrolled loop of the same
layers (the reference), the dense baseline against the paged model, the dense baseline's
compiled step (in place, no transposes), and a step program that does not grow with depth.

Parity with transformers is tests/test_models_parity.py; config reading tests/test_hf_config.py.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models.dense_baseline import dense_decode, init_dense_cache


def _model(model_type: str, seed: int = 0, **overrides):
    """A tiny random model with perturbed norms and an untied head (a random tied head with
    embeddings scaled by sqrt(hidden) echoes the input token), so that every weight moves the
    logits and greedy decoding does not repeat one token."""
    overrides.setdefault("tie_word_embeddings", False)
    model = models.init_random(models.LlamaConfig.tiny_family(model_type, **overrides), seed=seed, std=0.2)
    rng = np.random.default_rng(seed + 1)
    state = nnx.state(model)
    state = jax.tree_util.tree_map_with_path(
        lambda p, x: x + rng.normal(0, 0.3, x.shape).astype(x.dtype) if "scale" in jax.tree_util.keystr(p) else x, state
    )
    nnx.update(model, state)
    return model


PROMPTS = [[3, 17, 9, 25, 1, 12, 7, 40, 99, 5, 61, 2, 33, 8, 70], [5, 2, 90], list(range(30, 50))]


def test_dense_baseline_matches_paged():
    """Greedy tokens of the dense baseline == the paged arena's, on Gemma 2 (traced per-layer
    windows shorter than the sequences, both soft-caps, sandwich norms). The other families'
    dense paths share this code; `arena-bench decode` checks them the same way."""
    model = _model("gemma2")
    paged = models.generate(model, PROMPTS, 10, batch_size=3, chunk_size=8, stop_tokens=())
    assert models.dense_generate(model, PROMPTS, 10) == paged.tokens
    assert len({t for row in paged.tokens for t in row}) > 5  # not a degenerate model repeating one token


def test_scan_equals_a_python_loop_of_the_layers():
    """The scanned layers (per-layer window and RoPE as scanned data) == the same weights as a
    list of layers (`scan_layers=False`: a Python loop, each Block with its static layer index,
    window and RoPE constant), on the family with the most per-layer data. Same logits, and the
    loaded / exported checkpoint tensors are the same either way."""
    model = _model("gemma3_text", seed=3, num_layers=3, layer_types=("sliding_attention", "full_attention") * 1 +
                   ("sliding_attention",))
    loop = models.init_random(model.config, seed=0, scan_layers=False)
    nnx.update(loop, nnx.state(model, nnx.Not(nnx.PathContains("layers"))))
    for i in range(model.config.num_layers):
        nnx.update(loop.layers[i], nnx.state(model.layer(i)))
    tensors = models.export_hf_tensors(model)
    assert all(np.array_equal(v, tensors[k]) for k, v in models.export_hf_tensors(loop).items())
    layout = models.default_layout(model, 2, 32, page_size=8, dtype="float32")
    tokens = jnp.asarray([PROMPTS[0][:12], PROMPTS[2][:12]], jnp.int32)
    slots, counts = jnp.arange(2, dtype=jnp.int32), jnp.asarray([12, 9], jnp.int32)

    def run(net):
        cache, _ = aj.reserve(aj.create(layout), slots, counts)
        return net(tokens, models.token_positions(cache, slots, counts, 12), cache, slots, counts)[0]

    scanned, looped = jax.jit(lambda: run(model))(), jax.jit(lambda: run(loop))()
    live = np.arange(12)[None, :] < np.asarray(counts)[:, None]
    np.testing.assert_allclose(np.asarray(scanned)[live], np.asarray(looped)[live], rtol=1e-5, atol=1e-5)


def test_step_program_does_not_grow_with_depth():
    """The lowered decode steps of a 6-layer and a 24-layer model (both 5 local : 1 global) have
    the same operations (one layer body in a loop), so compile time does not follow depth."""
    def ops(num_layers):
        model = _model("gemma3_text", num_layers=num_layers, layer_types=models.presets.every_nth_global(num_layers))
        graphdef, state = nnx.split(model)
        cache = jax.eval_shape(lambda: aj.create(models.default_layout(model, 2, 32, page_size=8, dtype="float32")))
        slots = jax.ShapeDtypeStruct((2,), jnp.int32)
        text = models.decode_step.lower(graphdef, state, cache, slots, slots).as_text()
        return sorted(re.findall(r"= (?:\"?)(stablehlo\.\w+|\w+\.\w+)", text))

    assert ops(6) == ops(24)


def test_dense_baseline_updates_its_cache_in_place():
    """The dense step writes K and V with one dynamic-update-slice each per layer into the
    loop-carried [L, B, K, S, H] cache (heads-major): no transpose, copy or scatter of a whole-cache-shaped
    buffer, and the donated cache aliases the output."""
    model = _model("gemma2")
    graphdef, state = nnx.split(model)
    cache = init_dense_cache(model.config, 4, 40, jnp.float32)
    hlo = dense_decode.lower(graphdef, state, cache, jnp.zeros(4, jnp.int32)).compile().as_text()
    whole = re.escape("f32[" + ",".join(map(str, cache.k.shape)) + "]")
    bad = [line.strip()[:160] for line in hlo.splitlines()
           if re.search(r"= " + whole + r"\S* (transpose|copy|copy-start|scatter)\(", line)]  # fmt: skip
    assert not bad, "whole-cache transposes / copies / scatters:\n" + "\n".join(bad)
    updates = [line for line in hlo.splitlines() if re.search(r"= " + whole + r"\S* dynamic-update-slice\(", line)]
    assert len(updates) == 2, updates  # K and V, inside the layer loop (one body for every layer)
    assert "input_output_alias" in hlo
    # Heads-major: attention reads a layer as stored ([B, K, S, H]), with no transpose of it in
    # either order (the [L, B, S, K, H] layout transposed each layer's K and V every step).
    _, b, k, s, h = cache.k.shape
    layer = "|".join(re.escape(f"f32[{','.join(map(str, d))}]") for d in ((b, k, s, h), (b, s, k, h)))
    transposes = [line.strip()[:160] for line in hlo.splitlines() if re.search(r"= (" + layer + r")\S* transpose\(", line)]
    assert not transposes, "a layer's K or V transposed:\n" + "\n".join(transposes)
