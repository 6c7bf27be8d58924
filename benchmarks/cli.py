"""`arena-bench`: the KV layout of real models, allocator capacity under a memory budget,
end-to-end decode against a dense cache, the Pallas kernels, and prefix caching.

    arena-bench                       a quick tour on a tiny built-in model (< 2 min on a CPU)
    arena-bench layout                bytes per token and pages for a budget, per model
    arena-bench capacity              arena vs contiguous allocators serving one workload
    arena-bench decode                tokens/s and step latency, paged arena vs dense cache
    arena-bench kernels               append / paged-attention kernel timings (GPU)
    arena-bench kernels --compile-report   static sm_90a facts of every kernel variant (no GPU)
    arena-bench kernels --compile-report --target tpu-v5e   the TPU kernels compiled for v5e (no TPU)
    arena-bench accuracy              quantized KV arenas (int8, fp8, int4; rotated keys) vs float64 / bf16
    arena-bench prefix                multi-turn chat with and without the prefix cache, same KV budget
    arena-bench swap                  a preemption-heavy generate run: recompute vs swap to host memory
    arena-bench serve                 generate's decode step vs the bare jitted step, compiles per call / by depth
    arena-bench serve --http          arena-serve vs transformers serve under Poisson loads (TTFT, ITL, tokens/s)
    arena-bench speculative           speculative decoding (prompt lookup) vs plain decoding, repetitive prompts

layout, capacity, decode and kernels take the KV arena's dtype (`--kv-dtype`; kernels: `--dtype`):
bfloat16 by default, or int8 / float8_e4m3fn / float8_e5m2 (8-bit values and a float32 scale per
token and KV head, counted in every byte figure).

Every subcommand takes --json PATH (results + device, JAX version, date, arguments);
capacity, decode, kernels and prefix take --plot PATH (PNG).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

from arena_jax.benchmarks.arguments import GIB, TOUR_CAPACITY, TOUR_DECODE, build_parser, mesh_spec
from arena_jax.benchmarks.compile_cache import CACHE_ENV, cached_compiles, init_compile_cache  # noqa: F401  (init: kept importable here)
from arena_jax.benchmarks.runner import _Fail, _naming, run
from arena_jax.benchmarks.runner import (  # noqa: F401  (moved to runner with main's checks; kept importable here)
    ATTENTION_FLAGS, KERNEL_REPORT_FLAGS, KERNEL_TIMING_FLAGS, MODEL_FLAGS, SERVE_ARRIVAL_FLAGS, SERVE_STEP_FLAGS)
from arena_jax.benchmarks.serve import serve_command as _cmd_serve
from arena_jax.models.argtypes import INT32_MAX

__all__ = ["main", "build_parser", "mesh_spec", "CACHE_ENV"]


# ---- subcommands ---------------------------------------------------------------------------------


def _check_budget_pages(budget_gib: float, page_bytes: int, model: str, page_size: int) -> None:
    """The budget must hold at least one page and no more pages than an int32 page id can name."""
    from arena_jax.models.memory import fmt_bytes

    pages = int(budget_gib * GIB) // page_bytes
    most = INT32_MAX - 1  # page ids and the free-page count are int32
    if pages < 1:
        raise _Fail(
            f"--budget-gib {budget_gib:g} holds no page of {model}: one page of --page-size {page_size} "
            f"tokens is {fmt_bytes(page_bytes)}"
        )
    if pages > most:
        raise _Fail(
            f"--budget-gib {budget_gib:g} is {pages:,} pages of {model} ({fmt_bytes(page_bytes)} each at --page-size "
            f"{page_size}), more than the {most:,} an int32 page table can name: at most {most * page_bytes / GIB:,.0f} GiB"
        )


def _cmd_layout(args, console) -> dict:
    from arena_jax.benchmarks import report
    from arena_jax.benchmarks.presets import LAYOUT_MODELS, layout_report, preset

    kv_dtype = getattr(args, "kv_dtype", "bfloat16")
    for name in LAYOUT_MODELS:
        per_token = preset(name).kv_layout(num_pages=1, max_seqs=1, max_seq_len=16, dtype=kv_dtype).bytes_per_token
        _check_budget_pages(args.budget_gib, per_token * args.page_size, name, args.page_size)
    budget = int(args.budget_gib * GIB)
    try:
        rows = layout_report(budget, page_size=args.page_size, dtype=kv_dtype)
    except ValueError as exc:  # e.g. a page size the layout refuses
        raise _Fail(f"--budget-gib {args.budget_gib:g}, --page-size {args.page_size}: {exc}") from None
    console.print(report.layout_table(rows, budget, args.page_size, kv_dtype))
    report.note(console, "Only KV heads are stored (GQA): sizing by query heads would need the bytes per token of the "
                         "row 'if sized by query heads'.")  # fmt: skip
    if rows and rows[0]["scale_bytes_per_token"]:
        what = ("one bf16 scale per 32 lanes of each token, KV head and layer" if kv_dtype == "int4"
                else "one float32 scale per token, KV head and layer")
        report.note(console, f"{kv_dtype}: bytes/token include {what}, for K and V "
                             f"({rows[0]['scale_bytes_per_token']:,} B/token of {rows[0]['model']}'s).")
    return {"budget_bytes": budget, "page_size": args.page_size, "kv_dtype": kv_dtype, "models": rows}


def _capacity_settings(args):
    from arena_jax.benchmarks.capacity import CapacitySettings
    from arena_jax.benchmarks.presets import preset

    kv_dtype = getattr(args, "kv_dtype", "bfloat16")
    layout = preset(args.model).kv_layout(num_pages=1, max_seqs=1, max_seq_len=16, dtype=kv_dtype)
    return CapacitySettings(
        model=args.model,
        kv_dtype=kv_dtype,
        bytes_per_token=layout.bytes_per_token,
        budget_bytes=int(args.budget_gib * GIB),
        page_size=args.page_size,
        max_seq_len=args.max_seq_len,
        max_seqs=args.max_seqs,
        headroom=args.headroom,
        watermark=args.watermark,
    )


def _auto_rate(lengths, budget_tokens: int) -> float:
    """1.5x the arrival rate the budget could serve if each sequence held exactly its tokens."""
    import numpy as np

    p = np.array([x[0] for x in lengths], float)
    o = np.array([x[1] for x in lengths], float)
    concurrent = budget_tokens / np.mean(p + o / 2)
    return 1.5 * concurrent / np.mean(o + 1)


HOST_BYTES_PER_REQUEST = 4096  # workload, scheduler state, per-step series: a generous estimate
HOST_BYTES_PER_SLOT = 256


def _check_capacity_memory(args, settings, num_requests: int) -> None:
    """The arena the simulation really allocates (1 layer x 1 KV head, the budget's page count)
    must fit the device, and the workload the host, before either is built."""
    from arena_jax.benchmarks.allocators import tiny_arena_layout
    from arena_jax.models.memory import cache_bytes, check_fits, host_memory_limit

    _check_budget_pages(args.budget_gib, settings.bytes_per_token * settings.page_size, args.model, settings.page_size)
    flags = (f"--budget-gib {args.budget_gib:g}, --page-size {args.page_size}, --max-seqs {args.max_seqs}, "
             f"--max-seq-len {args.max_seq_len}")  # fmt: skip
    try:
        layout = tiny_arena_layout(settings.num_pages, settings.page_size, settings.max_seqs, settings.max_seq_len)
        check_fits({"arena (1 layer x 1 KV head) and page table": cache_bytes(layout)},
                   hint="lower --budget-gib, --max-seqs or --max-seq-len")  # fmt: skip
        check_fits({f"{num_requests:,} requests": num_requests * HOST_BYTES_PER_REQUEST,
                    f"{args.max_seqs:,} slots": args.max_seqs * HOST_BYTES_PER_SLOT},
                   limit=host_memory_limit(), hint="lower --requests (or the --lengths rows) or --max-seqs")  # fmt: skip
    except ValueError as exc:  # TooLarge, or a layout the arena refuses
        raise _Fail(f"{flags}: {exc}") from None


def _check_prompts_fit(rows, args) -> None:
    """A --lengths prompt must leave room for one output token under --max-seq-len (a longer
    output is cut at --max-seq-len, counted and reported; a cut prompt would be another request)."""
    long = [i for i, (p, _, _) in enumerate(rows) if p >= args.max_seq_len]
    if long:
        first = rows[long[0]][0]
        raise _Fail(f"--lengths {args.lengths}: {len(long):,} of {len(rows):,} requests have a prompt of --max-seq-len "
                    f"{args.max_seq_len} tokens or more (request {long[0] + 1}: {first:,} tokens), leaving no room for "
                    "an output token: raise --max-seq-len or leave them out")


STEP_LIMIT = INT32_MAX  # the simulation's step counter and arrival steps are int32


def _check_arrival_steps(rate: float, num_requests: int, args, wl=None) -> None:
    """Arrival steps, and the steps to serve every request after the last, must fit the int32
    step counter. Before the draw: its expected last arrival (a float: a rate of 1e-300 must not
    reach the int64 cast); after it (`wl`): the drawn last arrival + every request's tokens."""
    if wl is None:
        last = (num_requests - 1) / rate if 0 < rate < math.inf else 0.0
        if last > STEP_LIMIT / 4:
            raise _Fail(f"--rate {args.rate}: {num_requests:,} requests arrive over ~{last:,.3g} steps, past the "
                        f"simulation's int32 step counter ({STEP_LIMIT:,}): raise --rate (0: all at step 0)")
        return
    steps = wl.requests[-1].arrival + sum(r.total_len for r in wl.requests)
    if steps > STEP_LIMIT:
        raise _Fail(f"--rate {args.rate}, --requests / --lengths: the last arrival (step {wl.requests[-1].arrival:,}) "
                    f"+ every request's tokens = {steps:,} steps, past the simulation's int32 step counter ({STEP_LIMIT:,})")


def _cmd_capacity(args, console, progress) -> dict:
    from arena_jax.benchmarks import report, workload
    from arena_jax.benchmarks.capacity import run_capacity

    if args.page_size > args.max_seq_len:  # --max-seq-len is every slab's length: a longer page is never filled
        raise _Fail(f"--page-size {args.page_size} is longer than --max-seq-len {args.max_seq_len}: a page must fit in "
                    "the longest sequence (past it the utilization figures measure the page, not the allocator)")
    settings = _capacity_settings(args)
    try:
        settings.validate()
        rows = workload.load_lengths(args.lengths) if args.lengths else None
    except workload.WorkloadError as exc:
        raise _Fail(f"--lengths: {exc}") from None
    except ValueError as exc:
        raise _Fail(str(exc)) from None
    if rows:
        _check_prompts_fit(rows, args)
    num_requests = len(rows) if rows else args.requests
    _check_capacity_memory(args, settings, num_requests)
    try:
        if args.lengths:
            lengths = [(p, o) for p, o, _ in rows]
        else:
            probe = workload.synthetic(args.requests, seed=args.seed, rate=0, max_seq_len=args.max_seq_len)
            lengths = [(r.prompt_len, r.output_len) for r in probe.requests]
        rate = _auto_rate(lengths, settings.budget_tokens) if args.rate == "auto" else float(args.rate)
        _check_arrival_steps(rate, num_requests, args)
        if args.lengths:
            wl = workload.from_rows(rows, args.lengths, seed=args.seed, rate=rate, max_seq_len=args.max_seq_len)
        else:
            wl = workload.synthetic(args.requests, seed=args.seed, rate=rate, max_seq_len=args.max_seq_len)
    except ValueError as exc:
        raise _Fail(str(exc)) from None
    _check_arrival_steps(rate, num_requests, args, wl)
    console.print(f"[bold]capacity[/bold]: serving {len(wl.requests)} requests (arrival rate {rate:.3g}/step) with three allocators ...")
    t0 = time.perf_counter()
    with cached_compiles():
        result = run_capacity(wl, settings, progress, host_scheduler=args.host_scheduler)
    result["arrival_rate"] = rate
    result["wall_s"] = time.perf_counter() - t0
    for t in report.capacity_tables(result):
        console.print(t)
    for line in report.capacity_notes(result) + report.goal_lines(result):
        report.note(console, line)
    report.note(console, f"({result['wall_s']:.1f} s)")
    return result


def _check_depth(model: str, num_layers: int, devices: int = 1) -> None:
    """--num-layers' weights (at 2 bytes a parameter, split over every device of a mesh: a lower
    bound) must fit a device before the config is made: a mixed-layer preset builds its layer
    pattern per layer (1e9 entries: minutes)."""
    from arena_jax.benchmarks.presets import preset
    from arena_jax.models.memory import TooLarge, check_fits

    one, two = preset(model).with_num_layers(1), preset(model).with_num_layers(2)
    params = one.num_params() + (num_layers - 1) * (two.num_params() - one.num_params())
    what = f"weights ({num_layers:,} layers, at 2 bytes a parameter at least{f', / {devices} devices' if devices > 1 else ''})"
    try:
        check_fits({what: 2 * params // devices}, hint="lower --num-layers")
    except TooLarge as exc:
        raise _Fail(f"--num-layers {num_layers}: {model} {exc}") from None


def _model_config(args, tokens: int, what: str):
    """The model's config and dtype (--model / --model-dir, --num-layers, --dtype), read before any
    work; `tokens` (the longest sequence, `what` says of which flags) must fit its positions."""
    from arena_jax.benchmarks.decode import config_and_dtype

    if args.model_dir and not os.path.isdir(args.model_dir):
        raise _Fail(f"--model-dir {args.model_dir!r} is not a folder")
    if not args.model_dir and args.num_layers:
        mesh = getattr(args, "mesh", None)  # decode's (dp, tp)
        _check_depth(args.model, args.num_layers, mesh[0] * mesh[1] if mesh else 1)
    try:
        cfg, dtype = config_and_dtype(args)
    except (OSError, ValueError) as exc:  # a missing or invalid config.json, a depth the preset refuses
        which = f"--model-dir {args.model_dir}" if args.model_dir else f"--model {args.model}, --num-layers {args.num_layers}"
        raise _Fail(f"{which}: {exc}") from None
    if tokens > cfg.max_position_embeddings:
        raise _Fail(f"{what} = {tokens:,} tokens exceed the model's max_position_embeddings "
                    f"{cfg.max_position_embeddings:,}")
    return cfg, dtype


def _check_host_tokens(tokens: int, what: str, hint: str) -> None:
    """The workload's token ids, held in Python lists, must fit the host (drawn before any check
    of the run's own could see them)."""
    from arena_jax.models.memory import HOST_BYTES_PER_TOKEN, TooLarge, check_fits, host_memory_limit

    try:
        check_fits({f"{tokens:,} token ids in Python lists": tokens * HOST_BYTES_PER_TOKEN}, limit=host_memory_limit(),
                   hint=hint)  # fmt: skip
    except TooLarge as exc:
        raise _Fail(f"{what}: {exc}") from None


def _decode_settings(args):
    from arena_jax.benchmarks.decode import DecodeSettings

    if args.new_tokens < 2:
        raise _Fail("--new-tokens must be >= 2 (one token from prefill, at least one decode step)")
    _model_config(args, args.prompt_len + args.new_tokens, f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens}")
    hf_mode = getattr(args, "hf", "off")  # the tour runs without the transformers peer
    hf = False
    if hf_mode != "off":
        import jax

        from arena_jax.benchmarks.hf_peer import unavailable_reason

        reason = unavailable_reason(jax.default_backend(), getattr(args, "mesh", None))
        if reason is not None and hf_mode == "on":
            raise _Fail(f"--hf on: {reason}")
        hf = reason is None
    # the layers' form: --scan-layers, --no-scan-layers, or (None) as load_pretrained builds them here
    scan_layers = True if getattr(args, "scan_layers", False) else False if getattr(args, "no_scan_layers", False) else None
    return DecodeSettings(
        hf=hf,
        hf_threads=getattr(args, "hf_threads", 1),
        model=args.model,
        model_dir=args.model_dir,
        batch=args.batch,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        page_size=args.page_size,
        dtype=args.dtype,
        kv_dtype=getattr(args, "kv_dtype", None),
        num_layers=args.num_layers,
        seed=args.seed,
        mesh=getattr(args, "mesh", None),
        scan_layers=scan_layers,
    )


def _cmd_decode(args, console, progress) -> dict:
    from arena_jax.benchmarks import report
    from arena_jax.benchmarks.decode import ModelTooLarge, run_decode

    settings = _decode_settings(args)
    console.print(f"[bold]decode[/bold]: {settings.model_dir or settings.model}, paged arena vs dense cache (compiling first) ...")
    t0 = time.perf_counter()
    flags = (f"--batch {args.batch}, --prompt-len {args.prompt_len}, --new-tokens {args.new_tokens}, --page-size "
             f"{args.page_size}") + (f", --model-dir {args.model_dir}" if args.model_dir else "")  # fmt: skip
    try:
        result = run_decode(settings, progress)
    except (ModelTooLarge, OSError, ValueError) as exc:  # too large, unreadable or invalid checkpoint, bad sizes
        raise _naming(exc, flags) from None
    result["wall_s"] = time.perf_counter() - t0
    console.print(report.decode_table(result))
    a = result["arena"]
    note = lambda text: report.note(console, text)  # noqa: E731
    if result.get("mesh"):
        m = result["mesh"]
        note(
            f"mesh: data {m['data']} x tensor {m['tensor']} ({m['data'] * m['tensor']} devices); arena per device "
            f"{a['arena_bytes_per_device']:,} of {a['arena_bytes']:,} bytes, KV bytes/token per device "
            f"{a['kv_bytes_per_token_per_device']:,} (KV heads stored {a['kv_replicas']}x); dense cache: rows over data, KV heads over tensor when they divide"
        )
    note(
        f"arena / dense decode tokens/s: [bold]{result['speedup_tokens_per_s']:.2f}x[/bold] "
        f"on {result['device']}, attention backend {result['settings']['arena_layout']['backend']!r}"
    )
    if getattr(args, "explain_ratio", False):  # the tour: what that ratio means on a tiny model
        for line in report.decode_ratio_lines(result):
            note(line)
        note(report.compile_ratio_line(result))
    if result["same_tokens"]:
        note(f"greedy tokens: [green]match[/green] (arena == dense on every run; first tokens {result['tokens_sample']})")
    elif result["arena_quantized"]:
        note(
            f"greedy tokens: {result['token_agreement']:.1%} equal to the dense cache's, position by position "
            f"(the {result['settings']['arena_layout']['dtype']} arena quantizes K/V: tokens may differ; "
            "`arena-bench accuracy` measures how much)"
        )
    else:
        m = result["first_mismatch"]
        note(f"greedy tokens: [red]MISMATCH[/red] (first at row {m['row']}, token {m['token_index']}: arena {m['arena']} vs dense {m['dense']})" if m else "greedy tokens: [red]MISMATCH[/red]")
    h = result.get("transformers")
    if h:
        agree = "[green]match[/green]" if h["same_tokens"] else f"{h['token_agreement']:.1%} equal position by position"
        note(
            f"transformers ({h['model_class']}, its own KV cache, torch threads {h['torch_threads']}; JAX threads "
            f"{h['jax_threads']}): arena / transformers decode tokens/s [bold]{a['tokens_per_s'] / h['tokens_per_s']:.2f}x"
            f"[/bold]; greedy tokens vs the arena's: {agree}"
        )
    note(
        f"arena held {a['pages_in_use']} pages ({a['utilization']:.1%} of their positions filled); "
        f"dense cache sized to prompt + new tokens = {result['settings']['dense_max_len']} per row (its best case)"
    )
    note(f"({result['wall_s']:.1f} s)")
    return result


def _cmd_prefix(args, console, progress) -> dict:
    from arena_jax.benchmarks import report
    from arena_jax.benchmarks.prefix import PrefixSettings, PrefixTooLarge, run_prefix

    if args.num_pages is not None and args.budget_gib is not None:
        raise _Fail("give --num-pages or --budget-gib, not both")
    settings = PrefixSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(PrefixSettings)})
    _model_config(args, settings.max_total_len,
                  f"--system-len {args.system_len} + --turns {args.turns} x (up to {settings.user_max} user tokens "
                  f"(--user-len {args.user_len}) + --new-tokens {args.new_tokens})")  # fmt: skip
    turns = args.conversations * args.turns  # each: a user message, a prompt of up to max_total_len, an answer (x2 modes)
    _check_host_tokens(args.system_prompts * args.system_len + 2 * turns * (settings.user_max + settings.max_total_len),
                       f"--system-prompts {args.system_prompts} x --system-len {args.system_len} + --conversations "
                       f"{args.conversations} x --turns {args.turns} of up to {settings.max_total_len} tokens",
                       "lower --conversations, --turns or --system-prompts")  # fmt: skip
    budget = (f"--num-pages {args.num_pages}" if args.num_pages else
              f"--budget-gib {args.budget_gib:g}" if args.budget_gib else "the default --num-pages")  # fmt: skip
    flags = (f"--batch {args.batch}, --page-size {args.page_size}, {budget}, --chunk-size {args.chunk_size}, longest "
             f"request {settings.max_total_len} tokens")  # fmt: skip
    console.print(f"[bold]prefix[/bold]: {settings.model_dir or settings.model}, {settings.conversations} conversations x "
                  f"{settings.turns} turns, with and without the prefix cache (compiling first) ...")  # fmt: skip
    t0 = time.perf_counter()
    try:
        result = run_prefix(settings, progress)
    except (PrefixTooLarge, OSError, ValueError) as exc:
        raise _naming(exc, flags) from None
    result["wall_s"] = time.perf_counter() - t0
    console.print(report.prefix_table(result))
    for line in report.prefix_notes(result):
        console.print(f"  {line}", soft_wrap=True)
    console.print(f"  ({result['wall_s']:.1f} s)")
    return result


def _cmd_speculative(args, console, progress) -> dict:
    from arena_jax.benchmarks import report
    from arena_jax.benchmarks.speculative import SpeculativeSettings, run_speculative, speculative_lines

    settings = SpeculativeSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SpeculativeSettings)})
    return report.run_printed(console, "[bold]speculative[/bold]: prompt lookup vs plain decoding (compiling first) ...",
                              lambda: run_speculative(settings, progress), speculative_lines)  # fmt: skip


def _cmd_swap(args, console, progress) -> dict:
    from arena_jax.benchmarks.swap import SwapSettings, SwapTooLarge, run_swap, swap_notes, swap_table

    settings = SwapSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SwapSettings)})
    _model_config(args, settings.max_total_len, f"--prompt-len {args.prompt_len} (+ up to half of it) + --new-tokens "
                                                f"{args.new_tokens}")  # fmt: skip
    _check_host_tokens(4 * args.requests * settings.max_total_len, f"--requests {args.requests} of up to "
                       f"{settings.max_total_len} tokens (prompts, and the tokens of three modes)", "lower --requests")
    flags = (f"--batch {args.batch}, --page-size {args.page_size}, --num-pages {args.num_pages}, --host-pages "
             f"{args.host_pages}, longest request {settings.max_total_len} tokens")  # fmt: skip
    console.print(f"[bold]swap[/bold]: {settings.model_dir or settings.model}, {settings.requests} requests under memory "
                  "pressure: recompute vs swap to a host tier (compiling first) ...")  # fmt: skip
    t0 = time.perf_counter()
    try:
        result = run_swap(settings, progress)
    except (SwapTooLarge, OSError, ValueError) as exc:
        raise _naming(exc, flags) from None
    result["wall_s"] = time.perf_counter() - t0
    console.print(swap_table(result))
    for line in swap_notes(result):
        console.print(f"  {line}", soft_wrap=True)
    console.print(f"  ({result['wall_s']:.1f} s)")
    return result


def _check_kernel_memory(k: dict) -> None:
    """What the kernel benchmark allocates, checked first. On a CPU it runs the jnp reference on
    points clamped to CPU_MAX_BATCH x CPU_MAX_CONTEXT, all of which must fit. On a GPU a point
    too large for memory is skipped (and said so), but the smallest point and the largest
    batch's append (never skipped) must fit."""
    import jax
    import jax.numpy as jnp

    from arena_jax.benchmarks.kernels import CPU_MAX_BATCH, CPU_MAX_CONTEXT
    from arena_jax.models.memory import check_fits

    itemsize = jnp.dtype(k["dtype"]).itemsize
    ps, kv, hd, qh = k["page_size"], k["num_kv_heads"], k["head_dim"], k["num_q_heads"]
    row = hd * itemsize + (4 if itemsize == 1 else 0)  # 8-bit arenas: a float32 scale per token row
    itemsize = max(itemsize, 2)  # queries: bfloat16 over 8-bit arenas

    def arena(batch, tokens, copies=1):  # K and V pages of `copies` arenas
        return 2 * copies * kv * batch * -(-tokens // ps) * ps * row

    if jax.default_backend() != "gpu":
        b, c = min(max(k["batches"]), CPU_MAX_BATCH), min(max(k["contexts"]), CPU_MAX_CONTEXT)
        parts = {f"arena (batch {b} x context {c})": arena(b, c), "queries": b * qh * hd * itemsize}
    else:
        b, c = min(k["batches"]), min(k["contexts"])
        parts = {f"smallest point (batch {b} x context {c}, 3 arenas)": arena(b, c, copies=3),
                 f"append (batch {max(k['batches'])} x 512 tokens, 16 arenas)": arena(max(k["batches"]), 512, copies=16)}  # fmt: skip
    flags = "--batches, --contexts, --num-kv-heads, --num-q-heads, --head-dim, --page-size"
    try:
        check_fits(parts, hint=f"lower {flags}")
    except ValueError as exc:
        raise _Fail(str(exc)) from None


def _cmd_tpu_compile_report(args, console, progress) -> dict:
    from arena_jax.benchmarks.compile_report_tpu import (format_bundles_table, format_steps_table, format_tpu_table,
                                                         run_tpu_compile_report)

    console.print(f"[bold]kernels --compile-report --target {args.target}[/bold]: every TPU kernel variant compiled "
                  "with libtpu (XLA + Mosaic), no TPU ...")
    del progress
    try:
        result = run_tpu_compile_report(target=args.target, only=args.only, steps=args.steps)
    except RuntimeError as exc:
        raise _Fail(str(exc)) from None
    meta = result["metadata"]
    print(format_tpu_table(result["rows"]))
    copies = [r["variant"] for r in result["rows"] if r["arena_copies"]]
    console.print(f"  {meta['variants']} variants, jax {meta['jax']}, libtpu {meta['libtpu']}, {meta['wall_s']} s; "
                  f"arena copies: {', '.join(copies) if copies else 'none'}")
    console.print("  VMEM: scoped memory the compiler gave each Mosaic kernel (append: gather/scatter, DMA only); code: "
                  "the module's; DMA plan: the kernels' CostEstimate at the workload (rows at full page-table length); "
                  "XLA bytes: cost analysis of the module (plan + what XLA adds); must move: K/V/scales read or new "
                  "rows written. Static facts, not timings.")
    if result["bundle_rows"]:
        print(format_bundles_table(result["bundle_rows"], result["bundle_figures"]))
        console.print("  one iteration of the innermost loop with MXU ops (ours: decode two blocks of block_k keys of "
                      "every KV head, a chunk one block of one head; JAX paged: pages_per_compute_block x page keys of one head; ragged: a KV "
                      "block of all heads of its head block). Static count: every bundle once, both arms of each "
                      "branch; a nested loop with a constant trip count x that count; a register-bound nested loop "
                      "(reg) not in the iteration but under 'cold bundles' (ours: a row's first / last block or a block "
                      "with a hole; an interior block runs none). 'general-path bundles': the loop around it with MXU "
                      "ops of its own, less it (ours: the blocks the steady-state loop does not take: a row's first and "
                      "last block, the block before a partial one, a chunk's diagonal, a block before a hole; in decode "
                      "two blocks served alone, each by the general or the fast step), static, both arms of each branch. "
                      "issue = bundles / clock, HBM = K + V (+ scales) of the iteration's keys / bandwidth; both per 512 "
                      "keys of one head.")
    if result["steps"]:
        print(format_steps_table(result["steps"]))
    return result


def _cmd_compile_report(args, console, progress) -> dict:
    from arena_jax.benchmarks.compile_report import format_table, run_compile_report

    if getattr(args, "target", "sm90") != "sm90":
        return _cmd_tpu_compile_report(args, console, progress)

    console.print("[bold]kernels --compile-report[/bold]: every kernel variant compiled for sm_90a (H100), no GPU ...")
    del progress
    try:
        result = run_compile_report(via=args.via, only=args.only)
    except RuntimeError as exc:
        raise _Fail(str(exc)) from None
    meta = result["metadata"]
    print(format_table(result["rows"]))
    spills = [r["variant"] for r in result["rows"] if r["spill_stores"] or r["spill_loads"]]
    if any(not r.get("compiled", True) for r in result["rows"]):
        console.print("  mosaic rows: lowered for sm_90a only (Mosaic GPU makes machine code when the kernel first runs "
                      "on a GPU): registers and spills n/a; smem, wgmma and TMA from the lowering (JAX >= 0.11)")
    console.print(
        f"  {len(result['rows'])} kernels ({meta['variants']} variants), jax {meta['jax']}, via {meta['via']}, "
        f"{meta['wall_s']} s; spills: {', '.join(spills) if spills else 'none'}"
    )
    console.print("  smem: Triton's dynamic shared memory + ptxas static, per CTA; CTAs/SM: an sm_90 estimate from "
                  "registers, shared memory and warps (its limiter in brackets). Static facts, not timings.")
    return result


def _cmd_kernels(args, console, progress) -> dict:
    import inspect

    if args.compile_report:
        return _cmd_compile_report(args, console, progress)

    from arena_jax.benchmarks import report

    try:
        from arena_jax.benchmarks.kernels import run_kernel_benchmark
    except ImportError as exc:
        raise _Fail(f"the kernel benchmark is not available in this checkout ({exc})") from None
    wanted = {
        "batches": args.batches,
        "contexts": args.contexts,
        "page_size": args.page_size,
        "repeats": args.repeats,
        "num_q_heads": args.num_q_heads,
        "num_kv_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
    }
    params = inspect.signature(run_kernel_benchmark).parameters
    kwargs = {k: v for k, v in wanted.items() if v is not None}
    unknown = [k for k in kwargs if k not in params and not any(p.kind == p.VAR_KEYWORD for p in params.values())]
    if unknown:
        raise _Fail(f"this kernel benchmark does not take {', '.join('--' + k.replace('_', '-') for k in unknown)}")
    settings = {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}
    settings.update(kwargs)
    if "num_q_heads" in settings and settings["num_q_heads"] % settings["num_kv_heads"]:
        raise _Fail(f"--num-q-heads {settings['num_q_heads']} must be a multiple of --num-kv-heads {settings['num_kv_heads']}")
    _check_kernel_memory(settings)
    if "progress" in params:
        kwargs["progress"] = progress
    console.print("[bold]kernels[/bold]: paged decode attention and append ...")
    try:
        result = run_kernel_benchmark(**kwargs)
    except ValueError as exc:  # e.g. q heads not a multiple of KV heads
        raise _Fail(str(exc)) from None
    if not isinstance(result, dict):
        result = {"rows": list(result)}
    meta = result.get("metadata") or {k: v for k, v in result.items() if not k.endswith("rows")}
    if meta.get("note"):
        console.print(f"  [yellow bold]NOTE: {meta['note']}[/yellow bold]")
    head = [f"{k}: {meta[k]}" for k in ("device", "backend", "timing", "dtype") if meta.get(k) is not None]
    if meta.get("copy_bandwidth_gbps"):
        head.append(f"copy bandwidth (read + write): {meta['copy_bandwidth_gbps']:,.0f} GB/s")
    if meta.get("ratio"):
        head.append(f"ratio = {meta['ratio']}")
    console.print("  " + "; ".join(head))
    if meta.get("workload"):
        console.print(f"  workload: {meta['workload']}")
    for key, title in (("rows", "decode attention"), ("append_rows", "append")):
        rows = result.get(key) or []
        if not rows:
            continue
        numeric = [{k: v for k, v in r.items() if not isinstance(v, str)} for r in rows]
        console.print(report.generic_table(numeric, title))
        for r in rows:
            notes = [f"{k}: {v}" for k, v in r.items() if isinstance(v, str)]
            if notes:
                console.print(f"  batch {r.get('batch')}, context {r.get('context', r.get('tokens'))}: " + "; ".join(notes))
    return result


ACCURACY_PROMPT_MAX = 20  # benchmarks.accuracy.model_accuracy's prompts: 5, 13, 20 and 11 tokens


def _check_attention_memory(batch: int, context: int, q_heads: int, kv_heads: int, head_dim: int) -> None:
    """The attention test's K/V on the host (float32, their float64 copies repeated over the query
    heads for the exact attention, its scores) and on the device (float32 K/V and an arena), an
    estimate, checked before they are drawn."""
    from arena_jax.models.memory import TooLarge, check_fits, host_memory_limit

    kv = batch * context * kv_heads * head_dim
    host = {"K/V (float32)": 2 * kv * 4, "float64 K/V for the exact attention": 2 * kv * 8 + 2 * kv * 8 * (q_heads // kv_heads),
            "scores (float64)": 2 * batch * q_heads * context * 8}  # fmt: skip
    flags = f"--batch {batch}, --context {context}, --heads {q_heads},{kv_heads},{head_dim}"
    try:
        check_fits(host, limit=host_memory_limit(), hint="lower --batch, --context or --heads")
        check_fits({"K/V and a float32 arena": 4 * kv * 4}, hint="lower --batch, --context or --heads")
    except TooLarge as exc:
        raise _Fail(f"{flags}: {exc}") from None


def _cmd_accuracy(args, console, progress) -> dict:
    from arena_jax.benchmarks.accuracy import (FORMATS, PARITY_CONFIGS, AccuracySettings, _model_runs, format_attention_table,
                                     format_model_table, run_accuracy, split_format)

    settings_formats = lambda text: tuple(f for f in text.split(",") if f)  # noqa: E731

    backends = tuple(b for b in args.backends.split(",") if b)
    if not backends or any(b not in ("reference", "pallas") for b in backends):
        raise _Fail(f"--backends {args.backends!r}: a comma-separated list of reference, pallas")
    try:
        q_heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    except ValueError:
        raise _Fail(f"--heads {args.heads!r}: three integers Q,KV,D") from None
    if q_heads < 1 or kv_heads < 1 or q_heads % kv_heads or head_dim < 32 or head_dim % 32 or args.outliers * kv_heads > head_dim:
        raise _Fail(f"--heads {args.heads} --outliers {args.outliers}: query heads a multiple of KV heads, head_dim "
                    "a positive multiple of 32 (int4 groups), outliers x KV heads <= head_dim (the outlier channels "
                    "are drawn distinct across the KV heads)")
    if not args.skip_attention:
        _check_attention_memory(args.batch, args.context, q_heads, kv_heads, head_dim)
    longest = ACCURACY_PROMPT_MAX + args.new_tokens  # the end-to-end test's longest prompt + its new tokens
    positions = min(make().max_position_embeddings for make in PARITY_CONFIGS.values())
    if not args.skip_models and longest > positions:
        raise _Fail(f"--new-tokens {args.new_tokens}: the end-to-end test's longest prompt ({ACCURACY_PROMPT_MAX} tokens) "
                    f"+ {args.new_tokens} = {longest} tokens exceed its models' max_position_embeddings {positions}: "
                    f"at most {positions - ACCURACY_PROMPT_MAX}")
    names = tuple(o for o in args.key_options.split(",") if o)
    if not names or any(o not in ("plain", "rot", "smooth", "smooth+rot", "rot+smooth") for o in names):
        raise _Fail(f"--key-options {args.key_options!r}: one or more of plain, rot, smooth, smooth+rot")
    options = tuple("" if o == "plain" else "+" + o for o in names)
    formats = settings_formats(args.formats)
    if not formats or any(f not in FORMATS for f in formats):
        raise _Fail(f"--formats {args.formats!r}: one or more of {', '.join(FORMATS)}")
    try:
        for fmt in settings_formats(args.model_formats):
            split_format(fmt)
    except ValueError as exc:
        raise _Fail(f"--model-formats: {exc}") from None
    settings = AccuracySettings(context=args.context, new_tokens=args.new_tokens, seed=args.seed,
                                formats=formats, key_options=options,
                                skip_models=args.skip_models, skip_attention=args.skip_attention,
                                model_formats=settings_formats(args.model_formats),
                                model_key_outliers=args.model_key_outliers,
                                model_outlier_queries=args.model_outlier_queries, backends=backends, batch=args.batch,
                                outliers=args.outliers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim)
    steps = (0 if settings.skip_attention else len(settings.outlier_scales)) + (
        0 if settings.skip_models else sum(1 + len(f) for _, _, f in _model_runs(settings)))
    console.print("[bold]accuracy[/bold]: quantized KV arenas (8-bit, int4; keys plain, rotated, smoothed) against float64 "
                  "attention and a bf16 arena ...")
    advance = progress.add_task("accuracy", total=steps) if progress is not None else None
    try:
        result = run_accuracy(settings, advance)
    except ValueError as exc:
        raise _Fail(str(exc)) from None
    finally:
        if progress is not None:
            progress.finish_task()
    if result["attention"]:
        print(f"attention: batch {settings.batch} x {settings.context} cached tokens, {settings.q_heads} query / "
              f"{settings.kv_heads} KV heads, head_dim {settings.head_dim}, one decode query (float32), V ~ N(0, 1); "
              f"error vs float64 attention over the unquantized K/V, per backend ({', '.join(backends)})")
        print(format_attention_table(result["attention"]))
    if result["models"]:
        print()
        quiet = settings.model_outlier_queries == "quiet"
        outliers = (f", keys with one RoPE channel pair per KV head x{settings.model_key_outliers:g} "
                    + ("(q / x there: the same function)" if quiet else "(q as drawn there: those channels dominate the scores)")
                    if settings.model_key_outliers != 1.0 else "")
        print(f"end to end: HF-parity tiny configs, random weights ~N(0, 0.2){outliers}, float32 compute, 4 prompts x "
              f"{settings.new_tokens} greedy tokens; reference = the same model on a bf16 arena")
        print(format_model_table(result["models"]))
    console.print(f"  device {result['device']}; {result['wall_s']:.0f} s. Random-weight models say little about real "
                  "quality: see benchmarks/accuracy.py.")
    return result


def _tour(args, console, progress) -> dict:
    from arena_jax.benchmarks import report

    t0 = time.perf_counter()
    console.soft_wrap = False  # every line within the console's width (80 columns included), wrapped at words
    console.rule("[bold]arena-bench tour[/bold]")
    ns = argparse.Namespace
    layout = _cmd_layout(ns(budget_gib=40.0, page_size=16), console)
    console.print()
    cap_args = ns(model="mistral-7b", lengths=None, rate="auto", page_size=16, headroom=0.25, watermark=0.01, seed=0,
                  host_scheduler=False, **TOUR_CAPACITY)  # fmt: skip
    capacity = _cmd_capacity(cap_args, console, progress)
    console.print()
    dec_args = ns(model="tiny", model_dir=None, warmup=1, page_size=16, dtype=None, seed=0, explain_ratio=True,
                  **TOUR_DECODE)  # fmt: skip
    decode = _cmd_decode(dec_args, console, progress)
    console.print()
    g = capacity["goals"]
    a, cm = capacity["allocators"]["arena"], capacity["allocators"]["contiguous_max"]
    by = {r["model"]: r for r in layout["models"]}
    console.rule("[bold]summary[/bold]")
    lines = [
        f"KV per token (bf16): Mistral-7B {by['mistral-7b']['bytes_per_token']:,} B, Llama-3-8B "
        f"{by['llama3-8b']['bytes_per_token']:,} B, Llama-3-70B {by['llama3-70b']['bytes_per_token']:,} B (KV heads only)",
        f"capacity ({report.fmt_bytes(capacity['settings']['budget_bytes'])}, {capacity['workload']['requests']} requests): "
        f"arena utilization {g['arena_utilization']:.1%} vs {cm['utilization_mean']:.1%} for max-length slabs; "
        f"peak {a['peak_concurrent']} vs {cm['peak_concurrent']} concurrent sequences ({g['capacity_ratio_peak']:.1f}x; "
        f"{g['capacity_ratio_saturated']:.1f}x on average while requests wait); "
        f"goals {'met' if g['arena_utilization_met'] and g['capacity_ratio_met'] else 'NOT all met'}",
        f"decode (tiny model, {decode['device']}): arena {decode['arena']['tokens_per_s']:,.0f} tok/s vs dense "
        f"{decode['dense']['tokens_per_s']:,.0f} tok/s ({decode['speedup_tokens_per_s']:.2f}x); greedy tokens "
        f"{'match' if decode['same_tokens'] else 'MISMATCH'}",
        f"tour finished in {time.perf_counter() - t0:.0f} s. Next: arena-bench capacity --plot capacity.png, "
        "arena-bench decode --model llama3-8b (GPU), arena-bench kernels (GPU)",
    ]
    for line in lines:
        report.note(console, line)
    return {"layout": layout, "capacity": capacity, "decode": decode}


# ---- main ------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    return run(sys.argv[1:] if argv is None else argv, {
        "layout": lambda args, console, progress: _cmd_layout(args, console), "capacity": _cmd_capacity,
        "decode": _cmd_decode, "kernels": _cmd_kernels, "accuracy": _cmd_accuracy, "prefix": _cmd_prefix,
        "swap": _cmd_swap, "serve": _cmd_serve, "speculative": _cmd_speculative, "tour": _tour,
    })
