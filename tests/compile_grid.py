"""Which cases of a heavy compile grid a CI line runs: all of them, or a covering subset.

CI runs every test file on both JAX lines (scripts/test_all.sh). The offline compile grids
(`tests/test_compile_sm90.py`: a kernel variant lowered, compiled by XLA's deviceless GPU
compiler and assembled by ptxas; `tests/test_compile_tpu.py`: a kernel variant compiled by
libtpu's XLA and Mosaic) are the suite's largest block of CPU time, and what they check (no
spills, no arena copies) depends on the kernel and its shapes far more than on the JAX line.
So each grid runs in FULL on one line and a COVERING subset on the other:

    ARENA_COMPILE_GRID=full          every case of every grid (the default: pytest by hand)
    ARENA_COMPILE_GRID=cover         every grid's covering subset
    ARENA_COMPILE_GRID="sm90=full tpu=cover"   per grid (unnamed grids: full)

The covering subset is chosen by a rule, not by hand: a greedy set cover over the cases'
features (`features`: each parameter's value, e.g. ("kind", "prefill"), ("dtype", "int8"),
("head_dim", 96), ("soft_cap", True), and the (kind, dtype) pairs, so every kernel meets every
dtype it is compiled for at least once). Greedy: repeatedly take the case that adds the most
features not yet covered (ties: the earlier case in the grid's own order), until every
feature of the grid is covered; then a case the others cover already is dropped. So the subset contains every kernel, every option value and
every dtype of the full grid, and it grows by itself when the grid gains a new value
(tests/test_ci_lines.py checks that property on the real grids). A case outside the subset is
SKIPPED there with a reason naming the line that compiles it: the union of the two lines runs
every case, as before.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Hashable, Iterable, Sequence

import pytest

ENV = "ARENA_COMPILE_GRID"
MODES = ("full", "cover")
# Which CI line runs which grid in full (scripts/test_all.sh sets ARENA_COMPILE_GRID to match):
# the skip reason on the other line names it.
FULL_ON = {"sm90": "py313", "tpu": "py311"}

Feature = tuple[str, Hashable]


def grid_mode(grid: str, value: str | None = None) -> str:
    """"full" or "cover" for `grid` from ARENA_COMPILE_GRID (or `value`): a bare mode applies to
    every grid, `name=mode` words to one; anything else is an error (a typo must not silently
    shrink a line's coverage, nor silently run a full grid where the budget has no room)."""
    text = os.environ.get(ENV, "") if value is None else value
    words = text.replace(",", " ").split()
    mode = "full"
    for word in words:
        name, sep, m = word.rpartition("=")
        if m not in MODES or (sep and name not in FULL_ON):
            raise ValueError(f"{ENV}={text!r}: expected 'full', 'cover' or words like 'sm90=cover' "
                             f"(grids: {', '.join(FULL_ON)})")
        if not sep or name == grid:
            mode = m
    return mode


def field_features(case) -> frozenset[Feature]:
    """A dataclass case's features: each field's value, ("page_size", 16) and so on."""
    return frozenset((f.name, getattr(case, f.name)) for f in dataclasses.fields(case))


def some_fields(*names: str) -> Callable[[object], frozenset[Feature]]:
    """Features from the named fields only (the others are sizes that follow from them)."""
    return lambda case: frozenset((n, getattr(case, n)) for n in names)


def variant_features(case) -> frozenset[Feature]:
    """A kernel variant's features (`pallas_kernels.offline.sm90_variants.Variant`, `.tpu_variants.TpuVariant`):
    every field's value (kind, dtype, head_dim, page_size, group, the options soft_cap,
    traced_window, rotate...), its compute dtype, and its (kind, dtype) pair. The GQA group of
    an append (which has no query heads) is left out."""
    out = {(name, value) for name, value in field_features(case)
           if name != "compute_dtype"  # `compute` below says it whole (None means "the arena's")
           and not (name == "group" and case.kind.startswith("append"))}
    out.add(("compute", case.compute))
    out.add(("kind x dtype", (case.kind, case.dtype)))
    return frozenset(out)


def named_features(*names: str) -> Callable[[tuple], frozenset[Feature]]:
    """Features of a tuple case (a parametrize row): each argument's value under its name; a
    dataclass argument contributes its own `variant_features` / `field_features`."""
    def features(case: tuple) -> frozenset[Feature]:
        out: set[Feature] = set()
        for name, value in zip(names, case, strict=True):
            if dataclasses.is_dataclass(value):
                out |= variant_features(value) if hasattr(value, "compute") else field_features(value)
            else:
                out.add((name, value))
        return frozenset(out)

    return features


def greedy_cover(cases: Sequence, features: Callable[[object], Iterable[Feature]] = variant_features) -> list[int]:
    """Indices (ascending) of a subset of `cases` whose features cover every feature of `cases`:
    greedy set cover, each step the case adding the most uncovered features, ties to the first;
    then each chosen case, in the order chosen, is dropped if the others cover its features."""
    sets = [frozenset(features(c)) for c in cases]
    left = set().union(*sets) if sets else set()
    chosen: list[int] = []
    while left:
        best = max(range(len(sets)), key=lambda i: (len(sets[i] & left), -i))
        chosen.append(best)
        left -= sets[best]
    for i in list(chosen):  # then drop a case the others cover already (earliest picks first)
        rest = set().union(*(sets[j] for j in chosen if j != i))
        if sets[i] <= rest:
            chosen.remove(i)
    return sorted(chosen)


@dataclasses.dataclass(frozen=True)
class Grid:
    """One parametrized grid as `params` saw it (tests/test_compile_grid.py checks them all)."""

    name: str
    cases: tuple
    features: Callable


REGISTERED: list[Grid] = []


def skip_reason(grid: str) -> str:
    line = FULL_ON[grid]
    return (f"{ENV}: this line compiles the {grid} grid's covering subset (every kernel, option and dtype, "
            f"tests/compile_grid.py); the {line} CI line compiles every case, this one included")


def params(grid: str, cases: Sequence, *, features=variant_features, wrap=lambda c: (c,), ids=None,
           mode: str | None = None) -> list:
    """`cases` as pytest params for `grid`: all of them run in full mode; in cover mode those
    outside `greedy_cover` are skipped with a reason naming the line that runs them. `wrap` maps
    a case to its parameter tuple (e.g. (target, variant)); features see the case itself."""
    mode = mode or grid_mode(grid)
    REGISTERED.append(Grid(grid, tuple(cases), features))
    keep = set(range(len(cases))) if mode == "full" else set(greedy_cover(cases, features))
    skip = pytest.mark.skip(reason=skip_reason(grid))
    out = []
    for i, case in enumerate(cases):
        marks = () if i in keep else (skip,)
        out.append(pytest.param(*wrap(case), marks=marks, id=None if ids is None else ids(case)))
    return out
