"""`arena-bench prefix`: multi-turn chat with shared system prompts, served by `models.generate`
with and without the prefix cache, on the same model, the same KV budget and the same shapes.

Workload (seeded): `system_prompts` random system prompts of `system_len` tokens;
`conversations` conversations, conversation c on system prompt c % system_prompts; each has
`turns` turns. Turn 1's prompt is the system prompt plus a user message (random length in
[user_len / 2, 3 user_len / 2]); turn t + 1's prompt is turn t's prompt, turn t's answer (the
`new_tokens` greedy tokens the model generated) and a new user message. Turn t of every
conversation arrives at once, as one `generate` call (a round); the next round starts when
it is done. With the prefix cache, one cache and one `PrefixCache` serve every round, so a
turn hits its conversation's earlier turns and every prompt hits its system prompt.

KV budget: the same for both modes, `num_pages` (or `budget_gib`); by default twice what the
batch rows need at their longest, so that half of it is left over: the prefix cache keeps
pages there, the run without it leaves it idle (`--num-pages` sets any other budget; below
what the rows need, both modes wait or preempt, and the cache evicts).

`host_pages` > 0 adds a third mode: the prefix cache with a host tier of that many pages
(`generate(..., prefix_cache=True, host_pages=N)`): pages evicted from the device are copied
to host memory and hits there are brought back. Reported besides: hits per tier, pages and
bytes moved each way, and the transfer time a GPU would pay for them at the SwapPolicy's
assumed bandwidth (on a CPU "host" and "device" share DRAM: the copies are memcpys inside the
measured time, and the modelled transfer time is added on top, no overlap, as a bound).

Measured per mode: prompt tokens (every admission's, recomputations after preemption
included), prefill tokens computed (those minus prefix hits), time to first token (from the
start of a request's round to its first generated token, p50 / p99 over all requests),
throughput (generated tokens / the rounds' wall time), hit rate (hit / prompt tokens),
evictions, preemptions. Greedy answers are compared turn by turn: they must be equal.

Timing: the steps (prefill, decode, release, and the prefix ops) are compiled by a warm-up on
the same shapes before the timed runs; `generate` reads each step's results back before the
next (so times include the device's work). With `repeats` > 1 the two modes alternate and
the figures are per run (token and call counts are the same every run) with times pooled over
the repeats (TTFT percentiles over every request of every repeat, throughput and wall time
over their sum).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj
from arena_jax import models
from arena_jax.benchmarks.decode import config_and_dtype
from arena_jax.benchmarks.presets import preset
from arena_jax.models.memory import TooLarge, cache_bytes, check_fits, host_memory_limit, weight_bytes
from arena_jax.models.steps import (drop_host_page_rows, drop_page_rows, evict_to_host_rows, flush_rows, fork_page_rows,
                          hold_page_rows, offload_page_rows, swap_in_rows)  # fmt: skip

__all__ = ["PrefixSettings", "run_prefix", "make_workload", "PrefixTooLarge"]

GIB = 2**30


class PrefixTooLarge(TooLarge):
    """The run would not fit in memory (the CLI turns it into a clean error)."""


@dataclasses.dataclass(frozen=True)
class PrefixSettings:
    model: str = "tiny"
    model_dir: str | None = None
    num_layers: int | None = None
    dtype: str | None = None  # default: float32 for the CPU presets (tiny*, mid), bfloat16 otherwise
    system_prompts: int = 4
    system_len: int = 160
    conversations: int = 16
    turns: int = 3
    user_len: int = 24
    new_tokens: int = 16
    batch: int = 4
    chunk_size: int = 32
    page_size: int = 16
    num_pages: int | None = None  # KV budget in pages (default: twice what the batch rows need at their longest)
    budget_gib: float | None = None  # KV budget in GiB instead
    repeats: int = 1
    seed: int = 0
    host_pages: int = 0  # > 0: a third mode, the prefix cache with a host tier of this many pages

    @property
    def user_max(self) -> int:
        return self.user_len + self.user_len // 2

    @property
    def max_prompt_len(self) -> int:
        return self.system_len + self.turns * self.user_max + (self.turns - 1) * self.new_tokens

    @property
    def max_total_len(self) -> int:
        return self.max_prompt_len + self.new_tokens


def make_layout(s: PrefixSettings, cfg, dtype) -> aj.KVLayout:
    pages_per_seq = -(-s.max_total_len // s.page_size)
    if s.budget_gib is not None:
        probe = cfg.kv_layout(page_size=s.page_size, num_pages=1, max_seqs=s.batch, max_seq_len=s.page_size, dtype=dtype)
        num_pages = int(s.budget_gib * GIB) // probe.page_bytes
    else:
        num_pages = s.num_pages or 2 * s.batch * pages_per_seq
    if num_pages < pages_per_seq:
        raise ValueError(
            f"the KV budget holds {num_pages} pages of {s.page_size} tokens, fewer than the {pages_per_seq} the longest "
            f"request ({s.max_total_len} tokens) needs"
        )
    return cfg.kv_layout(page_size=s.page_size, num_pages=num_pages, max_seqs=s.batch,
                         max_seq_len=pages_per_seq * s.page_size, dtype=dtype)  # fmt: skip


def check_memory(s: PrefixSettings, cfg, dtype, layout) -> None:
    hint = "lower --batch, --num-pages / --budget-gib, --system-len, --turns or --new-tokens"
    if not s.model_dir:
        hint += f"; --num-layers N (fewer) shrinks {s.model}"
    try:
        check_fits({f"weights ({cfg.num_layers} layers, {dtype.name})": weight_bytes(cfg, dtype),
                    f"KV arena and page table ({layout.num_pages:,} pages)": cache_bytes(layout),
                    "logits": 2 * s.batch * s.chunk_size * cfg.vocab_size * 4}, hint=hint)  # fmt: skip
        if s.host_pages:
            check_fits({f"host tier ({s.host_pages:,} pages)": s.host_pages * layout.page_bytes},
                       limit=host_memory_limit(), hint="lower --host-pages")  # fmt: skip
    except TooLarge as exc:
        raise PrefixTooLarge(f"{s.model_dir or s.model} {exc}") from None


def make_workload(s: PrefixSettings, vocab: int):
    """(system prompts, user messages [conversation][turn]) as token-id lists, from the seed."""
    rng = np.random.default_rng(s.seed)
    systems = [rng.integers(0, vocab, s.system_len).tolist() for _ in range(s.system_prompts)]
    low = max(1, s.user_len // 2)
    users = [[rng.integers(0, vocab, int(rng.integers(low, s.user_max + 1))).tolist() for _ in range(s.turns)]
             for _ in range(s.conversations)]  # fmt: skip
    return systems, users


def _build_model(s: PrefixSettings, cfg, dtype):
    if s.model_dir:
        model, _tok = models.load_pretrained(s.model_dir, dtype=dtype)
        return model, f"checkpoint {s.model_dir}"
    # The tiny model's weights are drawn wider (std 0.2) so that greedy choices are well separated.
    std = 0.2 if s.model == "tiny" else 0.02
    depth = f", {cfg.num_layers} of {preset(s.model).num_layers} layers" if s.num_layers else ""
    return models.init_random(cfg, seed=s.seed, dtype=dtype, std=std), f"random weights (std {std}){depth}"


def _warm_up(model, layout, s: PrefixSettings) -> None:
    """Compile every step `generate` may call on these shapes (prefix ops included)."""
    plain = models.Serving(batch_size=s.batch, chunk_size=s.chunk_size)
    cached = dataclasses.replace(plain, prefix_cache=True)
    kw = dict(sampling=models.Sampling(stop_tokens=()))
    prompt = list(range(1, min(s.page_size + 3, s.max_prompt_len) + 1))
    first = models.generate(model, [prompt], 2, cache=aj.create(layout), serving=cached, **kw)
    again = models.generate(model, [prompt + [1]], 2, cache=first.cache, prefix_cache=first.prefix_cache, serving=cached, **kw)
    cache = again.cache
    width = s.batch * layout.max_pages_per_seq
    pad_pages = jnp.full((width,), aj.PAD_PAGE, jnp.int32)
    cache = hold_page_rows(cache, pad_pages, jnp.ones((width,), jnp.int32))
    cache = drop_page_rows(cache, pad_pages)
    rows = jnp.full((s.batch, layout.max_pages_per_seq), aj.PAD_PAGE, jnp.int32)
    cache = fork_page_rows(cache, rows, jnp.zeros((s.batch,), jnp.int32), jnp.full((s.batch,), aj.PAD_SLOT, jnp.int32))
    models.generate(model, [prompt], 2, cache=aj.create(layout), serving=plain, **kw)
    slots = jnp.full((s.batch,), aj.PAD_SLOT, jnp.int32)
    cache, _ = flush_rows(cache, None, pad_pages, jnp.ones((width,), jnp.int32), slots, *[pad_pages] * 4)
    if s.host_pages:  # the host tier's steps, on padding (and generate's with a host tier)
        hosted = models.generate(model, [prompt], 2, cache=aj.create(layout),
                                 serving=dataclasses.replace(cached, host_pages=s.host_pages), **kw)  # fmt: skip
        cache, host = hosted.cache, hosted.host
        cache, host = drop_host_page_rows(cache, host, pad_pages)
        cache, host = offload_page_rows(cache, host, pad_pages, pad_pages)
        cache, host = evict_to_host_rows(cache, host, pad_pages, pad_pages, pad_pages, pad_pages)
        cache, host = flush_rows(cache, host, pad_pages, jnp.ones((width,), jnp.int32), slots, *[pad_pages] * 4)
        cache, host, _ = swap_in_rows(cache, host, rows, jnp.zeros((s.batch,), jnp.int32),
                                      jnp.full((s.batch,), aj.PAD_SLOT, jnp.int32))  # fmt: skip
    jax.block_until_ready(cache)


def _serve(model, layout, s: PrefixSettings, systems, users, prefix: bool, host_pages: int = 0) -> dict:
    """Every round of the workload; returns per-round figures and the answers."""
    cache, index, host = aj.create(layout), None, None
    histories = [list(systems[c % len(systems)]) for c in range(s.conversations)]
    answers, rounds = [], []
    for t in range(s.turns):
        prompts = [histories[c] + users[c][t] for c in range(s.conversations)]
        serving = models.Serving(batch_size=s.batch, chunk_size=s.chunk_size, prefix_cache=prefix,
                                 host_pages=host_pages if host is None else 0)  # fmt: skip
        state = dict(cache=cache, **({} if host is None else dict(host=host)), **({} if index is None else dict(prefix_cache=index)))
        result = models.generate(model, prompts, s.new_tokens, sampling=models.Sampling(stop_tokens=()), serving=serving, **state)
        cache, index, host = result.cache, result.prefix_cache, result.host
        health = aj.health(cache, index, host=host)
        rounds.append({
            "turn": t + 1,
            "seconds": result.seconds,
            "generated": result.num_generated,
            "prompt_tokens": result.prompt_tokens,
            "prefill_tokens": result.prefill_tokens,
            "hit_tokens": result.prefix_hit_tokens,
            "evictions": result.evictions,
            "preemptions": result.preemptions,
            "prefill_calls": result.prefill_calls,
            "decode_calls": result.decode_calls,
            "ttft_s": list(result.first_token_seconds),
            "cached_pages": health["cached_pages"],
            "cow_copies": health["cow_copies"],
            "rejected_rows": health["rejected_rows"],
            "host_hit_tokens": health.get("prefix_host_hit_tokens", 0),  # the index's count: all rounds so far
            "pages_to_host": health["pages_to_host"],  # the cache's counters: all rounds so far
            "pages_to_device": health["pages_to_device"],
            "modelled_transfer_s": result.modelled_transfer_seconds,
        })  # fmt: skip
        answers.append(result.tokens)
        histories = [p + a for p, a in zip(prompts, result.tokens)]
    return {"rounds": rounds, "answers": answers}


def _summary(runs: list[dict]) -> dict:
    """Counts per run (every run serves the same workload the same way); times pooled over runs."""
    rounds = [r for run in runs for r in run["rounds"]]
    total = lambda key: int(round(sum(r[key] for r in rounds) / len(runs)))  # noqa: E731
    total_f = lambda key: sum(r[key] for r in rounds) / len(runs)  # noqa: E731
    ttft = np.concatenate([r["ttft_s"] for r in rounds]) * 1e3
    seconds = sum(r["seconds"] for r in rounds) / len(runs)
    prompt = total("prompt_tokens")
    return {
        "prompt_tokens": prompt,
        "prefill_tokens": total("prefill_tokens"),
        "hit_tokens": total("hit_tokens"),
        "hit_rate": total("hit_tokens") / prompt if prompt else 0.0,
        "ttft_ms_p50": float(np.percentile(ttft, 50)),
        "ttft_ms_p99": float(np.percentile(ttft, 99)),
        "tokens_per_s": total("generated") / seconds if seconds else float("nan"),
        "seconds": seconds,
        "generated": total("generated"),
        "prefill_calls": total("prefill_calls"),
        "decode_calls": total("decode_calls"),
        "preemptions": total("preemptions"),
        "evictions": total("evictions"),
        "cached_pages_end": runs[-1]["rounds"][-1]["cached_pages"],
        "host_hit_tokens": runs[-1]["rounds"][-1]["host_hit_tokens"],
        "pages_to_host": runs[-1]["rounds"][-1]["pages_to_host"],
        "pages_to_device": runs[-1]["rounds"][-1]["pages_to_device"],
        "modelled_transfer_s": total_f("modelled_transfer_s"),
        "tokens_per_s_modelled": total("generated") / (seconds + total_f("modelled_transfer_s")) if seconds else float("nan"),
        "cow_copies": runs[-1]["rounds"][-1]["cow_copies"],  # the cache's counter: all of a run's rounds
        "rejected_rows": sum(run["rounds"][-1]["rejected_rows"] for run in runs),
        "per_turn": [
            {
                "turn": t + 1,
                "prefill_tokens": int(sum(run["rounds"][t]["prefill_tokens"] for run in runs)) // len(runs),
                "hit_tokens": int(sum(run["rounds"][t]["hit_tokens"] for run in runs)) // len(runs),
                "ttft_ms_p50": float(np.percentile(np.concatenate([run["rounds"][t]["ttft_s"] for run in runs]) * 1e3, 50)),
            }
            for t in range(len(runs[0]["rounds"]))
        ],
        "ttft_ms": ttft.tolist(),
    }


def run_prefix(s: PrefixSettings, progress=None) -> dict:
    cfg, dtype = config_and_dtype(s)
    if s.max_total_len > cfg.max_position_embeddings:
        raise ValueError(
            f"the longest request ({s.system_len} system + {s.turns} x (up to {s.user_max} user + {s.new_tokens} answer) "
            f"tokens = {s.max_total_len}) exceeds the model's max_position_embeddings={cfg.max_position_embeddings}: "
            "lower --system-len, --turns, --user-len or --new-tokens"
        )
    layout = make_layout(s, cfg, dtype)
    check_memory(s, cfg, dtype, layout)
    model, weights = _build_model(s, cfg, dtype)
    systems, users = make_workload(s, cfg.vocab_size)

    modes = ("none", "prefix", "host") if s.host_pages else ("none", "prefix")
    advance = progress.add_task("prefix: warm-up + runs", total=1 + len(modes) * s.repeats) if progress else None
    t0 = time.perf_counter()
    _warm_up(model, layout, s)
    warm_s = time.perf_counter() - t0
    if advance:
        advance(1)
    runs = {mode: [] for mode in modes}
    for i in range(s.repeats):
        order = modes if i % 2 == 0 else modes[::-1]  # alternate: drift hits every mode
        for mode in order:
            runs[mode].append(_serve(model, layout, s, systems, users, prefix=mode != "none",
                                     host_pages=s.host_pages if mode == "host" else 0))  # fmt: skip
            if advance:
                advance(1)
    if progress:
        progress.finish_task()

    none, cached = _summary(runs["none"]), _summary(runs["prefix"])
    mismatch = None
    for mode in modes[1:]:
        for t, (a_turn, b_turn) in enumerate(zip(runs["none"][0]["answers"], runs[mode][0]["answers"])):
            for c, (a, b) in enumerate(zip(a_turn, b_turn)):
                if a != b and mismatch is None:
                    mismatch = {"turn": t + 1, "conversation": c, "without": a, "with": b, "mode": mode}
    tiered = {}
    if s.host_pages:
        host = _summary(runs["host"])
        tiered = {
            "host": host,
            "host_speedup_tokens_per_s": host["tokens_per_s"] / none["tokens_per_s"],
            "host_speedup_modelled": host["tokens_per_s_modelled"] / none["tokens_per_s"],
            "host_prefill_ratio": host["prefill_tokens"] / none["prefill_tokens"] if none["prefill_tokens"] else float("nan"),
            "host_ttft_p50_ratio": host["ttft_ms_p50"] / none["ttft_ms_p50"],
            "page_bytes": layout.page_bytes,
            "bandwidth_bytes_per_s": models.SwapPolicy().bandwidth_bytes_per_s,
        }
    return {
        "settings": {
            **dataclasses.asdict(s),
            "weights": weights,
            "dtype": dtype.name,
            "layout": {"num_pages": layout.num_pages, "page_size": layout.page_size, "max_seqs": layout.max_seqs,
                       "max_seq_len": layout.max_seq_len, "kv_bytes": layout.arena_bytes,
                       "bytes_per_token": layout.bytes_per_token, "backend": aj.default_backend()},  # fmt: skip
            "max_prompt_len": s.max_prompt_len,
        },
        "device": _device_name(),
        "warmup_s": warm_s,
        "none": none,
        "prefix": cached,
        "same_tokens": mismatch is None,
        "first_mismatch": mismatch,
        "prefill_ratio": cached["prefill_tokens"] / none["prefill_tokens"] if none["prefill_tokens"] else float("nan"),
        "speedup_tokens_per_s": cached["tokens_per_s"] / none["tokens_per_s"],
        "ttft_p50_ratio": cached["ttft_ms_p50"] / none["ttft_ms_p50"],
        **tiered,
    }


def _device_name() -> str:
    kind, backend = jax.devices()[0].device_kind, jax.default_backend()
    return backend if kind.lower() == backend else f"{kind} ({backend})"
