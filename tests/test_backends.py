"""The API's two backends agree: `backend="pallas"` (interpret mode on CPU) == `backend="reference"`
through aj.append / aj.attend, on scrambled pages whose stale contents are NaN."""
from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj

LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, page_size=8, num_pages=24, max_seqs=3,
                     max_pages_per_seq=6, dtype="float32")
# Both paths accumulate in f32 but in different orders (online softmax vs one softmax).
ATOL = 2e-5


def dirty_cache():
    cache = aj.create(LAYOUT)
    perm = jax.random.permutation(jax.random.key(0), LAYOUT.num_pages).astype(jnp.int32)
    return cache.replace(k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan),
                         table=cache.table.replace(free_stack=perm))


def run(backend, window):
    cache = dirty_cache()
    slots = jnp.array([0, aj.PAD_SLOT, 2])
    rng = np.random.default_rng(1)
    outs = []
    for counts in ([13, 0, 8], [1, 0, 9], [3, 0, 1]):  # prefill, then ragged chunks crossing pages
        counts = jnp.array(counts, jnp.int32)
        width = int(counts.max())
        cache, ok = aj.reserve(cache, slots, counts)
        assert np.asarray(ok).all()
        for layer in range(LAYOUT.num_layers):
            k, v = (jnp.asarray(rng.standard_normal((3, width, 2, 32)), jnp.float32) for _ in range(2))
            cache = aj.append(cache, layer, slots, k, v, num_tokens=counts, backend=backend)
            q = jnp.asarray(rng.standard_normal((3, width, 8, 32)), jnp.float32)
            outs.append(aj.attend(q, cache, layer, slots, num_tokens=counts, sliding_window=window, backend=backend))
    return cache, outs


@pytest.mark.parametrize("window", [None, 6])
def test_pallas_backend_matches_reference_backend(window):
    ref_cache, ref_outs = run("reference", window)
    pal_cache, pal_outs = run("pallas", window)
    lengths = np.asarray(ref_cache.table.lengths)
    for slot in (0, 2):  # live tokens identical in the arena
        pos = np.arange(lengths[slot])
        for cache_a, cache_b in ((ref_cache, pal_cache),):
            pa = np.asarray(cache_a.table.page_map[slot])[pos // 8]
            pb = np.asarray(cache_b.table.page_map[slot])[pos // 8]
            np.testing.assert_array_equal(np.asarray(cache_a.k)[:, :, pa, pos % 8], np.asarray(cache_b.k)[:, :, pb, pos % 8])
            np.testing.assert_array_equal(np.asarray(cache_a.v)[:, :, pa, pos % 8], np.asarray(cache_b.v)[:, :, pb, pos % 8])
    for got, want in zip(pal_outs, ref_outs):
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(aj.BACKEND_ENV, raising=False)
    assert aj.default_backend() == ("pallas" if jax.default_backend() in ("gpu", "tpu") else "reference")
    monkeypatch.setenv(aj.BACKEND_ENV, "pallas")
    assert aj.default_backend() == "pallas"
    monkeypatch.setenv(aj.BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match=aj.BACKEND_ENV):
        aj.default_backend()


# head_dim 20 in float32 is a legal layout (80-byte token rows) the kernels cannot take.
ODD = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=20, page_size=4, num_pages=4, max_seqs=1,
                  max_pages_per_seq=4, dtype="float32")


def _odd_inputs():
    cache, ok = aj.reserve(aj.create(ODD), jnp.array([0]), jnp.array([3]))
    assert np.asarray(ok).all()
    kv = jnp.ones((1, 3, 1, 20), jnp.float32)
    return cache, kv, jnp.ones((1, 3, 2, 20), jnp.float32)


def test_pallas_asked_for_on_a_layout_it_cannot_take_is_a_value_error(monkeypatch):
    cache, kv, q = _odd_inputs()
    for backend, env in (("pallas", None), (None, "pallas")):
        if env:
            monkeypatch.setenv(aj.BACKEND_ENV, env)
        with pytest.raises(ValueError, match="backend='pallas' cannot take this layout: head_dim=20: .* multiples of 8"):
            aj.append(cache, 0, jnp.array([0]), kv, kv, backend=backend)
        with pytest.raises(ValueError, match="head_dim=20"):
            aj.attend(q, cache, 0, jnp.array([0]), backend=backend)


def test_default_pallas_falls_back_to_reference_with_one_warning(monkeypatch):
    """On a GPU the default is Pallas; a layout it cannot take runs the reference, warning once."""
    import warnings

    from arena_jax import api

    monkeypatch.delenv(aj.BACKEND_ENV, raising=False)
    monkeypatch.setattr(api, "default_backend", lambda: "pallas")
    monkeypatch.setattr(api, "_FALLBACK_WARNED", set())
    cache, kv, q = _odd_inputs()
    with pytest.warns(RuntimeWarning, match=r"cannot take this layout \(head_dim=20.*using the jnp reference"):
        cache = aj.append(cache, 0, jnp.array([0]), kv, kv)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason warns once per process
        out = aj.attend(q, cache, 0, jnp.array([0]))
    assert api._resolve_backend(None, ODD) == "reference"
    assert api._resolve_backend(None, LAYOUT, group=4) == "pallas"  # a layout it takes stays on Pallas
    want = aj.attend(q, cache, 0, jnp.array([0]), backend="reference")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
