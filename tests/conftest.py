"""Hypothesis profiles for the model-based tests, and a report of how many ops they ran.

    pytest                                              profile "arena": the CI budget
    HYPOTHESIS_PROFILE=soak pytest tests/test_allocator_model.py -s    a long soak
    (ARENA_SOAK_EXAMPLES=N sets its examples; each runs 8-30 ops)
    HYPOTHESIS_PROFILE=find ...                         the CI budget, no shrinking: does a
                                                        (deliberately injected) bug get caught?
"""
from __future__ import annotations

import os
import zlib

from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# With the CI lines splitting the grids (ARENA_GRID_SHARE i/n, below), each line draws 1/n of the
# model-based test's examples: the lines draw independently, so together they run the budget.
_SHARE = os.environ.get("ARENA_GRID_SHARE", "").split("/")
CI_LINES = int(_SHARE[1]) if len(_SHARE) == 2 and _SHARE[1].isdigit() and int(_SHARE[1]) > 0 else 1


def per_line(examples: int) -> int:
    """A hypothesis budget for one of the CI lines drawing it together (ARENA_GRID_SHARE)."""
    return max(1, examples // CI_LINES)


MODEL_EXAMPLES = int(os.environ.get("ARENA_MODEL_EXAMPLES", str(per_line(60))))
settings.register_profile("arena", max_examples=MODEL_EXAMPLES, **_COMMON)
settings.register_profile("soak", max_examples=int(os.environ.get("ARENA_SOAK_EXAMPLES", "5000")), **_COMMON)
settings.register_profile("find", max_examples=int(os.environ.get("ARENA_MODEL_EXAMPLES", "60")),
                          phases=[Phase.explicit, Phase.generate], **_COMMON)  # fmt: skip
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "arena"))


# Parametrized grids the CI lines split between them. `ARENA_GRID_SHARE=i/n` (scripts/test_all.sh
# sets 0/2 and 1/2 when it runs both JAX lines): a parametrized test's first case runs on every
# line and each other case on one line only (the case id's CRC32 mod n == i), so the lines
# together run every case and each line runs every test function (but in WHOLE_SPLIT_FILES). Not split: the files whose
# cases skip on one line (the HF reference stack lives on the py311 line only; the Mosaic GPU
# interpret mode and the JAX bug repro are version-specific) and tests using `hf_reference`.
# Unset (pytest by hand, one line alone): every case.
BOTH_LINES_FILES = {"test_models_parity.py", "test_hf_config.py", "test_mosaic_decode.py",
                    "test_jax_bug_shardy_empty_operand.py", "test_ci_lines.py"}  # fmt: skip
# The costliest files, whose tests drive whole models (generate, the scheduler, the CLIs) or the
# 8-device checks (one child pytest, test_sharding.py): each of their tests, parametrized or
# not, runs on one line (dealt round-robin); those needing the HF stack run on both.
WHOLE_SPLIT_FILES = {"sharded_checks.py", "test_models.py", "test_prefix.py", "test_host_tier.py", "test_bench.py",
                     "test_overlap.py"}  # fmt: skip
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
    seen, keep, dealt = set(), [], 0
    for item in items:
        func = (item.path.name, getattr(item, "originalname", item.name), item.cls)
        hf = "hf_reference" in getattr(item, "fixturenames", ())
        if item.path.name in WHOLE_SPLIT_FILES and not hf:  # dealt round-robin in file order: balanced shares
            dealt += 1
            (keep if (dealt - 1) % lines == index else _LEFT_TO_OTHER_LINES).append(item)
            continue
        whole = item.path.name in BOTH_LINES_FILES or hf
        if whole or not hasattr(item, "callspec") or func not in seen:
            seen.add(func)
            keep.append(item)
        elif zlib.crc32(item.nodeid.encode()) % lines == index:
            keep.append(item)
        else:
            _LEFT_TO_OTHER_LINES.append(item)
    if _LEFT_TO_OTHER_LINES:
        config.hook.pytest_deselected(items=_LEFT_TO_OTHER_LINES)
        items[:] = keep


def pytest_terminal_summary(terminalreporter):
    import sys

    if _LEFT_TO_OTHER_LINES:
        terminalreporter.write_line(f"parametrized cases left to the other CI line(s) (ARENA_GRID_SHARE="
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
