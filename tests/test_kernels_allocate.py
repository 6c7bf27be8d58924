"""pallas_kernels/gpu/allocate.py and pallas_kernels/cpu/allocate.py (allocate.cc): `reserve`'s
table work as one kernel (issue 39, item 4).

`allocator.reserve_impl` with each kernel (the Triton one, `kernel=True`: interpreted on a CPU,
compiled on a GPU, `scripts/gpu_check.sh reserve`, for an H100 by tests/test_compile_bound.py;
the CPU's native call, `kernel="cpu"`: compiled here) against it with XLA's ops (`kernel=False`)
on the tables random histories leave: pages held, shared by forks (copy-on-write), the free
stack running out; duplicate, out-of-range, padded and over-long rows. Equal tables, counters,
arenas and flags.
"""
from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from arena_jax import allocator
from arena_jax.kv_cache import PAD_SLOT
from pallas_kernels.cpu import _build
from pallas_kernels.cpu import allocate as native
from pallas_kernels.gpu import allocate
from pallas_kernels.gpu.allocate import MAX_ROWS, reserve_pages

KERNELS = [True, "cpu"]  # the Triton kernel (interpreted here), the native call

SLOTS, MAX_PAGES, PAGE, PAGES, BATCH, DIM, HEADS = 6, 5, 4, 9, 5, 48, 2  # head_dim 48: lanes 48-63 masked
LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=HEADS, head_dim=DIM, page_size=PAGE, num_pages=PAGES, max_seqs=SLOTS,
                     max_pages_per_seq=MAX_PAGES, dtype="float32")  # fmt: skip


def _created(rng, layout=LAYOUT):
    """A new cache whose arena holds random values (a copy of a page must move its bytes)."""
    cache = aj.create(layout)
    if cache.k_scale is not None:
        return cache
    noise = lambda: jnp.asarray(rng.standard_normal(cache.k.shape), cache.k.dtype)  # noqa: E731
    return cache.replace(k=noise(), v=noise())


_reserve = jax.jit(functools.partial(allocator.reserve_impl, kernel=False))


def _written(cache, slots, asked, rng):
    """`reserve` then its tokens written (random K/V), as a step does: forks need written slots."""
    cache, ok = _reserve(cache, jnp.asarray(slots), jnp.asarray(asked))
    dtype = cache.k.dtype if cache.k_scale is None else jnp.float32  # (an 8-bit arena quantizes f32)
    kv = jnp.asarray(rng.standard_normal((len(slots), int(max(asked)) or 1, HEADS, DIM)), dtype)
    tokens = jnp.where(ok & (jnp.asarray(slots) != PAD_SLOT), jnp.asarray(asked), 0)
    for layer in range(cache.k.shape[0]):
        cache = aj.append(cache, layer, jnp.asarray(slots), kv, kv, num_tokens=tokens)
    return cache


def _history(rng):
    """A cache after a random run of reserve (its tokens written), fork and release."""
    cache = _created(rng)
    for _ in range(rng.integers(0, 9)):
        op = rng.choice(3, p=[0.5, 0.35, 0.15])
        if op == 0:
            slots = np.full(3, PAD_SLOT, np.int32)
            named = rng.integers(1, 4)
            slots[:named] = rng.choice(SLOTS, named, replace=False)
            cache = _written(cache, slots, rng.integers(0, 7, 3).astype(np.int32), rng)
        elif op == 1:
            active = np.asarray(cache.table.active)
            busy, idle = np.nonzero(active)[0], np.nonzero(active == 0)[0]
            if busy.size and idle.size:
                cache = aj.fork(cache, jnp.asarray([rng.choice(busy)], jnp.int32), jnp.asarray([rng.choice(idle)], jnp.int32))
        else:
            cache = aj.release(cache, jnp.asarray([rng.integers(0, SLOTS)], jnp.int32))
    return cache


def _assert_same(cache, slots, asked, kernel=True):
    """The kernel's `reserve` and the jnp one from `cache`: equal everywhere. Returns the counters."""
    want, want_ok = allocator.reserve_impl(cache, slots, asked, kernel=False)
    with mock.patch.object(allocator, "_reserve_by_kernel", wraps=allocator._reserve_by_kernel) as called:
        got, got_ok = allocator.reserve_impl(cache, slots, asked, kernel=kernel)
    assert called.call_count == 1 and called.call_args.kwargs["native"] == (kernel == "cpu")
    np.testing.assert_array_equal(np.asarray(got_ok), np.asarray(want_ok))
    np.testing.assert_array_equal(np.asarray(got.table.packed), np.asarray(want.table.packed))
    np.testing.assert_array_equal(np.asarray(got.stats.counts), np.asarray(want.stats.counts))
    np.testing.assert_array_equal(np.asarray(got.k), np.asarray(want.k))
    np.testing.assert_array_equal(np.asarray(got.v), np.asarray(want.v))
    for name in ("k_scale", "v_scale"):
        if getattr(want, name) is not None:
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))
    return {name: int(got.stats.as_dict()[name]) - int(cache.stats.as_dict()[name])
            for name in ("pages_allocated", "cow_copies", "failed_reservations", "rejected_rows")}  # fmt: skip


@pytest.mark.parametrize("kernel, page_lanes", [(True, None), (True, 2), ("cpu", None)])  # 2: pages over loop trips
def test_the_kernel_reserves_as_the_jnp_reserve_on_random_tables(kernel, page_lanes, monkeypatch):
    if page_lanes is not None:
        monkeypatch.setattr(allocate, "PAGE_LANES", page_lanes)
        jax.clear_caches()  # PAGE_LANES is read when the kernel is traced
    seed = 20261204 if kernel is True else np.random.SeedSequence().entropy  # the native call: fresh tables each run
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    seen = dict.fromkeys(("pages_allocated", "cow_copies", "failed_reservations", "rejected_rows"), 0)
    for _ in range({True: 40, "cpu": 150}[kernel] if page_lanes is None else 25):
        cache = _history(rng)
        slots = rng.integers(-1, SLOTS + 1, BATCH).astype(np.int32)  # out of range, duplicates
        slots[rng.random(BATCH) < 0.15] = PAD_SLOT
        counts = _assert_same(cache, jnp.asarray(slots), jnp.asarray(rng.integers(-1, 9, BATCH), jnp.int32), kernel)
        for name, delta in counts.items():
            seen[name] += delta > 0
    if page_lanes is not None:  # pops across loop trips (copy-on-write: the other case and its own test)
        seen = {"pages_allocated": seen["pages_allocated"]}
    assert min(seen.values()) >= 2, seen  # the cases drew pops, copy-on-write, refusals and rejections


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_keeper_is_refused_with_the_copier_it_shares_with(kernel):
    """Slots 0 and 1 share a partly filled page and both write; no page is free for 1's copy, so
    0 (the keeper) is refused too: it would write into a page 1 still holds."""
    rng = np.random.default_rng(0)
    cache = _written(_created(rng), np.asarray([0, 2, 3], np.int32), np.asarray([2, 20, 12], np.int32), rng)
    cache = aj.fork(cache, jnp.asarray([0], jnp.int32), jnp.asarray([1], jnp.int32))
    assert int(cache.table.num_free) == 0
    slots = jnp.asarray([0, 1, PAD_SLOT, PAD_SLOT, PAD_SLOT], jnp.int32)
    assert _assert_same(cache, slots, jnp.asarray([1, 1, 0, 0, 0], jnp.int32), kernel)["failed_reservations"] == 2


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])  # int8: the kernel maps, `_copy_pages` copies
def test_a_copy_on_write_copies_the_shared_page(dtype, kernel):
    rng = np.random.default_rng(1)
    layout = dataclasses.replace(LAYOUT, dtype=dtype)
    cache = _written(_created(rng, layout), np.asarray([0], np.int32), np.asarray([2], np.int32), rng)
    cache = aj.fork(cache, jnp.asarray([0], jnp.int32), jnp.asarray([1], jnp.int32))
    assert _assert_same(cache, jnp.asarray([1], jnp.int32), jnp.asarray([3], jnp.int32), kernel)["cow_copies"] == 1


@pytest.mark.parametrize("module", [allocate, native], ids=["triton", "native"])
def test_bad_rows_are_refused_with_the_limit(module):
    cache, reserve_pages, MAX_ROWS = aj.create(LAYOUT), module.reserve_pages, module.MAX_ROWS
    packed, counts = cache.table.packed, cache.stats.counts
    kwargs = dict(page_size=PAGE, geometry=(SLOTS, MAX_PAGES, 1, PAGES), offsets=(0, 0, 0, 0), pad_slot=PAD_SLOT,
                  counters=(0, 1, 2, 3, 4))  # fmt: skip
    with pytest.raises(ValueError, match=f"0 < B <= {MAX_ROWS}"):
        reserve_pages(jnp.zeros((MAX_ROWS + 1,), jnp.int32), jnp.zeros((MAX_ROWS + 1,), jnp.int32), packed, counts,
                      **kwargs)  # fmt: skip
    with pytest.raises(ValueError, match="one table row"):
        reserve_pages(jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), packed[None], counts, **kwargs)
    if module is native:  # the call checks the regions fit the table before it touches it
        with pytest.raises(Exception, match="geometry and offsets do not fit"):
            reserve_pages(jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), packed, counts,
                          **{**kwargs, "geometry": (SLOTS, MAX_PAGES, 1, packed.shape[0])}).block_until_ready()


def test_where_the_kernel_reserves():
    """"auto" by default: the native call on a CPU (this host), the Triton kernel on a GPU, XLA's ops
    on a TPU; "gpu" / "cpu": that platform's only; True: the Triton kernel off a TPU; for one data
    shard, up to the kernel's MAX_ROWS rows, no run-keeping; anything else refused."""
    cache, slots = aj.create(LAYOUT), jnp.zeros((3,), jnp.int32)
    where = functools.partial(allocator._reserves_by_kernel, cache, slots, False)
    assert allocator.RESERVE_KERNEL == "auto" and jax.default_backend() == "cpu"
    assert (where("auto"), where("cpu"), where("gpu"), where(True), where(False)) == ("native", "native", None, "triton", None)
    assert allocator._reserves_by_kernel(cache, slots, True, "auto") is None  # run-keeping
    assert allocator._reserves_by_kernel(cache, jnp.zeros((MAX_ROWS + 1,), jnp.int32), False, True) is None
    assert allocator._reserves_by_kernel(cache, jnp.zeros((MAX_ROWS + 1,), jnp.int32), False, "auto") == "native"
    assert allocator._reserves_by_kernel(cache, jnp.zeros((native.MAX_ROWS + 1,), jnp.int32), False, "auto") is None
    with pytest.raises(ValueError, match="RESERVE_KERNEL must be one of"):
        where("yes")
    with mock.patch.object(native, "native_problem", return_value="no C++ compiler found"):
        assert where("auto") is None and where("cpu") is None  # XLA's ops, as before the native call
    with mock.patch("pallas_kernels.tpu.common.target_platform", return_value="tpu"):
        assert where("auto") is None and where("gpu") is None and where("cpu") is None
        with pytest.raises(ValueError, match="Triton \\(GPU\\) kernel; on a TPU"):
            where(True)
    with mock.patch("pallas_kernels.tpu.common.target_platform", return_value="gpu"):
        assert where("cpu") is None and where("auto") == where("gpu")


def test_the_native_call_reserves_in_place():
    """`aj.reserve` on a donated cache: the native call writes the table, counters and arena where
    they lie (XLA aliases them into the call); nothing is copied."""
    cache = _written(_created(np.random.default_rng(2)), np.asarray([0], np.int32), np.asarray([2], np.int32),
                     np.random.default_rng(2))  # fmt: skip
    cache = aj.fork(cache, jnp.asarray([0], jnp.int32), jnp.asarray([1], jnp.int32))
    before = [x.unsafe_buffer_pointer() for x in (cache.table.packed, cache.stats.counts, cache.k, cache.v)]
    with mock.patch.object(allocator, "_reserve_by_kernel", wraps=allocator._reserve_by_kernel) as called:
        cache, ok = aj.reserve(cache, jnp.asarray([1], jnp.int32), jnp.asarray([3], jnp.int32))  # a copy-on-write
    assert called.call_args.kwargs["native"] and bool(ok.all()) and int(cache.stats.as_dict()["cow_copies"]) == 1
    assert [x.unsafe_buffer_pointer() for x in (cache.table.packed, cache.stats.counts, cache.k, cache.v)] == before


def test_the_native_call_is_built_once_and_its_absence_is_named(tmp_path, monkeypatch):
    """The library is built into $ARENA_JAX_NATIVE_DIR, keyed by its source and jaxlib; with no
    compiler, `native_problem` says so and `reserve_pages` refuses with it."""
    monkeypatch.setenv("ARENA_JAX_NATIVE_DIR", str(tmp_path))
    _build.library.cache_clear()
    try:
        assert native.native_problem() is None
        assert [p.suffix for p in tmp_path.iterdir()] == [".so"]
        _build.library.cache_clear()
        monkeypatch.setenv("CXX", "")
        with mock.patch("shutil.which", return_value=None):
            assert native.native_problem() == "no C++ compiler found ($CXX, g++, c++ or clang++)"
            with pytest.raises(RuntimeError, match="native reserve is not available: no C\\+\\+ compiler"):
                native.reserve_pages(jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.zeros((64,), jnp.int32),
                                     jnp.zeros((8,), jnp.int32), page_size=4, geometry=(2, 2, 1, 4), offsets=(0, 4, 12, 20),
                                     pad_slot=PAD_SLOT, counters=(0, 1, 2, 3, 4))  # fmt: skip
    finally:
        _build.library.cache_clear()


@pytest.mark.parametrize("kernel", [True, "auto"])  # the Triton kernel interpreted; the default: the native call
def test_generate_with_the_kernel_decodes_the_same_tokens(kernel):
    """End to end: `models.generate`'s prefill chunks and decode steps reserve through the kernel
    and give the jnp ops' greedy tokens and counters."""
    from arena_jax import models

    model = models.init_random(models.LlamaConfig.tiny(), seed=0, std=0.2)
    prompts = np.random.default_rng(3).integers(0, model.config.vocab_size, (3, 11)).tolist()
    jax.clear_caches()
    with mock.patch.object(allocator, "_reserve_by_kernel", wraps=allocator._reserve_by_kernel) as called:
        with mock.patch.object(allocator, "RESERVE_KERNEL", False):
            want = models.generate(model, prompts, 12, batch_size=2, chunk_size=8)
        assert called.call_count == 0
        jax.clear_caches()  # generate's steps were compiled with the flag off
        with mock.patch.object(allocator, "RESERVE_KERNEL", kernel):
            got = models.generate(model, prompts, 12, batch_size=2, chunk_size=8)
        jax.clear_caches()
    assert called.call_count >= 1  # `aj.reserve` traced with it, for prefill and decode rows alike
    assert {c.kwargs["native"] for c in called.call_args_list} == {kernel == "auto"}
    assert got.tokens == want.tokens and [len(t) for t in got.tokens] == [12] * 3
    np.testing.assert_array_equal(np.asarray(got.cache.stats.counts), np.asarray(want.cache.stats.counts))
    same = lambda table: np.asarray(table.packed)[:-1]  # noqa: E731  (the last word: each cache's random arena id)
    np.testing.assert_array_equal(same(got.cache.table), same(want.cache.table))


@pytest.mark.parametrize("batch, max_pages, num_pages", [(4, 8, 32), (64, 512, 32768)])
def test_the_kernel_compiles_for_an_h100_without_spills(batch, max_pages, num_pages):
    """sm_90a by XLA's deviceless compiler and ptxas (`pallas_kernels.offline.sm90`): a server's
    64 rows of 512 pages spill nothing (pages go PAGE_LANES a loop trip; 64 rows take 8 warps).
    Like the other device compile checks: under CI=true a missing toolchain fails, elsewhere skips."""
    import test_compile_sm90 as gpu
    from test_compile_bound import _require

    _require(gpu.gate(gpu.sm90.tooling_problem(), gpu.IN_CI))
    from arena_jax.kv_cache import _regions

    layout = aj.KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=16, num_pages=num_pages,
                         max_seqs=batch, max_pages_per_seq=max_pages)  # fmt: skip
    cache = jax.eval_shape(lambda: aj.create(layout))
    at = _regions(cache.table.geometry)
    row = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def reserve(slots, asked, packed, counts, k, v):
        return reserve_pages(slots, asked, packed, counts, page_size=16, geometry=cache.table.geometry,
                             offsets=tuple(at[r][0] for r in ("page_map", "slot_words", "page_words", "words")),
                             pad_slot=PAD_SLOT, counters=tuple(range(1, 6)), arenas=(k, v), interpret=False)  # fmt: skip

    (facts,) = gpu.sm90.compile_call(reserve, (row, row, cache.table.packed, cache.stats.counts, cache.k, cache.v))
    assert facts.name == f"reserve_pages_b{batch}_copy"
    assert facts.spill_stores == 0 and facts.spill_loads == 0, facts
    assert facts.num_warps == (8 if batch >= 64 else 4)
