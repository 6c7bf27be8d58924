"""Hypothesis profiles for the model-based tests, and a report of how many ops they ran.

    pytest                                              profile "arena": the CI budget
    HYPOTHESIS_PROFILE=soak pytest tests/test_allocator_model.py -s    a long soak
    (ARENA_SOAK_EXAMPLES=N sets its examples; each runs 8-30 ops)
    HYPOTHESIS_PROFILE=find ...                         the CI budget, no shrinking: does a
                                                        (deliberately injected) bug get caught?
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import pytest
from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def per_line(examples: int) -> int:
    """A test's hypothesis budget on a CI line: the whole budget (the lines deal tests, each test
    runs on one line with its full budget)."""
    return examples


MODEL_EXAMPLES = int(os.environ.get("ARENA_MODEL_EXAMPLES", str(per_line(60))))
settings.register_profile("arena", max_examples=MODEL_EXAMPLES, **_COMMON)
settings.register_profile("soak", max_examples=int(os.environ.get("ARENA_SOAK_EXAMPLES", "5000")), **_COMMON)
settings.register_profile("find", max_examples=int(os.environ.get("ARENA_MODEL_EXAMPLES", "60")),
                          phases=[Phase.explicit, Phase.generate], **_COMMON)  # fmt: skip
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "arena"))


@pytest.fixture(autouse=True, scope="module")
def _clear_jax_caches_after_each_module():
    """Drop JAX's compiled programs after every test module. On jaxlib 0.10.2, one pytest process
    running the suite's files in order up to tests/test_mixed.py segfaulted inside XLA CPU's
    compile of a prefill in `test_mixed_steps_with_a_prefix_cache`, 3 runs of 3 (either half of
    the files before it, or that file alone, passed); with the caches cleared after each module
    the same run passed. It depends on what the process compiled before, so it is JAX's (a
    compiler must not crash on a valid program) and not reduced to a small repro; README, "Two commands"."""
    yield
    jax.clear_caches()


# The CI lines share the suite. `ARENA_GRID_SHARE=i/n` (scripts/test_all.sh sets 0/2 and 1/2 when
# it runs both JAX lines): the tests that cost under `ARENA_BOTH_LINES_BELOW` seconds in the
# recorded run run on every line; the others are dealt, each to one line, by what they cost
# (tests/ci_durations.json, recorded from a CI run by scripts/ci_durations.py), so that the lines
# finish together; the files whose tests skip on one line (the HF reference stack lives on the
# py311 line only; the Mosaic GPU interpret mode and the JAX bug repro are version-specific),
# the CI-script checks and the tests using `hf_reference` run on every line. Unset (pytest by
# hand, one line alone): everything.
BOTH_LINES_FILES = {"test_models_parity.py", "test_hf_config.py", "test_mosaic_decode.py",
                    "test_jax_bug_shardy_empty_operand.py", "test_ci_lines.py"}  # fmt: skip
DURATIONS = Path(__file__).with_name("ci_durations.json")
_LEFT_TO_OTHER_LINES = []


def cheap(test: str, seconds: dict[str, float], below: float) -> bool:
    """A test that cost under `below` seconds in the recorded run: it runs on every line
    (`ARENA_BOTH_LINES_BELOW`, set by scripts/test_all.sh). A test without a record is dealt."""
    return test in seconds and seconds[test] < below


def grid_share(value: str | None) -> tuple[int, int] | None:
    """'i/n' -> (i, n) with 0 <= i < n; None or '' -> None; anything else is a ValueError."""
    if not value:
        return None
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise ValueError(f"ARENA_GRID_SHARE={value!r}: expected 'i/n', e.g. '0/2'") from None
    if not 0 <= i < n:
        raise ValueError(f"ARENA_GRID_SHARE={value!r}: expected 0 <= i < n")
    return i, n


def deal(tests: list[str], lines: int, seconds: dict[str, float], head_start: dict[str, float]) -> dict[str, int]:
    """{test: line} with every test on exactly one of `lines` lines: the costliest first, each
    to the line with the least work so far (a line starts with its head start, keyed 'i/n':
    its setup and the tests it runs in any case). A test without a recorded cost counts the
    median cost. Depends on the set of tests only, not on their order, so every line computes
    the same deal."""
    known = sorted(seconds.values())
    default = known[len(known) // 2] if known else 1.0
    load = [float(head_start.get(f"{i}/{lines}", 0.0)) for i in range(lines)]
    owner = {}
    for test in sorted(set(tests), key=lambda t: (-seconds.get(t, default), t)):
        line = min(range(lines), key=lambda i: (load[i], i))
        owner[test] = line
        load[line] += seconds.get(test, default)
    return owner


def pytest_collection_modifyitems(config, items):
    share = grid_share(os.environ.get("ARENA_GRID_SHARE"))
    if share is None:
        return
    index, lines = share
    recorded = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    below = float(os.environ.get("ARENA_BOTH_LINES_BELOW") or 0)
    every_line = {item.nodeid for item in items
                  if item.path.name in BOTH_LINES_FILES or "hf_reference" in getattr(item, "fixturenames", ())
                  or cheap(item.nodeid, recorded.get("seconds", {}), below)}  # fmt: skip
    owner = deal([item.nodeid for item in items if item.nodeid not in every_line], lines,
                 recorded.get("seconds", {}), recorded.get("head_start", {}))
    keep = []
    for item in items:
        (keep if item.nodeid in every_line or owner[item.nodeid] == index else _LEFT_TO_OTHER_LINES).append(item)
    if _LEFT_TO_OTHER_LINES:
        config.hook.pytest_deselected(items=_LEFT_TO_OTHER_LINES)
        items[:] = keep


_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Each test's seconds (setup + call + teardown), for ARENA_DURATIONS_OUT."""
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session):
    """ARENA_DURATIONS_OUT=path (scripts/test_all.sh sets it per line): the seconds of each test
    this line ran and the tests it left to the other lines, written there, for
    scripts/ci_durations.py (which also checks that every test left here ran on another line)."""
    out = os.environ.get("ARENA_DURATIONS_OUT")
    if out:
        left = sorted(item.nodeid for item in _LEFT_TO_OTHER_LINES)
        Path(out).write_text(json.dumps({"seconds": _SECONDS, "left_to_other_lines": left}, indent=0, sort_keys=True) + "\n")


def pytest_terminal_summary(terminalreporter):
    import sys

    if _LEFT_TO_OTHER_LINES:
        terminalreporter.write_line(f"tests dealt to the other CI line(s) (ARENA_GRID_SHARE="
                                    f"{os.environ.get('ARENA_GRID_SHARE')}): {len(_LEFT_TO_OTHER_LINES)}")

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
