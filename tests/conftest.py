"""Hypothesis profiles for the model-based tests, and a report of how many ops they ran.

    pytest                                              profile "arena": the CI budget
    HYPOTHESIS_PROFILE=soak pytest tests/test_allocator_model.py -s    a long soak
    (ARENA_SOAK_EXAMPLES=N sets its examples; each runs 8-30 ops)
    HYPOTHESIS_PROFILE=find ...                         the CI budget, no shrinking: does a
                                                        (deliberately injected) bug get caught?
"""
from __future__ import annotations

import os

# The suite compiles at XLA's backend optimization level 0: LLVM's code generation effort only.
# The optimized HLO is the same (compared on JAX 0.10.2 and 0.11.2: a tiny model's decode step,
# prefill, release and fork over f32 / int8 / int4 arenas and the Pallas attention kernel in
# interpret mode, 13 programs, identical text; tests/test_ci_lines.py checks the decode step),
# so every program, its fusions, its buffer donation and aliasing are what a user compiles.
# Compiles take 35-40% less time (most of the suite's time); tiny steps run slower. That lets
# CI run the whole suite on both JAX lines (docs/testing.md, "The JAX versions, the optimization level"). An XLA_FLAGS that names
# its own level wins: XLA_FLAGS=--xla_backend_optimization_level=3 pytest tests the default.
# (Set before JAX starts a backend: XLA reads XLA_FLAGS once. The sm_90a compile checks pin the
# default level in their own compile options, pallas_kernels/offline/sm90.py; the TPU compile checks need
# no pin: a v6e decode step compiled to the same module text at either level.)
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
LEVEL_FROM_USER = "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
if not LEVEL_FROM_USER:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from jax._src import xla_bridge  # noqa: E402

assert not xla_bridge.backends_are_initialized(), "a JAX backend started before tests/conftest.py set XLA_FLAGS"

# A persistent compilation cache for the run: a fresh folder (removed at the end), shared with the
# run's child processes (the 8-device checks) through ARENA_TEST_COMPILE_CACHE; =off: none; a
# folder: that one. The module fixture below clears JAX's in-memory caches after each module, so
# a program another module compiled already (a tiny model's steps) would be compiled again;
# with the folder it is read back instead (py313, 4 model-test files in one run: 10% less CPU).
# Keys hold the program, the compile options and XLA_FLAGS: only an identical compile is shared.
# Modules that read what a compile dumps (`xla_dump_to`: the sm_90a PTX, the level-0 check) or
# that report compiles (arena-bench) write nothing there, so their compiles are never read back.
NO_CACHE_WRITES = {"test_compile_sm90", "test_compile_tpu", "test_mosaic_decode", "test_bench", "test_ci_lines",
                   "test_cli_fuzz", "test_generate_cli"}
_NEVER = 1e9  # seconds: a compile-time threshold nothing reaches (no entry written)
_OWN_CACHE = None
COMPILE_CACHE = os.environ.get("ARENA_TEST_COMPILE_CACHE", "")
if COMPILE_CACHE.lower() == "off":
    COMPILE_CACHE = None
elif not COMPILE_CACHE:
    import tempfile

    COMPILE_CACHE = _OWN_CACHE = os.environ["ARENA_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="arena-test-jax-cache-")
if COMPILE_CACHE:
    jax.config.update("jax_compilation_cache_dir", COMPILE_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


MODEL_EXAMPLES = int(os.environ.get("ARENA_MODEL_EXAMPLES", "60"))
settings.register_profile("arena", max_examples=MODEL_EXAMPLES, **_COMMON)
settings.register_profile("soak", max_examples=int(os.environ.get("ARENA_SOAK_EXAMPLES", "5000")), **_COMMON)
settings.register_profile("find", max_examples=int(os.environ.get("ARENA_MODEL_EXAMPLES", "60")),
                          phases=[Phase.explicit, Phase.generate], **_COMMON)  # fmt: skip
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "arena"))


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_after_each_module(request):
    """Drop JAX's compiled programs after every test module. On jaxlib 0.10.2, one pytest process
    running the suite's files in order up to tests/test_mixed.py segfaulted inside XLA CPU's
    compile of a prefill in `test_mixed_steps_with_a_prefix_cache`, 3 runs of 3 (either half of
    the files before it, or that file alone, passed); with the caches cleared after each module
    the same run passed. It depends on what the process compiled before, so it is JAX's (a
    compiler must not crash on a valid program) and not reduced to a small repro; docs/testing.md.
    Not 0.10.2's alone: on jaxlib 0.11.2 the whole suite without the clearing segfaulted too, in
    tests/test_kernels_tpu.py's compile of a TPU kernel in interpret mode (2026-11-27)."""
    if COMPILE_CACHE:
        jax.config.update("jax_compilation_cache_dir", COMPILE_CACHE)  # (arena-bench points it at its own)
        no_writes = request.module.__name__.rpartition(".")[2] in NO_CACHE_WRITES
        jax.config.update("jax_persistent_cache_min_compile_time_secs", _NEVER if no_writes else 0)
    yield
    jax.clear_caches()


@pytest.fixture
def run_pages():
    """Every arena's reservations keep its slots' pages consecutive (`allocator.RUN_PAGES`, as a
    TPU's 8-bit scale-row arenas get them), in blocks of 8 keys (`RUN_BLOCK_KEYS`: two pages of
    the model tests' 4 keys, so that a prefill spans blocks and a whole one goes to its run's
    end), JAX's traces cleared before and after (both are read when `reserve` is traced)."""
    import jax

    from arena_jax import allocator

    jax.clear_caches()
    keys, allocator.RUN_PAGES, allocator.RUN_BLOCK_KEYS = allocator.RUN_BLOCK_KEYS, True, 8
    yield
    allocator.RUN_PAGES, allocator.RUN_BLOCK_KEYS = None, keys
    jax.clear_caches()


def pytest_terminal_summary(terminalreporter):
    import sys

    from cache_model import HOST_SERVED, OP_COUNTS

    tpu = sys.modules.get("test_kernels_tpu")
    if tpu is not None and tpu.COUNTS:
        grid = "full" if tpu.FULL else "CI"
        terminalreporter.write_line(f"TPU interpret-mode kernel cases run ({grid} grid): "
                                    + ", ".join(f"{k} {v}" for k, v in sorted(tpu.COUNTS.items())))
    if OP_COUNTS:
        per_mode = ", ".join(f"{mode} {n:,}" for mode, n in sorted(OP_COUNTS.items()))
        terminalreporter.write_line(f"model-based cache ops run: {sum(OP_COUNTS.values()):,} ({per_mode})")
    if HOST_SERVED:
        rows = ", ".join(f"{op} {n:,}" for op, n in sorted(HOST_SERVED.items()))
        terminalreporter.write_line(f"model-based host-tier rows served: {rows}")


# Seconds per test file (setup + call + teardown of its tests), written as JSON to
# $ARENA_DURATIONS_JSON at the end of the run: scripts/test_all.sh records each line's, and
# scripts/test_changed.sh orders and budgets its selection by them (docs/testing.md).
# (Taken out of the environment: a child pytest, e.g. the 8-device checks', writes none.)
_FILE_SECONDS: dict[str, float] = {}
_DURATIONS_JSON = os.environ.pop("ARENA_DURATIONS_JSON", None)


def pytest_runtest_logreport(report):
    path = report.nodeid.split("::")[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_sessionfinish(session):
    if _OWN_CACHE:
        import shutil

        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    if _DURATIONS_JSON and _FILE_SECONDS:
        import json

        with open(_DURATIONS_JSON, "w") as f:
            json.dump({k: round(v, 1) for k, v in sorted(_FILE_SECONDS.items())}, f, indent=1)
