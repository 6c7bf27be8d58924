"""pallas_kernels/cpu/attention.py and attention.cc: decode attention as one native call a layer (issue 39).

The native call against `paged_attention_blockwise` (the "xla" backend's path, its reference) and
`paged_attention_reference` on fresh random arenas each run: float32 and bfloat16, query groups
of 1, 2 and 4, head dims off the eight-lane width, page maps with unmapped and out-of-range
pages, lengths past the capacity, rows with no query, static and traced windows, a soft cap, and
NaN / inf in K and V rows both attended and not. Then the dispatch (`arena_ops.ATTEND_KERNEL`)
and `aj.attend` on a cache, native against blockwise, under a scan of layers.
"""
from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from arena_jax import arena_ops
from arena_jax.benchmarks.studies.op_hlo import widest_loop_start
from pallas_kernels.blockwise import paged_attention_blockwise
from pallas_kernels.cpu import attention
from pallas_kernels.reference import paged_attention_reference

pytestmark = pytest.mark.skipif(attention.native_problem() is not None, reason="no C++ compiler here")


def _case(rng, dtype):
    layers, kv_heads, pages, page_size = 2, int(rng.integers(1, 3)), 10, 4
    group, dim, batch, max_pages = int(rng.choice([1, 2, 4])), int(rng.choice([8, 12, 16, 20])), 3, 4
    k, v = (rng.standard_normal((layers, kv_heads, pages, page_size, dim)).astype(np.float32) for _ in range(2))
    for arena in (k, v):  # poison: NaN / inf rows, attended by some queries and not by others
        for _ in range(rng.integers(0, 3)):
            arena[rng.integers(layers), rng.integers(kv_heads), rng.integers(pages), rng.integers(page_size),
                  rng.integers(dim)] = rng.choice([np.nan, np.inf, -np.inf])  # fmt: skip
    page_map = rng.integers(-1, pages + 2, (batch, max_pages)).astype(np.int32)  # -1 unmapped, >= pages: clipped
    lengths = rng.integers(0, max_pages * page_size + 3, batch).astype(np.int32)
    num_tokens = rng.integers(0, 3, batch).astype(np.int32)
    q = rng.standard_normal((batch, 1, kv_heads * group, dim)).astype(np.float32)
    window = [None, int(rng.integers(0, 20)), jnp.int32(rng.integers(-2, 20))][rng.integers(3)]
    cap = [None, float(rng.uniform(0.5, 4))][rng.integers(2)]
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return (cast(q), cast(k), cast(v), jnp.int32(rng.integers(0, layers)), jnp.asarray(page_map), jnp.asarray(lengths),
            jnp.asarray(num_tokens)), dict(sliding_window=window, logits_soft_cap=cap)  # fmt: skip


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_native_decode_attention_is_the_blockwise_path_on_random_arenas(dtype):
    seed = np.random.SeedSequence().entropy  # fresh arenas each run
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    seen = {"nan": 0, "zero": 0, "finite": 0}
    for _ in range(60):
        args, kw = _case(rng, dtype)
        got = np.asarray(attention.decode_attention(*args, **kw).astype(jnp.float32))
        want = np.asarray(paged_attention_blockwise(*args, **kw).astype(jnp.float32))
        oracle = np.asarray(paged_attention_reference(*args, **kw).astype(jnp.float32))
        assert got.shape == want.shape and got.dtype == np.float32
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(oracle))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
        np.testing.assert_allclose(got, oracle, rtol=tol, atol=tol)
        heads = got.reshape(-1, got.shape[-1])
        seen["nan"] += int(np.isnan(heads).all(axis=1).sum())
        seen["zero"] += int((heads == 0).all(axis=1).sum())
        seen["finite"] += int((np.isfinite(heads).all(axis=1) & (heads != 0).any(axis=1)).sum())
    assert all(count > 0 for count in seen.values()), seen  # poisoned, empty and attending heads all met


def test_the_native_call_refuses_what_it_does_not_take():
    q = jnp.zeros((2, 1, 4, 8), jnp.float32)
    arena = jnp.zeros((1, 2, 3, 4, 8), jnp.float32)
    rows = (jnp.int32(0), jnp.zeros((2, 2), jnp.int32), jnp.ones((2,), jnp.int32), jnp.ones((2,), jnp.int32))
    for q_bad, k_bad in ((q.astype(jnp.float16), arena.astype(jnp.float16)), (q, arena.astype(jnp.bfloat16)),
                         (jnp.zeros((2, 2, 4, 8), jnp.float32), arena)):  # fmt: skip
        assert not attention.supports(q_bad, k_bad, k_bad)
        with pytest.raises(ValueError, match="one query a row"):
            attention.decode_attention(q_bad, k_bad, k_bad, *rows)
    assert attention.supports(q, arena, arena) and not attention.supports(q, arena, arena, k_scale=arena)


def _filled(dtype):
    layout = aj.KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, page_size=4, num_pages=24, max_seqs=4,
                         max_pages_per_seq=5, dtype=dtype)  # fmt: skip
    rng = np.random.default_rng(0)
    cache = aj.create(layout)
    slots = jnp.arange(3, dtype=jnp.int32)
    cache, ok = aj.reserve(cache, slots, jnp.asarray([5, 11, 1], jnp.int32))
    assert bool(ok.all())
    for layer in range(3):
        kv = jnp.asarray(rng.standard_normal((2, 3, 11, 2, 16)), dtype)
        cache = aj.append(cache, layer, slots, kv[0], kv[1], num_tokens=jnp.asarray([5, 11, 1], jnp.int32))
    return cache, slots, jnp.asarray(rng.standard_normal((3, 1, 4, 16)), dtype)


def test_the_dispatch_follows_attend_kernel():
    cache, _, q = _filled(jnp.float32)
    assert not arena_ops.attends_natively(False, "xla", q, cache)
    assert arena_ops.attends_natively("cpu", "xla", q, cache) and arena_ops.attends_natively("auto", "xla", q, cache)
    assert not arena_ops.attends_natively("cpu", "reference", q, cache)
    assert not arena_ops.attends_natively("cpu", "xla", q.astype(jnp.bfloat16), cache)  # q of another dtype
    assert not arena_ops.attends_natively("cpu", "xla", jnp.concatenate([q, q], axis=1), cache)  # two queries a row
    with mock.patch.object(attention, "MAX_KEYS_READ", 1):
        assert not arena_ops.attends_natively("auto", "xla", q, cache) and arena_ops.attends_natively("cpu", "xla", q, cache)
    with mock.patch.object(attention, "native_problem", lambda: "no compiler"):
        assert not arena_ops.attends_natively("cpu", "xla", q, cache)
    for bad in (True, "gpu", 1):
        with pytest.raises(ValueError, match="ATTEND_KERNEL"):
            arena_ops.attends_natively(bad, "xla", q, cache)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attend_gives_the_same_with_the_native_call_under_a_scan_of_layers(dtype):
    cache, slots, q = _filled(dtype)

    def run(kernel):  # a new function per mode: JAX reuses a function's trace across jits
        def body(_, layer):
            return None, aj.attend(q, cache, layer, slots, backend="xla", sliding_window=6)

        with mock.patch.object(arena_ops, "ATTEND_KERNEL", kernel):
            step = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(3, dtype=jnp.int32))[1])
            return step(), step.lower().as_text()

    want, text = run(False)
    assert "arena_decode_attention" not in text
    got, text = run("cpu")
    assert "arena_decode_attention" in text
    tol = 2e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)
    assert np.abs(np.asarray(want, np.float32)).max() > 0


@pytest.mark.parametrize("scan_layers", [True, False])
def test_a_model_step_with_the_native_call_keeps_the_arena_in_place_and_its_tokens(scan_layers):
    """A Gemma-2-style model's prefill and decode steps (traced per-layer windows in a scan of
    layers, static ones in a list, whose last layer attends from each row's last token alone under
    `StepPlan.last_query`; a soft cap) with ATTEND_KERNEL "cpu": one native call a layer in the
    decode step, no copy of the arena, the donated buffers back in place, the greedy tokens, logits
    and table those of the blockwise path. In the scan, at most 8 kernels wait at once as an
    iteration starts (`op_hlo.widest_loop_start`): the call's layer operand waits for its q, else it
    was a ninth and XLA ran the loop's body on its thread pool (`arena_ops.attend_impl`)."""
    import re

    from flax import nnx

    from arena_jax import models

    model = models.init_random(models.LlamaConfig.tiny_family("gemma2"), seed=1, scan_layers=scan_layers)
    graphdef, state = nnx.split(model)
    layout = models.default_layout(model, 4, 40, page_size=8, dtype="float32")
    slots = jnp.arange(4, dtype=jnp.int32)
    prompts = jnp.asarray(np.random.default_rng(1).integers(0, 100, (4, 24)), jnp.int32)
    arena = re.escape("f32[" + ",".join(map(str, layout.arena_shape)) + "]")
    runs = {}
    for kernel in (False, "cpu"):
        jax.clear_caches()  # the module-level steps' traces read ATTEND_KERNEL as they were traced
        with mock.patch.object(arena_ops, "ATTEND_KERNEL", kernel):
            cache = aj.create(layout)
            out = models.prefill(graphdef, state, cache, prompts, slots, jnp.asarray([24, 20, 9, 1], jnp.int32))
            hlo = models.decode_step.lower(graphdef, state, out.cache, out.tokens, slots).compile().as_text()
            assert ("arena_decode_attention" in hlo) == (kernel == "cpu")
            assert not scan_layers or 1 <= widest_loop_start(hlo) <= 8
            assert not [line for line in hlo.splitlines() if re.search(r"= " + arena + r"\S* copy(-start)?\(", line)]
            tokens = [out.tokens]
            logits = [np.asarray(out.logits)]
            for _ in range(6):
                ptr = out.cache.k.unsafe_buffer_pointer()
                out = models.decode_step(graphdef, state, out.cache, out.tokens, slots)
                assert out.cache.k.unsafe_buffer_pointer() == ptr
                tokens.append(out.tokens)
                logits.append(np.asarray(out.logits))
            table = out.cache.table
            runs[kernel] = (np.stack(tokens), [np.asarray(x) for x in (table.lengths, table.written, table.page_map)],
                            np.stack(logits))  # fmt: skip
    np.testing.assert_array_equal(runs["cpu"][0], runs[False][0])
    for got, want in zip(runs["cpu"][1], runs[False][1], strict=True):  # the rows' lengths, watermarks, pages
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(runs["cpu"][2], runs[False][2], rtol=1e-4, atol=1e-4)
    jax.clear_caches()


def test_the_study_times_both_paths_on_equal_outputs():
    from arena_jax.benchmarks.studies import attention_native

    row = attention_native.measure(2, 2, 2, 16, 20, repeats=2)
    assert row["native_us"] > 0 and row["blockwise_us"] > 0
    assert row["keys_read"] == 2 * 2 * 3 * 16 * 16 and row["max_abs_difference"] < 1e-5
    assert attention_native._case("4:2:2:16:48") == (4, 2, 2, 16, 48)
