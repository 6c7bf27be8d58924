"""`arena-bench swap`: a preemption-heavy `models.generate` run, recompute vs swap to host memory.

Workload (seeded): `requests` random prompts of `prompt_len` tokens (+- half), each generating
`new_tokens` greedy tokens, served `batch` at a time on a KV budget of `num_pages` pages (by
default 60% of what the rows need at their longest, so sequences outgrow it and the newest is
preempted). The same run three ways, same model, prompts and shapes:

  ample      a budget that holds every row's whole life: no preemption (the reference tokens)
  recompute  the budget, no host tier: a preempted sequence is recomputed from its tokens
  swap       the budget and a host tier of `host_pages` pages (default: every row at full
             length): a preempted sequence's pages go to host memory and come back
             (`generate(..., host_pages=N)`; the cost model `models.SwapPolicy`, here its
             defaults unless --bandwidth-gbps / --prefill-rate say otherwise)

Measured per mode: wall time (median over `repeats`, the modes alternating), preemptions, how
many were swapped, tokens recomputed (tokens preempted sequences had in the cache and computed
again), prefill tokens and calls, decode calls, pages and bytes moved each way, and the
transfer time a GPU would pay for them at the assumed bandwidth (on a CPU "host" and "device"
share DRAM: the copies are memcpys inside the measured time, so that time is a model, given
beside it, not a measurement). Tokens must equal the ample run's.

Why a `generate` run and not `arena-bench capacity` / `decode`: capacity simulates the
allocator alone (no model: a recompute costs nothing there but steps) and decode runs one
static batch (no scheduler, no preemption); preemption, and so swapping, lives in generate.
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import numpy as np

import arena_jax as aj
from arena_jax import models
from arena_jax.benchmarks.decode import config_and_dtype
from arena_jax.models.memory import TooLarge, cache_bytes, check_fits, host_memory_limit, weight_bytes

__all__ = ["SwapSettings", "run_swap", "SwapTooLarge"]


class SwapTooLarge(TooLarge):
    """The run would not fit in memory (the CLI turns it into a clean error)."""


@dataclasses.dataclass(frozen=True)
class SwapSettings:
    model: str = "tiny"
    model_dir: str | None = None
    num_layers: int | None = None
    dtype: str | None = None
    requests: int = 16
    prompt_len: int = 192
    new_tokens: int = 64
    batch: int = 4
    chunk_size: int = 32
    page_size: int = 16
    num_pages: int | None = None  # default: 60% of what the batch rows need at their longest
    host_pages: int | None = None  # default: every batch row at full length
    bandwidth_gbps: float | None = None  # SwapPolicy override (GB/s)
    prefill_rate: float | None = None  # SwapPolicy override (tokens/s); None: measured in the run
    repeats: int = 3
    seed: int = 0

    @property
    def max_total_len(self) -> int:
        return self.prompt_len + self.prompt_len // 2 + self.new_tokens


def _layouts(s: SwapSettings, cfg, dtype):
    pages_per_seq = -(-s.max_total_len // s.page_size)
    ample = s.batch * pages_per_seq
    num_pages = s.num_pages or max(pages_per_seq, int(0.6 * ample))
    if num_pages < pages_per_seq:
        raise ValueError(f"--num-pages {num_pages} cannot hold one request ({s.max_total_len} tokens need {pages_per_seq} pages)")
    make = lambda n: cfg.kv_layout(page_size=s.page_size, num_pages=n, max_seqs=s.batch,  # noqa: E731
                                   max_seq_len=pages_per_seq * s.page_size, dtype=dtype)  # fmt: skip
    return make(ample), make(num_pages), s.host_pages or ample


def _policy(s: SwapSettings) -> models.SwapPolicy:
    kw = {}
    if s.bandwidth_gbps is not None:
        kw["bandwidth_bytes_per_s"] = s.bandwidth_gbps * 1e9
    if s.prefill_rate is not None:
        kw["prefill_tokens_per_s"] = s.prefill_rate
    return models.SwapPolicy(**kw)


def _run(model, prompts, s: SwapSettings, layout, host_pages: int):
    serving = models.Serving(batch_size=s.batch, chunk_size=s.chunk_size, layout=layout, host_pages=host_pages,
                             swap_policy=_policy(s) if host_pages else None)  # fmt: skip
    start = time.perf_counter()
    result = models.generate(model, prompts, s.new_tokens, sampling=models.Sampling(stop_tokens=()), serving=serving)
    jax.block_until_ready(result.cache)
    return result, time.perf_counter() - start


def _figures(result, seconds: float, layout) -> dict:
    h = aj.health(result.cache, host=result.host)
    return {
        "seconds": seconds,
        "tokens_per_s": result.num_generated / seconds,
        "preemptions": result.preemptions,
        "swap_outs": result.swap_outs,
        "recomputed_tokens": result.recomputed_tokens,
        "swapped_tokens": result.swapped_tokens,
        "prefill_tokens": result.prefill_tokens,
        "prefill_calls": result.prefill_calls,
        "decode_calls": result.decode_calls,
        "pages_to_host": h["pages_to_host"],
        "pages_to_device": h["pages_to_device"],
        "bytes_moved": h["bytes_to_host"] + h["bytes_to_device"],
        "modelled_transfer_s": result.modelled_transfer_seconds,
    }


def run_swap(s: SwapSettings, progress=None) -> dict:
    cfg, dtype = config_and_dtype(s)
    if s.max_total_len > cfg.max_position_embeddings:
        raise ValueError(f"prompts of up to {s.max_total_len} tokens exceed max_position_embeddings={cfg.max_position_embeddings}")
    ample, tight, host_pages = _layouts(s, cfg, dtype)
    try:
        check_fits({f"weights ({dtype.name})": weight_bytes(cfg, dtype), "KV arenas": cache_bytes(ample) + cache_bytes(tight)},
                   hint="lower --batch, --prompt-len or --new-tokens")  # fmt: skip
        check_fits({f"host tier ({host_pages:,} pages)": host_pages * tight.page_bytes}, limit=host_memory_limit(),
                   hint="lower --host-pages")  # fmt: skip
    except TooLarge as exc:
        raise SwapTooLarge(str(exc)) from None
    std = 0.2 if s.model == "tiny" else 0.02
    model = models.load_pretrained(s.model_dir, dtype=dtype)[0] if s.model_dir else models.init_random(cfg, seed=s.seed, dtype=dtype, std=std)
    rng = np.random.default_rng(s.seed)
    lengths = rng.integers(s.prompt_len - s.prompt_len // 2, s.prompt_len + s.prompt_len // 2 + 1, s.requests)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in lengths]

    modes = {"ample": (ample, 0), "recompute": (tight, 0), "swap": (tight, host_pages)}
    advance = progress.add_task("swap: warm-up + runs", total=1 + 3 * s.repeats) if progress else None
    t0 = time.perf_counter()
    for layout, hp in modes.values():  # compile every step each mode uses (host ops included: the run preempts)
        _run(model, prompts[: s.batch + 2], s, layout, hp)
    warm_s = time.perf_counter() - t0
    if advance:
        advance(1)
    runs = {m: [] for m in modes}
    for i in range(s.repeats):
        for mode in (list(modes) if i % 2 == 0 else list(modes)[::-1]):
            runs[mode].append(_run(model, prompts, s, *modes[mode]))
            if advance:
                advance(1)
    if progress:
        progress.finish_task()
    out = {}
    for mode, results in runs.items():
        seconds = statistics.median(t for _, t in results)
        out[mode] = _figures(results[0][0], seconds, modes[mode][0])
    reference = runs["ample"][0][0].tokens
    same = {m: all(r.tokens == reference for r, _ in runs[m]) for m in ("recompute", "swap")}
    policy = _policy(s)
    return {
        "settings": {**dataclasses.asdict(s), "dtype": dtype.name, "num_pages": tight.num_pages, "ample_pages": ample.num_pages,
                     "host_pages": host_pages, "page_bytes": tight.page_bytes, "bytes_per_token": tight.bytes_per_token,
                     "bandwidth_bytes_per_s": policy.bandwidth_bytes_per_s, "prefill_rate": policy.prefill_tokens_per_s,
                     "backend": aj.default_backend()},  # fmt: skip
        "device": jax.devices()[0].platform,
        "warmup_s": warm_s,
        **out,
        "same_tokens": same,
        "speedup": out["recompute"]["seconds"] / out["swap"]["seconds"],
        "speedup_modelled": out["recompute"]["seconds"] / (out["swap"]["seconds"] + out["swap"]["modelled_transfer_s"]),
    }


def swap_table(result: dict):
    from rich import box
    from rich.table import Table

    from arena_jax.benchmarks.report import fmt_bytes

    s = result["settings"]
    t = Table(title=(f"swap: {s['model_dir'] or s['model']}, {s['requests']} requests of {s['prompt_len']} +- "
                     f"{s['prompt_len'] // 2} prompt + {s['new_tokens']} new tokens, batch {s['batch']}, "
                     f"{s['num_pages']} pages of {s['page_size']} (ample: {s['ample_pages']}), host tier {s['host_pages']} pages"),
              box=box.SIMPLE_HEAVY)  # fmt: skip
    for col in ("", "ample (no preemption)", "recompute", "swap", "swap / recompute"):
        t.add_column(col, justify="left" if not col else "right")
    rows = [
        ("wall time (median)", "seconds", lambda v: f"{v:.2f} s", True),
        ("generated tokens/s", "tokens_per_s", lambda v: f"{v:,.1f}", True),
        ("preemptions", "preemptions", lambda v: f"{v:,}", False),
        ("  swapped to host", "swap_outs", lambda v: f"{v:,}", False),
        ("tokens recomputed", "recomputed_tokens", lambda v: f"{v:,}", False),
        ("tokens swapped out and back", "swapped_tokens", lambda v: f"{v:,}", False),
        ("prefill tokens computed", "prefill_tokens", lambda v: f"{v:,}", True),
        ("prefill calls", "prefill_calls", lambda v: f"{v:,}", True),
        ("decode calls", "decode_calls", lambda v: f"{v:,}", False),
        ("pages to host / back", None, None, False),
        ("bytes moved", "bytes_moved", fmt_bytes, False),
        ("modelled transfer time (GPU)", "modelled_transfer_s", lambda v: f"{v * 1e3:.3f} ms", False),
    ]
    for label, key, fmt, ratio in rows:
        if key is None:
            cells = [f"{result[m]['pages_to_host']:,} / {result[m]['pages_to_device']:,}" for m in ("ample", "recompute", "swap")]
            t.add_row(label, *cells, "")
            continue
        a, r, w = (result[m][key] for m in ("ample", "recompute", "swap"))
        t.add_row(label, fmt(a), fmt(r), fmt(w), f"{w / r:.2f}x" if ratio and r else "")
    return t


def swap_notes(result: dict) -> list[str]:
    s, w, r = result["settings"], result["swap"], result["recompute"]
    rate = f"{s['prefill_rate']:,.0f} tokens/s" if s["prefill_rate"] else "the prefill rate measured in the run"
    same = result["same_tokens"]
    return [
        f"same model ({s['dtype']}, random weights), prompts and shapes; prefill chunks of {s['chunk_size']}; "
        f"{s['repeats']} timed run(s) per mode, alternating, after a warm-up ({result['warmup_s']:.1f} s, compiles); "
        f"{result['device']}, attention backend {s['backend']!r}",
        f"cost model (models.SwapPolicy): swap when 2 x pages x {fmt_b(s['page_bytes'])} / "
        f"{s['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s < tokens / {rate}",
        f"swap vs recompute: wall time {1 / result['speedup']:.2f}x ({result['speedup']:.2f}x faster), "
        f"{r['recomputed_tokens']:,} -> {w['recomputed_tokens']:,} tokens recomputed; {w['pages_to_host']:,} pages "
        f"({fmt_b(w['bytes_moved'])} both ways) moved, which a GPU would move in {w['modelled_transfer_s'] * 1e3:.3f} ms at "
        f"the assumed bandwidth ({1 / result['speedup_modelled']:.2f}x of recompute's time with that added, no overlap); "
        f"on this {result['device']} host and device share DRAM: the copies are memcpys inside the measured time",
        f"tokens: {'match' if same['recompute'] else 'MISMATCH'} (recompute), {'match' if same['swap'] else 'MISMATCH'} "
        "(swap) against the ample run, every request",
    ]


def fmt_b(n: int) -> str:
    from arena_jax.benchmarks.report import fmt_bytes

    return fmt_bytes(n)
