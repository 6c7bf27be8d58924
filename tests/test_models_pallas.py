"""Models with head sizes and page sizes real checkpoints use run end to end through the Pallas
kernels (interpret mode on CPU) and match the jnp reference path: same greedy tokens, close logits.

Phi-3-shaped: head_dim 96 (a tile padded to 128), 5 query heads per KV head, 8-token pages.
Gemma-shaped: head_dim 256, one KV head (multi-query), 32-token pages.
The models are tiny otherwise (1 layer, vocabulary 128): interpret mode is slow.
"""
from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest

import arena_jax as aj
import models

# float32 weights and arena: the two paths differ only in summation order (online softmax).
LOGIT_ATOL = 1e-4


def _generate(config, page_size, backend, monkeypatch):
    monkeypatch.setenv(aj.BACKEND_ENV, backend)
    jax.clear_caches()  # the jitted steps read the backend when traced: trace again
    model = models.init_random(config, seed=1, std=0.2)
    layout = models.default_layout(model, 2, 16, page_size=page_size, dtype="float32")
    prompts = [[3, 17, 9, 25, 1, 12, 7], [5, 2, 90]]
    return models.generate(model, prompts, 4, batch_size=2, chunk_size=4, layout=layout, return_logits=True)


@pytest.mark.parametrize(
    "name, overrides, page_size",
    [
        ("phi3-shaped", dict(head_dim=96, num_heads=5, num_kv_heads=1, num_layers=1), 8),
        ("gemma-shaped", dict(head_dim=256, num_heads=4, num_kv_heads=1, num_layers=1), 32),
    ],
)
def test_model_through_pallas_matches_reference(name, overrides, page_size, monkeypatch):
    config = models.LlamaConfig.tiny(**overrides)
    calls = {"attention": 0, "append": 0}
    for module, attr, key in (("pallas_kernels.paged_attention", "paged_attention", "attention"),
                              ("pallas_kernels.append", "paged_append", "append")):
        module = importlib.import_module(module)  # the package re-exports functions of the same names
        original = getattr(module, attr)

        def counting(*args, _original=original, _key=key, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, attr, counting)

    want = _generate(config, page_size, "reference", monkeypatch)
    assert calls == {"attention": 0, "append": 0}
    got = _generate(config, page_size, "pallas", monkeypatch)
    assert calls["attention"] > 0 and calls["append"] > 0, f"{name}: the Pallas kernels never ran"
    assert got.tokens == want.tokens
    for g, w in zip(got.logits, want.logits):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, atol=LOGIT_ATOL, rtol=0)
