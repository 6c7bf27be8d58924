"""Many devices: checks that need 8 devices, run by `tests/test_sharding.py` in ONE subprocess
with `XLA_FLAGS=--xla_force_host_platform_device_count=8` (set before JAX starts; the main
pytest process already has its single CPU device). Not collected on its own (no `test_`
prefix); to run it by hand:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu pytest tests/sharded_checks.py

Oracles: a sharded cache must behave exactly like single-device caches, one per data shard
(local slots and pages), on the same operations: tables equal, every stored head of every
shard equal to the head it replicates, attention equal; a sharded model must give the
single-device model's greedy tokens. And the compiled steps must not move pages between
devices (HLO) and must update every shard in place (buffer pointers).
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models
from test_jax_bug_shardy_empty_operand import zero_sized_manual_operands

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (see the module docstring)")

# page_size 5 with head_dim 16: a shape ending in [5, 16] is a page (or the arena); no activation has it.
LAYOUT = aj.KVLayout(num_layers=1, num_kv_heads=4, head_dim=16, page_size=5, num_pages=20, max_seqs=4,
                     max_pages_per_seq=4, dtype="float32")  # fmt: skip
Q_HEADS = 8
PAD = aj.PAD_SLOT
FAR = 10**6  # an out-of-range slot: what a row naming another data shard's slot is to that shard
ATOL = 2e-5  # Pallas (interpret) attention vs the reference oracle, f32, head_dim 16

# Every compile costs seconds on a 2-core CI machine, so the whole-scenario oracle check runs on
# the mesh that exercises the most code at once: data shards (own slots, pages, free stacks)
# times tensor shards holding replicated KV heads (2 KV heads on 4 tensor shards: each stored
# twice). The Pallas kernels are checked on the same cache against the reference path; the
# model checks below run every mesh the issue names (tp=1/2/4/8, dp=2 x tp=4), with KV heads
# split (tp=2) and replicated (tp=4, 8), through the same ops.
MESH, HEADS = (2, 4), 2


def make_mesh(shape):
    return jax.make_mesh(shape, ("data", "tensor"), devices=jax.devices()[: shape[0] * shape[1]])


# ---- one jitted scenario: every op, ragged rows, forks, copy-on-write, truncation ---------------


def scenario_inputs(heads):
    rng = np.random.default_rng(heads)
    return rng.normal(size=(4, 12, heads, 16)).astype(np.float32), rng.normal(size=(4, 4, Q_HEADS, 16)).astype(np.float32)


COUNTS = np.asarray([[7, 0, 12, 0], [0, 0, 0, 0], [2, 3, 1, 4], [3, 9, 13, 11], [0, 0, 0, 0], [4, 0, 6, 0]], np.int32)


def _scenario(cache, slots, counts, k, q, backend):
    """slots, counts: i32[6, B] (one batch per op below); k [B, 12, H, 16]; q [B, 4, N, 16]."""
    outs = {}
    cache, outs["ok_first"] = aj.reserve(cache, slots[0], counts[0])
    cache = aj.append(cache, 0, slots[0], k, -k, num_tokens=counts[0], backend=backend)
    cache = aj.fork(cache, slots[0], slots[1])  # 0 -> 1 and 2 -> 3: within each data shard
    cache, outs["ok_cow"] = aj.reserve(cache, slots[2], counts[2])  # shared partial pages: copy-on-write
    cache = aj.append(cache, 0, slots[2], 2 * k[:, :4], k[:, :4], num_tokens=counts[2], backend=backend)
    outs["attn"] = aj.attend(q, cache, 0, slots[2], num_tokens=counts[2], backend=backend)
    cache = aj.truncate(cache, slots[3], counts[3])
    cache = aj.release(cache, slots[4])
    cache, outs["ok_cross"] = aj.reserve(cache, slots[5], counts[5])  # dp: rows naming another shard's slot
    cache = aj.append(cache, 0, slots[5], k[:, :6], k[:, :6], num_tokens=counts[5], backend=backend)
    outs["attn_cross"] = aj.attend(q[:, :1], cache, 0, slots[5], backend=backend)
    return cache, outs


scenario = jax.jit(_scenario, static_argnames="backend", donate_argnames="cache")


def global_slots(dp):
    """The ops' batches for a cache of 4 slots split over dp shards (rows in dp blocks)."""
    cross = [3, PAD, 0, PAD] if dp == 2 else [3, PAD, 1, PAD]  # dp=2: rows 0 and 2 name the other shard's slot
    return np.asarray([[0, PAD, 2, PAD], [1, PAD, 3, PAD], [0, 1, 2, 3], [0, 1, 2, 3], [PAD, 1, 2, PAD], cross], np.int32)


def local_slots(slots, dp, shard):
    """Row block `shard` of each batch, slots made local to it (another shard's slot: FAR)."""
    per = 4 // dp
    rows = slots[:, shard * per : (shard + 1) * per]
    mine = (rows >= shard * per) & (rows < (shard + 1) * per)
    return np.where(rows == PAD, PAD, np.where(mine, rows - shard * per, FAR)).astype(np.int32)


def oracle(heads, dp, dtype="float32", k=None, key_factors=None):
    """Per data shard: the scenario on a single-device cache of that shard's slots and pages
    (reference backend: the ground truth of both sharded backends). Smoothed keys: each
    single-device cache is created with the same `key_factors` as the sharded one."""
    layout = dataclasses.replace(LAYOUT, num_kv_heads=heads, num_pages=LAYOUT.num_pages // dp, max_seqs=4 // dp,
                                 dtype=dtype, smooth_keys=key_factors is not None)  # fmt: skip
    k = scenario_inputs(heads)[0] if k is None else k
    q = scenario_inputs(heads)[1]
    slots = global_slots(dp)
    runs = []
    for d in range(dp):
        block = slice(d * (4 // dp), (d + 1) * (4 // dp))
        fresh = aj.create(layout, key_factors=key_factors)
        cache, outs = scenario(fresh, jnp.asarray(local_slots(slots, dp, d)), jnp.asarray(COUNTS[:, block]),
                               k[block], q[block], backend="reference")  # fmt: skip
        runs.append(jax.device_get((cache, outs)))
    return runs


COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter|collective-broadcast|"
                        r"ragged-all-to-all)(-start)?\(")  # fmt: skip


def collectives(hlo: str) -> list[tuple[str, str]]:
    """(op, result shape) of every collective in a compiled module's text (one per instruction line)."""
    found = []
    for line in hlo.splitlines():
        m = COLLECTIVE.search(line)
        if m:
            found.append((m.group(2), m.group(1)))
    return found


def moves_pages(shape: str, page_size: int = 5, head_dim: int = 16) -> bool:
    """A result shape with a [..., page_size, head_dim] tail: pages (or the arena) moving."""
    return any(s.endswith(f"{page_size},{head_dim}]") for s in re.findall(r"\[[\d,]*\]", shape))


def shard_pointers(x) -> list[int]:
    return [s.data.unsafe_buffer_pointer() for s in x.addressable_shards]


@pytest.fixture(scope="module")
def scenario_run():
    """The scenario on a dp=2 x tp=4 cache (reference backend), with its compiled HLO and the
    arena's shard pointers before and after."""
    layout = dataclasses.replace(LAYOUT, num_kv_heads=HEADS)
    cache = aj.create(layout, mesh=make_mesh(MESH), data_axis="data")
    k, q = scenario_inputs(HEADS)
    slots, counts = jnp.asarray(global_slots(MESH[0])), jnp.asarray(COUNTS)
    compiled = scenario.lower(cache, slots, counts, k, q, backend="reference").compile()
    before = (shard_pointers(cache.k), shard_pointers(cache.v))
    sizes = {s.data.nbytes for s in cache.k.addressable_shards}
    cache, outs = compiled(cache, slots, counts, k, q)
    after = (shard_pointers(cache.k), shard_pointers(cache.v))
    return layout, cache, outs, compiled.as_text(), before, after, sizes


def test_cache_ops_equal_single_device_per_shard(scenario_run):
    layout, cache, outs, hlo, before, after, sizes = scenario_run
    dp, tp = MESH
    sh = cache.sharding
    replicas = tp // HEADS
    assert sh.kv_replicas == replicas == 2 and cache.layout == layout
    # Per-device bytes: each device holds 1/(tp*dp) of the stored arena (2 copies of each head),
    # and the report says so: half the single-device bytes per token, not a quarter.
    assert cache.k.shape == (1, HEADS * replicas, 20, 5, 16)
    assert sizes == {cache.k.nbytes // (tp * dp)}
    assert 2 * cache.k.nbytes // (tp * dp) == sh.arena_bytes_per_device(layout)
    assert sh.bytes_per_token_per_device(layout) * tp == layout.bytes_per_token * replicas
    found = collectives(hlo)
    assert not found, f"the cache ops communicate: {found}"  # not even a table entry moves
    assert after == before, "an arena shard was not updated in place"

    got_cache, got = jax.device_get((cache, outs))
    per, pages = 4 // dp, 20 // dp
    for d, (want_cache, want) in enumerate(oracle(HEADS, dp)):
        rows, page_rows = slice(d * per, (d + 1) * per), slice(d * pages, (d + 1) * pages)
        t, w = got_cache.table, want_cache.table
        for field in ("page_map", "lengths", "active"):
            np.testing.assert_array_equal(getattr(t, field)[rows], getattr(w, field), err_msg=f"{field}, shard {d}")
        for field in ("free_stack", "refcount"):
            np.testing.assert_array_equal(getattr(t, field)[page_rows], getattr(w, field), err_msg=f"{field}, shard {d}")
        np.testing.assert_array_equal(t.written[:, rows], w.written)
        np.testing.assert_array_equal(t.num_free[d], w.num_free)
        for f in dataclasses.fields(got_cache.stats):
            np.testing.assert_array_equal(getattr(got_cache.stats, f.name)[d], getattr(want_cache.stats, f.name),
                                          err_msg=f"stats.{f.name}, shard {d}")  # fmt: skip
        for stored in range(HEADS * replicas):  # every replica of every head holds that head's pages
            np.testing.assert_array_equal(got_cache.k[:, stored, page_rows], want_cache.k[:, stored // replicas])
            np.testing.assert_array_equal(got_cache.v[:, stored, page_rows], want_cache.v[:, stored // replicas])
        for key in want:
            np.testing.assert_allclose(got[key][rows], want[key], rtol=0, atol=1e-6, err_msg=f"{key}, shard {d}")
    # the cross-shard rows were refused and counted, in the shard that got them
    assert not got["ok_cross"][0] and not got["ok_cross"][2] and not got["attn_cross"][[0, 2]].any()
    assert got_cache.stats.rejected_rows.tolist() == [2, 2]  # reserve + append, one row each
    health = aj.health(cache)
    assert health["arena_bytes_per_device"] == sh.arena_bytes_per_device(layout)
    assert health["free_pages"] == int(np.sum(got_cache.table.num_free)) and health["kv_replicas"] == 2


def test_an_8bit_cache_equals_single_device_per_shard():
    """int8 values and their per-token scales are split like the arena: the scenario on a
    dp=2 x tp=4 int8 cache equals single-device int8 caches, one per data shard. Its keys are
    smoothed (int8's default): the factors given at create (calibrated on keys with a channel
    8x the rest) are split over heads like the arena, replicas holding their head's, one set
    for all data shards, and no write changes them."""
    from cache_model import numpy_key_factors

    dp, tp = MESH
    replicas = tp // HEADS
    layout = dataclasses.replace(LAYOUT, num_kv_heads=HEADS, dtype="int8", smooth_keys=True)
    k, q = scenario_inputs(HEADS)
    k[2, :, :, 5] *= 8  # row 2: data shard 1's block
    given = aj.key_factors.from_keys(k[None])[0][None]  # [1, HEADS, 16], from every row's keys
    cache = aj.create(layout, mesh=make_mesh(MESH), data_axis="data", key_factors=given)
    assert cache.k_scale.sharding.spec == cache.k.sharding.spec
    assert cache.key_factors.sharding.spec == jax.sharding.PartitionSpec(None, "tensor")
    assert cache.sharding.bytes_per_token_per_device(layout) * tp == layout.bytes_per_token * (tp // HEADS)
    cache, outs = scenario(cache, jnp.asarray(global_slots(dp)), jnp.asarray(COUNTS), k, q, backend="reference")
    got_cache, got = jax.device_get((cache, outs))
    factors = got_cache.key_factors  # [1, HEADS * replicas, 16]
    np.testing.assert_array_equal(factors[0, ::replicas], numpy_key_factors(k.reshape(-1, HEADS, k.shape[-1])))
    np.testing.assert_array_equal(factors[:, ::replicas], np.asarray(given))
    np.testing.assert_array_equal(factors[:, ::replicas], factors[:, 1::replicas])
    assert (factors[0, :, 5] > 1).all() and (factors == 1).mean() > 0.5, factors
    per, pages = 4 // dp, 20 // dp
    for d, (want_cache, want) in enumerate(oracle(HEADS, dp, dtype="int8", k=k, key_factors=factors[:, ::replicas])):
        rows, page_rows = slice(d * per, (d + 1) * per), slice(d * pages, (d + 1) * pages)
        np.testing.assert_array_equal(got_cache.table.page_map[rows], want_cache.table.page_map)
        for stored in range(HEADS * (tp // HEADS)):
            for name in ("k", "v", "k_scale", "v_scale"):
                np.testing.assert_array_equal(getattr(got_cache, name)[:, stored, page_rows],
                                              getattr(want_cache, name)[:, stored // (tp // HEADS)], err_msg=name)  # fmt: skip
        for key in want:
            np.testing.assert_allclose(got[key][rows], want[key], rtol=0, atol=1e-6, err_msg=f"{key}, shard {d}")
    assert np.abs(got["attn"]).sum() > 0  # rows were served: a real comparison


@jax.jit
def _prefix_scenario(cache, k, q):
    """A slot written, its pages held by the cache, a new slot made from them (token granular:
    7 of 10 tokens), grown (copy-on-write of the partly used page) and written, attended, and
    the holds dropped."""
    one = jnp.asarray([0, PAD, PAD, PAD])
    cache, _ = aj.reserve(cache, one, 10)
    cache = aj.append(cache, 0, one, k[:, :10], -k[:, :10])
    pages = cache.table.page_map[0, :2]  # 10 tokens: page 0 full (5), page 1 full (5)
    cache = aj.hold_pages(cache, pages, jnp.asarray([5, 5]))
    cache = aj.fork_pages(cache, jnp.zeros((4, 4), jnp.int32).at[1, :2].set(pages).at[1, 2:].set(aj.PAD_PAGE),
                          jnp.asarray([0, 7, 0, 0]), jnp.asarray([PAD, 2, PAD, PAD]))  # fmt: skip
    two = jnp.asarray([PAD, PAD, 2, PAD])
    cache, ok = aj.reserve(cache, two, 2)
    cache = aj.append(cache, 0, two, 2 * k[:, :2], k[:, :2])
    out = aj.attend(q[:, :1], cache, 0, two)
    cache = aj.drop_pages(cache, pages)
    return cache, ok, out


@pytest.mark.parametrize("backend", ["reference", "pallas", "xla"])
def test_no_shard_map_body_gets_a_zero_sized_operand(backend):
    """jaxlib 0.11 segfaults compiling a shard_map that closes over a zero-sized constant (a JAX
    bug: tests/test_jax_bug_shardy_empty_operand.py). The scenario's ops and the prefix ops,
    lowered (not compiled) on their meshes, must give none, on every JAX."""
    k, q = scenario_inputs(HEADS)
    layout = dataclasses.replace(LAYOUT, num_kv_heads=HEADS)
    cache = aj.create(layout, mesh=make_mesh(MESH), data_axis="data")
    slots, counts = jnp.asarray(global_slots(MESH[0])), jnp.asarray(COUNTS)
    texts = {"scenario": scenario.lower(cache, slots, counts, k, q, backend=backend).as_text()}
    if backend == "reference":
        texts["prefix"] = _prefix_scenario.lower(aj.create(layout, mesh=make_mesh((1, 4))), k, q).as_text()
    for name, text in texts.items():
        assert "sdy.manual_computation" in text, name  # shard_map bodies: the check has something to see
        assert zero_sized_manual_operands(text) == [], name


def test_prefix_ops_on_a_tensor_parallel_cache_equal_one_device():
    layout = dataclasses.replace(LAYOUT, num_kv_heads=HEADS)
    k, q = scenario_inputs(HEADS)
    want = jax.device_get(_prefix_scenario(aj.create(layout), k, q))
    got = jax.device_get(_prefix_scenario(aj.create(layout, mesh=make_mesh((1, 4))), k, q))
    # Two arenas: equal tables but for their random ids.
    jax.tree.map(np.testing.assert_array_equal, got[0].table.replace(arena_id=want[0].table.arena_id), want[0].table)
    for f in dataclasses.fields(want[0].stats):
        np.testing.assert_array_equal(getattr(got[0].stats, f.name), getattr(want[0].stats, f.name), err_msg=f.name)
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_allclose(got[2], want[2], rtol=0, atol=1e-6)
    assert int(want[0].stats.cow_copies) == 1 and np.abs(want[2][2]).sum() > 0  # the scenario did what it says
    with pytest.raises(ValueError, match="data axis"):
        _prefix_scenario(aj.create(layout, mesh=make_mesh(MESH), data_axis="data"), k, q)


@jax.jit
def _host_scenario(cache, host, k, q):
    """A slot written and swapped out to host pages, its pages reused by another slot, swapped
    back into a third slot (appended after nothing) and read; a held page spilled to the host."""
    one, two, three = (jnp.asarray([s, PAD, PAD, PAD]) for s in (0, 1, 2))
    cache, _ = aj.reserve(cache, one, 8)
    cache = aj.append(cache, 0, one, k[:, :8], -k[:, :8])
    cache, host, ok_out = aj.swap_out(cache, host, one, jnp.full((4, 4), aj.PAD_PAGE).at[0, :2].set(jnp.asarray([3, 1])))
    cache, _ = aj.reserve(cache, two, 9)
    cache = aj.append(cache, 0, two, 3 * k[:, :9], k[:, :9])
    cache, host, ok_in = aj.swap_in(cache, host, jnp.full((4, 4), aj.PAD_PAGE).at[0, :2].set(jnp.asarray([3, 1])),
                                    jnp.asarray([8, 0, 0, 0]), three)  # fmt: skip
    out = aj.attend(q[:, :2], cache, 0, three)
    page = cache.table.page_map[1, 0]
    cache = aj.hold_pages(cache, page[None], jnp.asarray([5]))
    cache = aj.release(cache, two)
    cache, host = aj.offload_pages(cache, host, page[None], jnp.asarray([0]))
    return cache, host, ok_out, ok_in, out


def test_host_tier_on_a_tensor_parallel_cache_equals_one_device():
    """The host tier split like the arena (KV heads over the tensor axis, in pinned_host memory):
    the same moves as on one device (tables, counters, host page table, attention over swapped-in
    pages, every host head equal to the head it replicates), and no collective in the compiled
    ops (each device moves its own heads between its own memories). A data axis is refused."""
    layout = dataclasses.replace(LAYOUT, num_kv_heads=HEADS)
    k, q = scenario_inputs(HEADS)
    one = aj.create(layout)
    want = jax.device_get(_host_scenario(one, aj.create_host(one, 4), k, q))
    mesh = make_mesh((1, 4))
    cache = aj.create(layout, mesh=mesh)
    host = aj.create_host(cache, 4)
    assert host.pages["k"].sharding.memory_kind == "pinned_host" and host.pages["k"].sharding.spec == cache.sharding.arena_spec
    found = collectives(_host_scenario.lower(cache, host, k, q).compile().as_text())
    assert not found, f"the host tier's moves communicate: {found}"
    got = jax.device_get(_host_scenario(cache, host, k, q))
    jax.tree.map(np.testing.assert_array_equal, got[0].table.replace(arena_id=want[0].table.arena_id), want[0].table)
    for f in dataclasses.fields(want[0].stats):
        np.testing.assert_array_equal(getattr(got[0].stats, f.name), getattr(want[0].stats, f.name), err_msg=f.name)
    np.testing.assert_array_equal(got[1].held, want[1].held)
    replicas = cache.sharding.kv_replicas  # stored head h is one-device head h // replicas
    for name in ("k", "v"):
        np.testing.assert_array_equal(got[1].pages[name], np.repeat(want[1].pages[name], replicas, axis=1), err_msg=name)
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_array_equal(got[3], want[3])
    np.testing.assert_allclose(got[4], want[4], rtol=0, atol=1e-6)
    assert int(want[0].stats.swap_ins) == 1 and int(want[0].stats.pages_to_host) == 3 and np.abs(want[4][0]).sum() > 0
    with pytest.raises(ValueError, match="data axis"):
        aj.create_host(aj.create(layout, mesh=make_mesh(MESH), data_axis="data"), 4)


@functools.partial(jax.jit, static_argnames="backend")
def _write_and_read(cache, k, q, window, backend):
    """reserve + append + attend on the scenario's cache (not donated: run once per backend);
    then attend with a soft cap and a window, static and traced (`window`, replicated per shard)."""
    slots, n = jnp.asarray([0, PAD, 3, PAD]), jnp.asarray([3, 0, 2, 0])
    cache, _ = aj.reserve(cache, slots, n)
    cache = aj.append(cache, 0, slots, k[:, :3], -k[:, :3], num_tokens=n, backend=backend)
    options = [aj.attend(q[:, :3], cache, 0, slots, num_tokens=n, sliding_window=w, logits_soft_cap=1.5, backend=backend)
               for w in (WINDOW, window)]
    return cache.k, cache.v, aj.attend(q[:, :3], cache, 0, slots, num_tokens=n, backend=backend), *options


WINDOW = 4  # shorter than the rows' contexts: it excludes keys


@pytest.mark.parametrize("backend", ["pallas", "xla"])
def test_pallas_kernels_per_shard_equal_the_reference(scenario_run, backend):
    """The Pallas kernels and the blockwise jnp path ("xla"), run per shard == the reference."""
    cache = scenario_run[1]
    k, q = scenario_inputs(HEADS)
    want = jax.device_get(_write_and_read(cache, k, q, jnp.int32(WINDOW), backend="reference"))
    got = jax.device_get(_write_and_read(cache, k, q, jnp.int32(WINDOW), backend=backend))
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    for out in range(2, 5):
        np.testing.assert_allclose(got[out], want[out], rtol=0, atol=ATOL)
    for run in (got, want):
        np.testing.assert_array_equal(run[4], run[3])  # a traced window == the static one
    assert np.abs(want[2][[0, 2]]).sum() > 0  # the rows were served: a real comparison
    assert np.abs(want[3] - want[2]).max() > 1e-3  # the window and the cap changed something


def test_collective_detector_sees_a_gathered_arena():
    """The HLO check can fail: a step that replicates a sharded arena shows an all-gather of pages."""
    cache = aj.create(LAYOUT, mesh=make_mesh((2, 4)), data_axis="data")
    replicated = jax.sharding.NamedSharding(cache.sharding.mesh, jax.sharding.PartitionSpec())
    hlo = jax.jit(lambda c: jax.lax.with_sharding_constraint(c.k, replicated) * 2).lower(cache).compile().as_text()
    assert any(moves_pages(shape) for _, shape in collectives(hlo)), collectives(hlo)


def test_host_checks_name_the_shard_rule():
    mesh = make_mesh((2, 4))
    cache = aj.create(LAYOUT, mesh=mesh, data_axis="data")
    with pytest.raises(ValueError, match=r"slots\[0\]=3 is a slot of data shard 1, but row 0 is in shard 0's block"):
        aj.reserve(cache, [3, PAD], 1)
    with pytest.raises(ValueError, match="3 rows, not a multiple of the data axis 'data' of size 2"):
        aj.release(cache, [0, PAD, PAD])
    with pytest.raises(ValueError, match="q has 4 heads, not divisible by the tensor axis 'tensor' of size 8"):
        small = aj.create(dataclasses.replace(LAYOUT, num_kv_heads=4), mesh=make_mesh((1, 8)))
        aj.attend(jnp.zeros((4, 1, 4, 16)), small, 0, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="num_kv_heads=3 and the tensor axis 'tensor' of size 2: one must divide the other"):
        aj.create(dataclasses.replace(LAYOUT, num_kv_heads=3), mesh=make_mesh((1, 2)))
    with pytest.raises(ValueError, match="num_pages=21 is not divisible by the data axis 'data' of size 2"):
        aj.create(dataclasses.replace(LAYOUT, num_pages=21), mesh=mesh, data_axis="data")
    with pytest.raises(ValueError, match=r"tensor_axis='model' is not an axis of the mesh \(axes: \('data', 'tensor'\)\)"):
        aj.create(LAYOUT, mesh=mesh, tensor_axis="model")
    for op in (lambda c: aj.drop_pages(c, [0]), lambda c: aj.hold_pages(c, [0], 1), lambda c: aj.fork_pages(c, [[0]], [1], [0])):
        with pytest.raises(ValueError, match="split over the data axis 'data' .* is not supported: a prefix cache"):
            op(cache)  # the data axis is named first, not "page 0 is not held"


def test_layout_sizes_without_allocating():
    """Llama-3-70B's 8 KV heads on tp=16 (planned on an AbstractMesh, nothing allocated): 2
    copies of each, one whole head per device, twice the 1/16 an even split would suggest;
    reported as such."""
    layout = aj.KVLayout.from_hf_config(models.LlamaConfig.llama3_70b().to_hf(), num_pages=1024, max_seqs=64, max_seq_len=8192)
    sh = aj.CacheSharding.plan(layout, jax.sharding.AbstractMesh((1, 16), ("data", "tensor")))
    assert sh.kv_replicas == 2 and sh.kv_heads_per_device(layout) == 1
    assert sh.bytes_per_token_per_device(layout) == layout.bytes_per_token // 8  # one of 8 heads, not 1/16
    assert sh.arena_shape(layout) == (80, 16, 1024, 16, 128)
    assert sh.arena_bytes_per_device(layout) * 8 == layout.arena_bytes


# ---- models ----------------------------------------------------------------------------------------

CONFIG = models.LlamaConfig.tiny(num_heads=8, num_kv_heads=2)  # GQA 8/2: KV heads split on tp=2, replicated from tp=4 on
PROMPT, NEW = 5, 4
MODEL_MESHES = [("tp1", (1, 1)), ("tp2", (1, 2)), ("tp4", (1, 4)), ("tp8", (1, 8)), ("dp2xtp4", (2, 4))]


def greedy_loop(step, state, cache, prompts):
    """Feed prompts [4, PROMPT] one token per decode step, then NEW - 1 greedy tokens.
    Returns (tokens [4, NEW], logits [NEW, 4, V], per-step (k, v) shard pointers)."""
    slots = jnp.arange(4, dtype=jnp.int32)
    tokens, got, logits, pointers = jnp.asarray(prompts[:, 0]), [], [], []
    for t in range(PROMPT + NEW - 1):
        out = step(state, cache, tokens, slots)
        cache = out.cache
        pointers.append((shard_pointers(cache.k), shard_pointers(cache.v)))
        tokens = jnp.asarray(prompts[:, t + 1]) if t + 1 < PROMPT else out.tokens
        if t + 1 >= PROMPT:
            got.append(np.asarray(out.tokens))
            logits.append(np.asarray(out.logits))
    return np.stack(got, axis=1), np.stack(logits), pointers


@pytest.fixture(scope="module")
def single():
    """The single-device model and its greedy decode: the oracle of every mesh."""
    model = models.init_random(CONFIG, seed=3)
    graphdef, state = nnx.split(model)
    prompts = np.random.default_rng(0).integers(0, CONFIG.vocab_size, (4, PROMPT)).astype(np.int32)
    cache = aj.create(models.default_layout(model, 4, PROMPT + NEW, page_size=5))
    step = lambda state, cache, tokens, slots: models.decode_step(graphdef, state, cache, tokens, slots)  # noqa: E731
    tokens, logits, _ = greedy_loop(step, state, cache, prompts)
    return model, prompts, tokens, logits


@pytest.mark.parametrize("name,shape", MODEL_MESHES, ids=[m[0] for m in MODEL_MESHES])
def test_sharded_decode_equals_one_device(single, name, shape):
    """Megatron weights + sharded arena: greedy tokens and logits of the single-device run; the
    compiled step moves no page between devices (its only collectives: one all-reduce after
    each row-parallel projection, one for the vocabulary-split embedding, and the gather of the
    vocabulary-split argmax; the layers run in one loop, so its body holds each layer's two);
    every shard of the arena is updated in place."""
    model, prompts, want_tokens, want_logits = single
    mesh = make_mesh(shape)
    dp, tp = shape
    sharded = models.init_random(CONFIG, seed=3, mesh=mesh)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(sharded))):
        np.testing.assert_array_equal(a, b)
    q, o = sharded.layers.attn.q[...], sharded.layers.attn.o[...]  # stacked over layers: [L, E, N, H], [L, N, H, E]
    layers = CONFIG.num_layers
    assert q.sharding.shard_shape(q.shape) == (layers, 64, 8 // tp, 8)
    assert o.sharding.shard_shape(o.shape) == (layers, 8 // tp, 8, 64)
    graphdef, state = nnx.split(sharded)
    cache = aj.create(models.default_layout(model, 4, PROMPT + NEW, page_size=5), mesh=mesh,
                      data_axis="data" if dp > 1 else None)  # fmt: skip
    slots = jnp.arange(4, dtype=jnp.int32)
    compiled = models.decode_step.lower(graphdef, state, cache, jnp.asarray(prompts[:, 0]), slots).compile()

    found = collectives(compiled.as_text())
    moving = [c for c in found if moves_pages(c[1], 5, CONFIG.head_dim)]
    assert not moving, f"pages move between devices: {moving}"
    reduces = [shape for op, shape in found if op == "all-reduce" and re.search(rf",{CONFIG.hidden_size}\]", shape)]
    assert len(reduces) == (2 + 1 if tp > 1 else 0), found  # 2 in the layer loop's body (run per layer) + embedding
    assert tp > 1 or not found, found
    print(f"{name} decode step collectives:", json.dumps(found))

    tokens, logits, pointers = greedy_loop(compiled, state, cache, prompts)
    assert all(p == pointers[0] for p in pointers), "an arena shard moved during a donated step"
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)


def test_generate_with_a_mesh_equals_one_device(single):
    """Continuous batching on dp=2 x tp=4: the 4 prompts through 2 rows (one per data shard,
    each with its own slot and pages), sequences joining as others finish; the single-device
    model placed on the mesh by `generate` itself. Greedy tokens: the single-device run's."""
    model, prompts, want_tokens, _ = single
    got = models.generate(model, prompts.tolist(), NEW, batch_size=2, chunk_size=4, mesh=make_mesh((2, 4)), data_axis="data")
    assert got.tokens == want_tokens.tolist()
    assert got.cache.sharding.dp == 2 and aj.health(got.cache)["free_pages"] == got.cache.layout.num_pages


def test_speculative_decoding_on_a_mesh_equals_one_device(single):
    """generate(speculative=...) on dp=2 x tp=4: each decode call is a verify call (every row's
    last token and its proposals as one chunk, the rejected tail rolled back by truncate in the
    same call, per tensor and data shard). The proposer is a draft model, the single-device
    model itself in its own one-device arena, so every proposal is kept; the tokens are the
    single-device greedy run's and every page comes back. (tp=4 alone, the tensor half of this
    mesh, ran here too until 2026-11-28: the same checks, 4 s more of CI on each line.)"""
    model, prompts, want_tokens, _ = single
    for shape, data in (((2, 4), "data"),):
        draft = models.DraftModel(model, k=3, max_len=16)
        got = models.generate(model, prompts.tolist(), NEW, batch_size=2, mesh=make_mesh(shape), data_axis=data,
                              speculative=draft)  # fmt: skip
        assert got.tokens == want_tokens.tolist(), shape
        assert got.accepted_tokens == got.proposed_tokens > 0 and got.verify_calls <= len(prompts), shape  # NEW - 1 tokens in one call
        health = aj.health(got.cache)  # the verify step's counters: one row per data shard, summed
        assert health["free_pages"] == got.cache.layout.num_pages
        assert (health["proposed_tokens"], health["accepted_tokens"]) == (got.proposed_tokens, got.accepted_tokens), shape


def test_prefix_cache_on_a_tensor_parallel_mesh_equals_one_device(single):
    """generate with a prefix cache on tp=4 (its holds, page forks and drops run per tensor
    shard): a first call, then the same prompts again, which hit the first call's pages. Both
    give the single-device greedy tokens; the index matches the cache's held pages."""
    model, prompts, want_tokens, _ = single
    first, mesh = prompts[:2].tolist(), make_mesh((1, 4))
    a = models.generate(model, first, NEW, batch_size=2, chunk_size=4, prefix_cache=True, mesh=mesh)
    b = models.generate(model, first, NEW, batch_size=2, chunk_size=4, cache=a.cache, prefix_cache=a.prefix_cache)
    assert a.tokens == b.tokens == want_tokens[:2].tolist()
    assert b.prefix_hit_tokens > 0  # (a 2-page default arena: LRU evicts one prompt's page for the other)
    assert aj.health(b.cache, b.prefix_cache)["prefix_index_matches"]
    with pytest.raises(ValueError, match="one data shard"):
        models.generate(model, first, NEW, batch_size=2, prefix_cache=True, mesh=make_mesh((2, 4)), data_axis="data")
    with pytest.raises(ValueError, match="host_pages needs one data shard"):
        models.generate(model, first, NEW, batch_size=2, host_pages=4, mesh=make_mesh((2, 4)), data_axis="data")
    with pytest.raises(ValueError, match=r"batch_size=3 must split into 2 data shards \(a multiple of 2\)"):
        models.generate(model, first, NEW, batch_size=3, mesh=make_mesh((2, 4)), data_axis="data")


def test_mixed_steps_on_a_mesh_equal_one_device(single):
    """generate(mixed_steps=True) on tp=4 and on dp=2 x tp=4: decode rows and prompt chunks in one
    call, their tokens packed flat (replicated over tensor); with a data axis every shard gets its
    share of the chunks, for its own rows. The single-device greedy tokens, every page back."""
    model, prompts, want_tokens, _ = single
    got = models.generate(model, prompts.tolist(), NEW, batch_size=2, chunk_size=4, mesh=make_mesh((1, 4)),
                          mixed_steps=True)  # fmt: skip
    assert got.tokens == want_tokens.tolist() and got.mixed_calls > 0
    dp = dict(chunk_size=2, mesh=make_mesh((2, 4)), data_axis="data", mixed_steps=True)
    # Eight prompts of 1-5 tokens through fewer rows: rows finish their prompts at different
    # steps, so each shard's prefilling rows change in their own order. One row per data shard
    # with the default budget (a chunk per shard), then two rows and two chunks per shard.
    ragged = [p[:n] for p, n in zip(prompts.tolist() * 2, (5, 1, 3, 5, 2, 4, 1, 5))]
    want = models.generate(model, ragged, NEW, batch_size=4, chunk_size=2).tokens  # one device, separate prefills
    for batch, budget in ((2, None), (4, 4 + 4 * 2)):
        got = models.generate(model, ragged, NEW, batch_size=batch, token_budget=budget, **dp)
        assert got.tokens == want and got.mixed_calls > 0, (batch, budget)
        health = aj.health(got.cache)
        assert got.cache.sharding.dp == 2 and health["free_pages"] == got.cache.layout.num_pages
        assert got.preemptions == 0 and health["rejected_rows"] == 0, (got.preemptions, health)  # no chunk on another shard
    with pytest.raises(ValueError, match=r"token_budget=7 .* per data shard \(2\): at least 8"):
        models.generate(model, prompts.tolist(), NEW, batch_size=4, token_budget=7, **dp)


def test_a_mixed_step_refuses_a_chunk_of_another_data_shard(single):
    """models.mixed_step on a dp=2 cache (inside its own jit, so no host check): a chunk in
    shard 0's block naming shard 1's slot is refused (ok False, nothing reserved), the other
    rows are served; and a chunk count that does not split over the shards is a ValueError."""
    model = single[0]
    graphdef, state = nnx.split(model)
    layout = models.default_layout(model, 8, PROMPT + NEW, page_size=5)
    cache = aj.create(layout, mesh=make_mesh((2, 1)), data_axis="data")
    shard = layout.max_seqs // 2  # slots 0.. on shard 0, `shard`.. on shard 1
    tokens = jnp.asarray([7, 0, 9, 0], jnp.int32)
    slots = jnp.asarray([0, PAD, shard, PAD], jnp.int32)  # decode rows 0 (shard 0) and 2 (shard 1)
    chunks = jnp.asarray([[1, 2], [3, 4]], jnp.int32)
    chunk_slots = jnp.asarray([shard + 1, shard + 2], jnp.int32)  # block 0 names shard 1's slot: refused
    out = models.mixed_step(graphdef, state, cache, tokens, slots, chunks, chunk_slots, jnp.asarray([2, 2], jnp.int32),
                            jnp.asarray([1, 3], jnp.int32))  # fmt: skip
    np.testing.assert_array_equal(out.ok, [True, False, True, True])
    lengths = np.asarray(out.cache.table.lengths)
    assert lengths[0] == lengths[shard] == 1 and lengths[shard + 1] == 0 and lengths[shard + 2] == 2, lengths
    with pytest.raises(ValueError, match="3 chunks do not split into the cache's 2 data shards"):
        models.mixed_step(graphdef, state, out.cache, tokens, slots, jnp.zeros((3, 2), jnp.int32),
                          jnp.full((3,), PAD, jnp.int32), jnp.zeros((3,), jnp.int32), jnp.full((3,), -1, jnp.int32))  # fmt: skip


def test_swap_preemption_on_a_tensor_parallel_mesh_equals_one_device(single):
    """generate on tp=4 with too few pages for two rows and a host tier: preempted sequences are
    swapped out and back (per tensor shard); the single-device greedy tokens."""
    model, prompts, want_tokens, _ = single
    # 2-token pages: both rows are admitted (3 pages each for prompt + 1) and then outgrow 7 pages.
    layout = model.config.kv_layout(page_size=2, num_pages=7, max_seqs=2, max_seq_len=10, dtype=model.dtype)
    got = models.generate(model, prompts.tolist(), NEW, batch_size=2, chunk_size=4, layout=layout, mesh=make_mesh((1, 4)),
                          host_pages=4, swap_policy=models.SwapPolicy(prefill_tokens_per_s=1.0))  # fmt: skip
    assert got.tokens == want_tokens.tolist()
    assert got.swap_outs > 0 and got.recomputed_tokens == 0 and not np.asarray(got.host.held).any()


def test_load_pretrained_places_each_tensor_on_its_devices(tmp_path, single):
    from safetensors.numpy import save_file

    model = single[0]
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_hf()))
    save_file(models.export_hf_tensors(model), str(tmp_path / "model.safetensors"))
    mesh = make_mesh((1, 4))
    loaded, _ = models.load_pretrained(tmp_path, dtype=jnp.float32, mesh=mesh)
    assert models.weights_mesh(loaded) is not None
    o = loaded.layers.attn.o[...]
    assert o.sharding.shard_shape(o.shape) == (CONFIG.num_layers, 2, 8, 64)  # row-parallel: query heads split
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(loaded))):
        np.testing.assert_array_equal(a, b)
