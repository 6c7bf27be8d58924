"""benchmarks/studies/compile_bound.py (issue 39, item 4): its unsafe variants are what they say
and are undone on the way out, the step's distinct kernels fall variant by variant, and XLA's
per-module timers are read and summed by part right. Kernel counts and parsed logs only: the
compile times themselves are the study's to print, not a test's to assert."""
from __future__ import annotations

import jax.numpy as jnp
import pytest

import arena_jax as aj
from arena_jax import allocator
from arena_jax import plan as plan_lib
from arena_jax.benchmarks.studies import compile_bound
from arena_jax.benchmarks.studies.op_hlo import hlo_counts

LAYOUT = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4, num_pages=8, max_seqs=2,
                     max_pages_per_seq=4, dtype=jnp.float32)  # fmt: skip


def _free_after_reserving() -> int:
    cache, ok = aj.reserve(aj.create(LAYOUT), jnp.array([0, 1], jnp.int32), jnp.array([5, 3], jnp.int32))
    assert bool(ok.all())
    return int(cache.table.num_free)


def test_the_unsafe_variants_swap_reserve_and_put_it_back():
    real = (allocator.reserve_impl, allocator._allocate_and_map)
    assert _free_after_reserving() == 8 - 3  # pages for 5 and 3 tokens of 4
    with compile_bound.unsafe_variant("in-place branch only"):
        assert allocator.RESERVE_KERNEL is False and plan_lib.PLAN_KERNEL is False  # the branch swapped is XLA's ops'
        assert _free_after_reserving() == 8  # lengths grow, no page is popped
    with compile_bound.unsafe_variant("no reserve"):
        cache, ok = aj.reserve(aj.create(LAYOUT), jnp.array([0, 1], jnp.int32), jnp.array([5, 3], jnp.int32))
        assert bool(ok.all()) and int(cache.table.num_free) == 8 and cache.table.lengths.tolist() == [0, 0]
    assert (allocator.reserve_impl, allocator._allocate_and_map, allocator.RESERVE_KERNEL) == (*real, "auto")
    assert plan_lib.PLAN_KERNEL == "auto"
    assert _free_after_reserving() == 8 - 3  # nothing traced inside the blocks outlived them
    with pytest.raises(ValueError, match="variant must be one of"):
        with compile_bound.unsafe_variant("no plan"):
            pass


def test_each_variant_compiles_fewer_distinct_kernels():
    distinct = {}
    for variant in compile_bound.VARIANTS:
        with compile_bound.unsafe_variant(variant):
            programs = compile_bound._programs(batch=2, capacity=16, page_size=4, example=False)
            distinct[variant] = hlo_counts(programs[("tiny model", "paged")].compile().as_text())["distinct_kernels"]
            if variant == "as built":
                dense = hlo_counts(programs[("tiny model", "dense")].compile().as_text())["distinct_kernels"]
    assert distinct["XLA's ops"] > distinct["in-place branch only"] > distinct["no reserve"] > dense
    # the native calls: reserve in one kernel, fewer than any allocator branch of XLA's ops (and the
    # copies its aliased table takes here); the plan in one
    assert distinct["in-place branch only"] > distinct["XLA's plan"] and distinct["XLA's plan"] <= distinct["no reserve"] + 5
    assert distinct["XLA's plan"] > distinct["as built"] + 4


LOG = """\
I1201 02:07:43.1 cpu_compiler.cc:2154] Compiling: jit_setup
I1201 02:07:43.1 ir_compiler.cc:295] Compiled LLVM module: __compute_module_wrapped_iota time: 3 ms (3000 us)
compile_bound: compiling paged
I1201 02:07:43.2 fusion_compiler.cc:562] Compiled MLIR module: select_fusion_kernel_module time: 12.5 ms (12500 us)
I1201 02:07:43.2 ir_compiler.cc:295] Compiled LLVM module: __compute_module_select_fusion_kernel_module time: 7.5 ms (7500 us)
I1201 02:07:43.2 ir_compiler.cc:295] Compiled LLVM module: __compute_module_stack_fusion_kernel_module time: 800 us (800 us)
I1201 02:07:43.2 ir_compiler.cc:295] Compiled LLVM module: __compute_module_wrapped_scatter time: 1.5 s (1500000 us)
I1201 02:07:43.2 ir_compiler.cc:295] Compiled LLVM module: __compute_module_wrapped_copy time: 2 ms (2000 us)
compile_bound: compiling (done)
compile_bound: compiling dense
I1201 02:07:44.0 ir_compiler.cc:295] Compiled LLVM module: __compute_module_add_fusion_kernel_module time: 4 ms (4000 us)
"""

HLO = """\
ENTRY %main {
  %select_fusion = s32[4]{0} fusion(%p), kind=kLoop, calls=%f1, metadata={op_name="jit(decode_step)/jit(_reserve)/cond/branch_0_fun/select_n"}
  %stack_fusion = s32[5,4]{1,0} fusion(%q), kind=kLoop, calls=%f2, metadata={op_name="jit(decode_step)/jit(_plan)/stack"}
  %wrapped_scatter = s32[9]{0} fusion(%r), kind=kLoop, calls=%f3, metadata={op_name="jit(decode_step)/while/body/mul"}
  ROOT %wrapped_copy = s32[9]{0} fusion(%s), kind=kLoop, calls=%f4
}
"""


def test_module_times_and_parts_from_xla_logs():
    times = compile_bound.module_times(LOG)
    assert set(times) == {"paged", "(done)", "dense"}  # nothing before the first mark
    assert times["paged"] == pytest.approx({"select_fusion": 20.0, "stack_fusion": 0.8, "wrapped_scatter": 1500.0,
                                            "wrapped_copy": 2.0})  # fmt: skip
    assert times["dense"] == {"add_fusion": 4.0}
    parts = compile_bound.ms_by_part(times["paged"], HLO)
    assert parts["reserve"] == pytest.approx(20.0)  # the branch of reserve's conditional is reserve's
    assert parts["plan"] == pytest.approx(0.8)
    assert parts["model"] == pytest.approx(1500.0)
    assert parts["no op_name"] == pytest.approx(2.0)
    assert sum(parts.values()) == pytest.approx(sum(times["paged"].values()))


def test_xla_timers_by_part_from_a_child_process():
    # the logs' format as this JAX line's XLA prints it, end to end: a change there leaves parts at 0
    parts = compile_bound.compile_ms_by_part(batch=2, capacity=16, page_size=4)
    paged, dense = parts["paged"], parts["dense"]
    assert all(paged[p] > 0 for p in ("attend", "append", "model"))  # (reserve and the plan: native calls on a CPU)
    assert dense["model"] > 0 and all(dense[p] == 0 for p in ("reserve", "plan", "attend", "append"))


def _require(action):
    """A device compile tooling gate's verdict (`gate` of tests/test_compile_sm90.py or
    tests/test_compile_tpu.py): missing tooling fails under CI, skips elsewhere."""
    if action is not None:
        (pytest.fail if action[0] == "fail" else pytest.skip)(action[1])


def _kernels_fall_variant_by_variant(target: str):
    rows = {r["variant"]: r for r in compile_bound.measure(rounds=1, batch=2, capacity=16, page_size=8, target=target)}
    assert set(rows) == {*compile_bound.VARIANTS, "dense"} and all(r["model"] == "tiny model" for r in rows.values())
    kernels = {variant: row["distinct_kernels"] for variant, row in rows.items()}
    assert kernels["XLA's ops"] > kernels["in-place branch only"] >= kernels["no reserve"] > kernels["dense"]
    assert kernels["XLA's plan"] == kernels["as built"]  # the native plan is a CPU's
    if target == "h100":  # reserve as one Pallas kernel: fewer kernels than XLA's, about as few as no allocator branch
        assert kernels["XLA's ops"] > kernels["as built"] and kernels["as built"] <= kernels["in-place branch only"] + 1
    else:  # a TPU: XLA's ops
        assert kernels["as built"] == kernels["XLA's ops"]


def test_the_h100_target_compiles_the_presets_steps_without_a_gpu():
    """`--target h100`: the tiny preset's paged step (its attention and append the Triton kernels,
    as on a GPU) and the dense one, by XLA's deviceless GPU compiler, each variant fewer distinct
    kernels."""
    import test_compile_sm90 as gpu

    _require(gpu.gate(gpu.sm90.tooling_problem(), gpu.IN_CI))
    programs = compile_bound._device_programs("h100", "tiny", batch=2, capacity=16, page_size=8)
    assert "xla.gpu.triton" in programs[("tiny model", "paged")].as_text()
    assert "xla.gpu.triton" not in programs[("tiny model", "dense")].as_text()
    assert "reserve_pages_b2" in programs[("tiny model", "paged")].as_text()  # the kernel, lowered for the GPU
    _kernels_fall_variant_by_variant("h100")
    with pytest.raises(ValueError, match="target must be one of"):
        compile_bound.measure(rounds=1, target="tpu")


def test_the_tpu_target_compiles_the_presets_steps_without_a_tpu():
    """`--target tpu-v5e`: a head_dim-128 preset's paged step holds the Mosaic kernels (lowered
    only), the dense one none; the tiny preset (head_dim 16: the jnp path on a TPU, with a
    warning) compiled by libtpu, each variant fewer distinct kernels."""
    import test_compile_tpu as tpu

    _require(tpu.gate(tpu.tpu_compile.tooling_problem(), tpu.IN_CI))
    programs = compile_bound._device_programs("tpu-v5e", "llama3_8b", batch=2, capacity=32, page_size=16)
    assert "tpu_custom_call" in programs[("llama3_8b model", "paged")].as_text()
    assert "tpu_custom_call" not in programs[("llama3_8b model", "dense")].as_text()
    with pytest.warns(RuntimeWarning, match="the Pallas kernels cannot take this layout"):
        _kernels_fall_variant_by_variant("tpu-v5e")
