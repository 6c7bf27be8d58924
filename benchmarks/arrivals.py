"""Online serving latency: requests arriving as a Poisson process, mixed steps vs separate
prefill (`arena-bench serve`, its "arrivals" part; issue 17).

Workload (seeded): `requests` prompts, most of them short (`short_len` tokens, +-50%) and every
`long_every`-th one long (`long_len` tokens), each generating `new_tokens` (no stop token),
greedy, on a random-weight model (`model`: tiny, or mid = hidden 512, 8 layers) and one arena sized for the batch. Arrivals: exponential
gaps at `load` times the rate the loop sustains when every request is there at once (measured
first, with separate steps: requests finished per second), so the queue is busy but stable.

Schedules, alternated round by round on the same arrivals:
- "separate": today's loop, each iteration one `prefill` call of [batch, chunk] for the rows
  with prompt left, then one `decode_step` for the others;
- "mixed": `generate(mixed_steps=True)`: one `mixed_step` with every decoding row's token and
  `chunks` prompt chunks (token budget batch + chunks * chunk).

Throughput beside it: "all at once" is the wall time of the same requests all there at the
start (an offline batch), per schedule, in the same rounds.

Per request: time to first token (TTFT) = its first token's read-back time minus its arrival;
inter-token latency (ITL) = the gaps between its tokens' read-back times. Percentiles pool
every request of every round. Tokens are compared between schedules (greedy: equal).
"""
from __future__ import annotations

import dataclasses
import statistics

import numpy as np

__all__ = ["ArrivalSettings", "measure_arrivals", "arrival_lines"]


@dataclasses.dataclass
class ArrivalSettings:
    requests: int = 24
    short_len: int = 48
    long_len: int = 384
    long_every: int = 4
    new_tokens: int = 32
    batch: int = 8
    chunk: int = 64
    chunks: tuple = (1, 2)  # token budgets: batch + k * chunk
    load: float = 0.7
    rounds: int = 3
    model: str = "tiny"  # "tiny" (LlamaConfig.tiny()) or "mid" (hidden 512, 8 layers, 8 q / 2 KV heads, vocab 32000)
    seed: int = 0

    def config(self):
        from arena_jax import models

        if self.model == "tiny":
            return models.LlamaConfig.tiny()
        if self.model == "mid":  # the mid model of benchmarks.studies.context_cost
            from arena_jax.benchmarks.studies.context_cost import Settings

            return Settings().config()
        raise ValueError(f"model must be 'tiny' or 'mid', got {self.model!r}")


def _percentiles(xs) -> dict:
    a = np.asarray(xs, np.float64) * 1e3
    return dict(p50_ms=round(float(np.percentile(a, 50)), 2), p99_ms=round(float(np.percentile(a, 99)), 2),
                mean_ms=round(float(a.mean()), 2))  # fmt: skip


def _latencies(result, arrivals) -> tuple[list, list]:
    ttft = [times[0] - a for times, a in zip(result.token_seconds, arrivals)]
    itl = [b - a for times in result.token_seconds for a, b in zip(times, times[1:])]
    return ttft, itl


def measure_arrivals(settings: ArrivalSettings, advance=lambda: None) -> dict:
    from arena_jax import models

    s = settings
    net = models.init_random(s.config(), seed=s.seed)
    rng = np.random.default_rng(s.seed)
    lens = [s.long_len if (i + 1) % s.long_every == 0 else int(rng.integers(s.short_len // 2, s.short_len * 3 // 2 + 1))
            for i in range(s.requests)]  # fmt: skip
    prompts = [rng.integers(0, net.config.vocab_size, n).tolist() for n in lens]
    layout = models.default_layout(net, s.batch, max(lens) + s.new_tokens, dtype="float32")
    separate = models.Serving(batch_size=s.batch, chunk_size=s.chunk, layout=layout)
    schedules = {"separate": separate, **{f"mixed, budget {s.batch + k * s.chunk}": dataclasses.replace(
                 separate, mixed_steps=True, token_budget=s.batch + k * s.chunk) for k in s.chunks}}  # fmt: skip
    common = dict(sampling=models.Sampling(stop_tokens=()))
    for serving in schedules.values():  # warm: compile every step once
        models.generate(net, prompts[: s.long_every], 2, **common, serving=serving)
    burst = models.generate(net, prompts, s.new_tokens, **common, serving=separate)
    rate = s.load * s.requests / burst.seconds  # requests per second
    arrivals = np.cumsum(rng.exponential(1.0 / rate, s.requests)).tolist()
    arrivals = [a - arrivals[0] for a in arrivals]
    advance()
    pooled = {name: ([], [], [], []) for name in schedules}  # ttft, itl, wall, all-at-once wall
    tokens = {}
    for _ in range(s.rounds):
        for name, serving in schedules.items():
            r = models.generate(net, prompts, s.new_tokens, arrivals=arrivals, **common, serving=serving)
            ttft, itl = _latencies(r, arrivals)
            pooled[name][0].extend(ttft)
            pooled[name][1].extend(itl)
            pooled[name][2].append(r.seconds)
            pooled[name][3].append(models.generate(net, prompts, s.new_tokens, **common, serving=serving).seconds)
            tokens.setdefault(name, r.tokens)
        advance()
    ref = tokens["separate"]
    rows = []
    for name, (ttft, itl, wall, burst_wall) in pooled.items():
        rows.append(dict(schedule=name, ttft=_percentiles(ttft), itl=_percentiles(itl),
                         wall_s=round(statistics.median(wall), 3), all_at_once_s=round(statistics.median(burst_wall), 3),
                         same_tokens=tokens[name] == ref))  # fmt: skip
    return dict(
        model=s.model, requests=s.requests, prompt_lens=dict(short=s.short_len, long=s.long_len, long_every=s.long_every),
        new_tokens=s.new_tokens, batch=s.batch, chunk=s.chunk, load=s.load,
        burst_requests_per_s=round(s.requests / burst.seconds, 2), arrival_rate_per_s=round(rate, 2),
        span_s=round(arrivals[-1], 3), rounds=s.rounds, schedules=rows,
    )  # fmt: skip


def _prompts(lens: dict) -> str:
    if lens["long_every"] == 1:
        return f"every prompt {lens['long']} tokens"
    return f"every {lens['long_every']}th prompt {lens['long']} tokens, the rest ~{lens['short']}"


def arrival_lines(result: dict) -> list[str]:
    r = result
    lines = [
        f"Poisson arrivals, {r['model']} model: {r['requests']} requests ({_prompts(r['prompt_lens'])}), {r['new_tokens']} new tokens each, "
        f"batch {r['batch']}, chunk {r['chunk']}; {r['arrival_rate_per_s']} requests/s = {r['load']} x the all-at-once "
        f"rate ({r['burst_requests_per_s']}/s); {r['rounds']} alternated rounds, latencies pooled:",
        f"  {'schedule':<22} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'ITL mean':>9} {'wall':>7}"
        f"  {'all at once':>11}  tokens",
    ]
    for row in r["schedules"]:
        t, i = row["ttft"], row["itl"]
        lines.append(f"  {row['schedule']:<22} {t['p50_ms']:7.1f}ms {t['p99_ms']:7.1f}ms {i['p50_ms']:6.2f}ms "
                     f"{i['p99_ms']:6.2f}ms {i['mean_ms']:7.2f}ms {row['wall_s']:6.2f}s  {row['all_at_once_s']:10.3f}s  "
                     f"{'equal' if row['same_tokens'] else 'DIFFER'}")  # fmt: skip
    return lines
