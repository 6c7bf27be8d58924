"""`arena-bench capacity`: one workload served under one KV memory budget by three allocators.

A discrete-time simulation with real allocator state (see `benchmarks.allocators`). Each step:

1. requests whose arrival step has come join the waiting queue (FCFS);
2. every running sequence grows by one token (one batched reservation for all of them),
   oldest admission first; if some cannot grow, the newest of those is preempted (its memory
   is freed and it goes back to the head of the queue with its tokens so far as its new
   prompt: recompute) and the others stall for the step;
3. sequences that produced their last token free their memory;
4. waiting requests are admitted in order (prompt positions reserved) while memory and
   slots allow; the first that does not fit blocks the queue.

Measured every step while any sequence runs: concurrent sequences, token positions held,
memory reserved for them. Utilization = token positions held / positions reserved.
"""
from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

import arena_jax as aj
from arena_jax.benchmarks.allocators import ArenaBackend, ContiguousBackend, Seq, check_with_health, tiny_arena_layout
from arena_jax.benchmarks.arena_sim import run_arena_on_device
from arena_jax.benchmarks.workload import Workload

__all__ = ["CapacitySettings", "simulate", "run_capacity", "GOAL_UTILIZATION", "GOAL_CAPACITY_RATIO"]

GOAL_UTILIZATION = 0.96
GOAL_CAPACITY_RATIO = 3.0
MAX_SERIES_POINTS = 400  # per allocator, in the JSON and the plot


@dataclasses.dataclass(frozen=True)
class CapacitySettings:
    model: str  # the preset whose bytes_per_token sizes the budget
    bytes_per_token: int  # of the KV arena's dtype, scales of 8-bit arenas included
    budget_bytes: int
    page_size: int = 16
    max_seq_len: int = 2048
    max_seqs: int = 256
    headroom: float = 0.25
    watermark: float = 0.01  # fraction of the budget a (re)admission must leave free for growth
    max_admit: int = 32  # admissions per step at most
    health_every: int = 50  # cross-check the arena's step figures against aj.health this often
    kv_dtype: str = "bfloat16"  # what bytes_per_token was computed for (the simulation is dtype-blind)

    @property
    def budget_tokens(self) -> int:
        return self.budget_bytes // self.bytes_per_token

    @property
    def num_pages(self) -> int:
        return self.budget_bytes // (self.bytes_per_token * self.page_size)

    @property
    def watermark_pages(self) -> int:
        return int(self.watermark * self.num_pages)

    def validate(self) -> None:
        if self.max_seq_len < 2:
            raise ValueError(f"--max-seq-len {self.max_seq_len}: a sequence needs a prompt token and an output token")
        if self.num_pages * self.page_size < self.max_seq_len:
            raise ValueError(
                f"the budget holds {self.num_pages * self.page_size:,} tokens of {self.model} KV "
                f"({self.bytes_per_token:,} bytes/token), fewer than one max-length sequence "
                f"(--max-seq-len {self.max_seq_len}); raise --budget-gib or lower --max-seq-len"
            )
        longest = -(-self.max_seq_len // self.page_size)  # pages of a max-length sequence (a preempted one comes back so)
        if longest + self.watermark_pages > self.num_pages:
            raise ValueError(
                f"--watermark {self.watermark:g} keeps {self.watermark_pages:,} of the budget's {self.num_pages:,} pages "
                f"free at every admission, leaving fewer than the {longest:,} a max-length sequence (--max-seq-len "
                f"{self.max_seq_len}) needs: it could never be admitted; lower --watermark or raise --budget-gib"
            )


def _downsample(values, n=MAX_SERIES_POINTS):
    values = np.asarray(values)
    if len(values) <= n:
        return values.tolist()
    idx = np.linspace(0, len(values) - 1, n).round().astype(int)
    return values[idx].tolist()


def simulate(backend, workload: Workload, settings: CapacitySettings, advance=None, check=None) -> dict:
    """Serve `workload` with `backend`; `advance(n)` reports n more finished requests."""
    reqs = workload.requests
    n_req = len(reqs)
    waiting: collections.deque[Seq] = collections.deque()
    running: list[Seq] = []  # oldest admission first
    free_slots = list(range(settings.max_seqs))
    done, nxt, t = 0, 0, 0
    steps_limit = 20 * sum(r.total_len for r in reqs) + reqs[-1].arrival + 1000
    series_t, series_run, series_tok, series_res, series_wait = [], [], [], [], []
    finished: list[Seq] = []
    preemptions = stalls = 0
    start = time.perf_counter()
    while done < n_req:
        while nxt < n_req and reqs[nxt].arrival <= t:
            r = reqs[nxt]
            waiting.append(Seq(nxt, r.arrival, r.prompt_len, r.output_len))
            nxt += 1
        if not running and not waiting:  # idle until the next arrival
            t = reqs[nxt].arrival
            continue
        admit = [waiting[k] for k in range(min(len(waiting), len(free_slots), settings.max_admit))]
        for s, slot in zip(admit, free_slots):
            s.slot = slot
        finishing = [s.generated + 1 == s.output_len for s in running]
        done_before = done

        res = backend.step(running, finishing, admit)

        next_running, preempted, freed = [], [], []
        refused = [i for i, ok in enumerate(res.ok_grow) if not ok]
        victim = refused[-1] if refused else None  # the newest refused sequence is preempted
        stalls += len(refused) - (victim is not None)
        for i, (s, ok, fin) in enumerate(zip(running, res.ok_grow, finishing)):
            if ok:
                s.generated += 1
                if fin:
                    done += 1
                    finished.append(s)
                    freed.append(s.slot)
                else:
                    next_running.append(s)
            elif i == victim:
                s.preemptions += 1
                preemptions += 1
                preempted.append(s)
                freed.append(s.slot)
            else:  # stalls this step, keeps its memory
                next_running.append(s)
        n_admitted = 0
        while n_admitted < len(admit) and res.ok_admit[n_admitted]:
            n_admitted += 1
        if any(res.ok_admit[n_admitted:]):
            raise AssertionError(f"{backend.name}: admission was not first come, first served at step {t}")
        for _ in range(n_admitted):
            s = waiting.popleft()
            if s.first_admit is None:
                s.first_admit = t
            next_running.append(s)
        for s in admit[n_admitted:]:
            s.slot = -1
        free_slots = free_slots[n_admitted:] + freed
        for s in reversed(preempted):
            s.slot = -1
            waiting.appendleft(s)
        running = next_running

        held = sum(s.ctx for s in running)
        if held != res.tokens_held:
            raise AssertionError(f"{backend.name}: allocator holds {res.tokens_held} tokens, scheduler expects {held} (step {t})")
        if running:
            series_t.append(t)
            series_run.append(len(running))
            series_tok.append(res.tokens_held)
            series_res.append(res.reserved_tokens)
            series_wait.append(len(waiting))
        if check is not None and t % settings.health_every == 0:
            check(backend, res, running)
        if advance is not None and done > done_before:
            advance(done - done_before)
        t += 1
        if t > steps_limit:
            raise RuntimeError(f"{backend.name}: no progress after {t} steps (livelock?)")
    backend.drain()
    wall = time.perf_counter() - start
    first_admit = np.array([s.first_admit for s in sorted(finished, key=lambda s: s.rid)])
    out = summarize(
        backend.name, settings, series_t, series_run, series_tok, series_res, series_wait,
        first_admit, np.array([r.arrival for r in reqs]), preemptions, stalls, t, wall,
    )  # fmt: skip
    out.update(backend.counters())
    return out


def summarize(
    name, settings, steps, running, tokens, reserved, queued, first_admit, arrival, preemptions, stalls, total_steps, wall
) -> dict:
    """The reported figures from per-step samples (steps where a sequence ran) and per-request outcomes."""
    steps = np.asarray(steps)
    busy = np.asarray(queued) > 0  # steps with requests waiting: the allocator is at capacity
    run_, tok, res_ = (np.asarray(x, np.float64) for x in (running, tokens, reserved))
    util = tok / np.maximum(res_, 1)
    waits = np.asarray(first_admit) - np.asarray(arrival)
    return {
        "allocator": name,
        "peak_concurrent": int(run_.max()),
        "mean_concurrent": float(run_.mean()),
        "mean_concurrent_saturated": float(run_[busy].mean()) if busy.any() else float(run_.mean()),
        "saturated_steps": int(busy.sum()),
        "utilization_mean": float(util.mean()),
        "utilization_p5": float(np.percentile(util, 5)),
        "budget_held_mean": float((tok / settings.budget_tokens).mean()),  # token states / whole budget
        "waste_tokens_per_seq": float(((res_ - tok) / run_).mean()),
        "waste_bytes_per_seq": float(((res_ - tok) / run_).mean() * settings.bytes_per_token),
        "requests_waited": int(np.sum(waits > 0)),
        "mean_wait_steps": float(waits.mean()),
        "preemptions": int(preemptions),
        "growth_stalls": int(stalls),
        "total_steps": int(total_steps),
        "busy_steps": len(steps),
        "wall_s": wall,
        "steps_per_s": total_steps / wall if wall else float("inf"),
        "series": {
            "step": _downsample(steps),
            "concurrent": _downsample(run_),
            "utilization": _downsample(util),
        },
    }


def simulate_arena_on_device(layout, workload: Workload, settings: CapacitySettings, advance=None, health_samples=None) -> dict:
    """The arena with the scheduler on the device (`benchmarks.arena_sim`): same figures, fewer round trips."""
    cache = aj.create(layout)
    page = layout.page_size

    def check(cache, pending, running, tokens, pages):
        utilization = check_with_health(cache, pending, running, tokens, pages * page)
        if health_samples is not None:
            health_samples.append(utilization)

    reqs = workload.requests
    limit = 20 * sum(r.total_len for r in reqs) + reqs[-1].arrival + 1000
    cache, raw = run_arena_on_device(cache, workload, settings, advance=advance, check=check, steps_limit=limit)
    busy = raw["running"] > 0
    out = summarize(
        "arena (arena_jax)", settings, raw["t"][busy], raw["running"][busy], raw["tokens"][busy],
        raw["pages"][busy] * page, raw["queued"][busy], raw["first_admit"], np.array([r.arrival for r in reqs]),
        raw["preemptions"], raw["stalls"], raw["total_steps"], raw["wall_s"],
    )  # fmt: skip
    h = aj.health(cache)
    out.update(
        pages_allocated=h["pages_allocated"],
        pages_recycled=h["pages_recycled"],
        failed_reservations=h["failed_reservations"],
        cow_copies=h["cow_copies"],
        leaked_pages_after_drain=h["pages_in_use"],
    )
    return out


def _arena_check(samples: list):
    """Every `health_every` steps the arena's figures must agree with `aj.health`."""

    def check(backend, res, running):
        if isinstance(backend, ArenaBackend):
            samples.append(backend.check(res, running))

    return check


def run_capacity(workload: Workload, settings: CapacitySettings, progress=None, *, host_scheduler: bool = False) -> dict:
    """All three allocators on the same workload and budget. `progress`: a `report.BenchProgress` or None.

    The arena runs with the scheduler on the device (`arena_sim`, many steps per call) unless
    `host_scheduler`, which drives the same real operations one jitted call per step from the
    host scheduler shared with the contiguous allocators (slower; identical figures).
    """
    settings.validate()
    layout = tiny_arena_layout(settings.num_pages, settings.page_size, settings.max_seqs, settings.max_seq_len)
    wm_tokens = settings.watermark_pages * settings.page_size
    contiguous = [
        ContiguousBackend(settings.budget_tokens, settings.max_seq_len, None, settings.max_admit, wm_tokens),
        ContiguousBackend(settings.budget_tokens, settings.max_seq_len, settings.headroom, settings.max_admit, wm_tokens),
    ]
    health_samples: list[float] = []
    results = {}
    names = ["arena (arena_jax)"] + [b.name for b in contiguous]
    for i, name in enumerate(names):
        advance = None
        if progress is not None:
            advance = progress.add_task(f"capacity: {name}", total=len(workload.requests))
        if i == 0 and not host_scheduler:
            results["arena"] = simulate_arena_on_device(layout, workload, settings, advance, health_samples)
        elif i == 0:
            backend = ArenaBackend(layout, settings.max_admit, settings.watermark_pages)
            results["arena"] = simulate(backend, workload, settings, advance, _arena_check(health_samples))
        else:
            backend = contiguous[i - 1]
            results[backend.key] = simulate(backend, workload, settings, advance)
        if progress is not None:
            progress.finish_task()
    arena, cmax = results["arena"], results["contiguous_max"]
    ratio = arena["peak_concurrent"] / max(cmax["peak_concurrent"], 1)
    mean_ratio = arena["mean_concurrent"] / max(cmax["mean_concurrent"], 1e-9)
    sat_ratio = arena["mean_concurrent_saturated"] / max(cmax["mean_concurrent_saturated"], 1e-9)
    return {
        "settings": {
            **dataclasses.asdict(settings),
            "budget_tokens": settings.budget_tokens,
            "num_pages": settings.num_pages,
            "watermark_pages": settings.watermark_pages,
            "arena_layout": {
                "num_layers": layout.num_layers,
                "num_kv_heads": layout.num_kv_heads,
                "head_dim": layout.head_dim,
                "page_size": layout.page_size,
                "num_pages": layout.num_pages,
                "max_seqs": layout.max_seqs,
                "max_pages_per_seq": layout.max_pages_per_seq,
                "dtype": str(layout.dtype),
                "arena_bytes": layout.arena_bytes,
            },
        },
        "workload": workload.summary(),
        "allocators": results,
        "health_checks": len(health_samples),
        "arena_scheduler": "host" if host_scheduler else "device",
        "goals": {
            "arena_utilization": arena["utilization_mean"],
            "arena_utilization_goal": GOAL_UTILIZATION,
            "arena_utilization_met": arena["utilization_mean"] >= GOAL_UTILIZATION,
            "capacity_ratio_peak": ratio,
            "capacity_ratio_mean": mean_ratio,
            "capacity_ratio_saturated": sat_ratio,
            "capacity_ratio_goal": GOAL_CAPACITY_RATIO,
            "capacity_ratio_met": ratio >= GOAL_CAPACITY_RATIO,
        },
    }
