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
from arena_jax import models
from hf_reference import hf_reference  # noqa: F401  (a fixture: skips / fails as the CI line says where torch is absent)

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
    for module, attr, key in (("pallas_kernels.gpu.attention", "paged_attention", "attention"),
                              ("pallas_kernels.gpu.append", "paged_append", "append")):
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


def test_gemma2_through_pallas_matches_transformers(tmp_path, monkeypatch, hf_reference):
    """A Gemma-2-style checkpoint (soft-capped attention and logits, a window of 8 on every
    other layer, (1 + w) sandwich norms, tied head) through the Pallas kernels (interpret mode):
    the traced per-layer window and the soft-cap go through `aj.attend` into the kernels, and
    the greedy tokens and logits equal transformers' on the same safetensors."""
    torch, transformers = hf_reference  # the Hugging Face stack, as in the parity tests (on every CI line)
    transformers.logging.set_verbosity_error()
    config = transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=5.0,
        final_logit_softcapping=8.0, max_position_embeddings=64, initializer_range=0.2, attn_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.3 * torch.randn_like(param))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    calls = {"attention": 0}
    module = importlib.import_module("pallas_kernels.gpu.attention")
    original = module.paged_attention

    def counting(*args, **kwargs):
        calls["attention"] += 1
        assert kwargs.get("logits_soft_cap") == 5.0  # the cap reaches the kernel
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "paged_attention", counting)
    monkeypatch.setenv(aj.BACKEND_ENV, "pallas")
    jax.clear_caches()
    model, _ = models.load_pretrained(tmp_path, dtype=np.float32)
    assert model.config.layer_windows() == (8, None) and model.config.attn_logit_softcapping == 5.0
    prompts = [[3, 17, 9, 25, 1, 12, 7, 40, 99, 5, 61, 2, 33], [5, 2, 90]]  # 13 + 4 tokens > window 8, 2 pages
    layout = models.default_layout(model, 2, 24, page_size=8, dtype="float32")
    got = models.generate(model, prompts, 4, batch_size=2, chunk_size=8, layout=layout, return_logits=True,
                          stop_tokens=())
    assert calls["attention"] > 0, "the Pallas kernels never ran"
    for prompt, tokens, logits in zip(prompts, got.tokens, got.logits):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
        assert tokens == ref.argmax(-1).tolist()
        assert np.abs(logits - ref).max() <= 1e-4 * np.abs(ref).max()
    jax.clear_caches()  # later tests trace the default backend again
