"""`aj.attend` over pages == dense softmax attention over the same tokens gathered contiguously,
and no stale data of an earlier tenant ever reaches the output."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj

HEAD_DIM = 16
PAGE = 4
# f32 end to end; the oracle runs in float64 numpy: the gap is f32 rounding of exp/sums.
ATOL = {"float32": 2e-5}


def make_layout(num_kv_heads):
    return aj.KVLayout(
        num_layers=2, num_kv_heads=num_kv_heads, head_dim=HEAD_DIM, page_size=PAGE, num_pages=40, max_seqs=4,
        max_pages_per_seq=10, dtype="float32",
    )


def scramble(cache, seed):
    """Hand pages out in a random order, so logical neighbours are not physical neighbours."""
    perm = jax.random.permutation(jax.random.key(seed), cache.layout.num_pages).astype(jnp.int32)
    return cache.replace(table=cache.table.replace(free_stack=perm))


def dense_attention(q, keys, values, num_new, window, cap=None):
    """Oracle. q: [T, Hq, D] for the last `num_new` positions; keys/values: [n, Hkv, D];
    `cap`: Gemma 2's logit soft-cap, `cap * tanh(s / cap)` on the scaled scores."""
    n, num_kv, _ = keys.shape
    group = q.shape[1] // num_kv
    out = np.zeros(q.shape, np.float64)
    for t in range(num_new):
        pos = n - num_new + t
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(q.shape[1]):
            kk, vv = keys[lo : pos + 1, h // group].astype(np.float64), values[lo : pos + 1, h // group].astype(np.float64)
            logits = kk @ q[t, h].astype(np.float64) / np.sqrt(q.shape[-1])
            if cap is not None:
                logits = cap * np.tanh(logits / cap)
            w = np.exp(logits - logits.max())
            out[t, h] = (w / w.sum()) @ vv
    return out


def run_case(cache, prompt_lens, new_lens, num_q_heads, window, seed, backend=None):
    """Prefill each slot with a prompt, then add `new_lens` tokens per slot in one ragged batch and attend.

    Returns (outputs [B, T, Hq, D], per-slot dense keys/values, q) for the oracle. `backend`:
    the default (Pallas on a GPU, the blockwise "xla" path elsewhere) unless given."""
    layout = cache.layout
    batch, max_new = len(prompt_lens), max(new_lens)
    slots = np.arange(batch)
    rng = np.random.default_rng(seed)
    keys = [rng.standard_normal((p + n, layout.num_kv_heads, HEAD_DIM)).astype(np.float32) for p, n in zip(prompt_lens, new_lens)]
    values = [rng.standard_normal(k.shape).astype(np.float32) for k in keys]

    def padded(chunks, width):
        out = np.zeros((batch, width, layout.num_kv_heads, HEAD_DIM), np.float32)
        for b, c in enumerate(chunks):
            out[b, : len(c)] = c
        return jnp.asarray(out)

    prompt = np.asarray(prompt_lens, np.int32)
    cache, ok = aj.reserve(cache, slots, prompt)
    assert np.asarray(ok).all()
    width = max(prompt_lens)
    for layer in range(layout.num_layers):
        cache = aj.append(cache, layer, slots, padded([k[:p] for k, p in zip(keys, prompt_lens)], width),
                          padded([v[:p] for v, p in zip(values, prompt_lens)], width), num_tokens=prompt)
    new = np.asarray(new_lens, np.int32)
    cache, ok = aj.reserve(cache, slots, new)
    assert np.asarray(ok).all()
    q = rng.standard_normal((batch, max_new, num_q_heads, HEAD_DIM)).astype(np.float32)
    layer = 1
    cache = aj.append(cache, layer, slots, padded([k[p:] for k, p in zip(keys, prompt_lens)], max_new),
                      padded([v[p:] for v, p in zip(values, prompt_lens)], max_new), num_tokens=new)
    out = aj.attend(jnp.asarray(q), cache, layer, slots, num_tokens=new, sliding_window=window, backend=backend)
    return cache, np.asarray(out), keys, values, q


@pytest.mark.parametrize(
    "num_kv_heads, group, prompt_lens, new_lens, window",
    [
        (4, 1, [1, 3, 4, 5], [1, 1, 1, 1], None),  # MHA decode, lengths around a page boundary
        (2, 4, [7, 0, 17, 12], [1, 5, 2, 3], None),  # GQA 4, ragged multi-token queries (one cold prefill)
        (1, 8, [9, 30], [4, 1], None),  # MQA-like GQA 8, long context
        (2, 4, [15, 22, 3], [3, 1, 6], 5),  # sliding window shorter than the context
        (2, 4, [6, 2], [2, 2], 64),  # sliding window longer than the context
    ],
)
def test_paged_attention_equals_dense_attention(num_kv_heads, group, prompt_lens, new_lens, window):
    cache = scramble(aj.create(make_layout(num_kv_heads)), seed=len(prompt_lens))
    _, out, keys, values, q = run_case(cache, prompt_lens, new_lens, num_kv_heads * group, window, seed=1)
    for b, n_new in enumerate(new_lens):
        want = dense_attention(q[b], keys[b], values[b], n_new, window)
        np.testing.assert_allclose(out[b, :n_new], want[:n_new], atol=ATOL["float32"], rtol=0)
        assert not out[b, n_new:].any(), "padded query tokens must give zeros"


def test_padded_rows_attend_to_nothing():
    cache = aj.create(make_layout(2))
    cache, _ = aj.reserve(cache, [0], 5)
    kv = jnp.ones((1, 5, 2, HEAD_DIM))
    cache = aj.append(cache, 0, [0], kv, kv)
    q = jnp.ones((2, 1, 4, HEAD_DIM))
    out = aj.attend(q, cache, 0, [aj.PAD_SLOT, 0])
    assert not np.asarray(out[0]).any()
    np.testing.assert_allclose(out[1], 1.0, rtol=1e-6)  # the live row attends to its 5 ones


def test_stale_pages_of_earlier_tenants_never_reach_the_output():
    """Fill every free page with NaN, admit sequences that reuse them, attend: finite and equal
    to the same run on a clean arena."""
    layout = make_layout(2)
    prompt_lens, new_lens = [5, 9, 2], [1, 3, 2]  # partial last pages: NaN sits beside live tokens
    clean = scramble(aj.create(layout), seed=7)
    _, want, *_ = run_case(clean, prompt_lens, new_lens, 8, None, seed=3)

    dirty = scramble(aj.create(layout), seed=7)
    dirty, _ = aj.reserve(dirty, [0, 1, 2, 3], jnp.array([40, 40, 40, 40]))  # an earlier tenant everywhere
    dirty = aj.release(dirty, [0, 1, 2, 3])
    free = np.asarray(dirty.table.free_stack[: int(dirty.table.num_free)])
    assert len(free) == layout.num_pages
    dirty = dirty.replace(k=dirty.k.at[:, :, free].set(jnp.nan), v=dirty.v.at[:, :, free].set(jnp.inf))
    # Reuse the pages in the same order as the clean run.
    dirty = dirty.replace(table=dirty.table.replace(free_stack=clean_order(layout, seed=7)))
    _, got, *_ = run_case(dirty, prompt_lens, new_lens, 8, None, seed=3)

    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def clean_order(layout, seed):
    return jax.random.permutation(jax.random.key(seed), layout.num_pages).astype(jnp.int32)


@pytest.mark.parametrize("backend", ["reference", "pallas", "xla"])
def test_traced_windows_in_a_scan_over_layers_equal_static_calls(backend):
    """Per-step windows as a traced int32 array inside `lax.scan` over layers (local / global
    layers, as Gemma 2 / 3 interleave them; a global layer marked with a window >= max_seq_len),
    with a logit soft-cap: the same outputs as one static call per layer, and == the float64
    oracle; a traced window <= 0 admits no key (zeros)."""
    cache = scramble(aj.create(make_layout(2)), seed=4)
    rng = np.random.default_rng(4)
    slots, n, new, cap = np.arange(3), np.array([11, 6, 14]), np.array([3, 1, 4]), 2.0
    cache, _ = aj.reserve(cache, slots, n)
    keys = rng.standard_normal((2, 3, 14, 2, HEAD_DIM)).astype(np.float32)  # [L, B, n, Hkv, D]
    values = rng.standard_normal(keys.shape).astype(np.float32)
    for layer in range(2):
        cache = aj.append(cache, layer, slots, keys[layer], values[layer], num_tokens=n)
    layers, windows = jnp.asarray([0, 1, 1]), jnp.asarray([4, np.iinfo(np.int32).max, 0], jnp.int32)
    q = jnp.asarray(rng.standard_normal((3, 3, 4, 8, HEAD_DIM)), jnp.float32)  # [steps, B, T, Hq, D]

    @jax.jit
    def all_layers(cache, q, windows):
        def layer_step(carry, xs):
            layer, q_layer, window = xs
            out = aj.attend(q_layer, cache, layer, slots, num_tokens=new, sliding_window=window, logits_soft_cap=cap,
                            backend=backend)
            return carry, out

        return jax.lax.scan(layer_step, 0, (layers, q, windows))[1]

    got = np.asarray(all_layers(cache, q, windows))
    for step, window in ((0, 4), (1, None)):
        static = aj.attend(q[step], cache, step, slots, num_tokens=new, sliding_window=window, logits_soft_cap=cap,
                           backend=backend)
        np.testing.assert_allclose(got[step], np.asarray(static), atol=1e-6, rtol=0)
        for b in range(3):
            want = dense_attention(np.asarray(q[step, b]), keys[step, b, : n[b]], values[step, b, : n[b]], new[b],
                                   window, cap)
            np.testing.assert_allclose(got[step, b, : new[b]], want[: new[b]], atol=ATOL["float32"], rtol=0)
    assert not got[2].any(), "a traced window of 0 admits no key"
