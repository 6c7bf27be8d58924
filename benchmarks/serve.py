"""`arena-bench serve`: the serving loop against its own step (issue 17).

    arena-bench serve                       # tiny model, batch 8, 128-token prompts, 128 new tokens
    arena-bench serve --json serve.json --layers 2 8 32

Figures, all in one process (a tiny random-weight `LlamaConfig.tiny()`, float32, greedy):
- **Step time**: `generate`'s decode step (`Generation.decode_step_seconds`: the wall time of
  each scheduler iteration that only decoded, over its decode steps) against a bare loop of
  the jitted one-step program (`models.steps.bound_steps`' `decode_step`; and the public
  `models.decode_step`, which flattens the model's state per call, and until session 51 hashed
  its graphdef per call too: `models.model_jit`) run `chunk` steps at a time with
  the tokens fed back on the device and one read back at the end. Three `generate` loops:
  its default (decode blocks of 8 steps per call, run-ahead), one step per call
  (`decode_block=1`, run-ahead), and one step with run-ahead off (`Scheduler.RUN_AHEAD =
  False`: every step read back before the next is planned, the old loop); and a bare loop of
  the block program itself (BLOCK steps a call, no host work between calls but the dispatch).
  Rounds alternate them so that load on a shared machine hits each; medians over every step of
  every round.
  `host_overhead*_ms` = generate's step minus the bare step.
- **Compiles per call** (`benchmarks.compile_count`: programs JAX lowered, i.e. jit cache
  misses): the cold first `generate` call, the same call again, and a call with other prompt
  lengths, fewer prompts and another `max_new_tokens` on the same arena.
- **First-call compile time per depth** (`--layers`): `decode_step` and `prefill` lowered and
  compiled for tiny-width models of each depth (layers under `lax.scan`:
  `benchmarks.studies.layer_scaling.measure`), and the deepest over the shallowest.
- **Persistent compilation cache** (`--compile-cache-runs`): `arena-generate` run twice in fresh
  processes with one `--compile-cache` folder: the first fills it, the second reads it.
- **Poisson arrivals** (`benchmarks.arrivals`): time to first token and inter-token latency
  p50 / p99, mixed steps (`generate(mixed_steps=True)`) vs separate prefill, on the same
  arrivals (`--arrivals-*`; `--arrivals-only` runs this part alone).
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

from arena_jax.benchmarks.runner import _naming, run
from arena_jax.benchmarks.serve_settings import BLOCK, ServeSettings, _other_call

__all__ = ["ServeSettings", "run_serve", "serve_lines"]


def _model(seed: int):
    from arena_jax import models

    return models.init_random(models.LlamaConfig.tiny(), seed=seed)


def _step_times(net, settings: ServeSettings, advance) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import arena_jax as aj
    from arena_jax import models
    from arena_jax.models.scheduler import Scheduler
    from arena_jax.models.steps import bound_steps

    b, p, n = settings.batch, settings.prompt_len, settings.new_tokens
    rng = np.random.default_rng(settings.seed)
    prompts = [rng.integers(0, net.config.vocab_size, p).tolist() for _ in range(b)]
    layout = models.default_layout(net, b, p + n, dtype="float32")

    def gen(ahead, block=None):
        Scheduler.RUN_AHEAD = ahead
        try:
            return models.generate(net, prompts, n, sampling=models.Sampling(stop_tokens=()),
                                   serving=models.Serving(batch_size=b, chunk_size=32, layout=layout, decode_block=block))
        finally:
            Scheduler.RUN_AHEAD = True

    graphdef, state = nnx.split(net)
    bound = bound_steps(graphdef, state)
    slots = jnp.arange(b, dtype=jnp.int32)
    greedy, seed = models.GREEDY.rows(b), jnp.asarray(settings.seed * 0, jnp.int32)

    def bare(kind: str) -> list[float]:
        """Per-step wall time of runs of `chunk` steps of a jitted program ("bound": generate's
        one-step program; "public": `models.decode_step`; "block": generate's block program,
        BLOCK steps a call, whole blocks), tokens fed back on the device."""
        cache = jax.device_put(aj.create(layout), jax.devices()[0])  # committed, as generate's
        out, _ = bound.prefill(bound.leaves, cache, jnp.asarray(prompts, jnp.int32), slots, jnp.full((b,), p, jnp.int32),
                               slots, seed, greedy)  # fmt: skip
        cache, tokens = out.cache, out.tokens
        jax.block_until_ready(tokens)
        times, counts = [], jnp.full((b,), BLOCK, jnp.int32)
        calls = max(1, settings.chunk // BLOCK) if kind == "block" else settings.chunk
        steps = calls * BLOCK if kind == "block" else calls  # per timed run
        for _ in range((n - 1) // steps):
            t0 = time.perf_counter()
            for _ in range(calls):
                if kind == "public":
                    out = models.decode_step(graphdef, state, cache, tokens, slots, slots, seed, greedy)
                elif kind == "block":
                    out, _ = bound.decode_block(bound.leaves, cache, tokens, slots, counts, slots, seed, greedy, length=BLOCK)
                else:
                    out, _ = bound.decode_step(bound.leaves, cache, tokens, slots, slots, seed, greedy)
                cache, tokens = out.cache, out.tokens
            jax.block_until_ready(tokens)
            times.append((time.perf_counter() - t0) / steps)
        return times

    runs = dict(generate=lambda: gen(True, BLOCK), generate_one_step=lambda: gen(True, 1),
                generate_no_run_ahead=lambda: gen(False, 1))  # fmt: skip
    for run in runs.values():  # warm: compile everything once
        run()
    bare("bound"), bare("public"), bare("block")
    rows = {"generate": [], "generate_one_step": [], "generate_no_run_ahead": [], "bare": [], "bare_public": [],
            "bare_block": []}  # fmt: skip
    same, last = True, {}
    round_ratios = {k: [] for k in runs}
    for _ in range(settings.rounds):
        last = {k: run() for k, run in runs.items()}
        times = {k: r.decode_step_seconds for k, r in last.items()}
        times.update(bare=bare("bound"), bare_public=bare("public"), bare_block=bare("block"))
        for k, v in times.items():
            rows[k] += v
        for k in runs:
            round_ratios[k].append(statistics.median(times["bare"]) / statistics.median(times[k]))
        same = same and last["generate"].tokens == last["generate_one_step"].tokens == last["generate_no_run_ahead"].tokens
        advance()
    med = {k: statistics.median(v) for k, v in rows.items()}
    ms = lambda x: round(1e3 * x, 4)  # noqa: E731
    r = last["generate"]
    out = dict(
        batch=b, prompt_len=p, new_tokens=n, rounds=settings.rounds, samples={k: len(v) for k, v in rows.items()},
        bare_step_ms=ms(med["bare"]), bare_public_step_ms=ms(med["bare_public"]), bare_block_step_ms=ms(med["bare_block"]),
        bare_block_over_generate=round(med["bare_block"] / med["generate"], 3),
        decode_block=BLOCK, decode_calls=r.decode_calls, decode_steps=r.decode_steps, run_ahead_steps=r.run_ahead_steps,
        one_step_run_ahead_steps=last["generate_one_step"].run_ahead_steps,
        one_step_decode_calls=last["generate_one_step"].decode_calls,
        same_tokens_as_no_run_ahead=bool(same),
    )  # fmt: skip
    for k in runs:  # generate's step, its ratio to the bare step, per round, and the host's overhead per step
        suffix = "" if k == "generate" else k[len("generate") :]
        out[f"generate{suffix}_step_ms"] = ms(med[k])
        out[f"bare_over_generate{suffix}"] = round(med["bare"] / med[k], 3)
        out[f"per_round_bare_over_generate{suffix}"] = [round(x, 3) for x in round_ratios[k]]
        out[f"median_round_bare_over_generate{suffix}"] = round(statistics.median(round_ratios[k]), 3)
        out[f"host_overhead{suffix}_ms"] = ms(med[k] - med["bare"])
    return out


def _compiles_per_call(settings: ServeSettings) -> dict:
    """A fresh model structure (other depth: nothing of the timing runs is reused) called cold,
    again, then with other lengths on the same arena."""
    import numpy as np

    from arena_jax import models
    from arena_jax.benchmarks.compile_count import CompileCount

    net = models.init_random(models.LlamaConfig.tiny(num_layers=settings.cold_layers), seed=settings.seed)
    b, p, n = settings.batch, settings.prompt_len, settings.new_tokens
    rng = np.random.default_rng(settings.seed + 1)
    layout = models.default_layout(net, b, p + n, dtype="float32")
    calls = [("cold", [p] * b, n), ("same again", [p] * b, n),
             ("other lengths, fewer prompts, other max_new", *_other_call(p, n))]  # fmt: skip
    out = []
    for label, lens, new in calls:
        prompts = [rng.integers(0, net.config.vocab_size, k).tolist() for k in lens]
        with CompileCount() as c:
            t0 = time.perf_counter()
            models.generate(net, prompts, new, sampling=models.Sampling(stop_tokens=()),
                            serving=models.Serving(batch_size=b, layout=layout))
            wall = time.perf_counter() - t0
        out.append(dict(call=label, prompts=len(lens), max_new_tokens=new, programs_compiled=c.programs,
                        compile_s=round(c.seconds, 3), wall_s=round(wall, 3)))  # fmt: skip
    return dict(layout="given (models.default_layout for the longest prompt + max_new_tokens)", calls=out)


def _depth_compiles(settings: ServeSettings, advance) -> list[dict]:
    from arena_jax.benchmarks.studies.layer_scaling import measure

    rows = []
    for layers in settings.layers:
        row = measure(layers, batch=settings.batch, prompt_len=settings.prompt_len, steps=3)
        rows.append({k: row[k] for k in ("layers", "compile_decode_s", "compile_prefill_s", "step_ms_p50")})
        advance()
    return rows


def _persistent_cache(settings: ServeSettings) -> dict:
    """Two fresh `arena-generate` processes sharing one --compile-cache folder."""
    argv = [sys.executable, "-m", "arena_jax.models.cli", "--prompt", "x" * 40, "--batch", str(settings.batch), "--num-prompts", str(settings.batch),
            "--max-new-tokens", "16", "--seed", str(settings.seed)]  # fmt: skip
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for label, extra in (("no cache", ["--no-compile-cache"]), ("cold cache", ["--compile-cache", folder]),
                             ("warm cache", ["--compile-cache", folder])):  # fmt: skip
            t0 = time.perf_counter()
            proc = subprocess.run(argv + extra, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            if proc.returncode:
                raise RuntimeError(f"arena-generate failed ({label}): {proc.stderr[-2000:]}")
            entries = sum(len(files) for _, _, files in os.walk(folder))
            runs.append(dict(run=label, process_wall_s=round(wall, 2), cache_entries=entries))
    saved = runs[1]["process_wall_s"] - runs[2]["process_wall_s"]
    return dict(command=" ".join(["arena-generate"] + argv[3:]), runs=runs, saved_s=round(saved, 2))


def run_serve(settings: ServeSettings, progress=None) -> dict:
    import jax

    from arena_jax.benchmarks.arrivals import ArrivalSettings, measure_arrivals

    arrivals = settings.arrivals if settings.arrivals is not None else ArrivalSettings(seed=settings.seed)
    total = (arrivals.rounds + 1 if arrivals.requests else 0) + (0 if settings.arrivals_only else
                                                                 settings.rounds + len(settings.layers) + 2)  # fmt: skip
    step = progress.add_task("serve", total=total) if progress else None

    def advance():
        if step is not None:
            step()

    t0 = time.perf_counter()
    result = dict(device=str(jax.devices()[0].device_kind), backend=jax.default_backend(), jax=jax.__version__)
    result["arrivals"] = measure_arrivals(arrivals, advance) if arrivals.requests else None
    if settings.arrivals_only:
        result["wall_s"] = round(time.perf_counter() - t0, 1)
        return result
    result["compiles_per_call"] = _compiles_per_call(settings)
    advance()
    result["step"] = _step_times(_model(settings.seed), settings, advance)
    result["compile_by_depth"] = _depth_compiles(settings, advance) if settings.layers else []
    if result["compile_by_depth"]:
        d = result["compile_by_depth"]
        result["deepest_over_shallowest_decode_compile"] = round(d[-1]["compile_decode_s"] / d[0]["compile_decode_s"], 3)
    result["persistent_cache"] = _persistent_cache(settings) if settings.compile_cache_runs else None
    advance()
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    if progress is not None:
        progress.finish_task()
    return result


def serve_lines(result: dict) -> list[str]:
    from arena_jax.benchmarks.arrivals import arrival_lines

    tail = arrival_lines(result["arrivals"]) if result.get("arrivals") else []
    if "step" not in result:  # --arrivals-only
        return tail
    s = result["step"]
    lines = [
        f"decode step, batch {s['batch']}, {s['prompt_len']}-token prompts, tiny model ({result['device']}; medians of "
        f"{s['rounds']} alternated rounds):",
        f"  bare loop of generate's jitted step {s['bare_step_ms']:8.3f} ms   (public models.decode_step: "
        f"{s['bare_public_step_ms']:.3f} ms; bare loop of its block program: {s['bare_block_step_ms']:.3f} ms, "
        f"bare blocks/generate {s['bare_block_over_generate']:.2f})",
        f"  generate (decode blocks of {s['decode_block']})     {s['generate_step_ms']:8.3f} ms   bare/generate "
        f"{s['bare_over_generate']:.2f}   host overhead {s['host_overhead_ms']:+.3f} ms/step",
        f"  generate (one step per call)        {s['generate_one_step_step_ms']:8.3f} ms   bare/generate "
        f"{s['bare_over_generate_one_step']:.2f}   host overhead {s['host_overhead_one_step_ms']:+.3f} ms/step",
        f"  generate (one step, RUN_AHEAD=False) {s['generate_no_run_ahead_step_ms']:7.3f} ms   bare/generate "
        f"{s['bare_over_generate_no_run_ahead']:.2f}   host overhead {s['host_overhead_no_run_ahead_ms']:+.3f} ms/step",
        f"  per-round bare/generate: blocks {s['per_round_bare_over_generate']} (median "
        f"{s['median_round_bare_over_generate']:.2f}); one step {s['per_round_bare_over_generate_one_step']} (median "
        f"{s['median_round_bare_over_generate_one_step']:.2f}); RUN_AHEAD=False "
        f"{s['per_round_bare_over_generate_no_run_ahead']} (median {s['median_round_bare_over_generate_no_run_ahead']:.2f})",
        f"  blocks: {s['decode_steps']} decode steps in {s['decode_calls']} calls ({s['run_ahead_steps']} ran ahead); "
        f"one step: {s['one_step_run_ahead_steps']} of {s['one_step_decode_calls']} calls ran ahead; tokens equal to "
        f"RUN_AHEAD=False: {s['same_tokens_as_no_run_ahead']}",
        "compiles per generate call (programs lowered = jit cache misses):",
    ]
    for c in result["compiles_per_call"]["calls"]:
        lines.append(f"  {c['call']:<45} {c['prompts']} prompts, max_new {c['max_new_tokens']:4d}: "
                     f"{c['programs_compiled']:3d} programs, {c['compile_s']:6.2f} s compiling, {c['wall_s']:6.2f} s wall")
    if result["compile_by_depth"]:
        lines.append("first-call compile time by depth (tiny width, layers under lax.scan):")
        for d in result["compile_by_depth"]:
            lines.append(f"  {d['layers']:3d} layers: decode_step {d['compile_decode_s']:6.2f} s, prefill "
                         f"{d['compile_prefill_s']:6.2f} s, step {d['step_ms_p50']:.2f} ms")
        lines.append(f"  deepest / shallowest decode_step compile: {result['deepest_over_shallowest_decode_compile']:.2f}x")
    pc = result.get("persistent_cache")
    if pc:
        lines.append(f"persistent compilation cache ({pc['command']}, fresh processes):")
        for r in pc["runs"]:
            lines.append(f"  {r['run']:<11} {r['process_wall_s']:6.2f} s ({r['cache_entries']} cache entries)")
        lines.append(f"  a warm cache saves {pc['saved_s']:.2f} s per process")
    return lines + tail


def serve_command(args, console, progress) -> dict:
    """`arena-bench serve`: the parsed flags -> settings, checked, run, printed; the results."""
    from arena_jax.benchmarks.arrivals import ArrivalSettings

    if args.http:
        from arena_jax.benchmarks import report
        from arena_jax.benchmarks.http_serve import HttpSettings, http_lines, run_http

        settings = HttpSettings(model_dir=args.http_model_dir, rates=tuple(args.http_rates), requests=args.http_requests,
                                max_tokens=args.http_max_tokens, repeats=args.http_repeats, max_seqs=args.http_max_seqs,
                                peer=args.http_peer, seed=args.seed)  # fmt: skip
        return report.run_printed(console, "[bold]serve --http[/bold]: arena-serve vs transformers serve, Poisson loads "
                                  "over loopback ...", lambda: run_http(settings, progress), http_lines)  # fmt: skip

    settings = ServeSettings(batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                             chunk=args.chunk, cold_layers=args.cold_layers, rounds=args.rounds, layers=tuple(args.layers),
                             compile_cache_runs=not args.no_compile_cache_runs, seed=args.seed,
                             arrivals=ArrivalSettings(requests=args.arrivals_requests, rounds=args.arrivals_rounds,
                                                      load=args.arrivals_load, model=args.arrivals_model, seed=args.seed,
                                                      short_len=args.arrivals_short_len, long_len=args.arrivals_long_len,
                                                      long_every=args.arrivals_long_every),
                             arrivals_only=args.arrivals_only)  # fmt: skip
    flags = f"--batch {args.batch}, --prompt-len {args.prompt_len}, --new-tokens {args.new_tokens}"
    try:
        settings.validate()
    except ValueError as exc:  # memory.TooLarge included; a layout's own refusal names no flag
        raise _naming(exc, flags) from None
    what = ("Poisson arrivals, mixed steps vs separate prefill" if args.arrivals_only else
            "generate's loop vs its bare jitted step, tiny model; Poisson arrivals, mixed vs separate")  # fmt: skip
    console.print(f"[bold]serve[/bold]: {what} (compiling first) ...")
    try:
        result = run_serve(settings, progress)
    except ValueError as exc:  # as the other subcommands: a size the checks above missed
        raise _naming(exc, flags) from None
    for line in serve_lines(result):
        print(line)
    console.print(f"  ({result['wall_s']:.0f} s)")
    return result


def main(argv=None) -> int:  # python -m arena_jax.benchmarks.serve (the same as arena-bench serve)
    return run(["serve", *(sys.argv[1:] if argv is None else argv)], {"serve": serve_command})


if __name__ == "__main__":
    sys.exit(main())
