"""Mosaic TPU kernels == the jnp references, in TPU interpret mode on CPU, on fresh random data.

TPU interpret mode (`pltpu.InterpretParams`, what `interpret=True` selects for these kernels)
runs a kernel on CPU modelling HBM, VMEM, SMEM, the DMAs (executed when waited on) and the
semaphores, and fills never-written VMEM with NaN: a read before its DMA landed, a wait that
does not match its copy, or a missing mask shows. Every geometry here is one the TPU kernels
take (`tpu_unsupported_reason`: head_dim 128 / 256, pages multiples of 8 up to 256, 8-bit
pages 128 / 256); `tests/test_compile_tpu.py` compiles the same kernels for v5e / v6e.

CI runs a lean grid (interpret mode compiles a program per shape: ~5-10 s each, ~0.5 s per
call after); `ARENA_TPU_GRID=full` runs the full grid (GQA 1/4/8 x pages 8-256 x head 128/256
x bf16/f32 x decode/prefill x window, every 8-bit dtype x q dtype, appends over every page
size); the run's summary prints how many cases of each kind ran.
"""
from __future__ import annotations

import collections
import functools
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases
from kernel_cases import TOLERANCES, attention_ref, fill_ref
from pallas_kernels import BlockSizes, append_reference, paged_attention_reference
from pallas_kernels.quant import QUANTIZED_DTYPES
from pallas_kernels.tpu.append import tpu_paged_append
from pallas_kernels.tpu.attention import tpu_paged_attention

FULL = os.environ.get("ARENA_TPU_GRID", "").strip().lower() == "full"
NUM_PAGES = 40  # one pool size
COUNTS: collections.Counter = collections.Counter()  # cases run per kind (printed at the end with -s)
append_ref = jax.jit(append_reference)


def rows_for(page_size: int, tokens: int):
    """Lengths 1, S-1, S, S+1, long, and a padded row; num_tokens up to `tokens`."""
    s = page_size
    lengths = (1, max(s - 1, 2), s, s + 1, 3 * s + 5, 7)
    num_tokens = tuple(min(n, tokens) for n in (1, max(s - 1, 2), 2, s + 1, tokens, 0))
    return lengths, num_tokens


def float_case(*, seed, lengths, num_tokens, tokens, q_heads, kv_heads, page_size, head_dim, dtype, stale=np.nan,
               layers=2, layer=1, max_pages=None):
    """A filled arena (live positions random, every other position `stale`) plus queries."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    batch = len(lengths)
    max_pages = max_pages or int(-(-lengths.max() // page_size))
    page_map = kernel_cases.scrambled_page_map(seed, lengths, page_size, max_pages, NUM_PAGES)
    arena = kernel_cases.full((layers, kv_heads, NUM_PAGES, page_size, head_dim), stale, dtype)
    n = int(lengths.max())
    k, v = (kernel_cases.on_device(rng.standard_normal((batch, n, kv_heads, head_dim)), dtype) for _ in range(2))
    lens = jnp.asarray(lengths, jnp.int32)
    k_arena, v_arena = fill_ref(arena, arena, layer, k, v, page_map, lens, lens)
    q = kernel_cases.on_device(rng.standard_normal((batch, tokens, q_heads, head_dim)), dtype)
    return dict(q=q, k_arena=k_arena, v_arena=v_arena, layer=layer, page_map=page_map, lengths=lens,
                num_tokens=jnp.asarray(num_tokens, jnp.int32))


def quantized_case(*, seed, dtype, lengths, num_tokens, tokens, q_heads, kv_heads, page_size, head_dim, q_dtype,
                   stale_scale=np.nan, layer=1, num_pages=NUM_PAGES, page_map=None):
    """An 8-bit arena filled by the reference append over random-byte garbage (fp8 NaN bit
    patterns included) with stale scales `stale_scale`, plus queries; `page_map` default scrambled."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    batch = len(lengths)
    max_pages = int(-(-lengths.max() // page_size))
    if page_map is None:
        page_map = kernel_cases.scrambled_page_map(seed, lengths, page_size, max_pages, num_pages)
    page_map = jnp.asarray(page_map, jnp.int32)
    values = kernel_cases.random_bits(rng, (2, kv_heads, num_pages, page_size, head_dim), dtype)
    scales = kernel_cases.full((2, kv_heads, num_pages, page_size), stale_scale, jnp.float32)
    n = int(lengths.max())
    k = rng.standard_normal((batch, n, kv_heads, head_dim)) * np.where(np.arange(head_dim) % 7 == 3, 20.0, 1.0)
    v = rng.standard_normal((batch, n, kv_heads, head_dim))
    lens = jnp.asarray(lengths, jnp.int32)
    ka, va, ks, vs = fill_ref(values, values, layer, kernel_cases.on_device(k, jnp.float32),
                              kernel_cases.on_device(v, jnp.float32), page_map, lens, lens, k_scale=scales, v_scale=scales)
    q = kernel_cases.on_device(rng.standard_normal((batch, tokens, q_heads, head_dim)), q_dtype)
    return dict(q=q, k_arena=ka, v_arena=va, layer=layer, page_map=page_map, lengths=lens,
                num_tokens=jnp.asarray(num_tokens, jnp.int32), k_scale=ks, v_scale=vs)


def assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOLERANCES[jnp.dtype(dtype)])


def padded_rows_are_zero(out, num_tokens):
    pad = np.arange(out.shape[1])[None, :] >= np.asarray(num_tokens)[:, None]
    return not np.asarray(out, np.float32)[pad].any()


# ---- attention over float arenas ----------------------------------------------------------------

# (q_heads, kv_heads, page_size, head_dim, dtype, tokens, window, block_k)
ATTENTION_CI = [
    (8, 2, 16, 128, "bfloat16", 1, None, None),  # decode, GQA 4, default tiles (one block)
    (2, 2, 8, 128, "float32", 1, 5, 16),  # decode, GQA 1, blocks of 2 pages, a window
    (8, 1, 256, 256, "bfloat16", 1, None, None),  # GQA 8, 256-token pages, head 256
    (4, 1, 8, 128, "float32", 6, 10, 16),  # prefill: 6 tokens in row blocks of 4 tokens x 4 heads, a window
    (10, 10, 16, 128, "bfloat16", 1, None, 32),  # decode over more KV heads than it unrolls: a loop over heads
]
ATTENTION_FULL = [
    (g * kv, kv, s, d, dt, t, w, None)
    for (g, kv), s, d, dt, (t, w) in itertools.product(
        ((1, 2), (4, 2), (8, 1)), (8, 16, 64, 256), (128, 256), ("bfloat16", "float32"), ((1, None), (1, 5), (6, None), (6, 10)))
]


@pytest.mark.parametrize("q_heads,kv_heads,page_size,head_dim,dtype,tokens,window,block_k",
                         ATTENTION_FULL if FULL else ATTENTION_CI, ids=str)
def test_attention_matches_reference(q_heads, kv_heads, page_size, head_dim, dtype, tokens, window, block_k):
    """Kernel == reference; NaN in every unwritten position, in pages past the length and behind
    unmapped entries gives finite output, bit-equal to the same run over a zero-filled arena."""
    lengths, num_tokens = rows_for(page_size, tokens)
    kwargs = dict(seed=q_heads + page_size + head_dim + tokens, lengths=lengths, num_tokens=num_tokens, tokens=tokens,
                  q_heads=q_heads, kv_heads=kv_heads, page_size=page_size, head_dim=head_dim, dtype=jnp.dtype(dtype))
    dirty = float_case(**kwargs, stale=np.nan)
    bs = BlockSizes(block_k=block_k, block_tokens=4 if tokens > 1 else None) if block_k else None
    got = tpu_paged_attention(**dirty, sliding_window=window, interpret=True, block_sizes=bs)
    assert got.shape == dirty["q"].shape and got.dtype == dirty["q"].dtype
    assert np.isfinite(np.asarray(got, np.float32)).all()
    assert_close(got, attention_ref(**dirty, sliding_window=window), dtype)
    assert padded_rows_are_zero(got, num_tokens)
    if not FULL:  # stale NaN never reaches the output: bit-equal to a clean arena
        clean = float_case(**kwargs, stale=0.0)
        again = tpu_paged_attention(**clean, sliding_window=window, interpret=True, block_sizes=bs)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(again))
    COUNTS["attention (float arenas)"] += 1


def test_unmapped_page_inside_a_row_is_masked_under_jit():
    """A -1 entry inside a row's range (its keys are dead, as in the reference), a traced
    layer, and the kernel inlined in a user's jit."""
    case = float_case(seed=4, lengths=(40, 20, 9), num_tokens=(1, 1, 0), tokens=1, q_heads=4, kv_heads=2, page_size=8,
                      head_dim=128, dtype=jnp.float32)
    case["page_map"] = case["page_map"].at[0, 2].set(-1)
    step = jax.jit(lambda c, layer: tpu_paged_attention(**{**c, "layer": layer}, interpret=True,
                                                        block_sizes=BlockSizes(block_k=16)))
    got = step({k: v for k, v in case.items() if k != "layer"}, jnp.int32(case["layer"]))
    assert np.isfinite(np.asarray(got)).all()
    assert_close(got, attention_ref(**case), jnp.float32)
    COUNTS["attention (float arenas)"] += 1


def test_chunked_prefill_equals_one_shot():
    """TPU append + TPU attention in chunks of 4 tokens (ragged rows of 13 and 9 tokens over
    8-token pages: chunks that start mid-page and cross pages; a 10-token window, smaller than
    the context; NaN everywhere unwritten) == one-shot prefill; the arena after the chunks is
    bit-equal to the one-shot append's. (Token-by-token decode: the decode cases above and
    `test_api_backend_matches_reference`.)"""
    n = np.array([13, 9, 0])
    rng = np.random.default_rng(11)
    q_heads, kv_heads, page_size, head_dim, window, n_max = 4, 2, 8, 128, 10, 13
    k, v, q = (rng.standard_normal((3, n_max, h, head_dim)).astype(np.float32) for h in (kv_heads, kv_heads, q_heads))
    page_map = kernel_cases.scrambled_page_map(11, np.full(3, n_max), page_size, 2, NUM_PAGES)
    arena = kernel_cases.full((1, kv_heads, NUM_PAGES, page_size, head_dim), np.nan, jnp.float32)
    lens = jnp.asarray(n, jnp.int32)
    ka, va = tpu_paged_append(arena, arena, 0, k, v, page_map, lens, lens, interpret=True)
    for got, want in zip((ka, va), append_ref(arena, arena, 0, k, v, page_map, lens, lens)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    one_shot = tpu_paged_attention(q, ka, va, 0, page_map, lens, lens, sliding_window=window, interpret=True)
    assert_close(one_shot, attention_ref(q, ka, va, 0, page_map, lens, lens, sliding_window=window), jnp.float32)
    one_shot = np.asarray(one_shot)
    for chunk in (4,):
        kc_arena, vc_arena = arena, arena
        for start in range(0, n_max, chunk):
            take = np.clip(n - start, 0, chunk)
            lc, cnt = jnp.asarray(start + take, jnp.int32), jnp.asarray(take, jnp.int32)
            pad = ((0, 0), (0, max(0, start + chunk - n_max)), (0, 0), (0, 0))
            kc, vc, qc = (np.pad(x[:, start: start + chunk], pad) for x in (k, v, q))
            kc_arena, vc_arena = tpu_paged_append(kc_arena, vc_arena, 0, kc, vc, page_map, lc, cnt, interpret=True)
            out = np.asarray(tpu_paged_attention(qc, kc_arena, vc_arena, 0, page_map, lc, cnt, sliding_window=window,
                                                 interpret=True))
            for b in range(3):
                assert_close(out[b, : take[b]], one_shot[b, start: start + take[b]], jnp.float32)
            assert padded_rows_are_zero(out, take)
        np.testing.assert_array_equal(np.asarray(kc_arena), np.asarray(ka))
        np.testing.assert_array_equal(np.asarray(vc_arena), np.asarray(va))
    COUNTS["chunked prefill (append + attention)"] += 1


# ---- the contract's options and rules: soft-cap, traced windows, masked means masked, dtypes ----------

reference_traced = jax.jit(paged_attention_reference, static_argnames=("sm_scale", "logits_soft_cap"))


def assert_same_nans_and_close(got, want, dtype, label):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=label)
    assert_close(np.where(np.isnan(want), 0, got), np.where(np.isnan(want), 0, want), dtype)


def test_soft_cap_traced_windows_and_poison_rules():
    """One kernel (a traced window, soft-cap 5) over scenarios == the reference: windows 3,
    16, 0 (admits no key: zeros) and 1000 (none); NaN in a V row or K row a query attends to
    (its whole output row is NaN), in the V of a future key or of a key outside the window
    (contributes nothing), and in q."""
    case = float_case(seed=21, lengths=(40, 36, 9), num_tokens=(4, 4, 0), tokens=4, q_heads=4, kv_heads=2,
                      page_size=8, head_dim=128, dtype=jnp.float32)
    pm, layer = np.asarray(case["page_map"]), case["layer"]

    def poison(name, row, pos, head, lane):
        return {**case, name: case[name].at[layer, head, pm[row, pos // 8], pos % 8, lane].set(jnp.nan)}

    step = jax.jit(lambda c, w: tpu_paged_attention(**c, sliding_window=w, logits_soft_cap=5.0, interpret=True))
    scenarios = [("window 3", case, 3), ("window 16", case, 16), ("window 0", case, 0), ("no window", case, 1000),
                 ("visible v", poison("v_arena", 1, 33, 1, 5), 16), ("visible k", poison("k_arena", 1, 34, 0, 7), 16),
                 ("future v", poison("v_arena", 0, 39, 1, 2), 1000), ("v outside the window", poison("v_arena", 1, 2, 0, 3), 16),
                 ("q", {**case, "q": case["q"].at[0, 3, 2, 5].set(jnp.nan)}, 1000)]
    for label, c, w in scenarios:
        got = step(c, jnp.int32(w))
        want = reference_traced(**c, sliding_window=jnp.int32(w), logits_soft_cap=5.0)
        assert_same_nans_and_close(got, want, jnp.float32, label)
        nans = int(np.isnan(np.asarray(want)).sum())
        assert (nans > 0) == (label in ("visible v", "visible k", "future v", "q")), (label, nans)
        if label == "window 0":
            assert not np.asarray(got).any()
    COUNTS["attention (soft-cap, traced windows, poison rules)"] += len(scenarios)


def test_decode_poison_rules_and_a_hole_over_a_nan_page():
    """Decode (one token a program: the kernel finds a non-finite V row through P @ V itself)
    == the reference: NaN or inf in one lane of a V row a query attends to, or NaN in a K row,
    NaNs its whole output row; NaN in a V row past the length or outside the window
    contributes nothing; a hole (-1 entry) inside the range, whose DMA reads a NaN page, is
    masked (its V rows zeroed, its keys dead)."""
    case = float_case(seed=21, lengths=(40, 36, 9), num_tokens=(1, 1, 0), tokens=1, q_heads=4, kv_heads=2,
                      page_size=8, head_dim=128, dtype=jnp.float32)
    pm, layer = np.asarray(case["page_map"]), case["layer"]
    last = NUM_PAGES - 1  # where a -1 entry's DMA reads (the clip)
    assert not (pm == last).any()
    nan_page = {name: case[name].at[:, :, last].set(jnp.nan) for name in ("k_arena", "v_arena")}
    hole = {**case, **nan_page, "page_map": case["page_map"].at[1, 2].set(-1)}

    def poison(name, row, pos, head, lane, value=jnp.nan):
        return {**case, name: case[name].at[layer, head, pm[row, pos // 8], pos % 8, lane].set(value)}

    step = jax.jit(lambda c, w: tpu_paged_attention(**c, sliding_window=w, interpret=True))
    scenarios = [("visible v nan", poison("v_arena", 1, 33, 1, 5), 16, True),
                 ("visible v inf", poison("v_arena", 0, 12, 0, 9, jnp.inf), 1000, True),
                 ("visible k", poison("k_arena", 1, 34, 0, 7), 16, True),
                 ("v past the length", poison("v_arena", 1, 38, 1, 2), 1000, False),
                 ("v outside the window", poison("v_arena", 1, 2, 0, 3), 16, False),
                 ("a hole over a nan page", hole, 1000, False)]
    for label, c, w, nans in scenarios:
        got = step(c, jnp.int32(w))
        want = reference_traced(**c, sliding_window=jnp.int32(w))
        assert_same_nans_and_close(got, want, jnp.float32, label)
        assert bool(np.isnan(np.asarray(want)).any()) == nans, label
    COUNTS["attention (soft-cap, traced windows, poison rules)"] += len(scenarios)


def test_hole_ends_is_where_each_rows_last_hole_below_its_length_ends():
    """`hole_ends` (the kernels' steady-state loop starts past it) against a plain loop, on random
    page tables with holes and lengths anywhere: negative, inside, past the table."""
    from pallas_kernels.tpu.attention import hole_ends

    rng = np.random.default_rng(7)
    page_size, rows, max_pages = 8, 64, 12
    page_map = np.where(rng.random((rows, max_pages)) < 0.2, -1, rng.integers(0, 50, (rows, max_pages)))
    lengths = rng.integers(-10, max_pages * page_size + 20, rows)
    want = [max([(p + 1) * page_size for p in range(max_pages) if page_map[r, p] < 0 and p * page_size < lengths[r]],
                default=0) for r in range(rows)]
    got = hole_ends(jnp.asarray(page_map, jnp.int32), jnp.asarray(lengths, jnp.int32), page_size)
    np.testing.assert_array_equal(np.asarray(got), want)
    assert 0 < sum(w > 0 for w in want) < rows  # rows with and without a hole below their length


@pytest.mark.parametrize("tokens", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("quantized", [False, True], ids=["bf16", "int8"])
def test_fast_loop_equals_the_general_path(quantized, tokens, monkeypatch):
    """The steady state (blocks every query row sees whole, hole-free, in a loop of their own that
    starts the next block's DMAs after this block's reads; decode: branch-free, the output written
    every block; prefill: no mask built) == the general step alone, bit for bit, and == the
    reference, NaN rules included. Blocks of 2 pages over rows of whole blocks (decode: the fast
    loop crossing heads), a partial last block, a window, a hole inside a row, a poisoned V row
    (bf16: NaN in a lane; int8: a NaN scale) in an interior block, NaN stale data, and prefill row
    blocks of 4 tokens with a row of fewer tokens."""
    from pallas_kernels.tpu import attention as tpu_attention

    page = 128 if quantized else 8
    lengths, window = (16 * page, 11 * page + 3), 9 * page + 3  # (16 pages a row: NUM_PAGES holds two)
    num_tokens = (1, 1) if tokens == 1 else (6, 3)
    common = dict(seed=5, lengths=lengths, num_tokens=num_tokens, tokens=tokens, q_heads=8, kv_heads=2,
                  page_size=page, head_dim=128)
    if quantized:
        case = quantized_case(**common, dtype=jnp.dtype(jnp.int8), q_dtype=jnp.bfloat16)
    else:
        case = float_case(**common, dtype=jnp.dtype(jnp.bfloat16), max_pages=16)
    pm, layer = np.asarray(case["page_map"]), case["layer"]
    scenarios = {"whole rows": case, "a hole in row 1": {**case, "page_map": case["page_map"].at[1, 3].set(-1)},
                 "a late hole in row 0": {**case, "page_map": case["page_map"].at[0, 13].set(-1)},
                 # 7 whole blocks a head: a head's last block (past the hole) pairs with the next
                 # head's first (the hole's) in the decode loop's two-pair test
                 "a hole in the first of 7 blocks": {**case, "page_map": case["page_map"].at[0, 1].set(-1),
                                                     "lengths": case["lengths"].at[0].set(14 * page)}}
    if quantized:  # row 0, position 2 * page + 4: block 1 of 8, seen whole by every query row
        scenarios["a nan v scale"] = {**case, "v_scale": case["v_scale"].at[layer, 1, pm[0, 2], 4].set(jnp.nan)}
    else:
        scenarios["a nan v lane"] = {**case, "v_arena": case["v_arena"].at[layer, 1, pm[0, 2], 4, 7].set(jnp.nan)}
    bs = BlockSizes(block_k=2 * page, block_tokens=4 if tokens > 1 else None)
    for label, c in scenarios.items():
        for w in (None, window):
            monkeypatch.setattr(tpu_attention, "FAST_LOOP", True)
            fast = tpu_paged_attention(**c, sliding_window=w, interpret=True, block_sizes=bs)
            monkeypatch.setattr(tpu_attention, "FAST_LOOP", False)
            general = tpu_paged_attention(**c, sliding_window=w, interpret=True, block_sizes=bs)
            np.testing.assert_array_equal(np.asarray(fast, np.float32), np.asarray(general, np.float32),
                                          err_msg=f"{label}, window {w}")
            want = reference_traced(**c, sliding_window=None if w is None else jnp.int32(w))
            assert_same_nans_and_close(fast, want, jnp.bfloat16, f"{label}, window {w}")
            assert padded_rows_are_zero(fast, c["num_tokens"])
            if w is None:  # (the window starts past the poisoned row)
                assert np.isnan(np.asarray(want, np.float32)).any() == label.startswith("a nan"), label
    COUNTS["attention (the fast loop)"] += 2 * len(scenarios)


@pytest.mark.parametrize("q_dtype,arena", [("float32", "bfloat16"), ("bfloat16", "float32")])
def test_q_dtype_other_than_the_arena(q_dtype, arena):
    """The dots run in q's dtype (the arena's values converted to it)."""
    case = float_case(seed=23, lengths=(5, 17, 30), num_tokens=(1, 1, 1), tokens=1, q_heads=4, kv_heads=2,
                      page_size=8, head_dim=128, dtype=jnp.dtype(arena))
    case["q"] = case["q"].astype(q_dtype)
    got = tpu_paged_attention(**case, interpret=True)
    assert got.dtype == jnp.dtype(q_dtype)
    assert_close(got, attention_ref(**case), q_dtype)
    COUNTS["attention (float arenas)"] += 1


def test_quantized_poisoned_scales_with_soft_cap():
    """8-bit: a NaN key scale or value scale a query attends to NaNs its whole row (the stored
    poison of a NaN / inf input row), with a soft-cap; elsewhere == the reference."""
    case = quantized_case(seed=25, dtype="int8", lengths=(40, 140, 7), num_tokens=(1, 3, 0), tokens=3, q_heads=4,
                          kv_heads=2, page_size=128, head_dim=128, q_dtype=jnp.bfloat16)
    pm = np.asarray(case["page_map"])
    case = {**case, "v_scale": case["v_scale"].at[1, 0, pm[1, 0], 5].set(jnp.nan),
            "k_scale": case["k_scale"].at[1, 1, pm[0, 0], 3].set(jnp.nan)}
    got = tpu_paged_attention(**case, logits_soft_cap=20.0, interpret=True)
    want = reference_traced(**case, logits_soft_cap=20.0)
    assert_same_nans_and_close(got, want, jnp.bfloat16, "8-bit poison")
    assert np.isnan(np.asarray(want, np.float32)).any()
    COUNTS["attention (8-bit arenas)"] += 1


# ---- append -----------------------------------------------------------------------------------------

# (page_size, kv_heads, dtype, tokens)
APPEND_CI = [(8, 1, "float32", 9), (16, 2, "bfloat16", 1), (32, 2, "bfloat16", 20)]
APPEND_FULL = list(itertools.product((8, 16, 32, 64, 128, 256), (2,), ("float32", "bfloat16"), (1, 9, 40)))


def append_inputs(*, seed, page_size, kv_heads, dtype, tokens, head_dim=128, max_pages=4):
    rng = np.random.default_rng(seed)
    lengths, num_tokens = rows_for(page_size, tokens)
    shape = (2, kv_heads, NUM_PAGES, page_size, head_dim)
    k_arena, v_arena = (kernel_cases.on_device(rng.standard_normal(shape), dtype) for _ in range(2))
    k, v = (kernel_cases.on_device(rng.standard_normal((6, tokens, kv_heads, head_dim)), dtype) for _ in range(2))
    page_map = kernel_cases.scrambled_page_map(seed, lengths, page_size, max_pages, NUM_PAGES)
    return k_arena, v_arena, k, v, page_map, jnp.asarray(lengths, jnp.int32), jnp.asarray(num_tokens, jnp.int32)


@pytest.mark.parametrize("page_size,kv_heads,dtype,tokens", APPEND_FULL if FULL else APPEND_CI, ids=str)
def test_append_matches_reference(page_size, kv_heads, dtype, tokens):
    """Bit-equal to the reference: lengths 1, S-1, S, S+1, long, a padded row; tokens that
    straddle pages and start mid-chunk (the chunk's other rows must keep their contents)."""
    k_arena, v_arena, k, v, page_map, lengths, num_tokens = append_inputs(
        seed=page_size + tokens, page_size=page_size, kv_heads=kv_heads, dtype=jnp.dtype(dtype), tokens=tokens)
    got = tpu_paged_append(k_arena, v_arena, 1, k, v, page_map, lengths, num_tokens, interpret=True)
    for g, w in zip(got, append_ref(k_arena, v_arena, 1, k, v, page_map, lengths, num_tokens)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    COUNTS["append (float arenas)"] += 1


def test_append_unmapped_pages_past_the_table_and_donation_under_jit():
    """Traced layer, donated arena, a -1 page inside a row's range, a row whose last tokens
    fall past its page table (dropped), a layer out of range (writes nothing)."""
    k_arena, v_arena, k, v, page_map, _, _ = append_inputs(seed=3, page_size=8, kv_heads=2, dtype=jnp.float32, tokens=9)
    lengths, num_tokens = jnp.array([1, 7, 8, 35, 30, 5], jnp.int32), jnp.array([1, 5, 8, 9, 9, 0], jnp.int32)
    page_map = page_map.at[4, 1].set(-1)
    want = append_ref(k_arena, v_arena, 0, k, v, page_map, lengths, num_tokens)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k_arena, v_arena, layer):
        return tpu_paged_append(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens, interpret=True)

    before = (np.asarray(k_arena), np.asarray(v_arena))
    got = step(k_arena, v_arena, jnp.int32(0))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    untouched = step(*(jnp.asarray(b) for b in before), jnp.int32(5))  # layer 5 of 2: no write
    for g, b in zip(untouched, before):
        np.testing.assert_array_equal(np.asarray(g), b)
    COUNTS["append (float arenas)"] += 2


# ---- 8-bit arenas (page sizes 128 / 256: their scales' default TPU layout) ----------------------------

# (dtype, q_heads, kv_heads, page_size, q_dtype, tokens)
QUANT_CI = [("int8", 8, 2, 128, "bfloat16", 1), ("float8_e5m2", 4, 1, 128, "float32", 5)]
QUANT_FULL = [(jnp.dtype(d).name, g * 2, 2, s, qd, t) for d, g, s, qd, t in itertools.product(
    QUANTIZED_DTYPES, (1, 4), (128, 256), ("bfloat16", "float32"), (1, 5))]


@pytest.mark.parametrize("dtype,q_heads,kv_heads,page_size,q_dtype,tokens", QUANT_FULL if FULL else QUANT_CI, ids=str)
def test_quantized_attention_with_nan_poisoned_stale_scales(dtype, q_heads, kv_heads, page_size, q_dtype, tokens):
    """Stale values are random bytes, stale scales NaN: output finite, bit-equal to the same
    arena with stale scales 0, and close to the reference."""
    lengths, num_tokens = (1, 127, 129, 300, 7), (1, 1, tokens, tokens, 0)
    kwargs = dict(seed=page_size + q_heads + tokens, dtype=dtype, lengths=lengths, num_tokens=num_tokens, tokens=tokens,
                  q_heads=q_heads, kv_heads=kv_heads, page_size=page_size, head_dim=128, q_dtype=jnp.dtype(q_dtype))
    dirty, clean = quantized_case(**kwargs, stale_scale=np.nan), quantized_case(**kwargs, stale_scale=0.0)
    got = tpu_paged_attention(**dirty, interpret=True)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(tpu_paged_attention(**clean, interpret=True)))
    assert_close(got, attention_ref(**dirty), q_dtype)
    assert padded_rows_are_zero(got, num_tokens)
    COUNTS["attention (8-bit arenas)"] += 1


# 8-bit pages of 16 / 32 / 64: scales as rows of 128 lanes (`scale_rows`), 128 / S pages a row.
# (dtype, page_size, tokens, pages_per_block: None = the default block, else blocks of that many
# pages: several blocks a row, the steady-state loop, and blocks of fewer pages than a row holds)
SCALE_ROWS_CI = [("int8", 16, 1, None), ("int8", 32, 5, 3), ("float8_e4m3fn", 64, 1, 2), ("int8", 16, 1, 4)]
SCALE_ROWS_FULL = [(jnp.dtype(d).name, s, t, b) for d, s, t, b in itertools.product(
    QUANTIZED_DTYPES, (16, 32, 64), (1, 5), (None, 2, 3, 8))]


@pytest.mark.parametrize("dtype,page_size,tokens,pages_per_block", SCALE_ROWS_FULL if FULL else SCALE_ROWS_CI, ids=str)
def test_quantized_attention_over_scale_rows(dtype, page_size, tokens, pages_per_block):
    """Scale rows: stale values random bytes, stale scales NaN (the other pages of a row the
    block reads are someone else's: NaN here), on fresh random data. Output finite, bit-equal to
    the same arena with stale scales 0, close to the reference; scales as [L, H, P, S] refused
    with the reason; a NaN key scale a query attends to NaNs its row, and only it."""
    from pallas_kernels.tpu.common import scale_rows

    lengths, num_tokens = (1, 127, 129, 300, 7), (1, 1, tokens, tokens, 0)
    kwargs = dict(seed=page_size + tokens + (pages_per_block or 0), dtype=dtype, lengths=lengths, num_tokens=num_tokens,
                  tokens=tokens, q_heads=8, kv_heads=2, page_size=page_size, head_dim=128, q_dtype=jnp.bfloat16,
                  num_pages=128)
    dirty, clean = quantized_case(**kwargs, stale_scale=np.nan), quantized_case(**kwargs, stale_scale=0.0)
    blocks = None if pages_per_block is None else BlockSizes(pages_per_block=pages_per_block)

    def run(case, rows=True):
        scales = {k: scale_rows(case[k]) if rows else case[k] for k in ("k_scale", "v_scale")}
        return tpu_paged_attention(**{**case, **scales}, interpret=True, block_sizes=blocks)

    got = run(dirty)
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(run(clean)))
    with pytest.raises(ValueError, match=rf"page_size={page_size}: .*scale_rows"):
        run(dirty, rows=False)  # [L, H, P, S]: on a TPU, a relayout of every scale at every call
    assert_close(got, attention_ref(**dirty), jnp.bfloat16)
    assert padded_rows_are_zero(got, num_tokens)
    # A NaN key scale at row 3's key 200, which its queries attend: row 3 NaN, the others as before.
    page = int(dirty["page_map"][3, 200 // page_size])
    poisoned = {**dirty, "k_scale": dirty["k_scale"].at[dirty["layer"], 1, page, 200 % page_size].set(jnp.nan)}
    out = np.asarray(run(poisoned), np.float32)
    assert np.isnan(out[3, :tokens, 4:]).all() and not np.isnan(out[3, :, :4]).any()
    np.testing.assert_array_equal(np.delete(out, 3, axis=0), np.delete(np.asarray(got, np.float32), 3, axis=0))
    COUNTS["attention (8-bit arenas, scale rows)"] += 1


# Decode over 8-bit scale rows (pages of 16 / 32 / 64) reads a block whose pages are a run
# (`run_blocks`) in one DMA a buffer (`attention.start_run`). (dtype, page_size, pages_per_block)
RUNS_CI = [("int8", 32, 4), ("float8_e4m3fn", 64, 4)]
RUNS_FULL = [(jnp.dtype(d).name, s, b) for d, s, b in itertools.product(QUANTIZED_DTYPES, (16, 32, 64), (8, 16))]


def run_table(page_size: int, pages_per_block: int, num_pages: int):
    """Lengths and a page table (no page in two rows) whose blocks are of every kind: row 0 runs
    only, from page 0 (the runs' steady state, across heads), row 1 runs and scattered blocks in
    turn (the fast loops' hand-overs), row 2 a run from a page inside a scale row and one whose
    scale rows would pass the arena's (not a run), row 3 a run holding a hole, row 4 a run in a
    partial last block; -1 past each length."""
    ppb = pages_per_block
    blocks = 6
    m = blocks * ppb
    lengths = (m * page_size, m * page_size - 5, (4 * ppb) * page_size, 3 * ppb * page_size, ppb * page_size + 9)
    pm = np.full((5, m), -1, np.int64)
    scattered = iter(np.random.default_rng(page_size).permutation(np.arange(5 * m, num_pages - ppb)))
    take = lambda n: [next(scattered) for _ in range(n)]  # noqa: E731
    pm[0] = np.arange(m)
    for j in range(blocks):
        pm[1, j * ppb:(j + 1) * ppb] = (m + j * ppb + np.arange(ppb)) if j % 2 == 0 else take(ppb)
    pm[2, :ppb] = 2 * m + 1 + np.arange(ppb)  # from a scale row's second page
    pm[2, ppb:2 * ppb] = num_pages - ppb + np.arange(ppb)  # the arena's last pages
    pm[2, 2 * ppb:4 * ppb] = take(2 * ppb)
    pm[3, :3 * ppb] = take(3 * ppb)
    pm[3, ppb:2 * ppb] = 3 * m + np.arange(ppb)  # a run ...
    pm[3, ppb + 1] = -1  # ... with a hole
    pm[4, :2 * ppb] = 4 * m + np.arange(2 * ppb)  # a run, then a partial block of a run
    needed = -(-np.asarray(lengths) // page_size)
    pm = np.where(np.arange(m)[None, :] < needed[:, None], pm, -1)
    live = pm[pm >= 0]
    assert len(set(live.tolist())) == live.size and live.max() < num_pages
    return lengths, pm


@pytest.mark.parametrize("dtype,page_size,pages_per_block", RUNS_FULL if FULL else RUNS_CI, ids=str)
def test_decode_reads_runs_of_pages(dtype, page_size, pages_per_block, monkeypatch):
    """Decode over scale rows with runs read one DMA a buffer == the same call a DMA a page, bit for
    bit, with the fast loops on and off, and close to the reference; stale scales NaN, stale values
    random bytes; a NaN value scale inside a run poisons its row alone. `run_blocks` marks exactly
    the runs whose scale rows lie inside the arena's."""
    from pallas_kernels.tpu import attention as tpu_attention
    from pallas_kernels.tpu.common import scale_rows

    num_pages = max(256, 40 * pages_per_block)
    lengths, pm = run_table(page_size, pages_per_block, num_pages)
    case = quantized_case(seed=page_size + pages_per_block, dtype=dtype, lengths=lengths, num_tokens=(1,) * 5, tokens=1,
                          q_heads=8, kv_heads=2, page_size=page_size, head_dim=128, q_dtype=jnp.bfloat16,
                          num_pages=num_pages, page_map=pm)
    flags = np.asarray(tpu_attention.run_blocks(case["page_map"], page_size, num_pages, pages_per_block)).reshape(5, -1)
    want_flags = np.zeros_like(flags)
    want_flags[0] = 1
    want_flags[1, ::2] = 1
    want_flags[2, 0] = 1
    want_flags[4, 0] = 1
    np.testing.assert_array_equal(flags, want_flags)
    blocks = BlockSizes(pages_per_block=pages_per_block)
    rows = {k: scale_rows(case[k]) for k in ("k_scale", "v_scale")}

    def run(c, runs, fast_loop=True):
        monkeypatch.setattr(tpu_attention, "RUNS", runs)
        monkeypatch.setattr(tpu_attention, "FAST_LOOP", fast_loop)
        return np.asarray(tpu_paged_attention(**{**c, **rows}, interpret=True, block_sizes=blocks), np.float32)

    got = run(case, True)
    np.testing.assert_array_equal(got, run(case, False))
    np.testing.assert_array_equal(got, run(case, True, fast_loop=False))
    assert np.isfinite(got).all()
    assert_close(got, attention_ref(**case), jnp.bfloat16)
    # A NaN value scale at row 0's key in block 3 (a run): row 0 NaN, the others as before.
    key = 3 * pages_per_block * page_size + 7
    page = int(pm[0, key // page_size])
    poisoned = {**case, "v_scale": case["v_scale"].at[case["layer"], 1, page, key % page_size].set(jnp.nan)}
    rows = {k: scale_rows(poisoned[k]) for k in ("k_scale", "v_scale")}
    out = run(poisoned, True)
    assert np.isnan(out[0, :, 4:]).all() and not np.isnan(out[0, :, :4]).any()
    np.testing.assert_array_equal(out[1:], got[1:])
    COUNTS["attention (8-bit arenas, runs of pages)"] += 1


@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES if FULL else [jnp.dtype("float8_e4m3fn")], ids=str)
def test_quantized_append_matches_reference(dtype):
    """Values and scales bit-equal to the reference (same `quantize_rows`), with the rule rows:
    a zero row (scale 0), a NaN and an inf (scale NaN, values 0), values past fp8's range."""
    s, tokens, head_dim = 128, 9, 128
    rng = np.random.default_rng(5)
    lengths, num_tokens = (1, s - 1, s, s + 1, 2 * s + 2, 4), (1, 9, 2, 9, 9, 0)
    bits = rng.integers(0, 256, (2, 2, NUM_PAGES, s, head_dim), dtype=np.uint8)
    values = jnp.asarray(bits.view(jnp.dtype(dtype)))
    scales = jnp.asarray(rng.standard_normal((2, 2, NUM_PAGES, s)), jnp.float32)  # stale: must stay where not written
    k = rng.standard_normal((6, tokens, 2, head_dim)) * 3
    k[4, 0], k[4, 1, 0, 3], k[4, 2, 1, 0], k[4, 3, 0, :3] = 0.0, np.nan, -np.inf, (1e5, -1e5, 1e-3)
    k, v = kernel_cases.on_device(k, jnp.bfloat16), kernel_cases.on_device(rng.standard_normal((6, tokens, 2, head_dim)), jnp.bfloat16)
    page_map = kernel_cases.scrambled_page_map(5, lengths, s, 3, NUM_PAGES)
    args = (values, values, 1, k, v, page_map, jnp.asarray(lengths, jnp.int32), jnp.asarray(num_tokens, jnp.int32))
    got = tpu_paged_append(*args, k_scale=scales, v_scale=scales, interpret=True)
    want = fill_ref(*args, k_scale=scales, v_scale=scales)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    COUNTS["append (8-bit arenas)"] += 1


@pytest.mark.parametrize("page_size,tokens", [(16, 1), (16, 40), (32, 9), (64, 3)], ids=str)
def test_quantized_append_over_scale_rows(page_size, tokens):
    """Scale rows (`scale_rows`): values and scales bit-equal to the reference's on [L, H, P, S],
    on fresh random data, when several rows of one call write pages that share a scale row (each
    row read and written once, every entry's new scales merged into it), the stale scales of the
    row's other pages kept, and the rule rows (zero, NaN, inf) as in the test above."""
    from pallas_kernels.tpu.common import scale_rows

    head_dim, num_pages, rows = 128, 64, 8
    rng = np.random.default_rng(page_size + tokens)
    lengths = rng.integers(tokens, 3 * page_size + tokens, rows)
    num_tokens = np.minimum(rng.integers(0, tokens + 1, rows), lengths)
    num_tokens[0] = tokens
    bits = rng.integers(0, 256, (2, 2, num_pages, page_size, head_dim), dtype=np.uint8)
    values = jnp.asarray(bits.view(jnp.int8))
    scales = jnp.asarray(rng.standard_normal((2, 2, num_pages, page_size)), jnp.float32)
    k = rng.standard_normal((rows, tokens, 2, head_dim)) * 3
    k[0, 0] = 0.0
    k[0, -1, 1, 3] = np.nan
    k, v = (kernel_cases.on_device(x, jnp.bfloat16) for x in (k, rng.standard_normal((rows, tokens, 2, head_dim))))
    # Logical page i of row b is page i * rows + b: the rows' i-th pages share scale rows (all 8 at
    # page 16, 4 at 32, 2 at 64), so rows ending in the same logical page write one scale row.
    max_pages = int(-(-lengths.max() // page_size))
    i, b = np.meshgrid(np.arange(max_pages), np.arange(rows))
    page_map = jnp.asarray(np.where(i < -(-lengths[:, None] // page_size), i * rows + b, -1), jnp.int32)
    last_pages = (((lengths - 1) // page_size) * rows + np.arange(rows))[num_tokens > 0]
    shared = collections.Counter(last_pages // (128 // page_size))  # the scale rows written
    assert max(shared.values()) > 1  # (the case this test is for)
    args = (values, values, 1, k, v, page_map, jnp.asarray(lengths, jnp.int32), jnp.asarray(num_tokens, jnp.int32))
    want = fill_ref(*args, k_scale=scales, v_scale=scales)
    got = tpu_paged_append(*args, k_scale=scale_rows(scales), v_scale=scale_rows(scales), interpret=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32).reshape(w.shape), np.asarray(w, np.float32))
    COUNTS["append (8-bit arenas, scale rows)"] += 1


# ---- through the API: backend="pallas_tpu" == backend="reference" --------------------------------------


def test_api_backend_matches_reference():
    """aj.append / aj.attend with the TPU kernels (interpret mode) == the reference backend:
    ragged chunks of up to 4 tokens, then single tokens (decode), over scrambled NaN-filled
    pages, a padded row, a window, a soft-cap; arena contents and outputs. (One width: one compile per op.)"""
    import arena_jax as aj

    layout = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, page_size=8, num_pages=16, max_seqs=3,
                         max_pages_per_seq=4, dtype="float32")
    results = {}
    for backend in ("reference", "pallas_tpu"):
        cache = aj.create(layout)
        perm = jax.random.permutation(jax.random.key(0), layout.num_pages).astype(jnp.int32)
        cache = cache.replace(k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan),
                              table=cache.table.replace(free_stack=perm))
        slots, rng, outs = jnp.array([0, aj.PAD_SLOT, 2]), np.random.default_rng(1), []
        for counts in ([4, 0, 3], [4, 0, 4], [2, 0, 1], [1, 0, 1], [1, 0, 1]):
            counts, width = jnp.array(counts, jnp.int32), 4
            cache, ok = aj.reserve(cache, slots, counts)
            assert np.asarray(ok).all()
            for layer in range(layout.num_layers):
                k, v = (jnp.asarray(rng.standard_normal((3, width, 2, 128)), jnp.float32) for _ in range(2))
                cache = aj.append(cache, layer, slots, k, v, num_tokens=counts, backend=backend)
                q = jnp.asarray(rng.standard_normal((3, width, 4, 128)), jnp.float32)
                outs.append(aj.attend(q, cache, layer, slots, num_tokens=counts, sliding_window=6, logits_soft_cap=30.0,
                                      backend=backend))
        results[backend] = (cache, outs)
    (ref_cache, ref_outs), (tpu_cache, tpu_outs) = results["reference"], results["pallas_tpu"]
    np.testing.assert_array_equal(np.asarray(ref_cache.table.page_map), np.asarray(tpu_cache.table.page_map))
    for slot in (0, 2):
        pos = np.arange(int(ref_cache.table.lengths[slot]))
        pages = np.asarray(ref_cache.table.page_map[slot])[pos // 8]
        for a, b in ((ref_cache.k, tpu_cache.k), (ref_cache.v, tpu_cache.v)):
            np.testing.assert_array_equal(np.asarray(a)[:, :, pages, pos % 8], np.asarray(b)[:, :, pages, pos % 8])
    for got, want in zip(tpu_outs, ref_outs):
        assert np.isfinite(np.asarray(got)).all()
        assert_close(got, want, jnp.float32)
    COUNTS["API (aj.append / aj.attend)"] += len(tpu_outs)


@pytest.mark.parametrize("page_size", [16, 64] if FULL else [16])
def test_api_over_a_cache_with_scale_rows(page_size, monkeypatch):
    """An 8-bit cache created for a TPU (the platform patched; the kernels in interpret mode)
    stores its scales as rows of 128 lanes (`KVCache.scale_rows`) and runs every op on them
    (its reservations keep a slot's pages consecutive, `allocator._run_pages`; the reference
    cache's pop the free stack, so each is read through its own page table):
    prompts and decode tokens appended and attended through the TPU kernels, a fork whose shared
    partial last page is copied on write (k, v by the page-copy kernel, the scales' lanes of their
    rows by XLA), a release. Against the same ops on the [L, H, P, S] cache of the reference
    backend, on fresh random data: the page tables equal, every written K / V row and scale
    bit-equal, the outputs close. A host tier for it is refused with the reason."""
    import arena_jax as aj
    import pallas_kernels.tpu.common as tpu_common

    layout = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=128, page_size=page_size, num_pages=16, max_seqs=4,
                         max_pages_per_seq=4, dtype="int8")
    rng = np.random.default_rng(page_size)
    steps = [([0, 2], [2 * page_size + 3, page_size - 1], None)]  # (slots, counts, fork (src, dst) before them)
    steps += [([0, 2], [1, 1], None), ([0, 1, 2], [1, 2, 1], (0, 1)), ([1, 2], [1, 1], None)]
    data = [[(rng.standard_normal((len(sl), max(c), 2, 128)), rng.standard_normal((len(sl), max(c), 2, 128)),
              rng.standard_normal((len(sl), max(c), 4, 128))) for _ in range(layout.num_layers)] for sl, c, _ in steps]
    results = {}
    for backend, platform in (("reference", "cpu"), ("pallas_tpu", "tpu")):
        with monkeypatch.context() as patch:
            patch.setattr(tpu_common, "target_platform", lambda platform=platform: platform)
            cache = aj.create(layout)
            assert cache.scale_rows == (platform == "tpu")
            if platform == "tpu":
                assert cache.k_scale.shape == (2, 2, 16 * page_size // 128, 128)
            outs = []
            for (slots, counts, fork), layers in zip(steps, data):
                if fork is not None:
                    cache = aj.fork(cache, jnp.array([fork[0]]), jnp.array([fork[1]]))
                slots, counts = jnp.array(slots, jnp.int32), jnp.array(counts, jnp.int32)
                cache, ok = aj.reserve(cache, slots, counts)
                assert np.asarray(ok).all()
                for layer, (k, v, q) in enumerate(layers):
                    k, v, q = (jnp.asarray(x, jnp.bfloat16) for x in (k, v, q))
                    cache = aj.append(cache, layer, slots, k, v, num_tokens=counts, backend=backend)
                    outs.append(aj.attend(q, cache, layer, slots, num_tokens=counts, backend=backend))
            assert int(cache.stats.cow_copies.sum()) == 1  # the fork's shared last page, copied once
            cache = aj.release(cache, jnp.array([0], jnp.int32))
            # Slot 2 (page_size + 2 tokens: 2 pages) out to a host tier and back in as slot 3.
            host = aj.host.create_host(cache, 4)
            cache, host, ok = aj.host.swap_out(cache, host, jnp.array([2], jnp.int32), jnp.array([[1, 3]], jnp.int32))
            assert np.asarray(ok).all()
            host_pages = aj.host.host_pages_view(host, cache)
            cache, host, ok = aj.host.swap_in(cache, host, jnp.array([[1, 3]], jnp.int32),
                                              jnp.array([page_size + 2], jnp.int32), jnp.array([3], jnp.int32))
            assert np.asarray(ok).all()
            for layer, (_, _, q) in enumerate(data[-1]):
                outs.append(aj.attend(jnp.asarray(q[:1, :1], jnp.bfloat16), cache, layer, jnp.array([3], jnp.int32),
                                      num_tokens=jnp.array([1], jnp.int32), backend=backend))
            results[backend] = (cache, outs, host_pages)
    (ref, ref_outs, ref_host), (tpu, tpu_outs, tpu_host) = results["reference"], results["pallas_tpu"]
    for name in ref_host:  # the host pages slot 2 went to, as [L, H, pages, S(, D)]
        np.testing.assert_array_equal(ref_host[name][:, :, [1, 3]], tpu_host[name][:, :, [1, 3]])
    np.testing.assert_array_equal(np.asarray(ref.table.lengths), np.asarray(tpu.table.lengths))
    np.testing.assert_array_equal(np.asarray(ref.table.page_map) >= 0, np.asarray(tpu.table.page_map) >= 0)
    ref_scales, tpu_scales = ref.page_scales(), tpu.page_scales()
    for slot in (1, 3):
        pos = np.arange(int(ref.table.lengths[slot]))
        ref_pages, tpu_pages = (np.asarray(c.table.page_map[slot])[pos // page_size] for c in (ref, tpu))
        pairs = [(ref.k, tpu.k), (ref.v, tpu.v)] + list(zip(ref_scales, tpu_scales))
        for a, b in pairs:
            np.testing.assert_array_equal(np.asarray(a)[:, :, ref_pages, pos % page_size],
                                          np.asarray(b)[:, :, tpu_pages, pos % page_size])
    for got, want in zip(tpu_outs, ref_outs):
        assert np.isfinite(np.asarray(got, np.float32)).all()
        assert_close(got, want, jnp.bfloat16)
    COUNTS["API, scale rows"] += len(tpu_outs)


@pytest.mark.parametrize("dtype,window,soft_cap", [("float32", None, None), ("bfloat16", 10, 30.0)], ids=str)
def test_mixed_call_equals_its_two_calls(dtype, window, soft_cap):
    """`tpu_paged_attention_mixed`: decode rows (one of them padded: 0 tokens) and prompt chunks
    (ragged: 13 and 6 of 13 tokens, in row blocks of 4) in ONE call == `tpu_paged_attention` on
    each part, bit for bit, and == the reference, over a NaN-filled arena."""
    from pallas_kernels.tpu.mixed import tpu_paged_attention_mixed

    c = float_case(seed=3, lengths=(40, 17, 9, 13, 30), num_tokens=(1, 1, 0, 13, 6), tokens=13, q_heads=8,
                   kv_heads=2, page_size=8, head_dim=128, dtype=jnp.dtype(dtype))
    pm, lengths, counts, q = c["page_map"], c["lengths"], c["num_tokens"], c["q"]
    arena = dict(k_arena=c["k_arena"], v_arena=c["v_arena"], layer=c["layer"])
    opts = dict(sliding_window=window, logits_soft_cap=soft_cap, interpret=True)
    bs = BlockSizes(block_tokens=4)
    dec, pre = (slice(0, 3), slice(3, 5))
    got_dec, got_pre = tpu_paged_attention_mixed(q[dec, :1], q[pre], c["k_arena"], c["v_arena"], c["layer"], pm[dec],
                                                 lengths[dec], counts[dec], pm[pre], lengths[pre], counts[pre],
                                                 block_sizes=bs, **opts)
    for got, part, q_part, block_sizes in ((got_dec, dec, q[dec, :1], None), (got_pre, pre, q[pre], bs)):
        rows = dict(page_map=pm[part], lengths=lengths[part], num_tokens=counts[part])
        want = tpu_paged_attention(q_part, **arena, **rows, block_sizes=block_sizes, **opts)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.isfinite(np.asarray(got, np.float32)).all()
        assert_close(got, attention_ref(q_part, **arena, **rows, sliding_window=window, logits_soft_cap=soft_cap),
                     dtype)
    COUNTS["mixed call (decode rows + chunks)"] += 1


def test_mixed_call_reads_runs_in_its_decode_part(monkeypatch):
    """A mixed call over 8-bit scale rows (pages of 32): its decode rows read runs of pages one DMA
    a buffer as a decode call does (`run_blocks`: runs, scattered blocks, a run from a scale row's
    middle, one past the arena's scale rows), its chunks page by page: each part == its own call,
    bit for bit, runs on or off, and close to the reference; the kernel is the `_runs` one."""
    from pallas_kernels.tpu import attention as tpu_attention
    from pallas_kernels.tpu.common import scale_rows
    from pallas_kernels.tpu.mixed import tpu_paged_attention_mixed

    page_size, ppb, num_pages = 32, 4, 256
    lengths, pm = run_table(page_size, ppb, num_pages)
    case = quantized_case(seed=11, dtype=jnp.dtype("int8"), lengths=lengths, num_tokens=(1, 1, 1, 7, 5), tokens=7,
                          q_heads=8, kv_heads=2, page_size=page_size, head_dim=128, q_dtype=jnp.bfloat16,
                          num_pages=num_pages, page_map=pm)
    rows = {k: scale_rows(case[k]) for k in ("k_scale", "v_scale")}
    arena = dict(k_arena=case["k_arena"], v_arena=case["v_arena"], layer=case["layer"], **rows)
    q, pm, lengths, counts = case["q"], case["page_map"], case["lengths"], case["num_tokens"]
    dec, pre = slice(0, 3), slice(3, 5)
    blocks, chunk_blocks = BlockSizes(pages_per_block=ppb), BlockSizes(pages_per_block=ppb, block_tokens=4)

    def mixed(runs):
        monkeypatch.setattr(tpu_attention, "RUNS", runs)
        args = (q[dec, :1], q[pre], arena["k_arena"], arena["v_arena"], arena["layer"], pm[dec], lengths[dec],
                counts[dec], pm[pre], lengths[pre], counts[pre])
        text = str(jax.make_jaxpr(lambda *a: tpu_paged_attention_mixed(*a, **rows, interpret=True,
                                                                      block_sizes=chunk_blocks))(*args))
        assert ("_runs" in text) == runs
        return tpu_paged_attention_mixed(*args, **rows, interpret=True, block_sizes=chunk_blocks)

    got_dec, got_pre = mixed(True)
    for got, part, q_part, block_sizes in ((got_dec, dec, q[dec, :1], blocks), (got_pre, pre, q[pre], chunk_blocks)):
        part_rows = dict(page_map=pm[part], lengths=lengths[part], num_tokens=counts[part])
        want = tpu_paged_attention(q_part, **arena, **part_rows, interpret=True, block_sizes=block_sizes)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert np.isfinite(np.asarray(got, np.float32)).all()
        ref_arena = dict(arena, k_scale=case["k_scale"], v_scale=case["v_scale"])
        assert_close(got, attention_ref(q_part, **ref_arena, **part_rows), jnp.bfloat16)
    for got, want in zip((got_dec, got_pre), mixed(False)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    COUNTS["mixed call (decode rows + chunks)"] += 1


def test_api_attend_mixed_is_one_call_equal_to_attend_per_part():
    """aj.attend_mixed on the TPU kernels (interpret mode): a decode part and a chunk part in
    one kernel call == aj.attend on each part, bit for bit; other combinations (two decode
    parts, the reference backend) are aj.attend per part."""
    import arena_jax as aj

    layout = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=128, page_size=8, num_pages=16, max_seqs=4,
                         max_pages_per_seq=4, dtype="float32")
    rng = np.random.default_rng(2)
    cache = aj.create(layout)
    cache = cache.replace(k=jnp.full_like(cache.k, jnp.nan), v=jnp.full_like(cache.v, jnp.nan))
    slots, counts = jnp.array([0, 1, 2, 3]), jnp.array([9, 20, 5, 0], jnp.int32)
    cache, ok = aj.reserve(cache, slots, counts)
    assert np.asarray(ok).all()
    k, v = (jnp.asarray(rng.standard_normal((4, 20, 2, 128)), jnp.float32) for _ in range(2))
    cache = aj.append(cache, 0, slots, k, v, num_tokens=counts, backend="pallas_tpu")
    q_dec = jnp.asarray(rng.standard_normal((2, 1, 4, 128)), jnp.float32)
    q_pre = jnp.asarray(rng.standard_normal((2, 6, 4, 128)), jnp.float32)
    parts = [(q_dec, jnp.array([0, 3]), jnp.array([1, 0])), (q_pre, jnp.array([1, 2]), jnp.array([6, 3]))]
    opts = dict(sliding_window=7, backend="pallas_tpu")
    got = aj.attend_mixed(parts, cache, 0, **opts)
    text = str(jax.make_jaxpr(lambda c: aj.attend_mixed(parts, c, 0, **opts))(cache))
    assert text.count("tpu_paged_attention_mixed") == 1 and "tpu_paged_attention_bt" not in text, text[-2000:]
    for out, (q, s, n) in zip(got, parts):
        np.testing.assert_array_equal(np.asarray(out), np.asarray(aj.attend(q, cache, 0, s, num_tokens=n, **opts)))
        assert_close(out, aj.attend(q, cache, 0, s, num_tokens=n, sliding_window=7, backend="reference"), jnp.float32)
    two_decode = aj.attend_mixed(parts[:1] * 2, cache, 0, **opts)
    np.testing.assert_array_equal(np.asarray(two_decode[1]), np.asarray(got[0]))
    for bad in ((q_dec, jnp.array([0, 3])), [(q_dec, jnp.array([0, 3]))], q_dec):
        with pytest.raises(ValueError, match="parts must be a list of \\(q, slots, num_tokens\\) triples"):
            aj.attend_mixed(bad, cache, 0, **opts)
    COUNTS["mixed call (decode rows + chunks)"] += 1


@pytest.mark.parametrize("q_dtype", [jnp.float32, jnp.bfloat16], ids=str)
def test_api_rotated_int8_keys_match_reference(q_dtype):
    """An int8 arena with rotated keys (the int8 default) through the TPU kernels (interpret
    mode): keys rotated in float32 before the kernel quantizes them, q rotated before attention,
    as the reference and the "xla" path do it. Values and scales bit-equal to the reference
    backend, attention within q's tolerance, on keys with an outlier channel (x20); the same
    inputs unrotated store other keys (the rotation is applied)."""
    import arena_jax as aj

    def run(backend, rotate):
        layout = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=128, page_size=128, num_pages=4, max_seqs=2,
                             max_pages_per_seq=2, dtype="int8", rotate_keys=rotate)
        cache, rng, outs = aj.create(layout), np.random.default_rng(3), []
        slots = jnp.array([0, 1])
        for counts in ([4, 2], [1, 1], [1, 0], [1, 1]):
            counts = jnp.array(counts, jnp.int32)
            cache, ok = aj.reserve(cache, slots, counts)
            assert np.asarray(ok).all()
            k = rng.standard_normal((2, 4, 2, 128))
            k[..., 5] *= 20.0  # an outlier key channel
            k, v = jnp.asarray(k, jnp.float32), jnp.asarray(rng.standard_normal((2, 4, 2, 128)), jnp.float32)
            cache = aj.append(cache, 0, slots, k, v, num_tokens=counts, backend=backend)
            q = kernel_cases.on_device(rng.standard_normal((2, 4, 4, 128)), q_dtype)
            outs.append(aj.attend(q, cache, 0, slots, num_tokens=counts, backend=backend))
        return cache, outs

    (ref, ref_outs), (tpu, tpu_outs) = run("reference", True), run("pallas_tpu", True)
    assert ref.rotate_keys and tpu.rotate_keys
    written = [(slot, int(ref.table.lengths[slot])) for slot in (0, 1)]
    for slot, n in written:
        pages, pos = np.asarray(ref.table.page_map[slot])[np.arange(n) // 128], np.arange(n) % 128
        for a, b in ((ref.k, tpu.k), (ref.v, tpu.v), (ref.k_scale, tpu.k_scale), (ref.v_scale, tpu.v_scale)):
            np.testing.assert_array_equal(np.asarray(a)[:, :, pages, pos], np.asarray(b)[:, :, pages, pos])
    for got, want in zip(tpu_outs, ref_outs):
        assert np.isfinite(np.asarray(got, np.float32)).all()
        assert_close(got, want, q_dtype)
    unrotated, _ = run("reference", False)
    slot, n = written[0]
    pages = np.asarray(ref.table.page_map[slot])[np.arange(n) // 128]
    assert not np.array_equal(np.asarray(unrotated.k)[:, :, pages, np.arange(n)], np.asarray(tpu.k)[:, :, pages, np.arange(n)])
    COUNTS["API, rotated int8 keys"] += len(tpu_outs)


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_page_copies_match_a_scatter(dtype):
    """`tpu_copy_pages` (reserve's copy-on-write on a TPU; interpret mode) == `x.at[:, :, dst].set(
    x[:, :, src], mode="drop")` bit for bit on every array (values and an 8-bit arena's scales),
    with rows that copy nothing (dst == P, past it) and a page copied to two places; under a
    donating jit."""
    from pallas_kernels.tpu.copy_pages import tpu_copy_pages

    rng = np.random.default_rng(7)
    L, H, P, S, D = 3, 2, 6, (128 if dtype == "int8" else 16), 128
    if dtype == "int8":
        values = [jnp.asarray(rng.integers(-128, 128, (L, H, P, S, D)), jnp.int8) for _ in range(2)]
        arrays = values + [jnp.asarray(rng.standard_normal((L, H, P, S)), jnp.float32) for _ in range(2)]
    else:
        arrays = [kernel_cases.on_device(rng.standard_normal((L, H, P, S, D)), jnp.bfloat16) for _ in range(2)]
    src, dst = jnp.array([1, 4, 2, 0, 2]), jnp.array([5, P, 3, P + 2, 0])
    want = [np.asarray(a.at[:, :, dst].set(a[:, :, src], mode="drop")) for a in arrays]
    copy = jax.jit(lambda arrays, src, dst: tpu_copy_pages(arrays, src, dst, interpret=True), donate_argnums=0)
    got = copy(arrays, src, dst)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)
    COUNTS["page copies (copy-on-write)"] += 1


# ---- what the TPU kernels refuse ------------------------------------------------------------------------


def test_page_tables_over_the_smem_budget_are_named():
    """The page table (and append's chunk lists) are prefetched into SMEM (1 MiB on v5e / v6e;
    `test_compile_tpu.py` shows 1 MiB failing to compile): larger tables are a ValueError,
    raised while tracing (shapes only: nothing is allocated)."""
    sds = jax.ShapeDtypeStruct
    arena = sds((1, 1, 4, 16, 128), jnp.bfloat16)
    ints = lambda *shape: sds(shape, jnp.int32)  # noqa: E731
    with pytest.raises(ValueError, match=r"page_map \[30, 8192\]: 983,408 bytes of int32 tables .* SMEM"):
        jax.eval_shape(lambda q, *rows: tpu_paged_attention(q, arena, arena, 0, *rows, interpret=True),
                       sds((30, 1, 2, 128), jnp.bfloat16), ints(30, 8192), ints(30), ints(30))
    x = sds((4096, 300, 1, 128), jnp.bfloat16)  # 4096 rows x 20 chunks of 16 tokens
    with pytest.raises(ValueError, match=r"append of \[4096, 300\] tokens \(chunk lists\): 983,052 bytes"):
        jax.eval_shape(lambda x, *rows: tpu_paged_append(arena, arena, 0, x, x, *rows, interpret=True),
                       x, ints(4096, 4), ints(4096), ints(4096))


@pytest.mark.parametrize("change,match", [
    (dict(head_dim=64), "head_dim=64: the TPU kernels take multiples of 128 up to 256"),
    (dict(page_size=12), "page_size=12: the TPU kernels take multiples of 8 up to 256"),
    (dict(dtype=jnp.float16), "dtype=float16: the TPU kernels take bfloat16, float32"),
    (dict(q_dtype=jnp.float16), "q.dtype=float16: the TPU attention kernel computes in q's dtype"),
    (dict(dtype=jnp.int8, page_size=16), "page_size=16: the TPU kernels take multiples of 128 up to 256"),
    (dict(dtype=jnp.int8, page_size=128, scale_dtype=jnp.bfloat16), "scale_dtype=bfloat16: the TPU kernels take float32"),
])
def test_unsupported_geometries_are_named(change, match):
    geo = dict(head_dim=128, page_size=16, dtype=jnp.bfloat16, q_dtype=jnp.bfloat16, scale_dtype=jnp.float32)
    geo.update(change)
    quantized = jnp.dtype(geo["dtype"]) in QUANTIZED_DTYPES
    arena = jnp.zeros((1, 1, 4, geo["page_size"], geo["head_dim"]), geo["dtype"])
    scales = dict(k_scale=jnp.zeros(arena.shape[:4], geo["scale_dtype"]),
                  v_scale=jnp.zeros(arena.shape[:4], geo["scale_dtype"])) if quantized else {}
    rows = (jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32))
    q = jnp.zeros((1, 1, 2, geo["head_dim"]), geo["q_dtype"])
    with pytest.raises(ValueError, match=match):
        tpu_paged_attention(q, arena, arena, 0, *rows, interpret=True, **scales)
    if "q_dtype" not in change:
        x = jnp.zeros((1, 1, 1, geo["head_dim"]), jnp.bfloat16)
        with pytest.raises(ValueError, match=match):
            tpu_paged_append(arena, arena, 0, x, x, *rows, interpret=True, **scales)
