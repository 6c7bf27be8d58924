"""Every kernel variant `arena_jax` can dispatch compiles for an H100 (sm_90a), on a host without a GPU.

For each variant of `pallas_kernels.offline.sm90_variants.CI_VARIANTS` (every kind, dtype, head size,
page size and GQA group, and the 8-bit arenas; the module docstring says how the matrix was chosen) the kernels are
lowered for CUDA, compiled by XLA's deviceless GPU compiler for an H100 (the route that runs
on a GPU with jaxlib 0.10 and 0.11) and assembled by `ptxas -arch=sm_90a -v`; the test asserts
zero spill stores and loads and shared memory within the per-block limit, and that bf16/fp16
attention runs on tensor cores.

Needs jax-cuda12-plugin / jax-cuda12-pjrt (== jax) and nvidia-cuda-nvcc-cu12
(`bash scripts/install_sm90_tools.sh`) and JAX_PLATFORMS=cpu on a host without a GPU. Without
them the tests skip with the reason; under CI (CI=true) they fail instead, so a broken install
cannot pass silently.
"""
from __future__ import annotations

import os
import re

import jax
import pytest

import compile_grid
from pallas_kernels.offline import sm90, sm90_compat
from pallas_kernels.offline.sm90_variants import CI_VARIANTS, DTYPES, GROUPS, HEAD_DIMS, KINDS, PAGE_SIZES, QUANT_DTYPES, QUANT_KINDS

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def gate(problem: str | None, in_ci: bool):
    """What to do when the tooling is missing: ("fail" | "skip", message), or None to run."""
    if problem is None:
        return None
    if in_ci:
        return "fail", f"CI must run the sm_90a compile checks, but: {problem}"
    return "skip", f"sm_90a compile checks need the CUDA compile tooling: {problem}"


@pytest.fixture(scope="module")
def tooling():
    action = gate(sm90.tooling_problem(), IN_CI)
    if action is not None:
        kind, message = action
        (pytest.fail if kind == "fail" else pytest.skip)(message)


def test_gate_fails_in_ci_and_skips_elsewhere():
    assert gate(None, True) is None and gate(None, False) is None
    assert gate("ptxas not found", True) == ("fail", "CI must run the sm_90a compile checks, but: ptxas not found")
    assert gate("ptxas not found", False)[0] == "skip"


def _jaxlib_minor() -> tuple[int, int]:
    return tuple(int(x) for x in jax.lib.__version__.split(".")[:2])


def test_version_paths(tooling, capsys, tmp_path):
    """Which path of `sm90_compat` this JAX takes, checked against the jaxlib version: an abstract
    H100 names the target without a GPU; the CUDA plugin's own Triton compiler (via="plugin")
    exists up to jaxlib 0.10 (there it and XLA compile the same kernel without spills; registers
    may differ: other LLVM/PTX options) and is refused, with the reason, from 0.11 on."""
    from pallas_kernels.offline.sm90_variants import Variant

    paths = sm90_compat.paths()
    with capsys.disabled():
        print(f"\nsm90 paths on jax {jax.__version__}: {paths}")
    assert paths["target"] == ("gpu" if jax.default_backend() == "gpu" else "abstract-h100")
    assert paths["ptx"] == "xla-dump-emitter-ptx"
    call = Variant("decode", head_dim=128, group=4).call()
    if _jaxlib_minor() <= (0, 10):
        assert paths["plugin_route"] == "jaxlib-triton-handler"
        assert sm90.tooling_problem("plugin") is None
        (xla,) = sm90.compile_call(*call, via="xla", workdir=str(tmp_path))
        (plugin,) = sm90.compile_call(*call, via="plugin", workdir=str(tmp_path))
        assert xla.name == plugin.name and xla.tensor_core == plugin.tensor_core
        assert (xla.spill_stores, plugin.spill_stores) == (0, 0) and xla.regs > 0 and plugin.regs > 0
    else:
        assert paths["plugin_route"] is None
        assert "use via='xla'" in sm90.tooling_problem("plugin")
        with pytest.raises(ValueError, match="removed in jaxlib 0.11"):
            sm90.compile_call(*call, via="plugin")


def test_matrix_covers_every_value_of_every_axis():
    def seen(attr, kinds=KINDS):
        return {getattr(v, attr) for v in CI_VARIANTS if v.kind in kinds}

    attention = [k for k in KINDS if not k.startswith("append")]
    assert {v.kind for v in CI_VARIANTS} == set(KINDS)
    assert seen("dtype") == set(DTYPES) | set(QUANT_DTYPES)
    assert seen("head_dim") >= set(HEAD_DIMS)
    assert seen("page_size", attention) >= set(PAGE_SIZES)
    assert seen("group", attention) >= set(GROUPS)
    for kind in KINDS:  # every kind in every float dtype
        assert {v.dtype for v in CI_VARIANTS if v.kind == kind} >= set(DTYPES), kind
    for kind in QUANT_KINDS:  # every kind an 8-bit arena changes, in int8
        assert "int8" in {v.dtype for v in CI_VARIANTS if v.kind == kind}, kind
    for dtype in QUANT_DTYPES:  # every quantized dtype in split decode, prefill and append
        assert {v.kind for v in CI_VARIANTS if v.dtype == dtype} >= {"decode-split", "prefill", "append-prefill"}, dtype
    assert {v.compute for v in CI_VARIANTS if v.quantized} == set(DTYPES)  # bf16, fp16 and fp32 dots over 8-bit pages
    # The attention options, where they add code: soft-cap and traced windows in split decode,
    # prefill, an 8-bit arena and fp32 (FMA) prefill; a bf16 arena under f32 and f16 q.
    def options(v):
        return ("cap",) * v.soft_cap + ("wt",) * v.traced_window

    for option in ("cap", "wt"):
        with_option = [v for v in CI_VARIANTS if option in options(v)]
        assert {v.kind for v in with_option} >= {"window-decode", "window-prefill"}, option
        assert any(v.quantized for v in with_option) and any(v.compute == "float32" for v in with_option), option
    assert any(v.soft_cap and v.kind == "decode-split" for v in CI_VARIANTS)
    # int4 arenas and rotated keys: every kind an arena format changes, rotated, in int4 and int8;
    # int4 unrotated; int4 under each q dtype; rotation at a non-power-of-two head (96).
    assert {v.kind for v in CI_VARIANTS if v.dtype == "int4" and v.rotate} >= set(QUANT_KINDS)
    assert {v.kind for v in CI_VARIANTS if v.dtype == "int4" and not v.rotate} >= {"prefill", "append-prefill"}
    assert {v.kind for v in CI_VARIANTS if v.dtype == "int8" and v.rotate} >= {"decode-split", "prefill", "append-decode"}
    assert any(v.dtype == "int4" and not v.rotate for v in CI_VARIANTS)
    assert {v.compute for v in CI_VARIANTS if v.dtype == "int4"} == set(DTYPES)
    assert any(v.rotate and v.head_dim == 96 for v in CI_VARIANTS)
    converted = {(v.dtype, v.compute, v.kind) for v in CI_VARIANTS if not v.quantized and v.compute != v.dtype}
    assert {("bfloat16", "float32", "decode-split"), ("bfloat16", "float16", "prefill")} <= converted


# ARENA_COMPILE_GRID (tests/compile_grid.py): every variant, or (the other CI line) a covering subset
@pytest.mark.parametrize("variant", compile_grid.params("sm90", CI_VARIANTS), ids=lambda v: v.label.replace(" ", "-"))
def test_compiles_for_sm90a_without_spills(tooling, variant, tmp_path):
    facts = sm90.compile_call(*variant.call(), via="xla", workdir=str(tmp_path))
    assert len(facts) == 1
    (f,) = facts
    assert f.regs > 0, f"{f.name}: ptxas reported no registers"
    assert (f.spill_stores, f.spill_loads) == (0, 0), f"{f.name} spills: {f}"
    assert f.smem <= sm90.SM90["smem_per_block"], f"{f.name} needs {f.smem} B of shared memory per block: {f}"
    assert f.ctas_per_sm >= 1
    if variant.compute != variant.dtype:  # 8-bit / int4, or a float arena of another dtype than q: converted tiles
        assert f.name.removesuffix("_rot").endswith("_" + variant.dtype), f"{f.name}: not the {variant.dtype} kernel"
    # Rotated keys are rotated in the kernel (append: but float32 keys, which XLA rotates first).
    in_kernel = variant.rotate and not (variant.kind.startswith("append") and variant.compute == "float32")
    assert f.name.endswith("_rot") == in_kernel, f.name
    assert ("_cap" in f.name) == variant.soft_cap and ("_wt" in f.name) == variant.traced_window, f.name
    if not variant.kind.startswith("append"):
        splits = int(re.search(r"_s(\d+)", f.name).group(1))
        assert (splits > 1) == (variant.kind in ("decode-split", "window-decode")), f.name
        if variant.compute != "float32":  # the dots' dtype: an 8-bit arena's pages meet q in q's dtype
            assert f.tensor_core in ("mma", "wgmma"), f"{f.name} does not use tensor cores: {f}"


# A whole model step, the speculative verify call (benchmarks/studies/sm90_steps.py: a
# Llama-3-8B-shaped model, here 2 layers; its decode and prefill steps are in RESULTS.md, and the
# kernels they call are variants of the grid above).
def test_verify_step_compiles_for_sm90a_with_the_arena_in_place(tooling, tmp_path):
    """The jitted verify step (each row's last token + 4 proposals) with the cache donated,
    compiled for an H100 with the Triton kernels: the arena's k and v aliased to the outputs, no
    arena-sized copy, the append, chunked attention and reserve kernels without spills, and (JAX >= 0.11)
    no layer's matmul weights copied out of the stacked [L, ...] weights (`STEP_COMPILER_OPTIONS`:
    cuBLAS reads them in place; XLA 0.10 still copies the o / MLP projections)."""
    from arena_jax.benchmarks.studies.sm90_steps import compile_step, step_facts

    compiled, state, cache, _ = compile_step("verify", 32, 5, 2, str(tmp_path))
    facts = step_facts(compiled, state, cache, str(tmp_path))
    assert facts["aliased"] and facts["arena_copies"] == 0, facts
    names = [k["name"].split("_b")[0] for k in facts["kernels"]]  # reserve's table work: one Triton kernel too
    assert names == ["paged_append", "paged_attention", "reserve_pages"], facts
    assert all(k["regs"] and k["spills"] == 0 for k in facts["kernels"]), facts
    if _jaxlib_minor() >= (0, 11):
        assert facts["weight_bytes"] < 2**20, facts  # (the two norm scales' 8 KiB slices remain)
    # XLA's dot merger (off: `STEP_COMPILER_OPTIONS`) would concatenate each layer's q / k / v
    # weights into one [E, (N + 2K) H] buffer every step, to run one matmul.
    e, n, k, h = 4096, 32, 8, 128  # Llama-3-8B
    assert f"bf16[{e},{(n + 2 * k) * h}]" not in compiled.as_text(), "q / k / v weights concatenated every step"


def test_one_row_decode_step_reads_its_weights_where_they_lie(tooling, tmp_path):
    """A decode step of one row compiled for an H100 (2 layers of a Llama-3-8B-shaped model):
    no weight-sized buffer is made. Before `layers.one_row_safe_einsum`, XLA turned the one-row
    k / v projections into reduces over a transposed copy of the stacked k / v weights, and the
    float32 logits into a float32 copy of the LM head (2 GiB): 1.5 ms of a 7.3 ms step on an H200
    (benchmarks/RESULTS.md). JAX 0.10's XLA still copies per-layer weight slices (see above)."""
    from arena_jax.benchmarks.studies.sm90_steps import ARRAY_OP, _shape_bytes, _unfused, compile_step, step_facts

    compiled, state, cache, _ = compile_step("decode", 1, 1, 2, str(tmp_path))
    facts = step_facts(compiled, state, cache, str(tmp_path))
    assert facts["aliased"] and facts["arena_copies"] == 0, facts
    arena = f"{cache.k.dtype}[{','.join(map(str, cache.k.shape))}]".replace("bfloat16", "bf16")
    made = [f"{op} {dtype}[{dims}]" for dtype, dims, op in ARRAY_OP.findall(_unfused(compiled.as_text()))
            if op in ("fusion", "copy", "transpose", "convert", "concatenate") and f"{dtype}[{dims}]" != arena
            and _shape_bytes(dtype, dims) >= 4 * 2**20]  # fmt: skip
    if _jaxlib_minor() >= (0, 11):
        assert made == [] and facts["weight_bytes"] < 2**20, (made, facts)
    else:  # only the per-layer slices of the stacked weights ([1, ...]) that XLA 0.10 copies
        assert all(m.split("[")[1].startswith("1,") for m in made), made
