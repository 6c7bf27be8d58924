"""Hypothesis profiles for the model-based tests, and a report of how many ops they ran.

    pytest                                              profile "arena": the CI budget
    HYPOTHESIS_PROFILE=soak pytest tests/test_allocator_model.py -s    a long soak
    (ARENA_SOAK_EXAMPLES=N sets its examples; each runs 8-30 ops)
    HYPOTHESIS_PROFILE=find ...                         the CI budget, no shrinking: does a
                                                        (deliberately injected) bug get caught?
"""
from __future__ import annotations

import os

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


# The CI lines share the suite. `ARENA_GRID_SHARE=i/n` (scripts/test_all.sh sets 0/2 and 1/2 when
# it runs both JAX lines): the tests are dealt round-robin in collection order, each to one line,
# so that together the lines run every test once; the files whose tests skip on one line (the HF
# reference stack lives on the py311 line only; the Mosaic GPU interpret mode and the JAX bug
# repro are version-specific), the CI-script checks and the tests using `hf_reference` run on
# every line. Unset (pytest by hand, one line alone): everything.
BOTH_LINES_FILES = {"test_models_parity.py", "test_hf_config.py", "test_mosaic_decode.py",
                    "test_jax_bug_shardy_empty_operand.py", "test_ci_lines.py"}  # fmt: skip
_LEFT_TO_OTHER_LINES = []


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


def pytest_collection_modifyitems(config, items):
    share = grid_share(os.environ.get("ARENA_GRID_SHARE"))
    if share is None:
        return
    index, lines = share
    keep, dealt = [], 0
    for item in items:
        if item.path.name in BOTH_LINES_FILES or "hf_reference" in getattr(item, "fixturenames", ()):
            keep.append(item)
            continue
        dealt += 1
        (keep if (dealt - 1) % lines == index else _LEFT_TO_OTHER_LINES).append(item)
    if _LEFT_TO_OTHER_LINES:
        config.hook.pytest_deselected(items=_LEFT_TO_OTHER_LINES)
        items[:] = keep


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
