"""Request workloads for `arena-bench capacity`: seeded synthetic chat traffic or a replayed file.

A workload is a list of `Request(arrival, prompt_len, output_len)`; `arrival` is the
simulation step at which the request joins the waiting queue.

Synthetic traffic (the default) draws prompt and output lengths from log-normal
distributions resembling ShareGPT chat traffic (vLLM paper: mean prompt ~161 tokens,
mean output ~338 tokens, long right tails), and arrival steps from a Poisson process.

Replayed lengths (`--lengths FILE`), one request per line, either format:

    # CSV: prompt_len,output_len[,arrival]   (a header line and '#' comments are allowed)
    prompt_len,output_len
    182,311
    40,1024

    # JSON lines: {"prompt_len": 182, "output_len": 311}   ("arrival" optional)

Requests without an `arrival` column arrive as a Poisson process at `--rate` per step.
A request whose prompt_len + output_len exceeds `--max-seq-len` has its output clipped
to fit (counted and reported).
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import os

import numpy as np

from arena_jax.hf.config import INT32_MAX  # step counters and lengths are int32 in the device simulation

__all__ = ["Request", "Workload", "WorkloadError", "synthetic", "from_rows", "from_file", "load_lengths"]

# Log-normal parameters (of the underlying normal): median e**mu, mean e**(mu + sigma**2 / 2).
PROMPT_MU, PROMPT_SIGMA = math.log(100.0), 1.0  # median 100, mean ~165 tokens
OUTPUT_MU, OUTPUT_SIGMA = math.log(250.0), 0.78  # median 250, mean ~340 tokens


class WorkloadError(ValueError):
    """A workload file that cannot be read or parsed (the CLI turns it into a clean error)."""


@dataclasses.dataclass(frozen=True)
class Request:
    arrival: int
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclasses.dataclass(frozen=True)
class Workload:
    requests: tuple[Request, ...]
    source: str  # "lognormal(seed=0)" or the file path
    clipped: int  # requests whose output was clipped to max_seq_len

    def summary(self) -> dict:
        p = np.array([r.prompt_len for r in self.requests])
        o = np.array([r.output_len for r in self.requests])
        a = np.array([r.arrival for r in self.requests])
        return {
            "source": self.source,
            "requests": len(self.requests),
            "prompt_len_mean": float(p.mean()),
            "prompt_len_p50": float(np.median(p)),
            "prompt_len_max": int(p.max()),
            "output_len_mean": float(o.mean()),
            "output_len_p50": float(np.median(o)),
            "output_len_max": int(o.max()),
            "last_arrival_step": int(a.max()),
            "clipped_to_max_seq_len": self.clipped,
        }


def _arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals at `rate` requests per step (rate <= 0 or inf: everything at step 0)."""
    if rate <= 0 or math.isinf(rate):
        return np.zeros(n, np.int64)
    gaps = rng.exponential(1.0 / rate, size=n)
    return np.floor(np.cumsum(gaps) - gaps[0]).astype(np.int64)


def _fit(prompt: int, output: int, max_seq_len: int) -> tuple[int, int, bool]:
    prompt = max(1, min(int(prompt), max_seq_len - 1))
    output = max(1, int(output))
    if prompt + output > max_seq_len:
        return prompt, max_seq_len - prompt, True
    return prompt, output, False


def synthetic(num_requests: int, *, seed: int, rate: float, max_seq_len: int) -> Workload:
    """Log-normal chat-like lengths, Poisson arrivals; all seeded."""
    rng = np.random.default_rng(seed)
    prompts = np.maximum(4, np.round(rng.lognormal(PROMPT_MU, PROMPT_SIGMA, num_requests)))
    outputs = np.maximum(1, np.round(rng.lognormal(OUTPUT_MU, OUTPUT_SIGMA, num_requests)))
    arrivals = _arrivals(num_requests, rate, rng)
    requests, clipped = [], 0
    for a, p, o in zip(arrivals, prompts, outputs):
        p, o, c = _fit(p, o, max_seq_len)
        clipped += c
        requests.append(Request(int(a), p, o))
    return Workload(tuple(requests), f"lognormal(seed={seed})", clipped)


def load_lengths(path: str | os.PathLike) -> list[tuple[int, int, int | None]]:
    """(prompt_len, output_len, arrival or None) per line of a CSV or JSON-lines file."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise WorkloadError(f"cannot read lengths file {path!r}: {exc.strerror or exc}") from exc
    rows: list[tuple[int, int, int | None]] = []
    lines = [(i + 1, line.strip()) for i, line in enumerate(io.StringIO(text))]
    lines = [(n, line) for n, line in lines if line and not line.startswith("#")]
    for n, line in lines:
        try:
            if line.startswith("{"):
                obj = json.loads(line)
                prompt, output, arrival = obj["prompt_len"], obj["output_len"], obj.get("arrival")
                for key, value in (("prompt_len", prompt), ("output_len", output), ("arrival", arrival)):
                    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                        raise ValueError(f"{key} must be a JSON integer, got {value!r}")  # never int(3.7) == 3
            else:
                fields = next(csv.reader([line]))
                if not fields[0].strip().lstrip("-").isdigit():
                    if n == lines[0][0]:
                        continue  # a header line
                    raise ValueError("not a number")
                if len(fields) not in (2, 3):
                    raise ValueError(f"expected 2 or 3 comma-separated fields, got {len(fields)}")
                prompt, output = fields[0], fields[1]
                arrival = fields[2] if len(fields) == 3 and fields[2].strip() else None
            prompt, output = int(prompt), int(output)
            arrival = None if arrival is None else int(arrival)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise WorkloadError(
                f"{path}:{n}: cannot parse {line[:60]!r} ({exc}); expected 'prompt_len,output_len[,arrival]' "
                'or {"prompt_len": P, "output_len": O}'
            ) from None
        if not (1 <= prompt <= INT32_MAX and 1 <= output <= INT32_MAX and (arrival is None or 0 <= arrival <= INT32_MAX)):
            raise WorkloadError(
                f"{path}:{n}: prompt_len and output_len must be in [1, {INT32_MAX}] and arrival in [0, {INT32_MAX}], "
                f"got {line[:60]!r}"
            )
        rows.append((prompt, output, arrival))
    if not rows:
        raise WorkloadError(f"{path}: no requests found")
    return rows


def from_rows(rows, source: str, *, seed: int, rate: float, max_seq_len: int) -> Workload:
    """A workload from `load_lengths` rows; rows without an arrival arrive as a Poisson process."""
    rng = np.random.default_rng(seed)
    poisson = _arrivals(len(rows), rate, rng)
    requests, clipped = [], 0
    for (prompt, output, arrival), a in zip(rows, poisson):
        p, o, c = _fit(prompt, output, max_seq_len)
        clipped += c
        requests.append(Request(int(a if arrival is None else arrival), p, o))
    requests.sort(key=lambda r: r.arrival)  # stable: file order within a step
    return Workload(tuple(requests), source, clipped)


def from_file(path, *, seed: int, rate: float, max_seq_len: int) -> Workload:
    return from_rows(load_lengths(path), os.fspath(path), seed=seed, rate=rate, max_seq_len=max_seq_len)
