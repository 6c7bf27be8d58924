"""`arena-bench accuracy`: what storing the KV cache in 8 or 4 bits (with and without rotated
keys) does to attention and to a model.

1. Attention. One decode query per row over `context` cached tokens, Llama-3-8B-shaped heads
   (32 query / 8 KV heads, head_dim 128), stored in a bf16 arena and in each quantized arena
   (int8 / fp8: per-token absmax scales, float32; int4: per-32-lane-group scales, bf16), each
   with plain keys, rotated keys (`KVLayout(rotate_keys=True)`) and keys smoothed, then rotated
   (`smooth_keys=True`: static per-channel factors, `arena_jax.key_factors`). q ~ N(0, 1) in float32 (so only
   the cache's storage differs); V ~ N(0, 1); K ~ N(0, 1) except `outliers` channels of every
   KV head scaled by `outlier_scale` (real LLM keys carry a few such channels, 10-50x the
   rest). Reported per backend (the jnp reference and the Pallas kernels; on CPU the kernels
   run in interpret mode): the relative error ||o - o_exact|| / ||o_exact|| against float64
   attention over the unquantized K/V; the backends' largest element-wise difference; and the
   error against the bf16 arena's output.
2. End to end. The Hugging Face parity configs of tests/test_models_parity.py (tiny Llama /
   Mistral, 2 layers, GQA and MHA, Llama-3 RoPE scaling, a sliding window), random weights
   ~N(0, 0.2), float32 compute. Greedy generation of `new_tokens` tokens for 4 prompts with a
   bf16 arena is the reference. Teacher-forced (every arena fed the same tokens: the prompt and
   the bf16 run's continuation): the logits at every generated position, max relative error
   (max over positions of ||l - l_bf16|| / ||l_bf16||, and max |l - l_bf16| / max |l_bf16|)
   and top-1 agreement. Free-running: each arena's own greedy tokens, the fraction equal to
   the bf16 run's position by position, and how many tokens in they first differ.
   `model_key_outliers` > 1 measures the same models with outlier key channels
   (`with_key_outliers`: one RoPE channel pair per layer and KV head scaled up in the key
   projection), which random weights do not have by themselves; `model_outlier_queries` says
   what the query heads do in those channels: "quiet" divides them by the same factor (the
   model computes the same function, only its stored keys change), "loud" leaves them (those
   channels then dominate the scores, as in the attention test, where q ~ N(0, 1) meets keys
   with outlier channels).

Random-weight models say little about real quality: their logits are not a language model's,
and a random model's keys have no outlier channels (unless `model_key_outliers` puts them in). The
end-to-end figures show the quantization reaching the logits through a model's layers (and that
nothing is broken), not what a real checkpoint would lose; the attention figures with outlier keys are closer to what
matters, and a real checkpoint is the real test.
"""
from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import arena_jax as aj
from arena_jax import models

__all__ = ["AccuracySettings", "run_accuracy", "attention_accuracy", "model_accuracy", "exact_attention", "PARITY_CONFIGS",
           "FORMATS", "with_key_outliers"]

FORMATS = ("int8", "float8_e4m3fn", "float8_e5m2", "int4")
BASELINE = "bfloat16"


@dataclasses.dataclass(frozen=True)
class AccuracySettings:
    context: int = 1024  # cached tokens per row (attention)
    batch: int = 4
    outliers: int = 4  # outlier channels per KV head
    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    outlier_scales: tuple = (1.0, 10.0, 20.0, 50.0)  # 1.0: no outliers
    new_tokens: int = 64  # generated per prompt (end to end)
    seed: int = 0
    skip_models: bool = False
    skip_attention: bool = False
    formats: tuple = FORMATS  # the quantized arenas measured
    key_options: tuple = ("", "+rot", "+smooth+rot")  # each quantized format's keys: plain, rotated, smoothed + rotated
    backends: tuple = ("reference", "pallas")  # attention: the first is the table's; the others are compared to it
    model_formats: tuple = ("int8", "int8+rot", "int8+smooth+rot", "float8_e4m3fn", "int4", "int4+rot",
                            "int4+smooth+rot")  # end to end
    model_key_outliers: float = 1.0  # end to end: > 1 scales one RoPE channel pair per KV head (with_key_outliers)
    model_outlier_queries: str = "quiet"  # "quiet": q divided there (the same function); "loud": q as drawn


KEY_OPTIONS = ("rot", "smooth")  # "+rot": rotated keys (rotate_keys); "+smooth": smoothed keys (smooth_keys)


def split_format(fmt: str) -> tuple[str, bool | None, bool | None]:
    """"int4+smooth+rot" -> ("int4", True, True): (dtype, rotate_keys, smooth_keys); a quantized
    format without an option turns it off ("int4": plain keys); a float format -> (fmt, None, None)."""
    dtype, *options = fmt.split("+")
    if any(o not in KEY_OPTIONS for o in options) or (options and dtype not in FORMATS):
        raise ValueError(f"format {fmt!r}: a dtype, then for a quantized one (of {', '.join(FORMATS)}) any of "
                         "+rot (rotated keys) and +smooth (smoothed keys)")
    if dtype not in FORMATS:
        return dtype, None, None
    return dtype, "rot" in options, "smooth" in options


# tests/test_models_parity.py's configs (vocab 128, hidden 64, MLP 128, 2 layers, 4 query heads,
# 256 positions, rms eps 1e-6, weights ~0.2), as LlamaConfigs.
def _parity(**overrides) -> models.LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                max_position_embeddings=256, rms_norm_eps=1e-6)
    base.update(overrides)
    return models.LlamaConfig(**base)


PARITY_CONFIGS = {
    "llama_gqa_rope3_tied": lambda **kw: _parity(num_kv_heads=2, tie_word_embeddings=True, rope_theta=500000.0,
                                                 rope_scaling=models.RopeScaling(8.0, 1.0, 4.0, 16), **kw),
    "llama_mha": lambda **kw: _parity(num_kv_heads=4, **kw),
    "mistral_swa": lambda **kw: _parity(num_kv_heads=2, sliding_window=8, **kw),
}
# The parity configs' heads are 16 wide; an int4 arena takes multiples of 32 (whole scale
# groups). Its end-to-end figures use the same configs at hidden 128 (head_dim 32), each
# measured against its own bf16 run.
WIDE = dict(hidden_size=128, intermediate_size=256)


# ---- 1. attention ------------------------------------------------------------------------------------


def _keys_values(rng, batch, context, kv_heads, head_dim, outliers, scale):
    k = rng.standard_normal((batch, context, kv_heads, head_dim)).astype(np.float32)
    channels = rng.choice(head_dim, size=(kv_heads, outliers), replace=False) if outliers else np.zeros((kv_heads, 0), int)
    for h in range(kv_heads):
        k[:, :, h, channels[h]] *= scale
    v = rng.standard_normal((batch, context, kv_heads, head_dim)).astype(np.float32)
    return k, v


@functools.partial(jax.jit, static_argnames=("layout", "backend"))
def _fill_and_attend(layout, q, k, v, backend):
    """One call: an arena of `layout`, every row's K/V appended, one decode query attended.
    Smoothed keys: the factors are calibrated on these keys (every row's) before the arena is made."""
    batch, context = k.shape[:2]
    cache = aj.create(layout, key_factors=aj.key_factors.from_keys(k[None]) if layout.smooth_keys else None)
    slots = jnp.arange(batch, dtype=jnp.int32)
    cache, ok = aj.reserve(cache, slots, jnp.full((batch,), context, jnp.int32))
    if not layout.quantized:
        k, v = k.astype(layout.dtype), v.astype(layout.dtype)
    cache = aj.append(cache, 0, slots, k, v, backend=backend)
    return aj.attend(q, cache, 0, slots, backend=backend), ok


def _attend_with(dtype, rotate, smooth, q, k, v, backend="reference", page_size=16):
    batch, context, kv_heads, head_dim = k.shape
    pages = -(-context // page_size)
    layout = aj.KVLayout(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                         num_pages=batch * pages, max_seqs=batch, max_pages_per_seq=pages, dtype=dtype,
                         rotate_keys=rotate, smooth_keys=smooth)
    out, ok = _fill_and_attend(layout, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), backend)
    assert bool(np.all(ok))
    return np.asarray(out, np.float64)  # [B, 1, Hq, D]


def exact_attention(q, k, v):
    """float64 attention of one decode query per row over all of its K/V (unquantized):
    q [B, 1, Hq, D], k, v [B, S, Hkv, D] -> [B, 1, Hq, D]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # [B, S, Hq, D]
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


def _formats(s: AccuracySettings):
    """(label, dtype, rotate, smooth): bf16, then each quantized format with each key option."""
    out = [(BASELINE, BASELINE, None, None)]
    for fmt in s.formats:
        out += [(fmt + option, *split_format(fmt + option)) for option in s.key_options]
    return out


def attention_accuracy(s: AccuracySettings, progress=None) -> list[dict]:
    """Rows per (outlier scale, format): the relative error ||o - o_exact|| / ||o_exact|| of
    each backend's attention against float64 attention over the unquantized K/V, the bf16
    arena's output as a second reference, and how far the backends are from each other."""
    rng = np.random.default_rng(s.seed)
    q_heads, kv_heads, head_dim = s.q_heads, s.kv_heads, s.head_dim
    rows = []
    for scale in s.outlier_scales:
        k, v = _keys_values(rng, s.batch, s.context, kv_heads, head_dim, s.outliers if scale != 1.0 else 0, scale)
        q = rng.standard_normal((s.batch, 1, q_heads, head_dim)).astype(np.float32)
        exact = exact_attention(q, k, v)
        norm = np.linalg.norm(exact)
        base = _attend_with(BASELINE, None, None, q, k, v)
        label = "K ~ N(0, 1), no outliers" if scale == 1.0 else f"K with {s.outliers} outlier channels x{scale:g}"
        for name, dtype, rotate, smooth in _formats(s):
            outs = {b: base if (dtype == BASELINE and b == "reference") else _attend_with(dtype, rotate, smooth, q, k, v, b)
                    for b in s.backends}
            first = outs[s.backends[0]]
            rows.append({
                "keys": label,
                "outlier_scale": scale,
                "format": name,
                "rel_err_vs_f64": {b: float(np.linalg.norm(o - exact) / norm) for b, o in outs.items()},
                "backend_max_diff": max((float(np.abs(o - first).max()) for o in outs.values()), default=0.0),
                "rel_err_vs_bf16": float(np.linalg.norm(first - base) / np.linalg.norm(base)),
                "max_abs_err_vs_bf16": float(np.abs(first - base).max()),
            })
        if progress is not None:
            progress()
    return rows


# ---- 2. end to end -----------------------------------------------------------------------------------


def with_key_outliers(model, scale: float, seed: int = 0, queries: str = "quiet"):
    """`model` (changed in place and returned) with outlier key channels, as real LLMs' keys
    have them: in every layer and KV head one RoPE channel pair (c, c + head_dim / 2, c drawn per
    layer and head) of the key projection is multiplied by `scale`. `queries="quiet"`: the same
    channels of that head's query heads are divided by it; RoPE rotates within each pair, so
    every score q . k, and so the function the model computes, is unchanged up to the weights'
    float32 rounding, and only the keys stored in the cache carry the outliers. `"loud"`: the
    query heads are left as drawn, so those channels' share of every score grows by `scale`.
    Models with q / k norms or biases are refused (a norm would undo the scaling)."""
    config = model.config
    if config.qk_norm or config.qkv_bias or not (np.isfinite(scale) and scale > 0) or queries not in ("quiet", "loud"):
        raise ValueError(f"with_key_outliers: scale {scale} must be finite and > 0 and queries {queries!r} quiet or loud, on a "
                         "model without qk_norm or qkv_bias")
    attn = model.layers.attn  # layers under scan: q [L, E, Hq, D], k [L, E, Hkv, D]
    q, k = np.array(attn.q[...]), np.array(attn.k[...])
    if q.ndim != 4:
        raise ValueError("with_key_outliers: a model built with scan_layers=True (stacked layer weights)")
    layers, _, kv_heads, head_dim = k.shape
    group = q.shape[2] // kv_heads
    rng = np.random.default_rng(seed)
    for layer in range(layers):
        for h in range(kv_heads):
            c = int(rng.integers(head_dim // 2))
            pair = [c, c + head_dim // 2]
            k[layer, :, h, pair] *= np.float32(scale)
            if queries == "quiet":
                q[layer, :, h * group : (h + 1) * group, pair] /= np.float32(scale)
    attn.q[...], attn.k[...] = jnp.asarray(q), jnp.asarray(k)
    return model


def _layout(model, fmt, batch, max_len, page_size=16):
    """The arena for a format label ("int4+rot": an int4 arena with rotated keys)."""
    dtype, rotate, smooth = split_format(fmt)
    layout = models.default_layout(model, batch, max_len, page_size=page_size, dtype=dtype)
    return layout if rotate is None else dataclasses.replace(layout, rotate_keys=rotate, smooth_keys=smooth)


def _teacher_forced(model, dtype, sequences, score_from, chunk=32):
    """Logits f32[B, N, V] at positions score_from[b] .. score_from[b] + N - 1 of each sequence,
    prefilled chunk by chunk into an arena of `dtype` (every arena sees the same tokens)."""
    batch = len(sequences)
    longest = max(len(x) for x in sequences)
    graphdef, state = nnx.split(model)
    layout = _layout(model, dtype, batch, longest)
    cache = aj.create(layout, key_factors=models.calibrate_key_factors(model) if layout.smooth_keys else None)
    slots = jnp.arange(batch, dtype=jnp.int32)
    greedy = models.GREEDY.rows(batch)
    out = [[] for _ in range(batch)]
    for start in range(0, longest, chunk):
        tokens = np.zeros((batch, chunk), np.int32)
        counts = np.zeros(batch, np.int32)
        for b, seq in enumerate(sequences):
            piece = seq[start : start + chunk]
            tokens[b, : len(piece)], counts[b] = piece, len(piece)
        step = models.prefill(graphdef, state, cache, jnp.asarray(tokens), slots, jnp.asarray(counts), slots, 0, greedy,
                              all_logits=True)
        cache = step.cache
        assert bool(np.all(np.asarray(step.ok)))
        logits = np.asarray(step.logits)
        for b in range(batch):
            out[b].append(logits[b, : counts[b]])
    n = min(len(seq) - f for seq, f in zip(sequences, score_from))
    return np.stack([np.concatenate(out[b])[f : f + n] for b, f in enumerate(score_from)])


def _model_runs(s: AccuracySettings):
    """(config name, config kwargs, formats): the parity configs for the formats that fit them,
    and their head_dim-32 versions (`WIDE`) for every format when int4 is measured."""
    narrow = tuple(f for f in s.model_formats if split_format(f)[0] != "int4")
    runs = [(name, {}, narrow) for name in PARITY_CONFIGS]
    if len(narrow) < len(s.model_formats):
        runs += [(name + " (d32)", WIDE, tuple(s.model_formats)) for name in PARITY_CONFIGS]
    return runs


def model_accuracy(s: AccuracySettings, progress=None) -> list[dict]:
    rows = []
    for label, overrides, formats in _model_runs(s):
        name = label.split(" ")[0]
        config = PARITY_CONFIGS[name](**overrides)
        model = models.init_random(config, seed=s.seed, std=0.2)
        if s.model_key_outliers != 1.0:
            with_key_outliers(model, s.model_key_outliers, seed=s.seed, queries=s.model_outlier_queries)
            label += f", keys x{s.model_key_outliers:g}" + (", q loud" if s.model_outlier_queries == "loud" else "")
        rng = np.random.default_rng(s.seed + 1)
        prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 13, 20, 11)]
        longest = max(len(p) for p in prompts) + s.new_tokens
        run = lambda fmt: models.generate(model, prompts, s.new_tokens, sampling=models.Sampling(stop_tokens=()),  # noqa: E731
                                          serving=models.Serving(batch_size=len(prompts), chunk_size=32,
                                                                 layout=_layout(model, fmt, len(prompts), longest)))
        ref = run(BASELINE)
        sequences = [p + t[:-1] for p, t in zip(prompts, ref.tokens)]  # position P-1+i predicts token i
        score_from = [len(p) - 1 for p in prompts]
        ref_logits = _teacher_forced(model, BASELINE, sequences, score_from)  # [B, new_tokens, V]
        ref_top1 = ref_logits.argmax(-1)
        for fmt in ("float32",) + formats:
            logits = _teacher_forced(model, fmt, sequences, score_from)
            norm_rel = np.linalg.norm(logits - ref_logits, axis=-1) / np.linalg.norm(ref_logits, axis=-1)
            free = run(fmt)
            same = [np.mean(np.asarray(a) == np.asarray(b)) for a, b in zip(free.tokens, ref.tokens)]
            first = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b)) for a, b in zip(free.tokens, ref.tokens)]
            rows.append({
                "config": label,
                "format": fmt,
                "positions": int(ref_logits.shape[0] * ref_logits.shape[1]),
                "max_rel_logit_err": float(norm_rel.max()),
                "max_abs_logit_err_rel_to_max": float(np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()),
                "top1_agreement": float(np.mean(logits.argmax(-1) == ref_top1)),
                "free_run_token_agreement": float(np.mean(same)),
                "free_run_first_difference": [int(x) for x in first],
            })
            if progress is not None:
                progress()
    return rows


def run_accuracy(s: AccuracySettings, progress=None) -> dict:
    if s.new_tokens < 1 or s.context < 1:
        raise ValueError("context and new_tokens must be >= 1")
    t0 = time.perf_counter()
    attention = [] if s.skip_attention else attention_accuracy(s, progress)
    models_rows = [] if s.skip_models else model_accuracy(s, progress)
    return {
        "settings": dataclasses.asdict(s),
        "device": f"{jax.devices()[0].device_kind} ({jax.default_backend()})",
        "backends": list(s.backends),
        "attention": attention,
        "models": models_rows,
        "wall_s": time.perf_counter() - t0,
    }


# ---- tables (plain fixed width: copied as they are into benchmarks/RESULTS.md) -------------------------------

_SHORT = {"bfloat16": "bf16", "float32": "float32", "int8": "int8", "float8_e4m3fn": "fp8 e4m3",
          "float8_e5m2": "fp8 e5m2", "int4": "int4"}


def short_name(fmt: str) -> str:
    """"int4+smooth+rot" -> "int4 + smoothing + rotation"."""
    dtype, rotate, smooth = split_format(fmt)
    return _SHORT[dtype] + (" + smoothing" if smooth else "") + (" + rotation" if rotate else "")


def _table(header: list[str], body: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip(), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
    return "\n".join(lines)


def format_attention_table(rows: list[dict]) -> str:
    """One row per (keys, format): the error vs float64 per backend, the backends' largest
    element-wise difference, and the error vs the bf16 arena (first backend)."""
    backends = list(rows[0]["rel_err_vs_f64"]) if rows else []
    header = (["keys", "KV format"] + [f"rel. error vs f64 ({b})" for b in backends]
              + ["max |backend diff|", "rel. error vs bf16"])
    body = [[r["keys"], short_name(r["format"])] + [f"{r['rel_err_vs_f64'][b]:.2e}" for b in backends]
            + [f"{r['backend_max_diff']:.1e}", f"{r['rel_err_vs_bf16']:.2e}"] for r in rows]
    return _table(header, body)


def format_model_table(rows: list[dict]) -> str:
    header = ["config", "KV format", "max rel. logit error", "max |dlogit| / max |logit|", "top-1 agreement",
              "free-run tokens equal", "first difference (per prompt)"]
    body = [[r["config"], short_name(r["format"]), f"{r['max_rel_logit_err']:.2e}",
             f"{r['max_abs_logit_err_rel_to_max']:.2e}", f"{r['top1_agreement']:.1%}",
             f"{r['free_run_token_agreement']:.1%}", " ".join(str(x) for x in r["free_run_first_difference"])]
            for r in rows]
    return _table(header, body)
