"""CLI fuzz: every subcommand of `arena-bench` and `arena-generate` on drawn flag values.

Each draw is a subcommand's tiny base command line (serve, accuracy and kernels have a second:
the arrivals part, the end-to-end part, the compile report) with one to three flags set to a
drawn value (a later occurrence of a flag wins): a bad one (0, negative, nan, inf, past int32,
not a number, an unknown name, an unwritable path, a missing file), an edge one (huge, a page
longer than the sequence, a combination the command ignores or cannot serve) or a tiny good
one. Every invocation runs in-process through the CLI's own `main(argv)` and must end with exit
status 0 or a usage error (argparse's: status 2, `<prog> <cmd>: error: <message naming a
--flag>`); any other exception (a traceback) fails the test with the command line that raised
it. A draw with a bad value must be a usage error.

Two tiers, both seeded (the draws are the same on every run):

- `test_flags_are_refused_before_any_work`: many draws with the work replaced by a probe that
  stops the run where it would allocate (`arena_jax.create` outside a trace, `models.init_random`,
  `models.load_pretrained`, and the accuracy / kernel / compile-report entry points). A draw either
  is refused with a usage error before that point or reaches it; nothing else, and no draw
  runs any longer than `CHECK_DEADLINE_S`.
- `test_tiny_draws_run_to_the_end`: a few draws from the tiny good values only, run for real
  (no probe) on the cheap subcommands; each ends with status 0 or a usage error within
  `RUN_DEADLINE_S`.

A per-invocation deadline (SIGALRM: a draw that hangs fails as such, whatever pytest-timeout's
budget) guards both. More draws (a soak): ARENA_CLI_FUZZ_DRAWS=5000, ARENA_CLI_FUZZ_SEED=N,
ARENA_CLI_FUZZ_REAL=N (real draws per subcommand), ARENA_CLI_FUZZ_REAL_COMMANDS=all (every
subcommand for real; minutes), ARENA_CLI_FUZZ_VERBOSE=1 (print every outcome).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import os
import random
import re
import signal
import time

import jax
import jax.numpy as jnp
import pytest

import arena_jax
from arena_jax import models
from arena_jax.benchmarks import cli as bench_cli
from arena_jax.models import cli as generate_cli
from arena_jax.models import compile_cache

SEED = int(os.environ.get("ARENA_CLI_FUZZ_SEED", "37"))
DRAWS = int(os.environ.get("ARENA_CLI_FUZZ_DRAWS", "1000"))
REAL = int(os.environ.get("ARENA_CLI_FUZZ_REAL", "1"))
REAL_COMMANDS = os.environ.get("ARENA_CLI_FUZZ_REAL_COMMANDS", "layout,capacity,decode,kernels,generate")
VERBOSE = bool(os.environ.get("ARENA_CLI_FUZZ_VERBOSE"))
CHECK_DEADLINE_S = 20.0  # a refusal or the probe, per draw (the first draws import torch / transformers)
RUN_DEADLINE_S = 120.0  # a tiny real run, per draw

# ---- values ---------------------------------------------------------------------------------------

BAD_INT = ["0", "-1", "-2147483648", "2147483648", "99999999999", "1.5", "1e3", "nan", "x", ""]
BAD_FLOAT = ["nan", "inf", "-inf", "-1", "1e309", "x", ""]
HUGE_INT = ["2147483647", "1000000000", "65536"]
BAD_NAME = ["nope", "", "INT8"]


@dataclasses.dataclass(frozen=True)
class Flag:
    name: str
    kind: str  # int, float, rate, choice, bool, list, layers, text, path_in, path_out, dir, dir_out, mesh
    tiny: tuple = ()  # good values whose runs are quick
    edge: tuple = ()  # good types, possibly huge or inconsistent with the other flags
    takes: tuple = ()  # values of the bad pool this flag takes (an int flag's 0)


def _ints(name, tiny, edge=(), takes=()):
    """An integer flag; `takes`: values of BAD_INT this flag takes (e.g. 0)."""
    return Flag(name, "int", tuple(tiny), tuple(edge) + tuple(HUGE_INT), tuple(takes))


def _floats(name, tiny, edge=()):
    return Flag(name, "float", tuple(tiny), tuple(edge) + ("1e300", "1e-300", "0"))


def _choice(name, values):
    return Flag(name, "choice", tuple(values))


def _bool(name):
    return Flag(name, "bool", ("",))


# Paths are relative to the test's tmp folder: "{tmp}" is replaced when drawn.
OUT_PATHS = ("{tmp}/out/x.json",)  # {tmp}/out exists (_fixtures); a missing folder is refused, not created
BAD_OUT_PATHS = ("/proc/version", "/proc/no/such/place.json", "{tmp}", "{tmp}/lengths.csv/x.json", "{tmp}/missing/x.json")


def _common(plot: bool):
    flags = [Flag("--json", "path_out", OUT_PATHS)]
    if plot:
        flags.append(Flag("--plot", "path_out", ("{tmp}/out/x.png",)))
    return flags


MODELS = ("tiny", "tiny-gqa", "tiny-gemma3", "tiny-qwen3")
BIG_MODELS = ("mistral-7b", "llama3-8b", "llama3-70b", "gemma3-1b")
DTYPES = ("float32", "bfloat16", "float16")
KV_DTYPES = ("bfloat16", "float16", "float32", "int8", "float8_e4m3fn", "float8_e5m2")

# 128 MiB of Mistral-7B KV (tests/test_bench.py's capacity settings, fewer requests).
CAPACITY_BASE = ["--budget-gib", "0.125", "--max-seq-len", "256", "--max-seqs", "32", "--requests", "10"]
DECODE_BASE = ["--batch", "2", "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1", "--num-layers", "1",
               "--hf", "off"]  # fmt: skip
PREFIX_BASE = ["--conversations", "2", "--turns", "2", "--system-prompts", "1", "--system-len", "8", "--user-len", "4",
               "--new-tokens", "3", "--num-pages", "6", "--chunk-size", "8", "--batch", "2"]  # fmt: skip
SWAP_BASE = ["--requests", "3", "--prompt-len", "8", "--new-tokens", "4", "--batch", "2", "--chunk-size", "8",
             "--repeats", "1"]  # fmt: skip
SERVE_BASE = ["--batch", "1", "--prompt-len", "20", "--new-tokens", "12", "--rounds", "1", "--chunk", "2", "--layers",
              "--no-compile-cache-runs", "--cold-layers", "2", "--arrivals-requests", "0"]  # fmt: skip
ACCURACY_BASE = ["--context", "16", "--batch", "1", "--heads", "4,2,64", "--outliers", "1", "--formats", "int4",
                 "--key-options", "rot", "--backends", "reference", "--skip-models"]  # fmt: skip
KERNELS_BASE = ["--batches", "1", "--contexts", "64", "--repeats", "1"]
GENERATE_BASE = ["--prompt", "hello arena", "--max-new-tokens", "4", "--batch", "2", "--num-pages", "4",
                 "--chunk-size", "8", "--max-seq-len", "32"]  # fmt: skip

SPECS = {
    "tour": ([], _common(False)),
    "layout": ([], [
        _floats("--budget-gib", ("0.125", "1", "40"), ("1048576", "1e-9")),
        _ints("--page-size", ("1", "16", "256"), ("3000",)),
        _choice("--kv-dtype", KV_DTYPES + ("int4",)),
        *_common(False),
    ]),
    "capacity": (CAPACITY_BASE, [
        _choice("--model", BIG_MODELS),
        _floats("--budget-gib", ("0.125", "0.25"), ("1048576", "0.001")),
        _ints("--requests", ("1", "5"), ("100000",)),
        Flag("--lengths", "path_in", ("{tmp}/lengths.csv",), ("{tmp}/long.csv", "{tmp}/bad.csv", "{tmp}/missing.csv",
                                                              "{tmp}", "/proc/self/mem")),
        Flag("--rate", "rate", ("auto", "0", "0.3", "2"), ("1e-300", "1e300", "1e-9")),
        _ints("--max-seq-len", ("64", "256"), ("2", "3000", "1")),
        _ints("--page-size", ("8", "16", "32"), ("3000", "257", "1")),
        _ints("--max-seqs", ("4", "32"), ("1",)),
        _floats("--headroom", ("0.25", "1")),
        Flag("--watermark", "float", ("0", "0.01", "0.5"), ("0.999999", "1")),
        _ints("--seed", ("0", "3"), takes=("0",)),
        _bool("--host-scheduler"),
        _choice("--kv-dtype", KV_DTYPES + ("int4",)),
        *_common(True),
    ]),
    "decode": (DECODE_BASE, [
        _choice("--model", MODELS),
        Flag("--model-dir", "dir", (), ("{tmp}/missing", "{tmp}/empty", "{tmp}/lengths.csv")),
        _ints("--num-layers", ("1", "2")),
        _bool("--no-scan-layers"),
        _bool("--scan-layers"),
        _ints("--batch", ("1", "2")),
        _ints("--prompt-len", ("1", "8")),
        _ints("--new-tokens", ("2", "3"), ("1", "600")),
        _ints("--repeats", ("1",)),
        _ints("--warmup", ("1",)),
        _ints("--page-size", ("4", "16"), ("3000",)),
        _choice("--dtype", DTYPES),
        _choice("--kv-dtype", KV_DTYPES),
        _ints("--seed", ("0", "5"), takes=("0",)),
        Flag("--mesh", "mesh", (), ("tp=1", "dp=2", "tp=8", "dp=1,tp=1")),
        Flag("--hf", "choice", ("off",), ("on", "auto")),
        _ints("--hf-threads", ("1",)),
        *_common(True),
    ]),
    "kernels": (KERNELS_BASE, [
        Flag("--batches", "list", ("1", "1,2"), ("1,99999999999", "4096")),
        Flag("--contexts", "list", ("64", "16,64"), ("1", "100000000")),
        _ints("--page-size", ("16", "8"), ("3000",)),
        _ints("--repeats", ("1",)),
        _ints("--num-q-heads", ("8",), ("3", "200000000")),
        _ints("--num-kv-heads", ("8", "2"), ("3", "200000000")),
        _ints("--head-dim", ("128", "64"), ("3", "1")),
        _choice("--dtype", KV_DTYPES),
        Flag("--compile-report", "bool", (), ("",)),
        Flag("--via", "choice", (), ("xla", "plugin")),
        Flag("--only", "text", (), ("append-decode bf16", "")),
        Flag("--target", "choice", (), ("sm90", "tpu-v5e", "tpu-v6e")),
        Flag("--steps", "bool", (), ("",)),
        *_common(True),
    ]),
    "accuracy": (ACCURACY_BASE, [
        _ints("--context", ("16", "8"), ("2000000000",)),
        _ints("--new-tokens", ("2",), ("300", "2000000000")),
        _ints("--seed", ("0",), takes=("0",)),
        Flag("--skip-models", "bool", (), ("",)),
        Flag("--skip-attention", "bool", (), ("",)),
        Flag("--model-formats", "text", (), ("int8", "", "int8+rot", "bfloat16+rot", "int9", ",")),
        Flag("--model-key-outliers", "float", (), ("20", "1")),
        Flag("--model-outlier-queries", "choice", (), ("quiet", "loud")),
        Flag("--formats", "text", ("int4", "int8"), ("", "int9", "int8,,int4", "bfloat16")),
        Flag("--key-options", "text", ("rot", "plain"), ("", "rotate", "smooth+rot,plain")),
        _ints("--batch", ("1",), ("100000000",)),
        _ints("--outliers", ("1", "0"), ("32", "33", "64"), takes=("0",)),
        Flag("--heads", "text", ("4,2,64",), ("4,3,64", "4,2,0", "4,2,16", "4,2", "0,0,32", "4,2,64,1", "x",
                                              "2000000000,1,32", "1,1,2147483616")),
        Flag("--backends", "text", ("reference",), ("pallas", "", "reference,", "gpu")),
        *_common(False),
    ]),
    "prefix": (PREFIX_BASE, [
        _choice("--model", MODELS),
        Flag("--model-dir", "dir", (), ("{tmp}/missing", "{tmp}/empty")),
        _ints("--num-layers", ("1",)),
        _choice("--dtype", DTYPES),
        _ints("--system-prompts", ("1", "2")),
        _ints("--system-len", ("8", "16"), ("600",)),
        _ints("--conversations", ("2",)),
        _ints("--turns", ("1", "2")),
        _ints("--user-len", ("1", "4")),
        _ints("--new-tokens", ("1", "3")),
        _ints("--batch", ("1", "2")),
        _ints("--chunk-size", ("8", "64")),
        _ints("--page-size", ("8", "16"), ("3000",)),
        _ints("--num-pages", ("6", "12"), ("1",)),
        _floats("--budget-gib", ("0.001",), ("1048576", "1e-9")),
        _ints("--repeats", ("1",)),
        _ints("--seed", ("0",), takes=("0",)),
        _ints("--host-pages", ("0", "4"), takes=("0",)),
        *_common(True),
    ]),
    "swap": (SWAP_BASE, [
        _choice("--model", MODELS),
        Flag("--model-dir", "dir", (), ("{tmp}/missing", "{tmp}/empty")),
        _ints("--num-layers", ("1",)),
        _choice("--dtype", DTYPES),
        _ints("--requests", ("2", "3")),
        _ints("--prompt-len", ("1", "8"), ("600",)),
        _ints("--new-tokens", ("1", "4")),
        _ints("--batch", ("1", "2")),
        _ints("--chunk-size", ("8",)),
        _ints("--page-size", ("8", "16"), ("3000",)),
        _ints("--num-pages", ("2", "4"), ("1",)),
        _ints("--host-pages", ("4",), ("1",)),
        _floats("--bandwidth-gbps", ("25",)),
        _floats("--prefill-rate", ("1000",)),
        _ints("--repeats", ("1",)),
        _ints("--seed", ("0",), takes=("0",)),
        *_common(False),
    ]),
    "serve": (SERVE_BASE, [
        _ints("--batch", ("1", "2")),
        _ints("--prompt-len", ("20", "8"), ("1", "2", "600")),
        _ints("--new-tokens", ("12", "10"), ("2", "600")),
        _ints("--chunk", ("2", "1"), ("16", "100")),
        _ints("--cold-layers", ("2",), ("2000000000",)),
        _ints("--rounds", ("1",)),
        Flag("--layers", "layers", ("",), ("1 2", "2000000000", "0")),
        _bool("--no-compile-cache-runs"),
        _choice("--arrivals-model", ("tiny", "mid")),
        _ints("--arrivals-requests", ("0",), ("3", "1"), takes=("0",)),
        _ints("--arrivals-rounds", ("1",)),
        _ints("--arrivals-short-len", ("8",), ("2", "600")),
        _ints("--arrivals-long-len", ("40",), ("600",)),
        _ints("--arrivals-long-every", ("2",), ("1",)),
        Flag("--arrivals-load", "float", ("0.7",), ("10", "10.5", "0")),
        _bool("--arrivals-only"),
        _ints("--seed", ("0",), takes=("0",)),
        *_common(False),
    ]),
}
# The same flags again on another base: the part of the run the first base leaves out.
SPECS["serve --arrivals-only"] = (["--arrivals-only", "--arrivals-requests", "3", "--arrivals-rounds", "1",
                                   "--arrivals-short-len", "8", "--arrivals-long-len", "40", "--arrivals-long-every", "2"],
                                  SPECS["serve"][1])  # fmt: skip
SPECS["accuracy --skip-attention"] = (["--skip-attention", "--new-tokens", "2", "--model-formats", "int8"],
                                      SPECS["accuracy"][1])  # fmt: skip
SPECS["kernels --compile-report"] = (["--compile-report", "--only", "append-decode bf16"], SPECS["kernels"][1])
GENERATE_SPEC = (GENERATE_BASE, [
    Flag("--model-dir", "dir", (), ("{tmp}/missing", "{tmp}/empty", "{tmp}/lengths.csv")),
    _choice("--model", tuple(sorted(generate_cli.TINY_MODELS))),
    Flag("--prompt", "text", ("hello arena", "x"), ("", "x" * 600, "\u00e9\u00e9 arena")),
    _ints("--num-prompts", ("1", "3")),
    _ints("--max-new-tokens", ("1", "4"), ("600",)),
    _bool("--ignore-eos"),
    _ints("--batch", ("1", "2")),
    _ints("--chunk-size", ("8", "64")),
    _ints("--page-size", ("8", "16"), ("3000", "64")),
    _ints("--num-pages", ("4", "8"), ("1",)),
    _ints("--max-seq-len", ("32", "64"), ("1", "3000")),
    _floats("--temperature", ("0", "0.8")),
    _ints("--top-k", ("5",), ("1000",)),
    Flag("--top-p", "float", ("0.9",), ("1", "0")),
    _ints("--seed", ("0", "3"), takes=("0",)),
    _bool("--prefix-cache"),
    _ints("--host-pages", ("0", "4"), takes=("0",)),
    _choice("--dtype", DTYPES),
    _bool("--no-scan-layers"),
    _choice("--kv-dtype", KV_DTYPES + ("int4",)),  # int4: tiny-qwen3 (head_dim 32) runs it, the others are refused
    Flag("--compile-cache", "dir_out", ("{tmp}/cc",), ("{tmp}/cc/deeper/still", "/proc/no/cache", "/proc/version",
                                                        "{tmp}/lengths.csv", "")),
    _bool("--no-compile-cache"),
    _bool("--mixed-steps"),
    _ints("--token-budget", ("40",), ("5",)),
    _ints("--decode-block", ("1", "8"), ("1024", "1025")),
])


def _bad_values(flag: Flag) -> list[str]:
    kind = flag.kind
    if kind == "int":
        return BAD_INT
    if kind in ("float", "rate"):
        return BAD_FLOAT
    if kind == "choice":
        return BAD_NAME
    if kind == "list":
        return ["", "0", "-1", "1,x", "1.5", ","]
    if kind == "mesh":
        return ["tp=0", "x", "tp=", "dp=2,dp=2", "tp=-1"]
    if kind == "layers":
        return ["-1", "x", "1.5"]
    if kind == "path_out":
        return list(BAD_OUT_PATHS)
    if kind == "dir_out":
        return ["", "/proc/no/cache", "/proc/version", "{tmp}/lengths.csv", "{tmp}/lengths.csv/cache"]
    if kind in ("path_in", "dir"):
        return ["{tmp}/missing.csv", "/proc/no/such/file"]
    return []  # bool, text: no bad value of their own (edge values cover them)


def _draw(rng: random.Random, spec, tiny_only: bool = False) -> tuple[list[str], bool]:
    """(argv, whether a bad value was drawn: then the command must refuse it)."""
    base, flags = spec
    argv, bad = list(base), False
    for flag in rng.sample(flags, k=min(len(flags), rng.choice((1, 1, 2, 3)))) if flags else []:
        pools = [("tiny", list(flag.tiny))]
        if not tiny_only:
            pools += [("edge", list(flag.edge)), ("bad", [v for v in _bad_values(flag) if v not in flag.takes])]
        pools = [(k, v) for k, v in pools if v]
        if not pools:
            continue
        pool, values = rng.choice(pools)
        value = rng.choice(values)
        bad = bad or pool == "bad"
        if flag.kind == "bool":
            argv.append(flag.name)
        elif flag.kind == "layers":
            argv += [flag.name, *value.split()]
        else:
            argv += [flag.name, value]  # a later occurrence wins (argparse): the base's value is replaced
    return argv, bad


# ---- running one command line -----------------------------------------------------------------------


class _ReachedWork(Exception):
    """The probe: the command got past its checks to the first allocation."""


class _Deadline(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: float, argv):
    """SIGALRM after `seconds`; the previous handler and the rest of its timer (pytest-timeout's)
    are put back afterwards."""

    def fire(signum, frame):
        raise _Deadline(f"{' '.join(argv)!r} ran past its {seconds:.0f} s deadline")

    old_handler = signal.signal(signal.SIGALRM, fire)
    old_delay, old_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_handler)
        if old_delay:
            signal.setitimer(signal.ITIMER_REAL, max(old_delay - (time.monotonic() - t0), 0.001), old_interval)


def _invoke(main, argv, seconds: float) -> tuple[str, str]:
    """('ok' | 'usage' | 'work', stderr). Anything else raises, naming the command line."""
    err = io.StringIO()
    try:
        with _deadline(seconds, argv), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    except _ReachedWork:
        return "work", err.getvalue()
    except _Deadline:
        raise
    except BaseException as exc:  # a traceback: the test's failure
        raise AssertionError(f"{' '.join(argv)!r} raised {type(exc).__name__}: {exc}") from exc
    message = err.getvalue()
    if code == 0:
        return "ok", message
    assert code == 2, f"{' '.join(argv)!r} exited {code!r}: {message[-2000:]}"
    assert "Traceback" not in message, f"{' '.join(argv)!r}: {message[-2000:]}"
    last = message.strip().splitlines()[-1] if message.strip() else ""
    assert re.search(r": error: .*--[a-z]", last), f"{' '.join(argv)!r}: the usage error names no flag: {last!r}"
    return "usage", message


def _fixtures(tmp) -> None:
    """Files the drawn paths name."""
    (tmp / "empty").mkdir(exist_ok=True)
    (tmp / "out").mkdir(exist_ok=True)  # --json / --plot's folder
    (tmp / "lengths.csv").write_text("prompt_len,output_len\n30,40\n5,20\n60,10\n")
    (tmp / "long.csv").write_text("prompt_len,output_len\n30,40\n300,20\n")  # a prompt longer than --max-seq-len 256
    (tmp / "bad.csv").write_text("prompt_len,output_len\n10,abc\n")


def _fill(argv, tmp) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


@pytest.fixture
def quiet_caches(monkeypatch):
    """No persistent compilation cache: arena-bench's off, arena-generate's never set in this process."""
    monkeypatch.setenv(bench_cli.CACHE_ENV, "")
    monkeypatch.setattr(compile_cache, "enable", lambda *args, **kwargs: None)


@pytest.fixture
def probes(monkeypatch):
    """Every first allocation of a run raises _ReachedWork."""

    def probe(*args, **kwargs):
        raise _ReachedWork

    create = arena_jax.create

    def create_probe(*args, **kwargs):  # traced (models.memory.cache_bytes sizes an arena that way): no allocation
        if isinstance(jnp.zeros(()), jax.core.Tracer):
            return create(*args, **kwargs)
        raise _ReachedWork

    monkeypatch.setattr(arena_jax, "create", create_probe)
    monkeypatch.setattr(models, "init_random", probe)
    monkeypatch.setattr(models, "load_pretrained", probe)
    from arena_jax.benchmarks import accuracy, compile_report, compile_report_tpu, kernels

    for module, name in ((accuracy, "run_accuracy"), (kernels, "run_kernel_benchmark"),
                         (compile_report, "run_compile_report"), (compile_report_tpu, "run_tpu_compile_report")):  # fmt: skip
        def stand_in(*args, **kwargs):
            raise _ReachedWork

        monkeypatch.setattr(module, name, functools.wraps(getattr(module, name))(stand_in))  # its signature (cli inspects it)


def _commands():
    return [("arena-bench " + name, bench_cli.main, [name.split()[0]], spec) for name, spec in SPECS.items()] + [
        ("arena-generate", generate_cli.main, [], GENERATE_SPEC)]


def test_flags_are_refused_before_any_work(tmp_path, quiet_caches, probes):
    _fixtures(tmp_path)
    rng = random.Random(SEED)
    commands = _commands()
    seen = {name: {"usage": 0, "work": 0, "ok": 0} for name, *_ in commands}
    failures = []
    t0 = time.perf_counter()
    for i in range(DRAWS):
        name, main, head, spec = rng.choice(commands)
        drawn, bad = _draw(rng, spec)
        argv = head + _fill(drawn, tmp_path) + (["--no-progress"] if head else [])
        try:
            outcome, message = _invoke(main, argv, CHECK_DEADLINE_S)
        except (AssertionError, _Deadline) as exc:
            failures.append(str(exc).splitlines()[0][:1500])
            continue
        seen[name][outcome] += 1
        if bad and outcome != "usage":
            failures.append(f"{outcome}: {' '.join(argv)!r} (a bad value, not refused)")
        if VERBOSE:
            print(f"{outcome:5} {' '.join(argv)!r} {message.strip().splitlines()[-1] if outcome == 'usage' else ''}")
    wall = time.perf_counter() - t0
    print(f"{DRAWS} draws in {wall:.1f} s: " + "; ".join(f"{k} {v}" for k, v in seen.items()))
    for line in failures:
        print("FAIL", line)
    assert not failures, f"{len(failures)} of {DRAWS} draws failed:\n" + "\n".join(failures)
    for name, counts in seen.items():
        assert sum(counts.values()) > 0, f"no draw of {name}"


def test_tiny_draws_run_to_the_end(tmp_path, quiet_caches):
    _fixtures(tmp_path)
    rng = random.Random(SEED + 1)
    wanted = set(REAL_COMMANDS.split(","))
    for name, main, head, spec in _commands():
        short = "generate" if name == "arena-generate" else name.split()[1]  # "capacity", ..., "generate"
        if ("all" not in wanted and short not in wanted) or "--compile-report" in name:  # (minutes with the tooling)
            continue
        ran = 0
        for _ in range(10 * REAL):  # draws refused (tiny values may contradict each other) cost nothing: draw again
            argv = head + _fill(_draw(rng, spec, tiny_only=True)[0], tmp_path) + (["--no-progress"] if head else [])
            t0 = time.perf_counter()
            outcome, message = _invoke(main, argv, RUN_DEADLINE_S)
            print(f"{outcome:5} {time.perf_counter() - t0:5.1f} s {' '.join(argv)!r}")
            assert outcome in ("ok", "usage"), outcome
            ran += outcome == "ok"
            if ran == REAL:
                break
        assert ran == REAL, f"{name}: {ran} of {REAL} tiny draws ran (the others were refused)"
