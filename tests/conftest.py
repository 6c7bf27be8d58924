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
settings.register_profile("arena", max_examples=int(os.environ.get("ARENA_MODEL_EXAMPLES", "60")), **_COMMON)
settings.register_profile("soak", max_examples=int(os.environ.get("ARENA_SOAK_EXAMPLES", "5000")), **_COMMON)
settings.register_profile("find", max_examples=int(os.environ.get("ARENA_MODEL_EXAMPLES", "60")),
                          phases=[Phase.explicit, Phase.generate], **_COMMON)  # fmt: skip
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "arena"))


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
