"""`arena-bench speculative`: speculative decoding with prompt lookup against plain decoding, on
the same model, prompts and arena, alternated (and with `--draft-layers N` a draft model: the
target's first N layers, `models.DraftModel`). How many tokens does each target-model call
give, how many proposals are accepted, and what does that buy in tokens per second?

The workload is repetitive on purpose (prompt lookup's case: code, templates, a document being
edited): each prompt repeats a span of random tokens a few times, so the sequence's own history
predicts what follows as long as the model continues the pattern. Plain decoding runs twice:
one step per call and with decode blocks (generate's default: 8 steps per call while nothing
waits), since speculative calls read every call back and so run without blocks. Tokens must be
identical (greedy): checked. Tokens per second leave compile time out (`Generation`).
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

__all__ = ["SpeculativeSettings", "damped_after", "run_speculative", "speculative_lines"]


@dataclasses.dataclass(frozen=True)
class SpeculativeSettings:
    model: str = "tiny"  # "tiny" or "mid" (benchmarks.arrivals)
    batch: int = 1
    requests: int = 4
    span: int = 12  # tokens of the repeated span
    repeats_in_prompt: int = 4
    new_tokens: int = 128
    k: int = 4
    draft_layers: int = 0  # > 0: also a draft model, the target's first N layers (models.first_layers)
    # < 1: the target's layers past the draft's add `damping` x their output to the residual
    # stream (attention and MLP output projections scaled): a synthetic target its first layers
    # agree with often, standing in for a trained pair (random weights agree rarely); 1: as drawn.
    damping: float = 1.0
    rounds: int = 3
    seed: int = 0


def _model(settings: SpeculativeSettings):
    from arena_jax import models
    from arena_jax.benchmarks.arrivals import ArrivalSettings

    config = ArrivalSettings(model=settings.model).config()
    model = models.init_random(config, seed=settings.seed)
    if settings.damping != 1.0 and settings.draft_layers:
        model = damped_after(model, settings.draft_layers, settings.damping)
    return model


def damped_after(model, first: int, factor: float):
    """`model` with layers `first`.. contributing `factor` x their output to the residual
    stream: their attention output and MLP down projections scaled (stacked layers only)."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(model)
    scale = np.where(np.arange(model.config.num_layers) < first, 1.0, factor)

    def damp(path, leaf):
        name = jax.tree_util.keystr(path)
        if not ("['attn']['o']" in name or "['mlp']['down']" in name):
            return leaf
        if leaf.shape[0] != model.config.num_layers:
            raise ValueError("damped_after: needs stacked layers (scan_layers=True)")
        return leaf * scale.reshape(-1, *([1] * (leaf.ndim - 1))).astype(leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(damp, state))


def run_speculative(settings: SpeculativeSettings, progress=None) -> dict:
    from arena_jax import models

    model = _model(settings)
    rng = np.random.default_rng(settings.seed)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, settings.span).tolist() * settings.repeats_in_prompt for _ in range(settings.requests)]
    total = settings.span * settings.repeats_in_prompt + settings.new_tokens
    layout = models.default_layout(model, settings.batch, models.length_bucket(total), dtype=model.dtype)
    look = models.PromptLookup(k=settings.k)
    modes = {"plain, 1 step a call": dict(decode_block=1), "plain, decode blocks": dict(decode_block=8),
             f"speculative, k={settings.k}": dict(speculative=look)}  # fmt: skip
    if settings.draft_layers:
        draft = models.DraftModel(models.first_layers(model, settings.draft_layers), k=settings.k,
                                  max_len=models.length_bucket(total))  # fmt: skip
        modes[f"draft {settings.draft_layers}/{model.config.num_layers} layers, k={settings.k}"] = dict(speculative=draft)
    common = dict(batch_size=settings.batch, layout=layout, stop_tokens=())
    for kw in modes.values():  # compile first
        models.generate(model, prompts[:1], 4, **common, **kw)
    runs = {name: [] for name in modes}
    advance = progress.add_task("speculative: rounds", total=settings.rounds * len(modes)) if progress else None
    for _ in range(settings.rounds):
        for name, kw in modes.items():  # alternated
            runs[name].append(models.generate(model, prompts, settings.new_tokens, **common, **kw))
            if advance:
                advance(1)
    if progress:
        progress.finish_task()
    base = runs["plain, 1 step a call"][0].tokens
    rows = []
    for name, results in runs.items():
        r = results[0]
        calls = r.verify_calls if r.verify_calls else r.decode_calls
        rows.append({
            "mode": name,
            "tokens_per_s": round(statistics.median(x.tokens_per_second for x in results), 1),
            "decode_calls": calls,
            "tokens_per_call": round((r.num_generated - len(prompts)) / max(calls, 1), 2),  # the first comes from prefill
            "acceptance": round(r.accepted_tokens / r.proposed_tokens, 3) if r.proposed_tokens else None,
            "accepted_per_verify": round(r.accepted_tokens / r.verify_calls / settings.batch, 2) if r.verify_calls else None,
            "same_tokens": all(x.tokens == base for x in results),
        })  # fmt: skip
    plain = {row["mode"]: row for row in rows}
    spec = rows[2]  # prompt lookup
    out = {"settings": dataclasses.asdict(settings), "rows": rows,
           "speedup_vs_one_step": round(spec["tokens_per_s"] / plain["plain, 1 step a call"]["tokens_per_s"], 2),
           "speedup_vs_blocks": round(spec["tokens_per_s"] / plain["plain, decode blocks"]["tokens_per_s"], 2)}  # fmt: skip
    if settings.draft_layers:
        out["draft_speedup_vs_one_step"] = round(rows[3]["tokens_per_s"] / plain["plain, 1 step a call"]["tokens_per_s"], 2)
    return out


def speculative_lines(result: dict) -> list[str]:
    s = result["settings"]
    damped = (f"; target's layers past the draft's damped x{s['damping']:g} (a synthetic pair)"
              if s.get("damping", 1.0) != 1.0 and s["draft_layers"] else "")  # fmt: skip
    out = [f"{s['model']} model, batch {s['batch']}, {s['requests']} prompts of a {s['span']}-token span x "
           f"{s['repeats_in_prompt']}, {s['new_tokens']} greedy tokens each, median of {s['rounds']} alternated rounds"
           + damped,
           f"{'mode':<24}{'tok/s':>9}{'calls':>7}{'tok/call':>9}{'accept':>8}{'acc/verify':>11}{'same':>6}"]  # fmt: skip
    for r in result["rows"]:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        per = "-" if r["accepted_per_verify"] is None else f"{r['accepted_per_verify']:.2f}"
        out.append(f"{r['mode']:<24}{r['tokens_per_s']:>9.1f}{r['decode_calls']:>7}{r['tokens_per_call']:>9.2f}{acc:>8}{per:>11}"
                   f"{'yes' if r['same_tokens'] else 'NO':>6}")  # fmt: skip
    out.append(f"speculative / plain: {result['speedup_vs_one_step']:.2f}x one step a call, "
               f"{result['speedup_vs_blocks']:.2f}x decode blocks (tokens/s, compile excluded)")
    if "draft_speedup_vs_one_step" in result:
        out.append(f"draft model / plain: {result['draft_speedup_vs_one_step']:.2f}x one step a call")
    return out
