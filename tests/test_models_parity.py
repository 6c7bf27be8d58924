"""Oracle: our models on the paged cache == Hugging Face `transformers` on the same random
weights (torch on CPU, float32, eager attention), for every family: Llama, Mistral, Qwen 2,
Qwen 3, Gemma 2, Gemma 3 (text).

Each case saves a tiny random `<Family>ForCausalLM` with `save_pretrained(safe_serialization=True)`
(transformers writes config.json and safetensors), loads it with `models.load_pretrained`
(dispatching on model_type), then compares (1) chunked, ragged prefill logits at every prompt
position, (2) 31 decode-step logits, (3) 32 greedy tokens per row, and (4) for some cases
`models.generate` (continuous batching, 4 prompts on 3 rows) against Hugging Face's
`generate` (greedy). Windows (8) are shorter than the sequences, prompts (up to 20 tokens)
cross 16-token page boundaries, and the soft-caps (attention 5, logits 8) are below the
scores and logits these weights produce (up to ~11 and ~13), so a missing cap shows. Each
checkpoint's eos token is one that greedy decoding produces, so both sides must stop at it
(HF's generate does by default; so does ours, reading it from the saved generation_config.json).
"""
from __future__ import annotations

import numpy as np
import pytest

from hf_reference import require  # noqa: E402

torch, transformers = require(module_level=True)  # the reference stack, or a skip / failure saying why

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import arena_jax as aj  # noqa: E402
from arena_jax import models  # noqa: E402

# Both sides compute in float32; they differ only in summation order (XLA einsums vs torch
# matmuls, softmax reductions), which moves logits by ~1e-6 of their scale. 1e-4 of the
# logits' norm (and elementwise, of their largest magnitude) leaves ~100x headroom while
# any real mistake (a wrong RoPE frequency, mask or weight layout) is orders larger.
RTOL = 1e-4

B = 3  # batch rows: fixed so every step compiles once per case
CHUNK = 8  # prefill chunk: prompts longer than it are prefilled in several calls
PROMPT_LENS = (5, 13, 20)  # ragged rows; 20 > sliding window 8 and > CHUNK
DECODE_STEPS = 31  # + the token prefill samples: 32 greedy tokens per row
EXTRA_PROMPT_LEN = 11  # a 4th prompt for generate: it waits for a free row
GENERATE_STEPS = 20

CASES = {
    # GQA 4 query / 2 KV heads, Llama 3.1 rope scaling (original context 16 < sequence), tied embeddings.
    "llama_gqa_rope3_tied": dict(
        arch="llama",
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    # Multi-head attention (4 / 4), untied head, plain RoPE.
    "llama_mha": dict(arch="llama", num_key_value_heads=4, tie_word_embeddings=False),
    # Mistral: GQA with a sliding window shorter than every long sequence here.
    "mistral_swa": dict(arch="mistral", num_key_value_heads=2, sliding_window=8),
    # Qwen 2: q/k/v biases; sliding window on layer 1 only (use_sliding_window, max_window_layers).
    "qwen2_bias_swa": dict(arch="qwen2", num_key_value_heads=2, rope_theta=1000000.0, use_sliding_window=True,
                           sliding_window=8, max_window_layers=1),
    # Qwen 3: q/k RMSNorms, head_dim 32 (not hidden / heads), biases on all four projections.
    "qwen3_qknorm_bias": dict(arch="qwen3", num_key_value_heads=2, head_dim=32, attention_bias=True),
    # Gemma 2: GeGLU, (1 + w) and sandwich norms, sqrt(hidden) embeddings, query_pre_attn_scalar,
    # attention and final soft-caps, windows on alternating layers, tied head.
    "gemma2_softcap_swa": dict(arch="gemma2", num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
                               sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=8.0),
    # Gemma 3: 5 sliding : 1 global layers, local RoPE base 1e4 and global 1e6 linearly scaled by 8,
    # q/k norms (1 + w), final soft-cap.
    "gemma3_5to1": dict(arch="gemma3_text", num_hidden_layers=6, num_key_value_heads=2, head_dim=16,
                        query_pre_attn_scalar=24, sliding_window=8, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=8.0),
}
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def _hf_model(case: dict):
    kwargs = dict(case)
    arch = kwargs.pop("arch")
    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        # Larger than the default 0.02 so attention is far from uniform and logits spread out:
        # masks, positions and weight layouts then change the numbers visibly.
        initializer_range=0.2,
        attn_implementation="eager",
    )
    common.update(kwargs)
    config_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[arch])
    torch.manual_seed(0)
    model = model_cls(config_cls(**common)).eval()
    with torch.no_grad():  # norms start at ones (Gemma: zeros) and biases at zeros: perturb them so their loading shows
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                param.add_(0.3 * torch.randn_like(param))
    return model


def _stop_token(hf, prompts) -> int:
    """A token greedy decoding of the first prompt produces (first seen at step >= 2, so that
    sequence stops early), to be the checkpoint's eos."""
    free = _hf_greedy(hf, prompts[0], GENERATE_STEPS)
    return next((t for i, t in enumerate(free) if i >= 2 and t not in free[:i]), free[0])


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = _hf_model(CASES[request.param])
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 128, n).tolist() for n in PROMPT_LENS + (EXTRA_PROMPT_LEN,)]
    eos = _stop_token(hf, prompts)
    eos_ids = [eos, 127] if request.param.startswith("llama") else eos  # a list (Llama 3 style) or one id
    hf.config.eos_token_id = hf.generation_config.eos_token_id = eos_ids
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    model, tokenizer = models.load_pretrained(path, dtype=jnp.float32)
    assert tokenizer is None  # no tokenizer.json saved
    assert model.config.eos_token_ids == tuple(np.atleast_1d(eos_ids).tolist())  # from generation_config.json
    return request.param, hf, model, prompts


def _layout(model):
    # f32, head_dim 16, page 16: one token of one head is 64 B (a multiple of 16 B).
    return model.config.kv_layout(page_size=16, num_pages=16, max_seqs=B, max_seq_len=64, dtype="float32")


def _hf_logits(hf, tokens) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].numpy()  # [T, V]


def _hf_greedy(hf, prompt, steps):
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(_hf_logits(hf, tokens)[-1].argmax()))
    return tokens[len(prompt) :]


def _rel_err(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _assert_close(got, want, what):
    rel = _rel_err(got, want)
    worst = float(np.abs(got - want).max() / np.abs(want).max())
    assert rel <= RTOL and worst <= RTOL, f"{what}: norm-relative error {rel:.2e}, max-relative {worst:.2e} > {RTOL}"
    return max(rel, worst)


def test_prefill_and_decode_logits_match_hf(pair):
    name, hf, model, prompts = pair
    prompts = prompts[:B]
    graphdef, state = nnx.split(model)
    cache = aj.create(_layout(model))
    slots = jnp.arange(B, dtype=jnp.int32)
    seq_ids = slots
    greedy = models.GREEDY.rows(B)  # the arrays `generate` passes: the decode step compiles once per case

    # Chunked, ragged prefill: every row feeds up to CHUNK tokens per call; short rows run out early.
    got = [[] for _ in range(B)]
    fed = [0] * B
    next_tokens = np.zeros(B, np.int32)
    while any(fed[b] < len(prompts[b]) for b in range(B)):
        tokens = np.zeros((B, CHUNK), np.int32)
        counts = np.zeros(B, np.int32)
        for b, p in enumerate(prompts):
            piece = p[fed[b] : fed[b] + CHUNK]
            tokens[b, : len(piece)], counts[b] = piece, len(piece)
        out = models.prefill(
            graphdef, state, cache, jnp.asarray(tokens), slots, jnp.asarray(counts), seq_ids, 0, greedy, all_logits=True
        )
        cache = out.cache
        assert np.asarray(out.ok).all()
        logits, sampled = np.asarray(out.logits), np.asarray(out.tokens)
        for b in range(B):
            if counts[b]:
                got[b].append(logits[b, : counts[b]])
                fed[b] += int(counts[b])
                next_tokens[b] = sampled[b]
    worst = 0.0
    for b, p in enumerate(prompts):
        ref = _hf_logits(hf, p)
        worst = max(worst, _assert_close(np.concatenate(got[b]), ref, f"{name} prefill row {b}"))
        assert next_tokens[b] == ref[-1].argmax()

    # Greedy decode, all rows at once (different lengths), then one HF pass over each full sequence.
    generated = [[int(next_tokens[b])] for b in range(B)]
    step_logits = [[] for _ in range(B)]
    tokens = jnp.asarray(next_tokens)
    for _ in range(DECODE_STEPS):
        out = models.decode_step(graphdef, state, cache, tokens, slots, seq_ids, 0, greedy)
        cache, tokens = out.cache, out.tokens
        logits, sampled = np.asarray(out.logits), np.asarray(out.tokens)
        for b in range(B):
            step_logits[b].append(logits[b])
            generated[b].append(int(sampled[b]))
    for b, p in enumerate(prompts):
        full = p + generated[b]
        ref = _hf_logits(hf, full[:-1])  # position i predicts token i + 1
        decode_ref = ref[len(p) : len(p) + DECODE_STEPS]
        worst = max(worst, _assert_close(np.stack(step_logits[b]), decode_ref, f"{name} decode row {b}"))
        assert generated[b] == ref[len(p) - 1 :].argmax(-1).tolist(), f"{name} row {b}: greedy tokens differ"
    print(f"{name}: max relative logit error {worst:.2e}")


# The scheduler is architecture-blind: a few cases suffice (each costs compiles).
@pytest.mark.parametrize("pair", ["llama_gqa_rope3_tied", "mistral_swa", "gemma2_softcap_swa"], indirect=True)
def test_generate_matches_hf_greedy(pair):
    """Continuous batching (4 prompts, 3 rows), chunked prefill, per-step logits, eos stops."""
    name, hf, model, prompts = pair
    steps = GENERATE_STEPS
    result = models.generate(
        model, prompts, steps, batch_size=B, chunk_size=CHUNK, layout=_layout(model), return_logits=True
    )  # stop_tokens default: the checkpoint's eos
    assert result.prefill_calls >= 3  # the 20-token prompt needs 3 chunks
    stopped = 0
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False)  # stops at eos by default
        want = out[0, len(p) :].tolist()
        assert result.tokens[i] == want, f"{name} prompt {i}"
        stopped += len(want) < steps
        ref = _hf_logits(hf, p + want[:-1])[len(p) - 1 :]
        _assert_close(result.logits[i], ref, f"{name} generate logits prompt {i}")
    assert stopped >= 1  # some sequence ended at the eos token, on both sides
    assert aj.health(result.cache)["free_pages"] == _layout(model).num_pages  # every page came back
