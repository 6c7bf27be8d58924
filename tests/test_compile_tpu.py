"""The Mosaic TPU kernels, and whole model steps that use them, compile for TPU v5e / v6e without a TPU.

`libtpu` (`bash scripts/install_tpu_tools.sh`: the `jax[tpu]` extra's libtpu pinned to the
installed jax) gives TPU devices of a topology (`v5e:2x2`, `v6e:2x4`) on any host; a jitted
function lowered with inputs placed on them compiles with the TPU's XLA and Mosaic compilers
(`pallas_kernels.offline.tpu`). The tests check what the compiled module says:

- every kernel variant (`pallas_kernels.offline.tpu_variants`) compiles for v5e (a subset for v6e), XLA
  copies no array as large as a quarter of the arena (no relayout, no defensive copy), append
  aliases the donated arena (and scales) to its outputs, attention fits VMEM;
- the two limits of `tpu_unsupported_reason` that come from layouts are real: a head_dim-64
  arena, and the scales of an 8-bit arena with 16-token pages, get copied whole by XLA;
- `models.prefill` / `models.decode_step` of a Llama-3-8B-shaped model (1 of its 32 identical
  layers in CI; `arena-bench kernels --compile-report --target tpu-v5e --steps` compiles all
  32), on a data x tensor mesh of v5e 2x2 / v6e 2x4 devices with the cache donated: the
  arena's parameters are aliased to outputs, never copied, and the Mosaic kernels are in it;
- the host tier's page moves (`swap_out_rows`, `swap_in_rows`, `offload_page_rows`) alias cache
  and host tier and copy neither host tier nor (bf16) arena; an int8 arena's nested relayout is
  kept as strict expected failures (RESULTS, "The host tier's page moves on a TPU").

Without libtpu the tests skip with the reason; under CI (CI=true) they fail instead.
"""
from __future__ import annotations

import dataclasses
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import compile_grid
from pallas_kernels.offline import tpu as tpu_compile
from pallas_kernels.offline.tpu_variants import CI_VARIANTS, KINDS, V6E_VARIANTS

IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
VMEM_LIMIT = 16 << 20  # Mosaic's default scoped VMEM on v5e (v6e: 32 MiB)


def gate(problem: str | None, in_ci: bool):
    """What to do when the tooling is missing: ("fail" | "skip", message), or None to run."""
    if problem is None:
        return None
    if in_ci:
        return "fail", f"CI must run the TPU compile checks, but: {problem}"
    return "skip", f"TPU compile checks need libtpu: {problem}"


@pytest.fixture(scope="module")
def tooling():
    action = gate(tpu_compile.tooling_problem(), IN_CI)
    if action is not None:
        kind, message = action
        (pytest.fail if kind == "fail" else pytest.skip)(message)


def test_gate_fails_in_ci_and_skips_elsewhere():
    assert gate(None, True) is None and gate(None, False) is None
    assert gate("libtpu is not installed", True) == ("fail", "CI must run the TPU compile checks, but: libtpu is not installed")
    assert gate("libtpu is not installed", False)[0] == "skip"


def test_matrix_covers_every_kind_and_value():
    assert {v.kind for v in CI_VARIANTS} == set(KINDS)
    attention = [v for v in CI_VARIANTS if not v.kind.startswith("append")]
    assert {v.head_dim for v in CI_VARIANTS} == {128, 256}
    assert {v.group for v in attention} >= {1, 4, 8}
    assert {v.page_size for v in CI_VARIANTS} >= {8, 16, 64, 128, 256}
    assert {v.dtype for v in CI_VARIANTS} == {"bfloat16", "float32", "int8", "float8_e4m3fn", "float8_e5m2"}
    assert {v.compute for v in CI_VARIANTS if v.quantized} == {"bfloat16", "float32"}
    assert {v.kind for v in V6E_VARIANTS} >= {"decode", "append-prefill"} and any(v.quantized for v in V6E_VARIANTS)


# ARENA_COMPILE_GRID (tests/compile_grid.py): every case of the grids below, or (the other CI line) a covering subset
@pytest.mark.parametrize("target,variant", compile_grid.params(
    "tpu", [("tpu-v5e", v) for v in CI_VARIANTS] + [("tpu-v6e", v) for v in V6E_VARIANTS],
    features=compile_grid.named_features("target", "variant"), wrap=tuple),
    ids=lambda x: x if isinstance(x, str) else x.label.replace(" ", "-"))
def test_kernel_compiles_for_tpu_without_copying_the_arena(tooling, target, variant):
    fn, args, donate = variant.call()
    compiled = tpu_compile.compile_for_tpu(fn, args, target=target, donate_argnums=donate)
    facts = tpu_compile.module_facts(compiled, big=variant.arena_bytes() // 4)
    assert facts.big_copies == (), f"XLA copies arena-sized arrays: {facts.big_copies}"
    names = sorted(k.name.split(".")[0] for k in facts.kernels)
    if variant.kind.startswith("append"):
        assert [n.split("_c")[0] for n in names] == ["tpu_append_gather", "tpu_append_scatter"], names
        assert set(donate) <= set(facts.aliased_params), f"arena params {donate} not all aliased: {facts.aliased_params}"
    else:
        assert len(names) == 1 and names[0].startswith("tpu_paged_attention"), names
        (kernel,) = facts.kernels
        assert 0 < kernel.vmem_bytes <= VMEM_LIMIT, f"{kernel.name}: {kernel.vmem_bytes} B of VMEM"
    if variant.quantized:
        assert all(n.endswith("_" + variant.dtype) for n in names), names


@pytest.mark.parametrize("dtype,head_dim,page_size", [("bfloat16", 64, 16), ("int8", 128, 16)], ids=str)
def test_layouts_the_tpu_kernels_refuse_would_copy_the_arena(tooling, dtype, head_dim, page_size):
    """What `tpu_unsupported_reason` refuses, measured: the kernel itself compiles (called
    past the wrapper's check), but the TPU's default layout for a minor dim < 128 is not
    row-major, so XLA relayouts the whole arena (head_dim 64) or the scales (pages of 16)
    around the kernel on every call."""
    from pallas_kernels.tpu.attention import TpuAttentionTiles, _tpu_attention_call

    sds = jax.ShapeDtypeStruct
    arena = sds((2, 8, 2048, page_size, head_dim), jnp.dtype(dtype))
    quantized = dtype == "int8"
    scale = sds((2, 8, 2048, page_size), jnp.float32) if quantized else None
    q, rows = sds((8, 1, 32, head_dim), jnp.bfloat16), (sds((8, 64), jnp.int32), sds((8,), jnp.int32), sds((8,), jnp.int32))
    tiles = TpuAttentionTiles.choose(tokens=1, group=4, page_size=page_size, max_pages=64, block_sizes=None)

    def fn(q, ka, va, pm, lengths, n, *scales):
        meta = jnp.zeros((2,), jnp.int32)
        ks, vs = scales if quantized else (None, None)
        return _tpu_attention_call(q, ka, va, meta, pm, lengths, n, ks, vs, sm_scale=0.1, has_window=False,
                                   window_bound=None, soft_cap=None, tiles=tiles, interpret=False)

    extra = (scale, scale) if quantized else ()
    compiled = tpu_compile.compile_for_tpu(fn, (q, arena, arena, *rows, *extra), target="tpu-v5e")
    big = (scale.size * 4 if quantized else arena.size * arena.dtype.itemsize) // 2
    copies = tpu_compile.module_facts(compiled, big=big).big_copies
    assert copies, "expected XLA to relayout the arena / scales (the reason the TPU kernels refuse this layout)"


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_scale_rows_reach_the_kernel_without_a_copy(tooling, page_size):
    """8-bit pages under 128 with scales as rows of 128 lanes (`scale_rows`): the decode call
    compiles for v5e and XLA copies neither the arena (at pages of 32 and 64 also passed as rows for
    the aligned runs of pages, `attention.row_pages`) nor the scales around it (the [L, H, P, S]
    form above is relayouted), and 8-bit pages under 128 still need the rows: the cache does not
    store them yet, so `tpu_unsupported_reason` refuses those pages without `scale_rows`."""
    from pallas_kernels.tpu.attention import RUN_PAGE_SIZES, tpu_paged_attention
    from pallas_kernels.tpu.common import tpu_unsupported_reason

    sds = jax.ShapeDtypeStruct
    arena = sds((2, 8, 2048, page_size, 128), jnp.int8)
    scale = sds((2, 8, 2048 * page_size // 128, 128), jnp.float32)
    q, rows = sds((8, 1, 32, 128), jnp.bfloat16), (sds((8, 64), jnp.int32), sds((8,), jnp.int32), sds((8,), jnp.int32))

    def fn(q, ka, va, pm, lengths, n, ks, vs):
        return tpu_paged_attention(q, ka, va, 1, pm, lengths, n, k_scale=ks, v_scale=vs, interpret=False)

    compiled = tpu_compile.compile_for_tpu(fn, (q, arena, arena, *rows, scale, scale), target="tpu-v5e")
    facts = tpu_compile.module_facts(compiled, big=scale.size * 4 // 4)
    assert facts.big_copies == (), facts.big_copies
    runs = "_runs" if page_size in RUN_PAGE_SIZES else ""  # (blocks of aligned runs read from the arena as rows)
    assert [k.name.split(".")[0] for k in facts.kernels] == [f"tpu_paged_attention_bt1_g4_bk512x2_h8_d128_int8{runs}"]
    common = dict(head_dim=128, page_size=page_size, dtype=jnp.int8, scale_dtype=jnp.float32)
    assert tpu_unsupported_reason(**common, scale_rows=True) is None
    assert "scale_rows" in tpu_unsupported_reason(**common)


def test_a_mixed_call_over_scale_rows_reads_runs_without_a_copy(tooling):
    """The mixed call (decode rows and a prompt chunk in one kernel) over 8-bit scale rows, pages of
    32: its decode part reads runs (the `_runs` kernel: the arenas also passed as rows) and it
    compiles for v6e with neither the arena nor the scales copied."""
    from pallas_kernels.tpu.mixed import tpu_paged_attention_mixed

    sds = jax.ShapeDtypeStruct
    arena = sds((2, 8, 2048, 32, 128), jnp.int8)
    scale = sds((2, 8, 2048 * 32 // 128, 128), jnp.float32)
    i32 = jnp.int32

    def fn(qd, qp, ka, va, ks, vs, pmd, nd, td, pmp, np_, tp):
        return tpu_paged_attention_mixed(qd, qp, ka, va, 1, pmd, nd, td, pmp, np_, tp, k_scale=ks, v_scale=vs,
                                         interpret=False)

    args = (sds((8, 1, 32, 128), jnp.bfloat16), sds((1, 128, 32, 128), jnp.bfloat16), arena, arena, scale, scale,
            sds((8, 64), i32), sds((8,), i32), sds((8,), i32), sds((1, 64), i32), sds((1,), i32), sds((1,), i32))
    compiled = tpu_compile.compile_for_tpu(fn, args, target="tpu-v6e")
    facts = tpu_compile.module_facts(compiled, big=scale.size * 4)  # the scales' bytes (the chunk's q regrouped: less)
    assert facts.big_copies == (), facts.big_copies
    assert [k.name.split(".")[0] for k in facts.kernels] == ["tpu_paged_attention_mixed_bt128_g4_bk512x2_h8_d128_int8_runs"]


@pytest.mark.parametrize("page_size,tokens", [(16, 1), (32, 256)], ids=str)
def test_append_over_scale_rows_compiles_in_place(tooling, page_size, tokens):
    """The append kernel over scale rows (`scale_rows`: rows shared by 128 / S pages, merged in
    XLA, each read and written once by DMA) compiles for v5e with the arena and its scale rows
    aliased, and XLA copies none of them."""
    from pallas_kernels.tpu.append import tpu_paged_append

    sds = jax.ShapeDtypeStruct
    arena = sds((2, 8, 2048, page_size, 128), jnp.int8)
    scale = sds((2, 8, 2048 * page_size // 128, 128), jnp.float32)
    batch = 32 if tokens == 1 else 4
    kv = sds((batch, tokens, 8, 128), jnp.bfloat16)
    rows = (sds((batch, 64), jnp.int32), sds((batch,), jnp.int32), sds((batch,), jnp.int32))

    def fn(ka, va, ks, vs, k, v, pm, lengths, n):
        return tpu_paged_append(ka, va, 1, k, v, pm, lengths, n, k_scale=ks, v_scale=vs, interpret=False)

    compiled = tpu_compile.compile_for_tpu(fn, (arena, arena, scale, scale, kv, kv, *rows), target="tpu-v5e",
                                           donate_argnums=(0, 1, 2, 3))
    assert tpu_compile.module_facts(compiled, big=arena.size // 4).big_copies == ()  # (as every append variant)
    facts = tpu_compile.module_facts(compiled, big=scale.size * 4 // 4)
    assert [c for c in facts.big_copies if c[1].startswith("f32")] == []  # no copy of a quarter of the scales
    assert {0, 1, 2, 3} <= set(facts.aliased_params), facts.aliased_params


@pytest.mark.parametrize("rows,fits", [(16, True), (32, False)])
def test_smem_budget_is_what_mosaic_allows(tooling, rows, fits):
    """A 512 KiB page table compiles; a 1 MiB one does not ("Ran out of memory in memory
    space smem"): the reason for `tpu.common.SMEM_TABLE_BYTES` (960 KiB)."""
    from pallas_kernels.tpu.attention import TpuAttentionTiles, _tpu_attention_call

    sds = jax.ShapeDtypeStruct
    arena = sds((2, 8, 4096, 128, 128), jnp.bfloat16)  # 128-token pages: 4 DMAs per block, a quick compile
    tiles = TpuAttentionTiles.choose(tokens=1, group=4, page_size=128, max_pages=8192, block_sizes=None)
    fn = lambda q, ka, va, pm, lengths, n: _tpu_attention_call(  # noqa: E731
        q, ka, va, jnp.zeros((2,), jnp.int32), pm, lengths, n, None, None, sm_scale=0.1, has_window=False,
        window_bound=None, soft_cap=None, tiles=tiles, interpret=False)
    args = (sds((rows, 1, 32, 128), jnp.bfloat16), arena, arena, sds((rows, 8192), jnp.int32), sds((rows,), jnp.int32),
            sds((rows,), jnp.int32))
    if fits:
        tpu_compile.compile_for_tpu(fn, args, target="tpu-v5e")
    else:
        with pytest.raises(Exception, match="smem"):
            tpu_compile.compile_for_tpu(fn, args, target="tpu-v5e")


def _step_cases():
    """CI: one layer of the 32 (all identical), decode on v6e 2x4, a 64-token prefill on v5e 2x2,
    decode on an int8 arena with rotated keys (its default: the rotation runs in XLA around
    the kernels) on v6e, in pages of 128 and of 16 (scale rows), and a mixed step (decode rows and prompt chunks, each part through its
    own attention kernel call) on v5e 2x2. (A decode block, `STEP_CASES`' "decode_block", compiles in ~23 s, four
    times a step: checked by the compile report, RESULTS "Decode blocks".)"""
    from arena_jax.benchmarks.tpu_steps import STEP_CASES

    by_name = {(c.step, c.target, c.dtype): c for c in STEP_CASES}
    decode_v6e = by_name[("decode", "tpu-v6e", "bfloat16")]
    return [dataclasses.replace(decode_v6e, num_layers=1),
            dataclasses.replace(by_name[("prefill", "tpu-v5e", "bfloat16")], num_layers=1, tokens=64),
            dataclasses.replace(decode_v6e, num_layers=1, page_size=128, num_pages=2048, dtype="int8"),
            dataclasses.replace(decode_v6e, num_layers=1, page_size=16, num_pages=16384, dtype="int8"),  # scale rows
            dataclasses.replace(by_name[("mixed", "tpu-v5e", "bfloat16")], num_layers=1, tokens=64)]


STEP_FEATURES = compile_grid.some_fields("step", "target", "mesh", "dtype", "page_size")  # (sizes follow from these)


def _compiled_step_facts(case):
    """(compiled, cache, local arena shape, its HLO shape, facts, arena params) of a model step
    compiled for its TPU target; "big" copies are those of a quarter of one arena or more."""
    from arena_jax.benchmarks.tpu_steps import compile_step

    compiled, cache, _ = compile_step(case)
    local = cache.k.sharding.shard_shape(cache.k.shape)
    shape = tpu_compile.hlo_shape(str(cache.k.dtype), local)
    facts = tpu_compile.module_facts(compiled, big=(cache.k.size * cache.k.dtype.itemsize) // cache.k.sharding.num_devices // 4)
    return compiled, cache, local, shape, facts, facts.params_of_shape(shape)


@pytest.mark.slow
@pytest.mark.parametrize("case", compile_grid.params("tpu", _step_cases(), features=STEP_FEATURES),
                         ids=lambda c: c.label.replace(" ", "-"))
def test_model_step_compiles_for_tpu_with_the_arena_donated(tooling, case):
    compiled, cache, local, shape, facts, arena_params = _compiled_step_facts(case)
    assert len(arena_params) == 2, f"expected k and v params of shape {shape}: {facts.param_shapes}"
    assert set(arena_params) <= set(facts.aliased_params), (arena_params, facts.aliased_params)
    # A model weight may be copied (JAX 0.11 relayouts the q projection, [4096, 16, 128] per
    # device, the size of one head of this arena); the cache never.
    cache_copies = facts.cache_copies(arena_params)
    assert cache_copies == (), f"XLA copies arena-sized arrays: {cache_copies}"
    if cache.k_scale is not None:  # and not a quarter of the scales (scale rows: KVCache.scale_rows)
        assert cache.scale_rows == (case.page_size < 128)
        scale_facts = tpu_compile.module_facts(compiled, big=cache.k_scale.size * 4 // cache.k_scale.sharding.num_devices // 4)
        assert [c for c in scale_facts.big_copies if c[1].startswith("f32")] == [], scale_facts.big_copies
    # The CPU host's scatter workaround (`scatter.upcasts`: XLA CPU in jaxlib 0.10 converts whole
    # bf16 arrays, so writes go through uint16 bitcasts) stays out of a program lowered for a
    # TPU: no arena-shaped bitcast-convert (with it, a whole arena of temp per device).
    dims = f"[{','.join(map(str, local))}]"
    bitcasts = [line.strip()[:120] for line in compiled.as_text().splitlines() if dims in line and "bitcast-convert(" in line]
    assert bitcasts == [], bitcasts
    names = {re.sub(r"_(bt|c|d)\d+.*$", "", k.name.split(".")[0]) for k in facts.kernels}  # e.g. tpu_append_scatter_c16_d128
    # reserve's copy-on-write by DMA (tpu_copy_pages), append, attention (a mixed step's decode rows and
    # chunks in one call): no XLA gather/scatter on the arena
    attention = "tpu_paged_attention_mixed" if case.step == "mixed" else "tpu_paged_attention"
    assert names == {"tpu_copy_pages", attention, "tpu_append_gather", "tpu_append_scatter"}, names


INT8_ARENA_RELAYOUT = pytest.mark.xfail(strict=True, reason=(
    "known (benchmarks/RESULTS.md, 'The host tier's page moves on a TPU'): XLA's TPU layout "
    "assignment puts an int8 arena's one-page slices in another tiling (T(32,128) -> T(8,128)) "
    "through nested fusions that alias the arena; whether that moves the arena cannot be told "
    "without a TPU (XLA's cost estimate says page-sized)"))


def _host_op_facts(op, dtype, tensor=1):
    from arena_jax.benchmarks.studies.tpu_host_tier import arena_bytes, compile_host_op

    compiled, cache, host = compile_host_op(op, dtype, num_layers=2, tensor=tensor)
    size = arena_bytes(cache)  # per device
    facts = tpu_compile.module_facts(compiled, big=size // 4)
    arena_shape = tpu_compile.hlo_shape(dtype, cache.k.sharding.shard_shape(cache.k.shape))
    return facts, size, arena_shape, cache, host


@pytest.mark.parametrize("op,dtype,tensor", compile_grid.params(
    "tpu", [(op, dtype, tensor) for dtype, tensor in [("bfloat16", 1), ("int8", 1), ("int8", 2)]
            for op in ["swap_out_rows", "swap_in_rows", "offload_page_rows"]],
    features=compile_grid.named_features("op", "dtype", "tensor"), wrap=tuple))
def test_host_tier_ops_compile_for_tpu_without_copying_the_host_tier(tooling, op, dtype, tensor):
    """The host tier's page moves (`models.steps.swap_out_rows` & co., a loop of one-page
    dynamic slices across memory kinds) compiled for a v5e (one device, or KV heads split over
    2), cache and host tier donated: both aliased in place, nothing copied but (int8, the next
    test) the arena's own relayout, and a few pages of temp. An int8 arena's host pages are
    32-bit words there (`arena_jax.host.host_page_format`): as int8 pages, XLA copied the whole
    host tier to the device and back for each call (1 GiB of temp at the Llama-3-8B geometry)."""
    facts, size, arena_shape, cache, host = _host_op_facts(op, dtype, tensor)
    host_k = host.pages["k"]
    host_shape = tpu_compile.hlo_shape(str(host_k.dtype), host_k.sharding.shard_shape(host_k.shape))
    arena_params, host_params = facts.params_of_shape(arena_shape), facts.params_of_shape(host_shape)
    assert len(arena_params) == 2 and len(host_params) == 2, facts.param_shapes
    assert set(arena_params + host_params) <= set(facts.aliased_params), facts.aliased_params
    others = [c for c in facts.big_copies if c[1] != arena_shape]
    assert others == [], f"XLA copies host-tier-sized arrays: {others}"
    tier = int(np.prod(host_k.sharding.shard_shape(host_k.shape))) * host_k.dtype.itemsize  # per device
    assert facts.temp_bytes < tier // 8, f"temp {facts.temp_bytes} bytes (the host tier's k: {tier})"


@pytest.mark.parametrize("op", ["swap_out_rows", "swap_in_rows", "offload_page_rows"])
def test_host_tier_ops_over_scale_rows_compile_for_tpu(tooling, op):
    """An int8 arena in 16-token pages (scale rows, `KVCache.scale_rows`): the host tier keeps a
    128-lane row a host page for its scales and moves a page's lanes on the device side
    (`host.ops._move_scale_lanes`; as 16-lane host slices it did not compile: "Slicing lane
    dimension is only supported when the lane slice size is a multiple of LaneCount"). Compiled
    for v5e: the scale rows and the host scales aliased, none of them copied, temp under an eighth
    of the host tier's k (as the host-tier tests below: ~1 MiB, as at 128-token pages)."""
    from arena_jax.benchmarks.studies.tpu_host_tier import compile_host_op

    compiled, cache, host = compile_host_op(op, "int8", num_layers=2, page_size=16)
    assert cache.scale_rows and host.pages["k_scale"].shape == (2, 8, host.held.shape[0], 128)
    scales = cache.k_scale.size * 4
    facts = tpu_compile.module_facts(compiled, big=scales // 4)
    assert [c for c in facts.big_copies if c[1].startswith("f32")] == [], facts.big_copies
    for x in (cache.k_scale, host.pages["k_scale"]):
        params = facts.params_of_shape(tpu_compile.hlo_shape("float32", x.shape))
        assert len(params) == 2 and set(params) <= set(facts.aliased_params), (params, facts.aliased_params)
    host_k = host.pages["k"]
    assert facts.temp_bytes < host_k.size * host_k.dtype.itemsize // 8, facts.temp_bytes  # (as the tests below)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("int8", marks=INT8_ARENA_RELAYOUT)])
@pytest.mark.parametrize("op", ["swap_out_rows", "swap_in_rows", "offload_page_rows"])
def test_host_tier_ops_compile_for_tpu_without_copying_the_arena(tooling, op, dtype):
    facts, _, arena_shape, _, _ = _host_op_facts(op, dtype)
    arena_copies = [c for c in facts.big_copies if c[1] == arena_shape]
    assert arena_copies == [], f"arena-shaped copies: {arena_copies}"


def test_a_cache_on_a_tpu_mesh_gets_no_warning_about_the_cpus_writes(tooling):
    """The warning that appends copy the arena (XLA CPU in jaxlib 0.10 updates no bf16 array in
    place) comes with an append traced on the host's own backend (tests/test_scatter.py), never
    from `aj.create`: a cache sized for a TPU mesh from a CPU host gets none, nor the same layout
    on the host."""
    import warnings

    import arena_jax as aj
    from arena_jax import arena_ops

    layout = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=128, page_size=16, num_pages=8, max_seqs=2,
                         max_pages_per_seq=4, dtype="bfloat16")  # fmt: skip
    mesh = tpu_compile.mesh_of("tpu-v5e", "2x2", ("data", "tensor"))
    for where in (mesh, None):
        arena_ops._WRITE_COPY_WARNED.discard(jnp.dtype(jnp.bfloat16))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            jax.eval_shape(lambda: aj.create(layout, mesh=where, tensor_axis="tensor"))  # noqa: B023
        copies = [w for w in caught if "cannot update bfloat16" in str(w.message)]
        assert not copies, (where, [str(w.message) for w in caught])


def test_an_int4_cache_on_a_tpu_mesh_is_refused_with_the_reason(tooling, monkeypatch):
    """`aj.create` refuses an int4 layout on a TPU mesh, naming dtype, the measured cost (the next
    test) and what to use instead; on the CPU host it creates it. $ARENA_JAX_ALLOW_INT4_ON_TPU=1
    creates it on the TPU mesh with a warning (how the next test and the benchmark measure it)."""
    import warnings

    import arena_jax as aj
    from arena_jax import state

    layout = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=128, page_size=16, num_pages=8, max_seqs=2,
                         max_pages_per_seq=4, dtype="int4")  # fmt: skip
    mesh = tpu_compile.mesh_of("tpu-v5e", "2x2", ("data", "tensor"))
    monkeypatch.delenv(state.ALLOW_INT4_ON_TPU_ENV, raising=False)
    jax.eval_shape(lambda: aj.create(layout, tensor_axis="tensor"))  # the CPU host
    with pytest.raises(ValueError, match=r"dtype='int4' is refused on a TPU: .*64 bytes.*4 per token.*13\.3 GB.*int8"):
        aj.create(layout, mesh=mesh, tensor_axis="tensor")
    monkeypatch.setenv(state.ALLOW_INT4_ON_TPU_ENV, "1")
    state._WRITE_COPY_WARNED.discard("int4 on tpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(lambda: aj.create(layout, mesh=mesh, tensor_axis="tensor"))
    assert any("an int4 arena on a TPU" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.xfail(strict=True, reason=(
    "known (benchmarks/RESULTS.md, 'int4 arenas on a TPU'; aj.create refuses it there): an int4 arena's packed "
    "rows (64 bytes at head_dim 128) and group scales (4 per token) are narrower than the TPU's 128 "
    "lanes, so XLA relayouts the arena and its scales around the step (1 layer: six arena-sized copies)"))
def test_an_int4_decode_step_compiles_for_tpu_without_copying_the_arena(tooling, monkeypatch):
    """Llama-3-8B-shaped decode (1 layer) on a v6e 2x4 mesh with an int4 arena (the TPU kernels
    take no int4: the blockwise jnp path runs): the arena must be aliased and never copied, as
    for bf16 and int8 arenas. It is copied today (strict xfail: when a layout change or XLA
    removes the copies, this fails, and the refusal and the docs go). The relayout comes from
    the packed rows' width, not the arena's size: 8 rows of up to 128 tokens in 256 pages show
    the same copies as the benchmark's 64 rows in 16,384 pages, and compile in a third of the
    time (10 s against 33 s of CPU, JAX 0.11.2)."""
    from arena_jax.benchmarks.tpu_steps import STEP_CASES

    monkeypatch.setenv("ARENA_JAX_ALLOW_INT4_ON_TPU", "1")  # aj.create refuses it on a TPU otherwise
    int4 = next(c for c in STEP_CASES if c.dtype == "int4")
    small = dataclasses.replace(int4, num_layers=1, batch=8, num_pages=256, max_seq_len=128)
    _, cache, local, shape, facts, arena_params = _compiled_step_facts(small)
    assert len(arena_params) == 2 and set(arena_params) <= set(facts.aliased_params), facts.aliased_params
    one_layer = tpu_compile.hlo_shape(str(cache.k.dtype), local[1:])
    arena_copies = [c for c in facts.big_copies if c[1] in (shape, one_layer)]
    assert arena_copies == [], f"XLA copies the arena (or one layer of it): {arena_copies}"
