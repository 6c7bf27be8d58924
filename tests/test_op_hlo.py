"""benchmarks/studies/op_hlo.py: its HLO counter reads a stored module right, and what it measures
holds: blockwise attention compiles no loop when a row's capacity fits one block
(`blockwise.one_block`), and the loops when it does not; reserve's copy-on-write sits under a
conditional (issue 39, item 4)."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from arena_jax import api
from pallas_kernels import blockwise
from arena_jax.benchmarks.studies.op_hlo import (_instructions, hlo_counts, kernel_signatures, kernels_by_part,
                                                 measure, widest_loop_start)

SMALL_MODULE = """HloModule m

%fused_computation (param_0: s32[4]) -> s32[4] {
  %param_0 = s32[4]{0} parameter(0)
  %constant.1 = s32[] constant(1)
  %broadcast.1 = s32[4]{0} broadcast(%constant.1), dimensions={}
  ROOT %add.1 = s32[4]{0} add(%param_0, %broadcast.1)
}

%body (p: (s32[], s32[4])) -> (s32[], s32[4]) {
  %p = (s32[], s32[4]{0}) parameter(0)
  %gte.0 = s32[] get-tuple-element(%p), index=0
  %gte.1 = s32[4]{0} get-tuple-element(%p), index=1
  %fusion = s32[4]{0} fusion(%gte.1), kind=kLoop, calls=%fused_computation
  ROOT %tuple = (s32[], s32[4]{0}) tuple(%gte.0, %fusion)
}

ENTRY %main (x: s32[4]) -> s32[4] {
  %x = s32[4]{0} parameter(0)
  %copy = s32[4]{0} copy(%x)
  %zero = s32[] constant(0)
  %init = (s32[], s32[4]{0}) tuple(%zero, %copy)
  %while = (s32[], s32[4]{0}) while(%init), condition=%cond, body=%body
  %out = s32[4]{0} get-tuple-element(%while), index=1
  ROOT %negate = s32[4]{0} negate(%out)
}
"""


def test_the_counter_reads_a_stored_module():
    # tuples counted, fused bodies no kernels; the four kernels differ
    assert hlo_counts(SMALL_MODULE) == dict(instructions=16, kernels=4, distinct_kernels=4, while_loops=1)
    # two kernels of one body (names and metadata aside) are one distinct kernel
    twice = SMALL_MODULE.replace("  ROOT %negate = s32[4]{0} negate(%out)",
                                 '  %neg = s32[4]{0} negate(%out), metadata={op_name="a"}\n'
                                 '  ROOT %negate = s32[4]{0} negate(%neg), metadata={op_name="b"}')  # fmt: skip
    assert hlo_counts(twice)["kernels"] == 5 and hlo_counts(twice)["distinct_kernels"] == 4
    assert kernel_signatures(twice, op_name="a") == ["s32[4]{0} negate(%)"]


def _attend_loops(max_pages: int, page_size: int = 8) -> int:
    layout = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=16, page_size=page_size, num_pages=4 * max_pages,
                         max_seqs=2, max_pages_per_seq=max_pages, dtype=jnp.float32)  # fmt: skip
    cache = aj.create(layout)
    slots, ones = jnp.arange(2, dtype=jnp.int32), jnp.ones((2,), jnp.int32)
    q = jnp.ones((2, 1, 4, 16), jnp.float32)
    lowered = api._attend.lower(q, cache, jnp.int32(0), slots, ones, None, "xla", None, None, None)
    return hlo_counts(lowered.compile().as_text())["while_loops"]


def test_one_block_compiles_no_loop_and_a_longer_capacity_the_loops():
    pages = blockwise.ONE_BLOCK_KEYS // 8
    assert _attend_loops(max_pages=pages) == 0  # 512 keys: one block
    assert _attend_loops(max_pages=pages + 1) >= 1  # 520 keys: blocks in a loop


def test_the_study_reports_every_program():
    rows = {r["program"]: r for r in measure(batch=2, capacity=16, page_size=8)}
    assert set(rows) == {"paged decode step", "paged prefill, sampled", "dense decode step", "aj.reserve",
                         "aj.append (xla)", "aj.attend (xla)", "aj.release", "example paged decode",
                         "example dense decode"}  # fmt: skip (the checkout has examples/)
    assert all(r["kernels"] > 0 and r["instructions"] >= r["kernels"] and r["compile_cpu_s"] > 0 for r in rows.values())
    assert rows["aj.attend (xla)"]["while_loops"] == 0  # 16 keys: one block
    # XLA's CPU executor hands work to its thread pool past 8 kernels waiting: the paged step's
    # layer loop stays under it, as the dense step's does (`arena_jax.arena_ops.waits_for`).
    assert 1 <= rows["paged decode step"]["loop_start"] <= 8 and rows["paged prefill, sampled"]["loop_start"] <= 8
    assert rows["dense decode step"]["loop_start"] >= 1
    assert rows["paged decode step"]["kernels"] > rows["aj.reserve"]["kernels"]
    for name in ("paged decode step", "paged prefill, sampled", "dense decode step", "example paged decode",
                 "example dense decode"):  # every kernel has a part
        assert sum(rows[name]["parts"].values()) == rows[name]["kernels"], name
    example, example_dense = rows["example paged decode"]["parts"], rows["example dense decode"]["parts"]
    # the example's layers are a Python loop: an attention call per layer (4), reserve once
    assert example["attend"] >= 4 and example["reserve"] > 0 and example_dense["attend"] == example_dense["reserve"] == 0
    decode, prefill, dense = (rows[n]["parts"] for n in ("paged decode step", "paged prefill, sampled", "dense decode step"))
    assert min(decode["reserve"], decode["append"], decode["attend"]) > 0 and decode["sampling: threefry"] == 0  # greedy
    assert prefill["sampling: threefry"] > 0 and dense["reserve"] == dense["append"] == dense["attend"] == 0


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_a_model_steps_layer_loop_keeps_at_most_8_kernels_waiting(dtype):
    """The tiny model's decode step (layers scanned), on a float arena and on an int8 one (its
    keys smoothed by per-layer factors): what a layer reads by its index waits for its data
    (`arena_ops.waits_for`), so XLA's CPU executor never has more than 8 kernels waiting."""
    from flax import nnx

    from arena_jax import models
    from arena_jax.models import steps

    model = models.init_random(models.LlamaConfig.tiny(), seed=0)
    graphdef, state = nnx.split(model)
    cache = aj.create(models.default_layout(model, 3, 48, page_size=8, dtype=dtype))
    assert (cache.key_factors is not None) == (dtype == "int8")
    slots = jnp.arange(3, dtype=jnp.int32)
    text = steps.decode_step.lower(graphdef, state, cache, jnp.zeros((3,), jnp.int32), slots).compile().as_text()
    assert 1 <= widest_loop_start(text) <= 8


def test_the_widest_loop_start_reads_a_stored_module():
    """Four kernels read the loop's input alone; the fifth waits for two of them: at most three
    wait once the first is taken (the executor counts after taking one). Tuples, bitcasts and
    the fusion's own body are no kernels."""
    text = """HloModule m

%fused (p0: s32[4]) -> s32[4] {
  %p0 = s32[4]{0} parameter(0)
  ROOT %n = s32[4]{0} negate(%p0)
}

%body (p: (s32[], s32[4])) -> (s32[], s32[4]) {
  %p = (s32[], s32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = s32[4]{0} get-tuple-element(%p), index=1
  %a = s32[4]{0} fusion(%x), kind=kLoop, calls=%fused
  %b = s32[4]{0} negate(%x)
  %c = s32[4]{0} abs(%x)
  %d = s32[] add(%i, %i)
  %bc = s32[4]{0} bitcast(%a)
  %e = s32[4]{0} add(%bc, %b)
  ROOT %t = (s32[], s32[4]{0}) tuple(%d, %e)
}

ENTRY %main (x: s32[4]) -> s32[4] {
  %x = s32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], s32[4]{0}) tuple(%zero, %x)
  %while = (s32[], s32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = s32[4]{0} get-tuple-element(%while), index=1
}
"""
    assert widest_loop_start(text) == 3
    assert widest_loop_start(text.replace("body=%body", "body=%none")) == 0  # no loop body: nothing counted


def test_kernels_by_part_reads_op_names():
    text = """HloModule m

%fused_computation (param_0: s32[4]) -> s32[4] {
  %param_0 = s32[4]{0} parameter(0)
  ROOT %negate.9 = s32[4]{0} negate(%param_0), metadata={op_name="jit(step)/jit(_reserve)/neg"}
}

ENTRY %main (x: s32[4]) -> s32[4] {
  %x = s32[4]{0} parameter(0)
  %a = s32[4]{0} fusion(%x), kind=kLoop, calls=%fused_computation, metadata={op_name="jit(step)/jit(_reserve)/neg"}
  %b = s32[4]{0} negate(%a), metadata={op_name="jit(step)/while/body/jit(_append)/neg"}
  %c = s32[4]{0} negate(%b), metadata={op_name="jit(step)/jit(_random_bits)/threefry2x32"}
  %d = s32[4]{0} negate(%c), metadata={op_name="jit(step)/add"}
  ROOT %e = s32[4]{0} negate(%d)
}
"""
    parts = kernels_by_part(text)
    assert (parts["reserve"], parts["append"], parts["sampling: threefry"], parts["model"], parts["no op_name"]) == (1, 1, 1, 1, 1)
    assert sum(parts.values()) == hlo_counts(text)["kernels"] == 5


@pytest.mark.xfail(tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 11), strict=True,
                   reason="XLA CPU of JAX 0.10 expands optimization barriers before it folds constants: the "
                          "layer constant still reaches each layer's kernels (benchmarks/RESULTS.md, 'One compile "
                          "for every layer's cache ops')")
@pytest.mark.parametrize("layer_kind", ["int", "numpy", "array"])
def test_a_python_loop_of_layers_compiles_its_cache_kernels_once(layer_kind):
    """A model whose layers are a Python loop passes constant layer indices (an int, a numpy
    int, a concrete array made outside the jit): every layer's append and attention kernels are the same program,
    so XLA's CPU backend compiles them once (`api._opaque_layer`). Four layers add at most two
    distinct cache kernels to two layers' (before: 37 -> 57); the outputs equal the same calls
    outside jit, on fresh random data (checked first: on JAX 0.10 too)."""
    layout = aj.KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, page_size=8, num_pages=16, max_seqs=2,
                         max_pages_per_seq=4, dtype=jnp.float32)  # fmt: skip
    slots, ones = jnp.arange(2, dtype=jnp.int32), jnp.ones((2,), jnp.int32)
    rng = np.random.default_rng()
    data = [[jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(4)]
            for shape in ((2, 1, 4, 16), (2, 1, 2, 16), (2, 1, 2, 16))]  # q, k, v a layer (arguments, not constants)
    # (an array made outside the jit: one made inside is a tracer, which the ops cannot tell
    # from a layer scan's counter)
    layers = {"int": list(range(4)), "numpy": list(np.arange(4, dtype=np.int32)),
              "array": [jnp.int32(i) for i in range(4)]}[layer_kind]  # fmt: skip

    def step(cache, qs, ks, vs):
        step, _ = aj.begin_step(cache, slots, ones, width=1)
        outs = []
        for layer, (q, k, v) in enumerate(zip(qs, ks, vs)):
            step, out = step.attend(layers[layer], q, k, v)
            outs.append(out)
        return step.cache, outs

    def cache_kernels(layers):
        args = [d[:layers] for d in data]
        text = jax.jit(step).lower(aj.create(layout), *args).compile().as_text()
        return {sig for name in ("jit(_append)", "jit(_attend)") for sig in kernel_signatures(text, op_name=name)}

    cache, outs = jax.jit(step)(aj.create(layout), *data)
    eager_cache, eager_outs = step(aj.create(layout), *data)
    for got, want in zip(outs, eager_outs):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(cache.k), np.asarray(eager_cache.k))
    assert all(float(jnp.abs(o).sum()) > 0 for o in outs)  # every layer read what it wrote
    two, four = cache_kernels(2), cache_kernels(4)
    # (XLA fuses the layers' chain of counter adds in one kernel, whose body grows with the
    # layers: a kernel or two, not a layer's worth of them.)
    assert two and len(four - two) <= 2


def test_reserve_copies_pages_only_under_a_conditional():
    """The copy-on-write gather of every row's last page (all layers and heads) is not run
    when no row copies: it sits in a branch of a conditional."""
    layout = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=8, num_pages=16, max_seqs=2,
                         max_pages_per_seq=4, dtype=jnp.float32)  # fmt: skip
    slots = jnp.arange(2, dtype=jnp.int32)
    text = api._reserve.lower(aj.create(layout), slots, jnp.ones((2,), jnp.int32)).compile().as_text()
    assert " conditional(" in text


def _branch_kernels(text: str) -> list[int]:
    """The kernels in each branch of the (one) conditional of an optimized HLO module's entry."""
    per_computation: dict = {}
    for computation, _, _, kernel in _instructions(text):
        per_computation[computation] = per_computation.get(computation, 0) + kernel
    line = next(line for line in text.splitlines() if " conditional(" in line)
    names = re.search(r"branch_computations=\{([^}]*)\}", line).group(1)
    return [per_computation.get(name.strip().lstrip("%"), 0) for name in names.split(",")]


def test_reserve_s_in_place_branch_runs_almost_nothing():
    """A decode step's usual `reserve` (no page popped) takes the conditional's in-place branch:
    it returns the table as it is and its rows packed in one array, so it runs a kernel or two
    (it ran 8 when each branch wrote lengths, flags and counters of its own and returned them
    apart; RESULTS.md, session 41)."""
    layout = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=8, num_pages=32, max_seqs=4,
                         max_pages_per_seq=8, dtype=jnp.float32)  # fmt: skip
    slots = jnp.arange(4, dtype=jnp.int32)
    text = api._reserve.lower(aj.create(layout), slots, jnp.ones((4,), jnp.int32)).compile().as_text()
    in_place, allocator = sorted(_branch_kernels(text))
    assert in_place <= 2, in_place
    assert allocator >= 10  # (the other branch: the allocator's classification, pops and scatter)


def test_a_python_loop_of_layers_writes_the_page_table_as_often_whatever_its_depth():
    """Inside jit, `CacheStep` sets every layer's watermark at the commit (`step.cache`), not in
    each layer's append: the kernels that write the page table (`s32[W]`, its one array) are as
    many for 4 layers as for 2 (before: 2 more a layer, a watermark scatter and a copy)."""
    def table_writes(num_layers):
        layout = aj.KVLayout(num_layers=num_layers, num_kv_heads=2, head_dim=16, page_size=8, num_pages=16,
                             max_seqs=2, max_pages_per_seq=4, dtype=jnp.float32)  # fmt: skip
        slots, ones = jnp.arange(2, dtype=jnp.int32), jnp.ones((2,), jnp.int32)
        rng = np.random.default_rng()
        q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((2, 1, 4, 16), (2, 1, 2, 16), (2, 1, 2, 16)))

        def step(cache):
            step, _ = aj.begin_step(cache, slots, ones, width=1)
            for layer in range(num_layers):
                step, _ = step.attend(layer, q, k, v)
            return step.cache

        cache = aj.create(layout)
        width = cache.table.packed.shape[0]
        text = jax.jit(step).lower(cache).compile().as_text()
        return sum(kernel and line.partition(" = ")[2].startswith(f"s32[{width}]") for _, _, line, kernel in _instructions(text))

    two, four = table_writes(2), table_writes(4)
    assert two > 0 and four == two
