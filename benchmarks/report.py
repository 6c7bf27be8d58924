"""Output for `arena-bench`: rich tables, a live progress bar, JSON with metadata, PNG plots."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import time
import sys

import numpy as np
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

__all__ = [
    "make_console",
    "note",
    "BenchProgress",
    "metadata",
    "write_json",
    "layout_table",
    "capacity_tables",
    "capacity_notes",
    "goal_lines",
    "decode_table",
    "decode_ratio_lines",
    "compile_ratio_line",
    "prefix_table",
    "prefix_notes",
    "plot_prefix",
    "generic_table",
    "plot_capacity",
    "plot_decode",
    "plot_kernels",
    "fmt_bytes",
    "eprint",
]


def make_console() -> Console:
    """Writes to the current sys.stdout (so tests can capture it): as wide as the terminal, or
    when not a terminal, $COLUMNS, else 120 columns."""
    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console = Console(highlight=False, soft_wrap=True, width=120)
    return console


def note(console: Console, text: str) -> None:
    """A line under a table, two spaces in (rich markup allowed). Where the console soft-wraps
    (`make_console`'s: a terminal wraps the line, a log keeps it whole) as one line; where it
    does not (the tour's), wrapped at the console's width with the two spaces kept."""
    if console.soft_wrap:
        console.print(f"  {text}")
    else:
        console.print(Padding(Text.from_markup(text), (0, 0, 0, 2), expand=False))


class BenchProgress:
    """A rich progress bar on the console (drawn only on a terminal; a no-op when disabled)."""

    def __init__(self, console: Console, enabled: bool = True):
        self.enabled = enabled and console.is_terminal
        self._progress = None
        self._task = None
        if self.enabled:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                console=console,
                transient=True,
            )

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
        return False

    def add_task(self, description: str, total: int):
        """Returns advance(n): n more units done."""
        if self._progress is None:
            return lambda n=1: None
        self._task = self._progress.add_task(description, total=total)
        task = self._task
        return lambda n=1: self._progress.advance(task, n)

    def finish_task(self) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.remove_task(self._task)
            self._task = None


# ---- JSON --------------------------------------------------------------------------------------


def metadata(command: str, arguments: dict) -> dict:
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "tool": "arena-bench",
        "command": command,
        "arguments": arguments,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "jaxlib_version": getattr(jaxlib, "__version__", None),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": {
            "backend": jax.default_backend(),
            "kind": devices[0].device_kind,
            "count": len(devices),
            "name": str(devices[0]),
        },
        "host_cpus": os.cpu_count(),
    }


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, np.bool_):
        return bool(x)
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if x is None or isinstance(x, (bool, int, str)):
        return x
    return str(x)


def write_json(path: str, payload: dict) -> None:
    """`payload` as JSON at `path`, whose folder exists (`runner` checked it before the run)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_jsonable(payload), f, indent=2)
        f.write("\n")


# ---- formatting --------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:.1f}"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, np.integer)):
        return f"{int(value):,}"
    if isinstance(value, (float, np.floating)):
        v = float(value)
        if not math.isfinite(v):
            return "-"
        if v == 0:
            return "0"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    if value is None:
        return "-"
    return str(value)


# ---- tables --------------------------------------------------------------------------------------


def _label_column(t: Table, labels, header: str = "") -> None:
    """The row labels' column: as wide as its longest label and never wrapped, so that at a
    narrow console (80 columns) the value columns' headers wrap instead (`_value_column`)."""
    t.add_column(header, width=max(map(len, [header, *labels])), no_wrap=True)


def _value_column(t: Table, header: str, justify: str = "right") -> None:
    """A column of figures: its header wraps at a narrow console; a figure wider than the column
    is folded onto the next line, never cut with an ellipsis."""
    t.add_column(header, justify=justify, overflow="fold")


def layout_table(rows: list[dict], budget_bytes: int, page_size: int, kv_dtype: str = "bfloat16") -> Table:
    """One column per model, one row per figure (so that it fits 80 columns)."""
    short = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
             "int4": "int4 + bf16 scales per 32 lanes"}.get(kv_dtype, kv_dtype + " + f32 scales")
    t = Table(
        title=f"KV layout per model (arena_jax.KVLayout, {short}, {fmt_bytes(budget_bytes)} budget, {page_size}-token pages)",
        box=box.SIMPLE_HEAVY,
    )
    figures = [
        ("layers", lambda r: str(r["layers"])),
        ("query / KV heads", lambda r: f"{r['q_heads']} / {r['kv_heads']}"),
        ("head_dim", lambda r: str(r["head_dim"])),
        ("KV bytes / token", lambda r: f"{r['bytes_per_token']:,}"),
        ("  if sized by query heads", lambda r: f"{r['bytes_per_token_if_q_heads']:,}"),
        (f"page ({page_size} tokens)", lambda r: fmt_bytes(r["page_bytes"])),
        ("pages in the budget", lambda r: f"{r['num_pages']:,}"),
        ("tokens in the budget", lambda r: f"{r['token_capacity']:,}"),
    ]
    _label_column(t, [label for label, _ in figures])
    for r in rows:
        _value_column(t, r["model"])
    for label, value in figures:
        t.add_row(label, *(value(r) for r in rows))
    return t


_CAPACITY_ROWS = [
    ("peak concurrent sequences", "peak_concurrent", _fmt),
    ("mean concurrent sequences", "mean_concurrent", lambda v: f"{v:.1f}"),
    ("  same, while requests wait", "mean_concurrent_saturated", lambda v: f"{v:.1f}"),
    ("utilization, mean", "utilization_mean", _pct),
    ("utilization, p5", "utilization_p5", _pct),
    ("budget holding tokens, mean", "budget_held_mean", _pct),
    ("internal waste / sequence", "waste_tokens_per_seq", lambda v: f"{v:,.1f} tok"),
    ("  same, in bytes", "waste_bytes_per_seq", fmt_bytes),
    ("requests that waited", "requests_waited", _fmt),
    ("mean wait (steps)", "mean_wait_steps", lambda v: f"{v:,.0f}"),
    ("preemptions (recompute)", "preemptions", _fmt),
    ("growth stalls (sequence-steps)", "growth_stalls", _fmt),
    ("total steps", "total_steps", _fmt),
]


def capacity_tables(result: dict) -> list:
    s, w, allocs = result["settings"], result["workload"], result["allocators"]
    keys = list(allocs)
    t = Table(
        title=(
            f"capacity: {w['requests']} requests, {fmt_bytes(s['budget_bytes'])} KV budget "
            f"= {s['budget_tokens']:,} tokens of {s['model']} ({s['bytes_per_token']:,} B/token"
            + (f", {s['kv_dtype']} KV)" if s.get("kv_dtype", "bfloat16") != "bfloat16" else ")")
        ),
        box=box.SIMPLE_HEAVY,
        pad_edge=False,  # in 80 columns: the labels and the three allocators' figures, none wrapped
    )
    _label_column(t, [label for label, _, _ in _CAPACITY_ROWS] + ["memory recycled", "copies (regrowth / COW)"])
    for k in keys:
        _value_column(t, allocs[k]["allocator"])
    for label, key, fmt in _CAPACITY_ROWS:
        t.add_row(label, *(fmt(allocs[k][key]) for k in keys))
    recycled = []
    for k in keys:
        a = allocs[k]
        if "pages_recycled" in a:
            recycled.append(f"{a['pages_recycled']:,} pages")
        else:
            recycled.append(f"{a['slabs_freed']:,} slabs")
    t.add_row("memory recycled", *recycled)
    copies = []
    for k in keys:
        a = allocs[k]
        if "copies" in a:
            copies.append(f"{a['copies']:,} ({fmt_bytes(a['tokens_copied'] * s['bytes_per_token'])})")
        elif "cow_copies" in a:
            copies.append(f"{a['cow_copies']:,}")
        else:
            copies.append("0")
    t.add_row("copies (regrowth / COW)", *copies)
    return [t]


def capacity_notes(result: dict) -> list[str]:
    s, w = result["settings"], result["workload"]
    al = s["arena_layout"]
    notes = [
        f"workload: {w['source']}, prompt mean {w['prompt_len_mean']:.0f} / p50 {w['prompt_len_p50']:.0f} / "
        f"max {w['prompt_len_max']}, output mean {w['output_len_mean']:.0f} / p50 {w['output_len_p50']:.0f} / "
        f"max {w['output_len_max']}, arrivals over {w['last_arrival_step']:,} steps"
        + (f", {w['clipped_to_max_seq_len']} clipped to max_seq_len {s['max_seq_len']}" if w["clipped_to_max_seq_len"] else ""),
        f"arena: real aj.reserve / aj.release on a KVLayout with the budget's page count ({al['num_pages']:,} pages of "
        f"{al['page_size']} tokens) but {al['num_layers']} layer x {al['num_kv_heads']} KV head x head_dim {al['head_dim']} "
        f"({fmt_bytes(al['arena_bytes'])}): the allocator state is what is measured; "
        f"{result['health_checks']} step samples cross-checked with aj.health",
        f"contiguous: slabs in a token-granular first-fit free list over the same {s['budget_tokens']:,} tokens; "
        f"max-length slab = {s['max_seq_len']} tokens; growth slab = context + {s['headroom']:.0%}, regrown by "
        f"{s['headroom']:.0%} (in place if the next block is free, else copied)",
        f"policy (all three): FCFS admission (<= {s['max_admit']} per step, {s['max_seqs']} slots), leaving "
        f"{s['watermark']:.0%} of the budget free for growth ({s['watermark_pages']} pages; none for max-length slabs, "
        "which never grow); when growth is refused the newest refused sequence is preempted (recomputed later) and the "
        "others stall a step",
    ]
    return notes


def goal_lines(result: dict) -> list[str]:
    g = result["goals"]
    allocs = result["allocators"]
    mark = lambda ok: "[green]met[/green]" if ok else "[red]NOT met[/red]"  # noqa: E731
    return [
        f"goal: arena utilization >= {g['arena_utilization_goal']:.0%}: measured {g['arena_utilization']:.1%} "
        f"(p5 {allocs['arena']['utilization_p5']:.1%}) -> {mark(g['arena_utilization_met'])}",
        f"goal: arena concurrency >= {g['capacity_ratio_goal']:.0f}x contiguous max-length: peak "
        f"{allocs['arena']['peak_concurrent']} vs {allocs['contiguous_max']['peak_concurrent']} = "
        f"{g['capacity_ratio_peak']:.2f}x (mean while requests wait {g['capacity_ratio_saturated']:.2f}x, "
        f"mean over all busy steps {g['capacity_ratio_mean']:.2f}x) -> {mark(g['capacity_ratio_met'])}",
    ]


def decode_table(result: dict) -> Table:
    a, d = result["arena"], result["dense"]
    s = result["settings"]
    t = Table(
        title=f"decode: {s['model_dir'] or s['model']}, batch {s['batch']}, {s['prompt_len']} prompt + {s['new_tokens']} new tokens",
        caption=f"{s['weights']}, {s['dtype']}; {s['repeats']} timed repeats after {s['warmup']} warm-up",
        box=box.SIMPLE_HEAVY,
    )
    h = result.get("transformers")
    _label_column(t, [label for label, _, _, _ in _DECODE_ROWS])
    for col in ("paged arena", "dense cache", "arena / dense") + (("transformers", "arena / transformers") if h else ()):
        _value_column(t, col)

    def row(label, key, fmt, ratio=True):
        x, y = a[key], d[key]
        cells = [label, fmt(x), fmt(y), f"{x / y:.2f}x" if ratio and y else ""]
        if h:
            z = h.get(key)
            cells += ["" if z is None else fmt(z), f"{x / z:.2f}x" if ratio and z else ""]
        t.add_row(*cells)

    for label, key, fmt, ratio in _DECODE_ROWS:
        row(label, key, fmt, ratio)
    return t


_DECODE_ROWS = [
    ("decode tokens/s (median)", "tokens_per_s", lambda v: f"{v:,.1f}", True),
    ("step time, mean", "step_ms_mean", lambda v: f"{v:.3f} ms", True),
    ("step latency p50", "step_ms_p50", lambda v: f"{v:.3f} ms", True),
    ("step latency p99", "step_ms_p99", lambda v: f"{v:.3f} ms", True),
    ("prefill (median)", "prefill_ms", lambda v: f"{v:.2f} ms", True),
    ("compile (first calls)", "compile_s", lambda v: f"{v:.2f} s", True),
    ("  of which the decode step", "compile_decode_s", lambda v: f"{v:.2f} s", True),
    ("KV bytes / token", "kv_bytes_per_token", lambda v: f"{v:,}", False),
    ("KV bytes reserved", "kv_bytes_reserved", fmt_bytes, True),
    ("reserved / token held", "kv_bytes_reserved_per_token", lambda v: f"{v:,.0f} B", True),
]


def decode_ratio_lines(result: dict) -> list[str]:
    """The tour's word on its decode ratio (issue 40): what the run's arena / dense figure means,
    from this run's own step times, and where the figures at a real model's size are. Every
    figure is this run's; the measurements at real sizes are pointed at, not quoted. The step
    times are the ratio's own: each run's mean step (`step_ms_mean`, batch / tokens/s), so the
    two always agree (p50 steps can disagree with a tokens/s ratio near 1x)."""
    ratio, s = result["speedup_tokens_per_s"], result["settings"]
    arena, dense = result["arena"]["step_ms_mean"], result["dense"]["step_ms_mean"]
    context = s["prompt_len"] + s["new_tokens"]
    elsewhere = ("For decode speed at a real model's size see benchmarks/RESULTS.md, 'Layer weights read in place: the "
                 "step time on an H200' (Llama-3-8B on a GPU), or run arena-bench decode --model llama3-8b on one. What "
                 "the arena buys is the capacity above.")
    if ratio >= 1:
        return [f"What {ratio:.2f}x means: the arena decoded {ratio:.2f} tokens for each token of the dense cache in "
                f"the same time (a step {arena:.3f} ms vs {dense:.3f} ms, mean)."]
    warm = [result[k].get("warm_step_ms_p50") for k in ("arena", "dense")]
    settled = ""
    if None not in warm:
        settled = (f" Past each run's first {result['arena']['cold_steps']} decode steps, which start cold after its "
                   f"prefill and cost the longer step more, the median steps are {warm[0]:.3f} and {warm[1]:.3f} ms "
                   f"({warm[1] / warm[0]:.2f}x).")
    return [
        f"What {ratio:.2f}x means: a decode step took {arena:.3f} ms on the arena and {dense:.3f} ms on the dense "
        f"cache (mean). The {arena - dense:.3f} ms more is the paged cache's own work in every step (passing its page "
        f"table and counters into and out of the call, reserving pages, reading the page table, gathering each row's pages "
        f"for attention and checking their values for NaN poison), which a tiny model's short step on "
        f"{'a CPU' if result['device'] == 'cpu' else result['device']}, at {context} tokens of context, does not amortize."
        + settled,
        elsewhere,
    ]


COMPILE_SECTION = "One compile for every layer's cache ops (issue 39, item 4; session 28)"  # in benchmarks/RESULTS.md


def compile_ratio_line(result: dict) -> str:
    """The tour's word on its compile row: this run's first-call seconds, what the arena's extra
    is made of, and that the command-line tools keep compiled programs (`models.compile_cache`)."""
    arena, dense = result["arena"]["compile_s"], result["dense"]["compile_s"]
    if arena <= dense:
        return f"Compile: the first calls took {arena:.2f} s on the arena and {dense:.2f} s on the dense cache."
    return (f"Compile: the first calls (a prefill and a decode step) took {arena:.2f} s on the arena and {dense:.2f} s on "
            f"the dense cache. The {arena - dense:.2f} s more compiles the cache's own ops into each program (reserving "
            f"pages, the step's plan of the page table, paged attention): a cost that does not grow with the model's "
            f"depth (benchmarks/RESULTS.md, '{COMPILE_SECTION}'). arena-generate and arena-serve keep compiled programs "
            f"in a persistent compilation cache, so only a machine's first run pays it.")


_PREFIX_ROWS = [
    ("prompt tokens (admissions)", "prompt_tokens", _fmt),
    ("prefill tokens computed", "prefill_tokens", _fmt),
    ("prefix hit tokens", "hit_tokens", _fmt),
    ("hit rate", "hit_rate", _pct),
    ("time to first token p50", "ttft_ms_p50", lambda v: f"{v:,.1f} ms"),
    ("time to first token p99", "ttft_ms_p99", lambda v: f"{v:,.1f} ms"),
    ("throughput (generated tokens/s)", "tokens_per_s", lambda v: f"{v:,.1f}"),
    ("wall time (all turns, per run)", "seconds", lambda v: f"{v:.2f} s"),
    ("prefill calls", "prefill_calls", _fmt),
    ("decode calls", "decode_calls", _fmt),
    ("preemptions", "preemptions", _fmt),
    ("evictions (pages)", "evictions", _fmt),
    ("cached pages at the end", "cached_pages_end", _fmt),
    ("copy-on-write page copies", "cow_copies", _fmt),
]
_HOST_ROWS = [
    ("  of which hits in host pages", "host_hit_tokens", _fmt),
    ("pages copied to host / back", "pages_moved", lambda v: v),
    ("modelled transfer time (GPU)", "modelled_transfer_s", lambda v: f"{v * 1e3:,.2f} ms"),
    ("throughput + modelled transfers", "tokens_per_s_modelled", lambda v: f"{v:,.1f}"),
]


def prefix_table(result: dict) -> Table:
    s, lay = result["settings"], result["settings"]["layout"]
    t = Table(
        title=(
            f"prefix: {s['model_dir'] or s['model']}, {s['conversations']} conversations x {s['turns']} turns, "
            f"{s['system_prompts']} system prompts of {s['system_len']} tokens, {lay['num_pages']:,} pages of "
            f"{lay['page_size']} tokens ({fmt_bytes(lay['kv_bytes'])} KV)"
        ),
        box=box.SIMPLE_HEAVY,
    )
    modes = ["none", "prefix"] + (["host"] if "host" in result else [])
    cols = ["no prefix cache", "prefix cache"] + (["+ host tier"] if "host" in result else [])
    cols += ["cache / none"] + (["host / none"] if "host" in result else [])
    t.add_column("", justify="left")
    for col in cols:
        t.add_column(col, justify="right")
    ratios = {"prefill_tokens", "ttft_ms_p50", "ttft_ms_p99", "tokens_per_s", "seconds", "prefill_calls", "tokens_per_s_modelled"}
    rows = _PREFIX_ROWS + (_HOST_ROWS if "host" in result else [])
    for label, key, fmt in rows:
        values = [_prefix_value(result[m], key) for m in modes]
        x = values[0]
        shown = [fmt(v) if v is not None else "" for v in values]
        extra = [f"{v / x:.2f}x" if key in ratios and x and v is not None else "" for v in values[1:]]
        t.add_row(label, *shown, *extra)
    return t


def _prefix_value(summary: dict, key: str):
    if key == "pages_moved":
        return f"{summary.get('pages_to_host', 0):,} / {summary.get('pages_to_device', 0):,}"
    if key == "tokens_per_s_modelled":
        return summary[key] if summary.get("pages_to_host") or summary.get("pages_to_device") else None
    return summary.get(key, 0)


def prefix_notes(result: dict) -> list[str]:
    s, lay = result["settings"], result["settings"]["layout"]
    none, pre = result["none"], result["prefix"]
    lines = [
        f"workload: seed {s['seed']}; turn t+1's prompt = turn t's prompt + its {s['new_tokens']}-token answer + a user "
        f"message of {max(1, s['user_len'] // 2)}-{s['user_len'] + s['user_len'] // 2} tokens; each turn of every "
        f"conversation arrives at once (one generate call per turn); prompts up to {s['max_prompt_len']} tokens",
        f"same model ({s['weights']}, {s['dtype']}), same KV budget ({lay['num_pages']:,} pages), batch {s['batch']}, "
        f"prefill chunks of {s['chunk_size']}; {s['repeats']} timed run(s) per mode after a warm-up "
        f"({result['warmup_s']:.1f} s, compiles); {result['device']}, attention backend {lay['backend']!r}",
        f"prefix cache: prefill tokens {result['prefill_ratio']:.2f}x, time to first token p50 "
        f"{result['ttft_p50_ratio']:.2f}x, throughput {result['speedup_tokens_per_s']:.2f}x of no cache; hit rate "
        f"{pre['hit_rate']:.1%}, {pre['evictions']:,} pages evicted (LRU), {pre['preemptions']} preemptions "
        f"(vs {none['preemptions']} without)",
    ]
    if "host" in result:
        h = result["host"]
        moved = (h["pages_to_host"] + h["pages_to_device"]) * result["page_bytes"]
        lines.append(
            f"host tier ({s['host_pages']:,} pages): prefill tokens {result['host_prefill_ratio']:.2f}x, time to first token "
            f"p50 {result['host_ttft_p50_ratio']:.2f}x, throughput {result['host_speedup_tokens_per_s']:.2f}x of no cache "
            f"({result['host_speedup_modelled']:.2f}x with the modelled transfers added); hit rate {h['hit_rate']:.1%} "
            f"({h['host_hit_tokens']:,} hit tokens in host pages), {h['evictions']:,} device pages evicted"
        )
        lines.append(
            f"transfers: {h['pages_to_host']:,} pages to host, {h['pages_to_device']:,} back, {fmt_bytes(moved)} per run; "
            f"on this {result['device']} host and device share DRAM, so they are memcpys inside the measured time; a GPU "
            f"would pay {fmt_bytes(moved)} / {result['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s (PCIe 4.0 x16, "
            f"SwapPolicy) = {h['modelled_transfer_s'] * 1e3:.2f} ms, added on top (no overlap) in the modelled throughput"
        )
    if result["same_tokens"]:
        lines.append("greedy tokens: [green]match[/green] (every turn of every conversation, with and without the cache)")
    else:
        m = result["first_mismatch"]
        lines.append(f"greedy tokens: [red]MISMATCH[/red] (turn {m['turn']}, conversation {m['conversation']}, "
                     f"{m.get('mode', 'prefix')}: {m['without']} without vs {m['with']} with the cache)")  # fmt: skip
    if none["rejected_rows"] or pre["rejected_rows"]:
        lines.append(f"[red]rows refused by the cache's checks: {none['rejected_rows']} / {pre['rejected_rows']}[/red]")
    return lines


def generic_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title, box=box.SIMPLE_HEAVY)
    cols: list[str] = []
    for r in rows:
        for k in r:
            if k not in cols:
                cols.append(k)
    for c in cols:
        numeric = all(isinstance(r.get(c), (int, float, np.integer, np.floating)) or r.get(c) is None for r in rows)
        t.add_column(c, justify="right" if numeric else "left")
    for r in rows:
        t.add_row(*(_fmt(r.get(c)) for c in cols))
    return t


# ---- plots ---------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> None:
    fig.savefig(path, dpi=120)


def plot_capacity(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for key, a in result["allocators"].items():
        s = a["series"]
        ax1.plot(s["step"], s["concurrent"], label=a["allocator"], lw=1.2)
        ax2.plot(s["step"], np.asarray(s["utilization"]) * 100, label=a["allocator"], lw=1.2)
    st = result["settings"]
    ax1.set_ylabel("concurrent sequences")
    ax1.set_title(f"{fmt_bytes(st['budget_bytes'])} KV budget ({st['model']}), {result['workload']['requests']} requests")
    ax1.legend(loc="upper right")
    ax2.set_ylabel("utilization (%)\ntoken states / reserved")
    ax2.set_xlabel("simulation step (one token per running sequence)")
    ax2.set_ylim(0, 105)
    ax2.axhline(result["goals"]["arena_utilization_goal"] * 100, color="gray", ls=":", lw=1)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_decode(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    a, d = result["arena"], result["dense"]
    ax1.hist([a["step_ms"], d["step_ms"]], bins=30, label=["paged arena", "dense cache"])
    ax1.set_xlabel("decode step latency (ms)")
    ax1.set_ylabel("steps")
    ax1.legend()
    ax2.bar(["paged arena", "dense cache"], [a["tokens_per_s"], d["tokens_per_s"]], color=["C0", "C1"])
    ax2.set_ylabel("decode tokens/s (median of repeats)")
    s = result["settings"]
    fig.suptitle(f"{s['model']} batch {s['batch']}, prompt {s['prompt_len']}, {s['new_tokens']} new tokens ({result.get('device', '')})")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_prefix(result: dict, path: str) -> None:
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    turns = [r["turn"] for r in result["none"]["per_turn"]]
    x = np.arange(len(turns))
    for i, (key, label) in enumerate((("none", "no prefix cache"), ("prefix", "prefix cache"))):
        ax1.bar(x + (i - 0.5) * 0.4, [r["prefill_tokens"] for r in result[key]["per_turn"]], width=0.4, label=label)
        ttft = np.sort(result[key]["ttft_ms"])
        ax2.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=label)
    ax1.set_xticks(x, [f"turn {t}" for t in turns])
    ax1.set_ylabel("prefill tokens computed")
    ax1.legend()
    ax2.set_xlabel("time to first token (ms)")
    ax2.set_ylabel("fraction of requests")
    ax2.set_xscale("log")
    ax2.legend()
    s = result["settings"]
    fig.suptitle(f"{s['model']}: {s['conversations']} conversations x {s['turns']} turns ({result.get('device', '')})")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def plot_kernels(rows: list[dict], path: str) -> bool:
    """GB/s of KV read against context, a line per (implementation, batch); False without such rows."""
    rows = [r for r in rows if "context" in r and "batch" in r]
    impls = sorted({k[: -len("_gbps")] for r in rows for k in r if k.endswith("_gbps")})
    if not rows or not impls:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, impl in enumerate(impls):
        for j, batch in enumerate(sorted({r["batch"] for r in rows})):
            pts = sorted((r["context"], r[f"{impl}_gbps"]) for r in rows if r["batch"] == batch and f"{impl}_gbps" in r)
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", ls=("-", "--", ":", "-.")[j % 4], label=f"{impl}, batch {batch}")
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("GB/s of KV read")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=7)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
    return True


def eprint(*args) -> None:
    print(*args, file=sys.stderr)


def run_printed(console, headline: str, run, lines) -> dict:
    """A subcommand that prints plain lines: the headline, `run()`, its `lines(result)`, the seconds."""
    console.print(headline)
    start = time.perf_counter()
    result = run()
    for line in lines(result):
        print(line)
    console.print(f"  ({time.perf_counter() - start:.0f} s)")
    return result
