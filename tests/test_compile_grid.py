"""The compile grids' covering subsets (tests/compile_grid.py) really cover: every kernel, every
option value and every dtype of each full grid runs on the covering line too, and the two CI
lines together run every case."""
from __future__ import annotations

import pytest

import compile_grid
import test_compile_sm90  # noqa: F401  (registers its grids with compile_grid)
import test_compile_tpu  # noqa: F401
from compile_grid import greedy_cover, grid_mode, params


def _grids():
    seen = {}
    for g in compile_grid.REGISTERED:
        seen[(g.name, tuple(map(repr, g.cases)))] = g
    return list(seen.values())


def test_every_heavy_grid_is_registered():
    names = [(g.name, len(g.cases)) for g in _grids()]
    assert sorted({n for n, _ in names}) == ["sm90", "tpu"], names
    assert len(names) == 4, names  # sm90 variants; TPU kernels, model steps, host-tier ops


@pytest.mark.parametrize("grid", _grids(), ids=lambda g: f"{g.name}-{len(g.cases)}-cases")
def test_the_cover_has_every_feature_of_its_grid(grid):
    everything = set().union(*(grid.features(c) for c in grid.cases))
    chosen = greedy_cover(grid.cases, grid.features)
    assert set().union(*(grid.features(grid.cases[i]) for i in chosen)) == everything
    assert len(chosen) < len(grid.cases) or len(grid.cases) <= 2, "a cover as large as its grid saves nothing"
    # the marks: cover mode skips exactly the others, with a reason naming the full line; full mode skips none
    covered = params(grid.name, grid.cases, features=grid.features, wrap=lambda c: (c,), mode="cover")
    skipped = [i for i, p in enumerate(covered) if p.marks]
    assert sorted(set(range(len(grid.cases))) - set(skipped)) == chosen
    for i in skipped:
        (mark,) = covered[i].marks
        assert mark.name == "skip" and compile_grid.FULL_ON[grid.name] in mark.kwargs["reason"]
    assert not any(p.marks for p in params(grid.name, grid.cases, features=grid.features, mode="full"))


def test_the_sm90_cover_has_every_kind_dtype_option_and_shape():
    """Spelled out on the real sm_90a matrix, independently of `variant_features`: a change to
    the features cannot silently shrink what the covering line compiles."""
    from pallas_kernels.offline.sm90_variants import CI_VARIANTS, DTYPES, GROUPS, HEAD_DIMS, KINDS, PAGE_SIZES, QUANT_DTYPES

    sub = [CI_VARIANTS[i] for i in greedy_cover(CI_VARIANTS)]
    attention = [v for v in sub if not v.kind.startswith("append")]
    assert {v.kind for v in sub} == set(KINDS)
    assert {v.dtype for v in sub} == set(DTYPES) | set(QUANT_DTYPES)
    assert {v.compute for v in sub} == set(DTYPES)
    assert {v.head_dim for v in sub} >= set(HEAD_DIMS)
    assert {v.page_size for v in sub} >= set(PAGE_SIZES)
    assert {v.group for v in attention} >= set(GROUPS)
    for option in ("soft_cap", "traced_window", "rotate"):
        assert {getattr(v, option) for v in sub} == {False, True}, option
    assert {(v.kind, v.dtype) for v in sub} == {(v.kind, v.dtype) for v in CI_VARIANTS}  # every kernel in every dtype
    assert len(sub) <= len(CI_VARIANTS) // 2


def test_the_tpu_cover_has_every_kernel_dtype_target_and_op():
    from pallas_kernels.offline.tpu_variants import CI_VARIANTS, KINDS, V6E_VARIANTS

    grid = [("tpu-v5e", v) for v in CI_VARIANTS] + [("tpu-v6e", v) for v in V6E_VARIANTS]
    sub = [grid[i] for i in greedy_cover(grid, compile_grid.named_features("target", "variant"))]
    assert {t for t, _ in sub} == {"tpu-v5e", "tpu-v6e"}
    assert {v.kind for _, v in sub} == set(KINDS)
    assert {v.dtype for _, v in sub} == {v.dtype for v in CI_VARIANTS}
    assert {v.compute for _, v in sub} == {v.compute for v in CI_VARIANTS}
    assert {v.head_dim for _, v in sub} == {v.head_dim for v in CI_VARIANTS}
    assert {v.page_size for _, v in sub} == {v.page_size for v in CI_VARIANTS}
    steps = test_compile_tpu._step_cases()
    sub = [steps[i] for i in greedy_cover(steps, test_compile_tpu.STEP_FEATURES)]
    assert {(c.step, c.target, c.dtype) for c in sub} >= {("prefill", "tpu-v5e", "bfloat16"), ("decode", "tpu-v6e", "int8")}


def test_greedy_cover_on_a_synthetic_grid():
    feats = compile_grid.named_features("x", "y")
    cases = [("a", 1), ("a", 2), ("b", 2), ("b", 1)]
    assert greedy_cover(cases, feats) == [0, 2]  # ("a", 1) first (ties: the earlier), then the one with b and 2
    cases = [("a", 1), ("a", 2), ("b", 1), ("c", 3), ("b", 3)]
    chosen = greedy_cover(cases, feats)
    assert set().union(*(feats(cases[i]) for i in chosen)) == set().union(*map(feats, cases))
    assert greedy_cover([], feats) == []


def test_the_mode_is_read_strictly():
    assert grid_mode("sm90", "") == "full" and grid_mode("tpu", "") == "full"  # unset: everything
    assert grid_mode("sm90", "cover") == "cover" == grid_mode("tpu", "cover")
    assert grid_mode("sm90", "sm90=cover tpu=full") == "cover" and grid_mode("tpu", "sm90=cover tpu=full") == "full"
    assert grid_mode("tpu", "sm90=cover") == "full"
    for bad in ("some", "sm90=half", "gpu=cover", "sm90:cover"):
        with pytest.raises(ValueError, match="ARENA_COMPILE_GRID"):
            grid_mode("sm90", bad)


def test_each_grid_runs_in_full_on_exactly_one_ci_line():
    """scripts/test_all.sh sets ARENA_COMPILE_GRID per line to what compile_grid.FULL_ON says:
    each grid full on one line, covered on the other (so the lines' union runs every case)."""
    import re
    from pathlib import Path

    script = (Path(__file__).resolve().parent.parent / "scripts" / "test_all.sh").read_text()
    setting = dict(re.findall(r'^\s*(py3\d+)\) grid="([^"]*)"', script, re.M))
    assert set(setting) == {"py311", "py313"}, setting
    for name, line in compile_grid.FULL_ON.items():
        modes = {ln: grid_mode(name, value) for ln, value in setting.items()}
        assert modes[line] == "full" and sorted(modes.values()) == ["cover", "full"], (name, modes)
