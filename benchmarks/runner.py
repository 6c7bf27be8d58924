"""Running one `arena-bench` subcommand: how is a command line checked, run and written out?

`run(argv, commands)` parses with `arguments.build_parser`, refuses before any work what the run
would not do (unwritable --json / --plot paths, a missing folder included: none is created;
contradicting or ignored flags: usage errors, exit status 2), runs the subcommand's function
from `commands` under a console and a progress bar, then writes --plot and --json. `_Fail`
and its helpers are the usage errors a subcommand finds after parsing. Below the subcommands:
`cli` gives it all of them, `serve.main` its own.
"""
from __future__ import annotations

import os

from arena_jax.benchmarks.arguments import build_parser
from arena_jax.benchmarks.compile_cache import init_compile_cache

__all__ = ["run"]


def _unwritable(path: str) -> str | None:
    """Why `path` cannot be written, or None. Its folder must exist (no folder is created: a
    typo in it would otherwise leave new folders behind); the file is really opened (as root,
    os.access says yes to read-only mounts and /proc); a file the probe created is removed again."""
    if os.path.isdir(path):
        return "is a folder"
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.lexists(folder) else "does not exist"
        return f"the folder {folder} {what}; arena-bench creates no folders"
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):  # append: an existing file is left as it is
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        if not existed and os.path.lexists(path):
            os.remove(path)
    return None


class _Fail(Exception):
    """A user-facing error found after parsing: printed as `arena-bench <cmd>: error: ...`, exit 2."""


def _naming(exc: Exception, flags: str) -> _Fail:
    """`exc` as a usage error that names the flags: its message as it is where it names one,
    else after `flags` (the flags that size the run)."""
    text = str(exc)
    return _Fail(text if "--" in text else f"{flags}: {text}")


def _given(args, parser, dests) -> list[str]:
    """The flags among `dests` (argparse dests) whose value is not their default: given by the user."""
    return ["--" + d.replace("_", "-") for d in dests if getattr(args, d, None) != parser.get_default(d)]


def _ignored(args, parser, dests, why: str) -> None:
    """Refuse flags the run would ignore (`why`: when it does), rather than drop them silently."""
    given = _given(args, parser, dests)
    if given:
        raise _Fail(f"{', '.join(given)} {'has' if len(given) == 1 else 'have'} no effect {why}")


# ---- flags the run would ignore ------------------------------------------------------------------------

KERNEL_TIMING_FLAGS = ("batches", "contexts", "page_size", "repeats", "num_q_heads", "num_kv_heads", "head_dim", "dtype",
                       "plot")  # fmt: skip
KERNEL_REPORT_FLAGS = ("via", "only", "target", "steps")
ATTENTION_FLAGS = ("context", "batch", "outliers", "heads", "backends", "formats", "key_options")
MODEL_FLAGS = ("new_tokens", "model_formats", "model_key_outliers", "model_outlier_queries")
SERVE_STEP_FLAGS = ("batch", "prompt_len", "new_tokens", "chunk", "cold_layers", "rounds", "layers", "no_compile_cache_runs")
SERVE_ARRIVAL_FLAGS = ("arrivals_model", "arrivals_rounds", "arrivals_short_len", "arrivals_long_len",
                       "arrivals_long_every", "arrivals_load")  # fmt: skip


def _check_combinations(command: str, args, parser) -> None:
    """Flags that contradict each other, or that the run would drop without a word: usage errors."""
    if command in ("decode", "prefix", "swap") and args.model_dir:
        _ignored(args, parser, ("model", "num_layers"), "with --model-dir (the checkpoint is the model)")
    if command == "kernels":
        if args.compile_report:
            _ignored(args, parser, KERNEL_TIMING_FLAGS, "with --compile-report (it compiles the kernels' own variants)")
            if args.steps and args.target == "sm90":
                raise _Fail("--steps compiles the TPU model steps: give it with --target tpu-v5e or tpu-v6e")
            if args.target != "sm90":
                _ignored(args, parser, ("via",), f"with --target {args.target} (it picks the sm_90a compiler)")
        else:
            _ignored(args, parser, KERNEL_REPORT_FLAGS, "without --compile-report")
    elif command == "accuracy":
        if args.skip_models and args.skip_attention:
            raise _Fail("--skip-models with --skip-attention measures nothing")
        if args.skip_attention:
            _ignored(args, parser, ATTENTION_FLAGS, "with --skip-attention")
        if args.skip_models:
            _ignored(args, parser, MODEL_FLAGS, "with --skip-models")
        if args.model_key_outliers == 1.0:
            _ignored(args, parser, ("model_outlier_queries",), "without --model-key-outliers (other than 1)")
    elif command == "serve":
        if args.arrivals_only:
            _ignored(args, parser, SERVE_STEP_FLAGS, "with --arrivals-only")
        if args.arrivals_requests == 0:
            _ignored(args, parser, SERVE_ARRIVAL_FLAGS, "with --arrivals-requests 0 (no arrivals run)")


# ---- run ---------------------------------------------------------------------------------------------


def run(argv, commands: dict) -> int:
    """`arena-bench ARGV`: parse, refuse what the run cannot do (exit 2), run the subcommand with
    `commands[name](args, console, progress) -> results` ("tour" when none is named), then write
    --plot and --json. The exit status."""
    parser = build_parser()
    argv = list(argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["tour", *argv]  # bare `arena-bench [--json PATH ...]`: the tour
    args = parser.parse_args(argv)
    command = args.command
    sub_parser = parser.subcommands[command]
    for flag in ("json", "plot"):  # before the run, not after it
        path = getattr(args, flag, None)
        why = _unwritable(path) if path else None
        if why:
            sub_parser.error(f"--{flag} {path}: cannot write there ({why})")
    try:
        _check_combinations(command, args, sub_parser)
    except _Fail as exc:
        sub_parser.error(str(exc))

    from arena_jax.benchmarks import report

    init_compile_cache()
    console = report.make_console()
    arguments = {k: v for k, v in vars(args).items()}
    arguments["command"] = command
    try:
        with report.BenchProgress(console, enabled=not args.no_progress) as progress:
            results = commands[command](args, console, progress)
    except _Fail as exc:
        sub_parser.error(str(exc))  # exits 2
    except KeyboardInterrupt:
        report.eprint("arena-bench: interrupted")
        return 130

    if getattr(args, "plot", None):
        wrote = True
        if command == "capacity":
            report.plot_capacity(results, args.plot)
        elif command == "decode":
            report.plot_decode(results, args.plot)
        elif command == "kernels":
            wrote = report.plot_kernels(results.get("rows") or [], args.plot)
        elif command == "prefix":
            report.plot_prefix(results, args.plot)
        console.print(f"  plot: {args.plot}" if wrote else "  (no plot: the rows have no context/time columns)")
    if args.json:
        report.write_json(args.json, {**report.metadata(command, arguments), "results": results})
        console.print(f"  json: {args.json}")
    return 0
