"""A forward pass that needs one token a row past the last layer (`Llama.hidden(...,
last_only=True)`, what `prefill` samples from; the dense baseline's `dense_prefill` the same;
a list of layers runs the last layer for that token alone, stacked layers take it after a full
pass): its hidden state equals the full pass's at each row's last new token, and the cache it
leaves equals the full pass's, on fresh random weights and prompts."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models import dense_baseline
from arena_jax.models.llama import token_positions

BATCH, WIDTH = 4, 11


def _model(scan: bool, window: int | None, seed: int):
    config = models.LlamaConfig.tiny()
    if window is not None:
        config = dataclasses.replace(config, sliding_window=window, model_type=None)
    return models.init_random(config, seed=seed, scan_layers=scan)


def _forward(model, cache, tokens, slots, counts, last_only):
    cache, ok = aj.reserve(cache, slots, counts)
    positions = token_positions(cache, slots, counts, tokens.shape[1])
    x, cache = model.hidden(tokens, positions, cache, slots, counts, last_only=last_only)
    return x, cache, ok


def _jitted(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, *args: _forward(nnx.merge(graphdef, state), *args), static_argnums=5)


@pytest.mark.parametrize("scan, window, dtype", [(True, None, None), (False, None, None), (True, 5, None),
                                                 (False, None, "int8")])  # fmt: skip
def test_last_only_equals_the_full_pass_at_each_rows_last_token(scan, window, dtype):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    model = _model(scan, window, seed)
    cache = aj.create(models.default_layout(model, BATCH, 64, page_size=8, dtype=dtype))
    slots = jnp.arange(BATCH, dtype=jnp.int32)
    # A first chunk, so that the second one's rows continue at positions past 0.
    first = jnp.asarray(rng.integers(0, WIDTH + 1, BATCH), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (BATCH, WIDTH)), jnp.int32)
    run = _jitted(model)
    _, cache, ok = run(nnx.state(model), cache, tokens, slots, first, False)
    assert bool(jnp.all(ok))
    counts = jnp.asarray(rng.integers(1, WIDTH + 1, BATCH), jnp.int32).at[0].set(WIDTH)
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (BATCH, WIDTH)), jnp.int32)
    full, full_cache, ok = run(nnx.state(model), cache, tokens, slots, counts, False)
    last, last_cache, _ = run(nnx.state(model), cache, tokens, slots, counts, True)
    assert bool(jnp.all(ok))
    assert last.shape == (BATCH, 1, model.config.hidden_size)
    want = jnp.take_along_axis(full, (counts - 1)[:, None, None], axis=1)
    np.testing.assert_allclose(np.asarray(last), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(full_cache, name), getattr(last_cache, name)
        assert (a is None) == (b is None) and (a is None or bool(jnp.all(a == b))), name
    assert bool(jnp.all(full_cache.table.page_map == last_cache.table.page_map))
    assert bool(jnp.all(full_cache.table.slot_words == last_cache.table.slot_words))
    assert bool(jnp.all(full_cache.stats.counts == last_cache.stats.counts))


def test_stacked_layers_take_no_last_body():
    model = _model(True, None, 0)
    with pytest.raises(ValueError, match="last_body needs a list of layers"):
        models.llama.run_layers(model, None, None, None, last_body=lambda *a: a)


@pytest.mark.parametrize("scan", [True, False])
def test_one_token_a_row_is_the_same_pass(scan):
    model = _model(scan, None, 0)
    cache = aj.create(models.default_layout(model, BATCH, 64, page_size=8))
    slots = jnp.arange(BATCH, dtype=jnp.int32)
    tokens, counts = jnp.ones((BATCH, 1), jnp.int32), jnp.ones((BATCH,), jnp.int32)
    run = _jitted(model)
    full = run.lower(nnx.state(model), cache, tokens, slots, counts, False).as_text()
    last = run.lower(nnx.state(model), cache, tokens, slots, counts, True).as_text()
    assert full == last


def test_last_only_must_be_a_bool():
    model = _model(True, None, 0)
    cache = aj.create(models.default_layout(model, BATCH, 64, page_size=8))
    slots, counts = jnp.arange(BATCH, dtype=jnp.int32), jnp.ones((BATCH,), jnp.int32)
    with pytest.raises(ValueError, match="last_only must be a bool"):
        _forward(model, cache, jnp.ones((BATCH, 2), jnp.int32), slots, counts, 1)


@pytest.mark.parametrize("scan", [True, False])
def test_the_dense_prefill_equals_its_full_pass(scan):
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    model = _model(scan, None, seed)
    dense = dense_baseline.init_dense_cache(model.config, BATCH, 32)
    tokens = jnp.asarray(rng.integers(0, model.config.vocab_size, (BATCH, WIDTH)), jnp.int32)
    counts = jnp.asarray(rng.integers(1, WIDTH + 1, BATCH), jnp.int32)
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, *args: dense_baseline._forward(nnx.merge(graphdef, state), *args), static_argnums=4)
    full, full_cache = run(state, dense, tokens, counts, False)
    last, last_cache = run(state, dense, tokens, counts, True)
    want = jnp.take_along_axis(full, (counts - 1)[:, None, None], axis=1)
    np.testing.assert_allclose(np.asarray(last), np.asarray(want), rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
    assert bool(jnp.all(full_cache.k == last_cache.k)) and bool(jnp.all(full_cache.v == last_cache.v))


def test_a_last_query_plan_is_for_attention_only():
    model = _model(False, None, 0)
    config = model.config
    cache = aj.create(models.default_layout(model, BATCH, 64, page_size=8))
    slots, counts = jnp.arange(BATCH, dtype=jnp.int32), jnp.full((BATCH,), 3, jnp.int32)
    cache, _ = aj.reserve(cache, slots, counts)
    plan = aj.plan_step(cache, slots, counts, 3).last_query()
    kv = jnp.zeros((BATCH, 1, config.num_kv_heads, config.head_dim), jnp.float32)
    with pytest.raises(ValueError, match="for aj.attend only"):
        aj.append(cache, 0, slots, kv, kv, num_tokens=jnp.minimum(counts, 1), plan=plan)


def _mixed_forward(model, cache, decode, chunks, last_only):
    """A mixed step's reservation and forward: decode rows (tokens i32[R], slots, counts 0 / 1)
    and prompt chunks (tokens i32[P, T], slots, counts)."""
    (d_tokens, d_slots, d_counts), (p_tokens, p_slots, p_counts) = decode, chunks
    cache, ok = aj.reserve(cache, jnp.concatenate([d_slots, p_slots]), jnp.concatenate([d_counts, p_counts]))
    d_pos = token_positions(cache, d_slots, d_counts, 1)
    p_pos = token_positions(cache, p_slots, p_counts, p_tokens.shape[1])
    groups = [(d_tokens[:, None], d_pos, d_slots, d_counts), (p_tokens, p_pos, p_slots, p_counts)]
    out, cache = model.hidden_mixed(groups, cache, last_only=last_only)
    return out, cache, ok


@pytest.mark.parametrize("scan, dtype", [(True, None), (False, None), (False, "int8")])
def test_a_mixed_step_last_only_equals_its_full_pass(scan, dtype):
    """`hidden_mixed(..., last_only=True)` (what `mixed_step` samples from): each decode row's
    state and each chunk row's at its last new token equal the full pass's, and the cache is
    left the same, on fresh random weights, prompts and counts (rows continuing past a first
    chunk, a padded decode row)."""
    seed = int(np.random.default_rng().integers(2**31))
    rng = np.random.default_rng(seed)
    model = _model(scan, None, seed)
    cache = aj.create(models.default_layout(model, BATCH + 2, 64, page_size=8, dtype=dtype))
    graphdef = nnx.graphdef(model)
    prefill = jax.jit(lambda state, *args: _forward(nnx.merge(graphdef, state), *args), static_argnums=5)
    mixed = jax.jit(lambda state, *args: _mixed_forward(nnx.merge(graphdef, state), *args), static_argnums=4)
    vocab, slots = model.config.vocab_size, jnp.arange(BATCH + 2, dtype=jnp.int32)
    first = jnp.asarray(rng.integers(1, WIDTH + 1, BATCH + 2), jnp.int32)
    tokens = jnp.asarray(rng.integers(0, vocab, (BATCH + 2, WIDTH)), jnp.int32)
    _, cache, ok = prefill(nnx.state(model), cache, tokens, slots, first, False)
    assert bool(jnp.all(ok))
    # Slots 0-2 decode (slot 2's row padded), slots 3-5 take a chunk each.
    d_slots = jnp.asarray([0, 1, aj.PAD_SLOT], jnp.int32)
    decode = (jnp.asarray(rng.integers(0, vocab, 3), jnp.int32), d_slots, (d_slots >= 0).astype(jnp.int32))
    p_counts = jnp.asarray(rng.integers(1, WIDTH + 1, 3), jnp.int32).at[0].set(WIDTH)
    chunks = (jnp.asarray(rng.integers(0, vocab, (3, WIDTH)), jnp.int32), slots[3:], p_counts)
    (full_d, full_p), full_cache, ok = mixed(nnx.state(model), cache, decode, chunks, False)
    (last_d, last_p), last_cache, _ = mixed(nnx.state(model), cache, decode, chunks, True)
    assert bool(jnp.all(ok))
    assert last_d.shape == full_d.shape == (3, 1, model.config.hidden_size) and last_p.shape == (3, 1, model.config.hidden_size)
    close = dict(rtol=2e-5, atol=2e-5, err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(last_d)[:2], np.asarray(full_d)[:2], **close)
    np.testing.assert_allclose(np.asarray(last_p), np.asarray(jnp.take_along_axis(full_p, (p_counts - 1)[:, None, None], axis=1)), **close)
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(full_cache, name), getattr(last_cache, name)
        assert (a is None) == (b is None) and (a is None or bool(jnp.all(a == b))), name
    assert bool(jnp.all(full_cache.table.packed == last_cache.table.packed))
    assert bool(jnp.all(full_cache.stats.counts == last_cache.stats.counts))
    with pytest.raises(ValueError, match="last_only must be a bool"):
        model.hidden_mixed([], cache, last_only=1)
