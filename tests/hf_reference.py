"""The Hugging Face reference stack (torch + transformers) the parity tests compare against.

The `test` extra installs it. One CI line leaves it out on purpose: the JAX 0.11 / Python 3.13
line installs the `test-jax` extra (torch for Python 3.13 comes from the registry only as the
CUDA build, ~6 GB) and says so with ARENA_HF_REFERENCE=absent; there, and only there, the
parity tests skip with that reason (the JAX 0.10 line runs them). Missing anywhere else under
CI (CI=true) fails; outside CI it is a skip that names the missing package.
"""
from __future__ import annotations

import os

import pytest

DELIBERATELY_ABSENT = os.environ.get("ARENA_HF_REFERENCE", "").strip().lower() == "absent"
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")

try:
    import torch
    import transformers

    MISSING = None
except ImportError as exc:  # the reference stack is not installed
    torch = transformers = None
    MISSING = str(exc)


def gate(missing: str | None, *, deliberately_absent: bool, in_ci: bool):
    """What to do when the reference stack is missing: ("skip" | "fail", message), or None to run."""
    if missing is None:
        return None
    if deliberately_absent:
        return "skip", ("the HF reference stack (torch, transformers) is deliberately not installed on this CI line "
                        "(ARENA_HF_REFERENCE=absent: the `test-jax` extra); the Python 3.11 line runs these tests")
    if in_ci:
        return "fail", f"CI must run the HF parity tests, but the reference stack is missing: {missing}"
    return "skip", f"the HF parity tests need `pip install -e '.[test]'` (torch, transformers): {missing}"


def require(*, module_level: bool = False):
    """(torch, transformers), or skip / fail as `gate` says."""
    action = gate(MISSING, deliberately_absent=DELIBERATELY_ABSENT, in_ci=IN_CI)
    if action is not None:
        kind, message = action
        if kind == "fail":
            pytest.fail(message, pytrace=False)
        pytest.skip(message, allow_module_level=module_level)
    return torch, transformers


@pytest.fixture
def hf_reference():
    """For a test that needs the reference stack (see `require`)."""
    return require()
