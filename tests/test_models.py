"""models: config, full-size shapes (eval_shape only), loading, generation (continuous
batching, preemption, sampling, stop tokens, no recompilation), the dense baseline, the CLI.

Every generation test shares one tiny model and one deliberately small arena (6 pages of
16 tokens for 4 rows of up to 64 tokens), so the jitted steps compile once for the module.
"""
from __future__ import annotations

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import arena_jax as aj
from arena_jax import models
from arena_jax.models.dense_baseline import dense_generate
from hf_folders import save_hf_folder

BATCH, CHUNK, NEW = 4, 8, 24

# Jitted once per shape: op-by-op eager dispatch would compile every primitive separately.
_filter = jax.jit(models.filter_logits)
_sample = jax.jit(models.sample)
PROMPT_LENS = (3, 17, 9, 25, 1, 12)


def _tiny_model(seed=0, **overrides):
    """Tiny random Llama with weights ~0.2 (not 0.02) so logits are well separated."""
    return models.init_random(models.LlamaConfig.tiny(**overrides), seed=seed, std=0.2)


@pytest.fixture(scope="module")
def model():
    return _tiny_model()


@pytest.fixture(scope="module")
def small_layout(model):
    # 6 pages hold 96 tokens; 4 rows of up to 48 fed tokens would need 12: preemption is certain.
    return model.config.kv_layout(page_size=16, num_pages=6, max_seqs=BATCH, max_seq_len=64, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 128, n).tolist() for n in PROMPT_LENS]


def _run(model, layout, prompts, **kwargs):
    new = kwargs.pop("max_new_tokens", NEW)
    return models.generate(model, prompts, new, batch_size=BATCH, chunk_size=CHUNK, layout=layout, **kwargs)


@pytest.fixture(scope="module")
def greedy(model, small_layout, prompts):
    return _run(model, small_layout, prompts, return_logits=True)


# ---- config ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(head_dim=15), "head_dim"),
        (dict(hidden_size=66, head_dim=None), "hidden_size"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(rope_theta=-1.0), "rope_theta"),
        (dict(rms_norm_eps=0), "rms_norm_eps"),
    ],
)
def test_config_validation_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        models.LlamaConfig.tiny(**overrides)


def test_rope_scaling_validation():
    with pytest.raises(ValueError, match="high_freq_factor"):
        models.RopeScaling(factor=8.0, low_freq_factor=4.0, high_freq_factor=1.0)
    with pytest.raises(ValueError, match="rope_scaling"):
        models.LlamaConfig.tiny(rope_scaling={"rope_type": "llama3"})


def test_from_hf_both_spellings(tmp_path):
    v4 = {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    }
    assert models.LlamaConfig.from_hf(v4) == models.LlamaConfig.llama3_8b()
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(v4["rope_scaling"], rope_theta=500000.0)
    (tmp_path / "config.json").write_text(json.dumps(v5))
    assert models.LlamaConfig.from_hf(tmp_path) == models.LlamaConfig.llama3_8b()
    assert models.LlamaConfig.from_hf(tmp_path / "config.json") == models.LlamaConfig.llama3_8b()
    mistral = models.LlamaConfig.mistral_7b()
    assert models.LlamaConfig.from_hf(mistral.to_hf()) == mistral
    with pytest.raises(ValueError, match="model_type"):
        models.LlamaConfig.from_hf(dict(v4, model_type="gpt2"))
    with pytest.raises(ValueError, match="rope_type"):
        models.LlamaConfig.from_hf(dict(v4, rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    # A missing key takes transformers' default (32 layers for Llama); a wrong type is refused.
    assert models.LlamaConfig.from_hf({k: v for k, v in v4.items() if k != "num_hidden_layers"}).num_layers == 32
    with pytest.raises(ValueError, match="num_hidden_layers must be a JSON integer"):
        models.LlamaConfig.from_hf(dict(v4, num_hidden_layers="32"))


def test_presets_and_kv_layout():
    assert models.LlamaConfig.llama3_8b().num_params() == 8_030_261_248
    assert models.LlamaConfig.llama3_70b().num_params() == 70_553_706_496
    assert models.LlamaConfig.mistral_7b().num_params() == 7_241_732_096
    # the published parameter counts: biases, q/k norms, sandwich norms and tied heads counted right
    assert models.LlamaConfig.qwen2_5_7b().num_params() == 7_615_616_512
    assert models.LlamaConfig.qwen3_8b().num_params() == 8_190_735_360
    assert models.LlamaConfig.gemma2_9b().num_params() == 9_241_705_984
    assert models.LlamaConfig.gemma3_1b().num_params() == 999_885_952
    layout = models.LlamaConfig.llama3_70b().kv_layout(budget_bytes=1 << 30, max_seqs=4, max_seq_len=4096)
    assert layout.num_kv_heads == 8 and layout.head_dim == 128  # sized by KV heads, never 64 query heads
    assert layout.bytes_per_token == 2 * 80 * 8 * 128 * 2
    assert layout.num_pages == (1 << 30) // layout.page_bytes and layout.max_pages_per_seq == 256
    with pytest.raises(ValueError, match="num_pages and budget_bytes"):
        models.LlamaConfig.tiny().kv_layout()


@pytest.mark.parametrize("preset", ["mistral_7b", "llama3_8b", "qwen2_5_7b", "qwen3_8b", "gemma2_9b", "gemma3_1b"])
def test_full_size_models_eval_shape(preset):
    """The full models, their arenas and a whole decode step, traced abstractly (never allocated)."""
    cfg = getattr(models.LlamaConfig, preset)()
    abstract = nnx.eval_shape(lambda: models.Llama(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    assert sum(int(np.prod(x.shape)) for x in jax.tree.leaves(state)) == cfg.num_params()
    layout = cfg.kv_layout(page_size=16, budget_bytes=16 << 30, max_seqs=8, max_seq_len=8192)
    cache = jax.eval_shape(lambda: aj.create(layout))
    assert cache.k.shape == (cfg.num_layers, cfg.num_kv_heads, layout.num_pages, 16, cfg.head_dim)
    assert cache.k.dtype == jnp.bfloat16
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    out = jax.eval_shape(lambda s, c, t, sl: models.decode_step(graphdef, s, c, t, sl), state, cache, i32(8), i32(8))
    assert out.logits.shape == (8, cfg.vocab_size) and out.tokens.shape == (8,)
    assert out.cache.k.shape == cache.k.shape and out.ok.dtype == jnp.bool_
    out = jax.eval_shape(
        lambda s, c, t, sl, n: models.prefill(graphdef, s, c, t, sl, n), state, cache, i32(8, 64), i32(8), i32(8)
    )
    assert out.logits.shape == (8, cfg.vocab_size)


# ---- loading -----------------------------------------------------------------------------------


def _save(path, model, tensors=None, shards=1):
    tensors = models.export_hf_tensors(model) if tensors is None else tensors
    save_hf_folder(path, model.config.to_hf(), tensors, shards)


def _same_params(a, b):
    la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


def test_load_round_trip_sharded_and_bf16(tmp_path, model):
    _save(tmp_path / "single", model)
    loaded, tokenizer = models.load_pretrained(tmp_path / "single", dtype=jnp.float32)
    assert tokenizer is None and loaded.config == model.config and _same_params(loaded, model)
    _save(tmp_path / "sharded", model, shards=3)
    assert _same_params(models.load_pretrained(tmp_path / "sharded", dtype=jnp.float32).model, model)
    # bfloat16 on disk: numpy has no bf16, the loader reads the raw bytes.
    bf16 = {k: v.astype(jnp.bfloat16) for k, v in models.export_hf_tensors(model).items()}
    _save(tmp_path / "bf16", model, bf16)
    loaded = models.load_pretrained(tmp_path / "bf16", dtype=jnp.bfloat16).model
    want = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), jax.tree.leaves(nnx.state(model)))
    assert all(np.array_equal(np.asarray(x), y) for x, y in zip(jax.tree.leaves(nnx.state(loaded)), want))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(nnx.state(loaded)))
    tied = _tiny_model(tie_word_embeddings=True)
    _save(tmp_path / "tied", tied)
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    assert _same_params(models.load_pretrained(tmp_path / "tied", dtype=jnp.float32).model, tied)


def test_load_errors_name_the_tensor(tmp_path, model):
    tensors = models.export_hf_tensors(model)
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.weight"]
    _save(tmp_path / "missing", model, missing)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(128, 64\)"):
        models.load_pretrained(tmp_path / "missing", dtype=jnp.float32)
    wrong = dict(tensors)
    wrong["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)  # 4 KV heads, config says 2
    _save(tmp_path / "wrong", model, wrong)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(64, 64\).*\(32, 64\)"):
        models.load_pretrained(tmp_path / "wrong", dtype=jnp.float32)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps(model.config.to_hf()))
    with pytest.raises(ValueError, match="safetensors"):
        models.load_pretrained(tmp_path / "empty")


def test_tokenizer_json_is_loaded(tmp_path, model):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["[UNK]", "hello", "arena", "pages"])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    _save(tmp_path, model)
    tok.save(str(tmp_path / "tokenizer.json"))
    _, loaded = models.load_pretrained(tmp_path, dtype=jnp.float32)
    assert loaded.encode("hello pages").ids == [1, 3]


# ---- generation --------------------------------------------------------------------------------


def test_preemption_matches_ample_memory(model, small_layout, prompts, greedy):
    assert greedy.preemptions > 0  # the arena cannot hold every row at once
    for i, p in enumerate(prompts):  # alone, a sequence never lacks pages
        alone = _run(model, small_layout, [p])
        assert alone.preemptions == 0
        assert greedy.tokens[i] == alone.tokens[0], f"prompt {i}"
    assert all(len(t) == NEW for t in greedy.tokens)
    health = aj.health(greedy.cache)
    assert health["free_pages"] == small_layout.num_pages and health["active_sequences"] == 0
    assert health["dropped_writes"] == 0  # refused rows were run as padding, never written


# int8 arena vs the float32 arena, same model and prompts, logits compared while the greedy
# tokens agree (same context). int8 keeps each K/V element within absmax / 254 of its row
# (test_quantized.py): measured 3.1e-2 of the largest logit here (random weights ~0.2, 2
# layers). A dequantization bug (a wrong or stale scale, a scale applied twice) moves logits by
# their own size; 0.1 leaves 3x headroom. (fp8 figures: benchmarks/RESULTS.md, `arena-bench accuracy`.)
INT8_LOGIT_RTOL = 0.1


def test_int8_arena_end_to_end_with_preemption(model, small_layout, prompts, greedy, capsys):
    import dataclasses

    layout = dataclasses.replace(small_layout, dtype="int8")  # float32 scales, same geometry
    result = _run(model, layout, prompts, return_logits=True)
    assert result.preemptions > 0  # pages released and reused: stale values and scales behind them
    assert all(len(t) == NEW for t in result.tokens)
    health = aj.health(result.cache)
    assert health["free_pages"] == layout.num_pages and health["dropped_writes"] == 0
    for i, (got, want) in enumerate(zip(result.tokens, greedy.tokens)):
        same = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        assert same >= 1, f"prompt {i}: the first token (prefill) differs"
        g, w = result.logits[i][: same + 1], greedy.logits[i][: same + 1]  # same context up to the first difference
        assert np.isfinite(g).all()
        assert np.abs(g - w).max() <= INT8_LOGIT_RTOL * np.abs(w).max(), f"prompt {i}"
    # generate sizes an int8 arena itself with kv_dtype, and refuses kv_dtype beside a layout.
    with pytest.raises(ValueError, match="give kv_dtype only when generate sizes the arena"):
        _run(model, layout, prompts[:1], kv_dtype="int8")
    # The CLI, same shapes (no new compile): --kv-dtype int8.
    from arena_jax.models.cli import main

    args = ["--prompt", "hello arena", "--max-new-tokens", "6", "--batch", "4", "--num-pages", "6", "--no-compile-cache",
            "--chunk-size", "8", "--max-seq-len", "64", "--kv-dtype", "int8"]
    assert main(args) == 0
    assert "KV arena int8" in capsys.readouterr().out


def test_no_recompilation_as_sequences_come_and_go(model, small_layout, prompts, greedy):
    before = dict(models.TRACE_COUNTS)
    has_size = hasattr(models.prefill, "_cache_size")  # a private jit attribute: checked only where present
    sizes = (models.prefill._cache_size(), models.decode_step._cache_size()) if has_size else None
    rng = np.random.default_rng(5)
    more = [rng.integers(0, 128, int(n)).tolist() for n in rng.integers(1, 40, 9)]
    result = _run(model, small_layout, more, max_new_tokens=12, stop_tokens=(7, 9))
    _run(model, small_layout, prompts[:2], max_new_tokens=5)
    assert result.prefill_calls > 0 and result.decode_calls > 0
    assert dict(models.TRACE_COUNTS) == before  # nothing traced, so nothing compiled
    if sizes is not None:
        assert (models.prefill._cache_size(), models.decode_step._cache_size()) == sizes


def test_stop_tokens(model, small_layout, prompts, greedy):
    base = greedy.tokens
    stop = base[1][4]
    stopped = _run(model, small_layout, prompts, stop_tokens=[stop])
    for want, got in zip(base, stopped.tokens):
        cut = want.index(stop) + 1 if stop in want else len(want)
        assert got == want[:cut]  # the stop token is kept, nothing after it
    assert aj.health(stopped.cache)["free_pages"] == small_layout.num_pages


def test_greedy_logits_are_returned(greedy):
    for toks, logits in zip(greedy.tokens, greedy.logits):
        assert logits.shape == (len(toks), 128) and np.array_equal(logits.argmax(-1), toks)


def test_sampling_seeded_and_filtered(model, small_layout, prompts):
    before = dict(models.TRACE_COUNTS)
    kw = dict(temperature=0.8, top_k=5, top_p=0.9, return_logits=True)
    a = _run(model, small_layout, prompts, seed=1, **kw)
    b = _run(model, small_layout, prompts, seed=1, **kw)
    c = _run(model, small_layout, prompts, seed=2, **kw)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    sampling = models.Sampling(0.8, 5, 0.9)
    for toks, logits in zip(a.tokens, a.logits):
        kept = np.isfinite(np.asarray(_filter(jnp.asarray(logits), sampling.rows(len(toks)))))  # [steps, V]
        assert kept.sum(-1).max() <= 5
        assert kept[np.arange(len(toks)), toks].all()  # every draw is inside top-k and the nucleus
    assert dict(models.TRACE_COUNTS) == before  # sampling settings are arrays: the greedy steps serve them


def test_per_row_sampling_params():
    """Rows of one batch may sample differently; a greedy row stays argmax."""
    logits = jnp.log(jnp.tile(jnp.asarray([[0.5, 0.3, 0.1, 0.06, 0.04]], jnp.float32), (64, 1)))
    params = models.SamplingParams(
        temperature=jnp.where(jnp.arange(64) % 2 == 0, 1.0, 0.0),
        top_k=jnp.full((64,), 3, jnp.int32),
        top_p=jnp.ones((64,), jnp.float32),
    )
    ids = jnp.arange(64, dtype=jnp.int32)
    draws = np.asarray(_sample(logits, params, 0, ids, ids))
    assert (draws[1::2] == 0).all() and set(draws[::2].tolist()) <= {0, 1, 2} and len(set(draws[::2].tolist())) > 1


def test_filter_logits_and_sample():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.1, 0.06, 0.04]], jnp.float32))
    kept = lambda s: np.isfinite(np.asarray(_filter(logits, s.rows(1))))[0].tolist()  # noqa: E731
    assert kept(models.Sampling(1.0, top_k=2)) == [True, True, False, False, False]
    assert kept(models.Sampling(1.0, top_p=0.75)) == [True, True, False, False, False]  # 0.5 < 0.75 <= 0.8
    assert kept(models.Sampling(1.0, top_p=0.5)) == [True, False, False, False, False]
    assert kept(models.Sampling(1.0, top_p=1.0)) == [True] * 5
    rows = jnp.tile(logits, (64, 1))
    ids = jnp.arange(64, dtype=jnp.int32)
    draws = np.asarray(_sample(rows, models.Sampling(1.0, top_k=3).rows(64), 0, ids, ids))
    assert set(draws.tolist()) <= {0, 1, 2} and len(set(draws.tolist())) > 1
    assert np.asarray(_sample(rows, models.GREEDY.rows(64), 0, ids, ids)).tolist() == [0] * 64


def test_a_top_p_that_keeps_no_token_keeps_the_argmax(model, small_layout, prompts, greedy):
    """top_p=1e-39 (below float32's smallest normal number, flushed to 0) kept no token, and every
    draw was token 0: the most likely token is always kept, so it samples greedily."""
    logits = jnp.log(jnp.asarray([[0.1, 0.5, 0.3, 0.06, 0.04]], jnp.float32))
    kept = np.isfinite(np.asarray(_filter(logits, models.Sampling(1.0, top_p=1e-39).rows(1))))[0]
    assert kept.tolist() == [False, True, False, False, False]
    out = _run(model, small_layout, prompts, temperature=1.0, top_p=1e-39, return_logits=True)
    assert out.tokens == greedy.tokens


def test_a_tiny_temperature_samples_the_argmax(model, small_layout, prompts, greedy):
    """temperature=2e-38 (a normal float32) overflowed logits / temperature to inf (the two
    largest tied, NaN probabilities): the logits are shifted by their row's largest first, so
    it samples the argmax."""
    logits = jnp.asarray([[10.0, 30.0, 25.0, -10.0]], jnp.float32)
    out = np.asarray(_filter(logits, models.Sampling(2e-38).rows(1)))[0]
    assert np.isneginf(out[[0, 2, 3]]).all() and out[1] == 0.0
    assert _run(model, small_layout, prompts, temperature=2e-38).tokens == greedy.tokens


def test_generate_names_a_missing_model_or_prompts(model):
    with pytest.raises(ValueError, match="model must be a models.Llama .*got NoneType"):
        models.generate(None, [[1, 2]], 4)
    with pytest.raises(ValueError, match="prompts must be a sequence of token-id lists, got NoneType"):
        models.generate(model, None, 4)


def test_the_dense_baseline_refuses_token_ids_outside_the_vocabulary(model):
    """They reached the embedding (its gather clips them to the last row) as if valid."""
    with pytest.raises(ValueError, match=r"prompts\[1\]\[2\] = 128 is outside \[0, vocab_size=128\)"):
        models.dense_generate(model, [[1, 2], [3, 4, 128]], 4)
    with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] = -1 is outside \[0, vocab_size=128\)"):
        models.dense_generate(model, [np.asarray([-1, 2], np.int32)], 4)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):  # as generate refuses it
        models.dense_generate(model, [[1, 2], []], 4)


def test_generate_validation(model, small_layout):
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        models.generate(model, [[1], []], 4)
    with pytest.raises(ValueError, match="vocab_size"):
        models.generate(model, [[1, 500]], 4)
    with pytest.raises(ValueError, match="does not fit"):
        models.generate(model, [[1] * 60], 10, layout=small_layout)
    with pytest.raises(ValueError, match="max_seqs"):
        models.generate(model, [[1]], 4, batch_size=8, layout=small_layout)
    with pytest.raises(ValueError, match="top_p"):
        models.generate(model, [[1]], 4, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match="temperature"):
        models.Sampling(temperature=-1.0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        models.generate(model, [[1]], 4, layout=models.LlamaConfig.tiny(num_kv_heads=4).kv_layout(num_pages=4))
    assert models.generate(model, [[1, 2]], 0, layout=small_layout).tokens == [[]]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0, got nan"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0, got inf"),
        (dict(temperature=1.0, top_p=float("nan")), r"top_p must be a finite number in \(0, 1\], got nan"),
        (dict(top_k=2.0), "top_k must be an integer, got 2.0"),
        (dict(prompts=[[1, 3.7]]), r"prompts\[0\]\[1\] = 3.7 is not an integer token id"),
        (dict(prompts=[[1, 3.0]]), r"prompts\[0\]\[1\] = 3.0 is not an integer token id"),
        (dict(prompts=[["5"]]), r"prompts\[0\]\[0\] = '5' is not an integer token id"),
        (dict(prompts=[[True, 2]]), r"prompts\[0\]\[0\] = True is not an integer token id"),
        (dict(prompts=[[np.bool_(True)]]), r"prompts\[0\]\[0\] = (np\.True_|True) is not an integer token id"),
        (dict(prompts=[np.array([1.0, 2.0])]), r"prompts\[0\] must be a 1-D integer array, got float64"),
        (dict(prompts=["hello"]), r"prompts\[0\] is a string"),
        (dict(prompts=[[1, 2**40]]), r"prompts\[0\]\[1\] = 1099511627776 is outside \[0, vocab_size=128\)"),
        (dict(seed=2**31), r"seed must be in \[-2147483648, 2147483647\], got 2147483648"),
        (dict(seed=99999999999), r"seed must be in \[-2147483648, 2147483647\]"),
        (dict(seed=1.5), "seed must be an integer, got 1.5"),
        (dict(seed=True), "seed must be an integer, got True"),
        (dict(max_new_tokens=2**31), r"max_new_tokens must be in \[0, 2147483647\]"),
        (dict(max_new_tokens=4.0), "max_new_tokens must be an integer"),
        (dict(batch_size=np.int64(0)), r"batch_size must be in \[1, 2147483647\], got 0"),
        (dict(stop_tokens=["7"]), r"stop_tokens\[0\] = '7' is not an integer token id"),
        (dict(stop_tokens=[128]), r"stop_tokens\[0\] = 128 is outside \[0, vocab_size=128\)"),
        (dict(return_logits="yes"), "return_logits must be a bool, got 'yes'"),
        (dict(return_logits=1), "return_logits must be a bool, got 1"),
    ],
    ids=lambda x: ",".join(f"{k}={v!r}" for k, v in x.items()) if isinstance(x, dict) else "",
)
def test_generate_refuses_values_it_would_cast(model, kwargs, message):
    """Every value that used to be cast (int(3.7) == 3, int("5"), True == 1, an int32 wrap) or run
    silently (NaN temperature ran greedy) is a ValueError naming the argument and the limit."""
    kwargs = dict(dict(prompts=[[1, 2]], max_new_tokens=4), **kwargs)
    with pytest.raises(ValueError, match=message):
        models.generate(model, kwargs.pop("prompts"), kwargs.pop("max_new_tokens"), **kwargs)


def test_numpy_integers_are_token_ids(model, small_layout, prompts, greedy):
    as_numpy = [np.asarray(p, np.int64) for p in prompts[:2]]
    as_scalars = [[np.int32(t) for t in p] for p in prompts[2:4]]
    out = _run(model, small_layout, as_numpy + as_scalars, seed=np.int64(0), max_new_tokens=np.int64(NEW))
    assert out.tokens == greedy.tokens[:4]


# One checkpoint whose config.json names an eos token that greedy decoding of CLI_PROMPT
# produces; the library and the CLI tests share it (and the compiled steps: same shapes).
CLI_PROMPT = "hello arena"
CLI_SHAPES = ["--batch", "4", "--num-pages", "6", "--chunk-size", "8", "--max-seq-len", "64", "--dtype", "float32"]


@pytest.fixture(scope="module")
def eos_checkpoint(model, small_layout, tmp_path_factory):
    ids = [b % 128 for b in CLI_PROMPT.encode()]
    free = _run(model, small_layout, [ids], max_new_tokens=6, stop_tokens=()).tokens[0]
    eos = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])  # first seen at step >= 2
    path = tmp_path_factory.mktemp("eos")
    _save(path, model)
    (path / "config.json").write_text(json.dumps(dict(model.config.to_hf(), eos_token_id=eos)))
    return path, ids, free, eos


def test_generate_stops_at_the_checkpoint_eos_by_default(eos_checkpoint, small_layout, prompts, greedy):
    path, ids, free, eos = eos_checkpoint
    loaded = models.load_pretrained(path, dtype=jnp.float32).model
    assert loaded.config.eos_token_ids == (eos,)
    everything = list(prompts) + [ids]
    default = _run(loaded, small_layout, everything)
    unstopped = _run(loaded, small_layout, everything, stop_tokens=())
    assert unstopped.tokens[:-1] == greedy.tokens  # same weights: without stopping, the same tokens
    for want, got in zip(unstopped.tokens, default.tokens):
        assert got == (want[: want.index(eos) + 1] if eos in want else want)
    assert default.tokens[-1] == free[: free.index(eos) + 1] and len(default.tokens[-1]) < 6
    assert _run(loaded, small_layout, everything, stop_tokens=[free[0]]).tokens[-1] == free[:1]  # explicit list wins


def test_cli_stops_at_eos_unless_told(eos_checkpoint, capsys):
    from arena_jax.models.cli import main

    path, ids, free, eos = eos_checkpoint
    args = ["--model-dir", str(path), "--prompt", CLI_PROMPT, "--max-new-tokens", "6", *CLI_SHAPES, "--no-compile-cache"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"[0] {' '.join(map(str, free[: free.index(eos) + 1]))}\n") and f"stop tokens [{eos}]" in out
    assert main(args + ["--ignore-eos"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"[0] {' '.join(map(str, free))}\n") and "stop tokens none" in out


def test_dense_baseline_matches_paged(model, prompts, greedy):
    assert dense_generate(model, prompts, NEW) == greedy.tokens


# ---- CLI ---------------------------------------------------------------------------------------


def test_cli_tiny_model(capsys):
    from arena_jax.models.cli import main

    # Same shapes as the fixtures above (4 rows, 6 pages, chunk 8, max 64 tokens): no new compile.
    args = ["--prompt", "hello arena", "--max-new-tokens", "6", "--batch", "4", "--num-pages", "6", "--no-compile-cache"]
    assert main(args + ["--chunk-size", "8", "--max-seq-len", "64", "--num-prompts", "5"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and out.startswith("[0] ")
    assert main(args + ["--chunk-size", "8", "--max-seq-len", "64", "--num-prompts", "5", "--mixed-steps"]) == 0
    mixed = capsys.readouterr().out
    assert re.search(r"0 prefill \+ [1-9]\d* mixed \+ \d+ decode calls", mixed)
    assert mixed.splitlines()[:5] == out.splitlines()[:5]  # the same tokens


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch", "0"], "--batch: expected an integer in"),
        (["--max-new-tokens", "x"], "--max-new-tokens: expected an integer"),
        (["--bogus"], "unrecognized arguments"),
        (["--top-p", "2"], r"--top-p: expected a finite number in \(0, 1\], got 2"),
        (["--top-p", "nan"], r"--top-p: expected a finite number in \(0, 1\], got nan"),
        (["--temperature", "nan"], "--temperature: expected a finite number >= 0, got nan"),
        (["--temperature", "inf"], "--temperature: expected a finite number >= 0, got inf"),
        (["--seed", "99999999999"], r"--seed: expected an integer in \[0, 2,?147,?483,?647\], got 99999999999"),
        (["--seed", "-1"], "--seed: expected an integer in"),
        (["--batch", "3000000000"], r"--batch: expected an integer in \[1, 2,?147,?483,?647\]"),
        (["--top-k", "1000"], "--top-k 1000 exceeds the model's vocab_size 128"),
        (["--token-budget", "40"], "token_budget is the mixed steps' size: give it with mixed_steps=True"),
        (["--mixed-steps", "--token-budget", "5"], r"token_budget=5 must hold .* at least 36"),
        (["--model-dir", "/nonexistent/dir"], "--model-dir /nonexistent/dir"),
        # sizes the device cannot hold: refused before allocating, with needed and available bytes
        (["--page-size", "1000000000"], r"--page-size 1000000000.*needs .* bytes.*KV arena.*more than 90% of the .* bytes"),
        (["--batch", "100000000"], r"--batch 100000000.*needs .* bytes.*more than 90% of the .* bytes"),
        (["--max-new-tokens", "2000000000"], r"--max-new-tokens = 2000000\d+ tokens: needs .* bytes"),
        (["--num-pages", "2000000000"], r"--num-pages 2000000000.*needs .* bytes"),
        (["--num-prompts", "2000000000"], r"--num-prompts 2000000000 x \d+ tokens: needs .* bytes.* this host \(RAM\)"),
    ],
    ids=lambda x: " ".join(x) if isinstance(x, list) else "",
)
def test_cli_bad_flags(argv, message, capsys):
    from arena_jax.models.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv + ["--no-compile-cache"])  # never touch the user's cache from a test
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "arena-generate: error:" in err and "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.parametrize("spec, rows, w_shape", [("BTE,EKH->BTKH", (1, 1), (16, 2, 8)), ("BTE,EV->BTV", (1, 1), (16, 40)),
                                                 ("BTE,EV->BTV", (3, 2), (16, 40))])  # fmt: skip
def test_one_row_safe_einsum_runs_one_row_as_two_on_a_gpu_only(spec, rows, w_shape):
    """Its values are the einsum's; lowered for CUDA a lone row is computed beside a zero row
    (what keeps XLA's GPU compiler from copying the weight: test_compile_sm90), for the CPU (and
    for more rows than one) it is the plain einsum."""
    from arena_jax.models.layers import one_row_safe_einsum

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((*rows, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    f = jax.jit(lambda x, w: one_row_safe_einsum(spec, x, w, preferred_element_type=jnp.float32))
    np.testing.assert_array_equal(np.asarray(f(x, w)), np.asarray(jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)))
    cuda = f.trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    cpu = f.trace(x, w).lower(lowering_platforms=("cpu",)).as_text()
    assert "concatenate" not in cpu
    assert ("concatenate" in cuda) == (rows == (1, 1)), cuda
    if rows == (1, 1):
        assert re.search(r"dot_general.*-> tensor<2x", cuda), cuda


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the two-row branch runs on a GPU only (scripts/gpu_check.sh tests)")
@pytest.mark.parametrize("spec, w_shape", [("BTE,EKH->BTKH", (512, 8, 128)), ("BTE,EV->BTV", (512, 32000))])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_row_safe_einsum_on_a_gpu_matches_the_einsum(spec, w_shape, dtype):
    """The GPU branch (one row computed beside a zero row, cuBLAS) against the plain einsum
    (what XLA made of one row: a reduce, or a float32 GEMV), float32 logits as the models take them."""
    from arena_jax.models.layers import one_row_safe_einsum

    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 1, 512)), dtype)
    w = jnp.asarray(rng.standard_normal(w_shape) / 20, dtype)
    with jax.default_matmul_precision("highest"):
        got = jax.jit(lambda x, w: one_row_safe_einsum(spec, x, w, preferred_element_type=jnp.float32))(x, w)
        want = jax.jit(lambda x, w: jnp.einsum(spec, x, w, preferred_element_type=jnp.float32))(x, w)
    tol = 1e-5 if dtype == "float32" else 1e-2
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)
    assert "concatenate" in jax.jit(lambda x, w: one_row_safe_einsum(spec, x, w)).lower(x, w).as_text()
