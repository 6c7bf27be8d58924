"""The blockwise jnp attention (`pallas_kernels.blockwise`, backend "xla") == the dense reference
(`paged_attention_reference`, the oracle stating the rules) on fresh random data, and its work
follows the context, not the capacity.

Kernel level: the option cases of `test_kernels_options` (GQA 1 / 4 / 8, pages 1 / 16 / 256,
soft-cap, static and traced windows including invalid traced values, decode, prefill and
chunked prefill, f32 / f16 / bf16 q over float, int8 and e4m3 arenas), each with the default
blocks and with small ones (4 pages a big block, 1 a tail block: both loops, several steps,
window starts that skip blocks); its masked-means-masked fixture (NaN / inf inside and
outside every mask, f32, int8 and e5m2 arenas); ragged lengths including 0 and the full
capacity at pages 1 / 16 / 256; every arena dtype `arena_jax` can create. Structure: the
compiled step holds no array the size of the capacity. API level (`aj.attend`, and
`tests/test_backends.py`, `tests/test_attend.py`, `tests/test_cache_safety.py`,
`tests/sharded_checks.py` with backend "xla"): inside a user's jit with traced slots, counts
and layers (out-of-range rows give zeros). Model level: a one-layer Mistral's chunked prefill
and greedy decode give the reference backend's tokens.
"""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from pallas_kernels import paged_attention_reference
from pallas_kernels import blockwise as bw
from pallas_kernels.blockwise import _key_range, block_geometry, paged_attention_blockwise
from test_kernels_options import CASES, HEAD_DIM, _OptionsTest, close, make_case, oracle, reference

STATIC = ("sm_scale", "sliding_window", "logits_soft_cap", "block_keys", "tail_keys")
blockwise = jax.jit(paged_attention_blockwise, static_argnames=STATIC)
blockwise_traced = jax.jit(paged_attention_blockwise, static_argnames=STATIC[:1] + STATIC[2:])
SMALL = "small"  # blocks of 4 pages, tails of 1 page


def blocks_of(kind, page):
    return {} if kind is None else dict(block_keys=4 * page, tail_keys=page)


OPTION_RUNS = [(name, SMALL) for name in CASES] + [(name, None) for name in CASES if CASES[name][11]]


@pytest.mark.parametrize("name,blocks", OPTION_RUNS, ids=[f"{n}-{b or 'default'}" for n, b in OPTION_RUNS])
def test_options_equal_the_reference(name, blocks):
    """Small blocks (several steps of both loops, window starts past block 0) and, for the
    traced-window cases, the default blocks (one step here) with invalid traced windows."""
    arena, q_dtype, q_heads, kv_heads, page, max_pages, lengths, num_new, tokens, cap, window, traced, _ = CASES[name]
    case = make_case(seed=len(name), arena=arena, q_dtype=q_dtype, lengths=lengths, num_tokens=num_new, tokens=tokens,
                     q_heads=q_heads, kv_heads=kv_heads, page_size=page, max_pages=max_pages)
    sizes = blocks_of(blocks, page)
    want = np.asarray(reference(**case, sliding_window=window, logits_soft_cap=cap), np.float64)
    if traced:
        got = blockwise_traced(**case, sliding_window=jnp.int32(window), logits_soft_cap=cap, **sizes)
    else:
        got = blockwise(**case, sliding_window=window, logits_soft_cap=cap, **sizes)
    assert got.dtype == q_dtype and np.isfinite(np.asarray(got, np.float32)).all()
    close(got, want, q_dtype)
    close(got, oracle(case, window=window if window < 256 else None, cap=cap), q_dtype)
    if q_dtype == jnp.float32:
        np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-6, rtol=0)  # summation order only
    if traced and blocks is None:  # invalid traced windows: <= 0 admits no key, huge is none
        no_window = np.asarray(reference(**case, logits_soft_cap=cap), np.float64)
        for w in (0, -7, 2**31 - 1):
            got_w = np.asarray(blockwise_traced(**case, sliding_window=jnp.int32(w), logits_soft_cap=cap), np.float64)
            if w <= 0:
                assert not got_w.any(), f"window {w}: queries must see no key"
            else:
                close(got_w, no_window, q_dtype)


class TestMaskedMeansMasked(_OptionsTest):
    """The kernel options test's NaN / inf fixture, run on the blockwise path and the reference
    (the Pallas entry of `run` is replaced): NaN lanes equal the rule on both, every other
    output bit-equal to a clean arena's, and the two paths close."""

    interpret = True

    @pytest.fixture(autouse=True)
    def _blockwise_for_pallas(self, monkeypatch):
        import test_kernels_options

        sizes = blocks_of(SMALL, 4)  # pages of 4: blocks of 16 keys, tails of 4 (several steps, skipped blocks)
        monkeypatch.setattr(test_kernels_options, "paged_attention",
                            lambda **c: blockwise(**{k: v for k, v in c.items() if k not in ("block_sizes", "interpret")},
                                                  **sizes))

    test_options_equal_reference_and_float64 = None  # run above, on the blockwise path


class TestMaskedMeansMaskedInOneBlock(TestMaskedMeansMasked):
    """The same fixture with the default blocks: the rows' 24 keys fit one block, whose float
    arenas check their V rows only when the output is not finite (`paged_attention_blockwise`'s
    one-block path); the poisoned lanes, and every other lane bit for bit, as above."""

    @pytest.fixture(autouse=True)
    def _blockwise_for_pallas(self, monkeypatch):
        import test_kernels_options

        monkeypatch.setattr(test_kernels_options, "paged_attention",
                            lambda **c: blockwise(**{k: v for k, v in c.items() if k not in ("block_sizes", "interpret")}))


def ragged_case(rng, *, page, max_pages, lengths, num_new, q_heads, kv_heads):
    """A float32 arena (half its unwritten lanes NaN) holding `lengths` tokens per row (layer 1)
    on scrambled pages. Built in numpy: no compile per row."""
    batch = len(lengths)
    num_pages = batch * max_pages + 1
    perm = rng.permutation(np.arange(1, num_pages))[: batch * max_pages].reshape(batch, max_pages)
    needed = -(-np.asarray(lengths) // page)
    page_map = np.where(np.arange(max_pages)[None] < needed[:, None], perm, -1)
    shape = (2, kv_heads, num_pages, page, HEAD_DIM)
    arenas = [np.where(rng.random(shape) < 0.5, np.nan, rng.standard_normal(shape)).astype(np.float32) for _ in "kv"]
    for b, n in enumerate(lengths):
        pos = np.arange(n)
        for arena in arenas:
            arena[1][:, page_map[b][pos // page], pos % page] = rng.standard_normal((kv_heads, n, HEAD_DIM))
    q = rng.standard_normal((batch, max(num_new), q_heads, HEAD_DIM)).astype(np.float32)
    return dict(q=jnp.asarray(q), k_arena=jnp.asarray(arenas[0]), v_arena=jnp.asarray(arenas[1]), layer=1,
                page_map=jnp.asarray(page_map, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
                num_tokens=jnp.asarray(num_new, jnp.int32))


# (page, max pages, lengths, new tokens, q / kv heads): lengths 0 and the full capacity, GQA 1 / 4 / 8
RAGGED = {
    "p1-gqa8": (1, 40, (40, 0, 17, 1), (1, 0, 3, 1), 8, 1),
    "p16-gqa4": (16, 5, (80, 33, 0, 16), (5, 1, 0, 16), 8, 2),
    "p256-gqa1": (256, 2, (512, 3, 300), (2, 3, 1), 2, 2),
}


def test_decode_with_a_window_past_the_first_blocks():
    """Decode whose window starts past every row's first blocks (the batch's first key 21, blocks
    of 8 keys, tails of 4): the first block, computed straight-line, starts there and the loops
    after it cover the rest of the window, equal to the reference."""
    case = ragged_case(np.random.default_rng(11), page=4, max_pages=12, lengths=(40, 37, 33), num_new=(1, 1, 1),
                       q_heads=4, kv_heads=2)
    want = np.asarray(reference(**case, sliding_window=13, logits_soft_cap=None))
    for sizes in (dict(block_keys=8, tail_keys=4), dict(block_keys=4, tail_keys=4)):
        got = np.asarray(blockwise(**case, sliding_window=13, **sizes))
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(RAGGED))
def test_ragged_lengths_with_nan_stale_pages(name):
    page, max_pages, lengths, num_new, q_heads, kv_heads = RAGGED[name]
    case = ragged_case(np.random.default_rng(len(name)), page=page, max_pages=max_pages, lengths=lengths,
                       num_new=num_new, q_heads=q_heads, kv_heads=kv_heads)
    want = np.asarray(reference(**case, sliding_window=None, logits_soft_cap=None))
    for sizes in ({}, dict(block_keys=2 * page, tail_keys=page)):
        got = np.asarray(blockwise(**case, **sizes))
        assert np.isfinite(got).all(), "stale NaN reached the output"
        np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
        for b, n in enumerate(num_new):
            assert not got[b, n:].any(), "padded query tokens give zeros"


@pytest.mark.parametrize("sizes", [{}, dict(block_keys=8, tail_keys=4)], ids=["one-block", "loop"])
def test_one_query_without_a_window_poisons_exactly_the_heads_a_bad_v_row_reaches(sizes):
    """Decode (one query a row, no window) finds poisoned V rows by its output alone, with no
    conditional, on the one-block path and through the loop's online softmax (blocks of 8 keys:
    the poisoned positions 3, 5 and 9 lie in its first, straight-line block and in a loop block):
    NaN or inf in one lane of a live V row NaNs exactly the query heads of that row's KV head,
    whole, as the reference does; a row whose query is not valid (no new token) reads nothing over
    a poisoned row (zero), stale NaN pages are never read, and every other lane is bit for bit a
    clean arena's."""
    page, group = 4, 4
    case = ragged_case(np.random.default_rng(7), page=page, max_pages=6, lengths=(24, 10, 13, 7), num_new=(1, 1, 0, 1),
                       q_heads=8, kv_heads=2)  # fmt: skip
    v, page_map = np.asarray(case["v_arena"]).copy(), np.asarray(case["page_map"])
    for b, kv_head, pos, lanes, value in ((0, 1, 5, 3, np.nan), (1, 0, 9, 0, np.inf), (2, 0, 3, slice(None), np.nan)):
        v[1, kv_head, page_map[b, pos // page], pos % page, lanes] = value  # layer 1, live positions
    poisoned = dict(case, v_arena=jnp.asarray(v))
    got = np.asarray(paged_attention_blockwise(**poisoned, **sizes))  # [B, 1, Hq, D]
    expected = np.zeros(got.shape, bool)
    expected[0, 0, 1 * group:2 * group] = True  # row 0, KV head 1's query heads
    expected[1, 0, 0:group] = True  # row 1, KV head 0's
    np.testing.assert_array_equal(np.isnan(got), expected)
    np.testing.assert_array_equal(np.isnan(np.asarray(reference(**poisoned))), expected)
    clean = np.asarray(paged_attention_blockwise(**case, **sizes))
    np.testing.assert_array_equal(got[~expected], clean[~expected])
    assert not got[2].any()  # no query: nothing read
    # A row asking 3 new tokens of a 1-token call (garbage a traced call may pass): its query sits
    # at position lengths - 3, so row 1's poisoned position 9 (of 10) is past it and unseen.
    past = dict(poisoned, num_tokens=jnp.asarray((1, 3, 0, 1), jnp.int32))
    got, want = np.asarray(paged_attention_blockwise(**past, **sizes)), np.asarray(reference(**past))
    expected[1] = False
    np.testing.assert_array_equal(np.isnan(got), expected)
    np.testing.assert_array_equal(np.isnan(want), expected)
    np.testing.assert_allclose(got[~expected], want[~expected], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("sizes", [{}, dict(block_keys=8, tail_keys=4)], ids=["one-block", "loop"])
@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
def test_one_query_with_a_window_poisons_only_what_the_window_sees(sizes, traced):
    """Decode with a window finds poisoned V rows by its output alone too (no conditional): a
    poisoned live V row before the query's window (or past the query) changes nothing, one
    inside it NaNs exactly the query heads of its KV head, as the reference says. Window 6:
    row 0 (query at 23) sees keys 18-23, row 1 (query at 9) keys 4-9."""
    page, group, window = 4, 4, 6
    case = ragged_case(np.random.default_rng(8), page=page, max_pages=6, lengths=(24, 10, 13), num_new=(1, 1, 1),
                       q_heads=8, kv_heads=2)  # fmt: skip
    v, page_map = np.asarray(case["v_arena"]).copy(), np.asarray(case["page_map"])
    # (row, KV head, position, value): row 0 before its window (5, 17) and inside it (20, head 0);
    # row 1 inside (4, head 1: its window's first key); row 2 before its window (6, both heads).
    for b, kv_head, pos, value in ((0, 1, 5, np.nan), (0, 1, 17, np.inf), (0, 0, 20, np.nan), (1, 1, 4, -np.inf),
                                   (2, 0, 6, np.nan), (2, 1, 6, np.inf)):  # fmt: skip
        v[1, kv_head, page_map[b, pos // page], pos % page, 2] = value
    poisoned = dict(case, v_arena=jnp.asarray(v))
    w = jnp.int32(window) if traced else window
    got = np.asarray(jax.jit(functools.partial(paged_attention_blockwise, **sizes))(**poisoned, sliding_window=w))
    want = np.asarray(reference(**poisoned, sliding_window=window, logits_soft_cap=None))
    expected = np.zeros(got.shape, bool)
    expected[0, 0, 0:group] = True  # row 0, KV head 0's query heads
    expected[1, 0, group:2 * group] = True  # row 1, KV head 1's
    np.testing.assert_array_equal(np.isnan(want), expected)
    np.testing.assert_array_equal(np.isnan(got), expected)
    np.testing.assert_allclose(got[~expected], want[~expected], atol=1e-5, rtol=1e-5)


def test_every_arena_dtype_is_read():
    """Each dtype an arena can hold (`arena_jax.layout.ARENA_DTYPES`) is read by the blockwise
    path (traced for each; a new storage format must be taught to it as to the reference), and
    the one no other case stores, float16, equals the reference; bytes of a format it does not
    know are refused."""
    sds = jax.ShapeDtypeStruct
    assert set(aj.layout.ARENA_DTYPES) == {"bfloat16", "float16", "float32", "int4", *aj.layout.EIGHT_BIT_DTYPES}
    for dtype in aj.layout.ARENA_DTYPES:
        head_dim = 32 if dtype == "int4" else HEAD_DIM
        if dtype == "int4":  # two codes a byte, a scale per group of 32 lanes
            arena = sds((1, 2, 7, 4, head_dim // 2), jnp.uint8)
            scale = sds((1, 2, 7, 4, head_dim // 32), jnp.bfloat16)
            scales = dict(k_scale=scale, v_scale=scale)
        else:
            arena = sds((1, 2, 7, 4, head_dim), jnp.dtype(dtype))
            scales = dict(k_scale=sds((1, 2, 7, 4), jnp.float32), v_scale=sds((1, 2, 7, 4), jnp.float32)) \
                if dtype in aj.layout.QUANTIZED_DTYPES else {}
        out = jax.eval_shape(paged_attention_blockwise, sds((2, 1, 4, head_dim), jnp.float32), arena, arena, 0,
                             sds((2, 3), jnp.int32), sds((2,), jnp.int32), sds((2,), jnp.int32), **scales)
        assert out.shape == (2, 1, 4, head_dim) and out.dtype == jnp.float32, dtype
    case = make_case(seed=3, arena="float16", q_dtype=jnp.float32, lengths=(9, 4), num_tokens=(2, 1), tokens=2,
                     q_heads=4, kv_heads=2, page_size=4, max_pages=3)
    np.testing.assert_allclose(np.asarray(blockwise(**case)), np.asarray(reference(**case)), atol=1e-6, rtol=0)
    bad = dict(case, k_arena=case["k_arena"].astype(jnp.int16), v_arena=case["v_arena"].astype(jnp.int16))
    with pytest.raises(ValueError, match="arena dtype int16 is not a format it reads"):
        jax.eval_shape(paged_attention_blockwise, **bad)


# head_dim, q_heads, kv_heads, page_size, q dtype: GQA 1 / 8 / 4, pages 1 / 16 / 4, every q dtype.
INT4_CASES = [(32, 2, 2, 1, jnp.float32), (64, 8, 1, 16, jnp.bfloat16), (96, 8, 2, 4, jnp.float16)]


@pytest.mark.parametrize("head_dim,q_heads,kv_heads,page_size,q_dtype", INT4_CASES)
def test_int4_pages_equal_the_reference(head_dim, q_heads, kv_heads, page_size, q_dtype):
    """int4 pages (codes two a byte, a scale per group of 32 lanes) on fresh random data: decode
    over stale NaN scales, then a ragged 5-token chunk with a window and a soft-cap, each at
    the default and at small blocks; a NaN group scale poisons exactly the queries that see it."""
    from kernel_cases import TOLERANCES
    from test_kernels_int4 import make_case as int4_case, scale_at

    s = page_size
    lengths = (1, s + 1, 3 * s + 3, 7) if s > 1 else (1, 2, 9, 7)
    base = dict(fmt="int4", seed=head_dim + s, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads, page_size=s,
                q_dtype=q_dtype, lengths=lengths)  # fmt: skip
    decode = int4_case(**base, num_tokens=(1, 1, 1, 0), tokens=1)
    chunk = int4_case(**base, num_tokens=(1, 2, 5, 0), tokens=5)
    options = dict(sliding_window=6, logits_soft_cap=20.0)
    for case, extra in ((decode, {}), (chunk, options)):
        case = {k: v for k, v in case.items() if k != "rotate_keys"}
        want = np.asarray(reference(**case, **extra), np.float32)  # jitted (eager: ~60 one-op compiles a case)
        for sizes in ({}, dict(block_keys=2 * s, tail_keys=s)):
            got = np.asarray(paged_attention_blockwise(**case, **extra, **sizes), np.float32)  # eager: cheaper than a jit each
            assert np.isfinite(got).all() and not got[3].any()  # stale NaN never read; the padded row is 0
            np.testing.assert_allclose(got, want, **TOLERANCES[jnp.dtype(q_dtype)])
    case = {k: v for k, v in decode.items() if k != "rotate_keys"}
    k_at, v_at = scale_at(case, 1, 0, s) + (head_dim // 32 - 1,), scale_at(case, 2, 2, s) + (0,)
    k_scale, v_scale = np.array(case["k_scale"]), np.array(case["v_scale"])  # poisoned on the host: no compile per shape
    k_scale[k_at], v_scale[v_at] = np.nan, np.nan
    poisoned = dict(case, k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
    expected = np.zeros(case["q"].shape, bool)
    expected[[1, 2], :, : q_heads // kv_heads, :] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(paged_attention_blockwise(**poisoned), np.float32)), expected)
    np.testing.assert_array_equal(np.isnan(np.asarray(reference(**poisoned), np.float32)), expected)


@pytest.mark.parametrize("group,tokens", [(4, 1), (2, 8), (4, 5), (8, 16)])
def test_scores_in_either_form_equal_a_float64_product(group, tokens):
    """`_scores` takes K as the dot's left operand up to head_dim queries a KV head (G * T <=
    D: 4, 16) and the einsum form past it (20, 128): both equal q . k in float64, fresh data."""
    rng = np.random.default_rng()
    qg = rng.standard_normal((3, 2, group, tokens, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((3, 2, 11, HEAD_DIM)).astype(np.float32)
    got = np.asarray(jax.jit(bw._scores)(jnp.asarray(qg), jnp.asarray(k)), np.float64)
    want = np.einsum("bkgtd,bknd->bkgtn", qg.astype(np.float64), k.astype(np.float64))
    assert got.shape == want.shape == (3, 2, group, tokens, 11)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_key_range_and_block_geometry():
    """The loop covers exactly the keys valid queries may see: rows without queries do not
    extend it, windows move its start, a window <= 0 empties it."""
    q_pos = jnp.asarray([[99, 100], [9, 10], [500, 501]], jnp.int32)
    q_valid = jnp.asarray([[True, True], [False, True], [False, False]])
    cases = {None: (0, 101), 4: (7, 101), 0: (11, 101), 1000: (0, 101)}
    for window, (lo, hi) in cases.items():
        got = _key_range(q_pos, q_valid, window, 1000)
        assert (int(got[0]), int(got[1])) == (lo, hi), window
    none = _key_range(q_pos, jnp.zeros_like(q_valid), None, 1000)
    assert int(none[1]) == 0
    assert block_geometry(16, 512) == (16, 4, 512)  # 256 keys a block, 64 a tail
    # one straight-line block: up to 256 keys always, up to 512 while the extra keys read are few
    assert bw.one_block(256, 64, 8, 128) and bw.one_block(496, 1, 2, 16) and bw.one_block(384, 8, 2, 16)
    assert not bw.one_block(496, 8, 2, 16) and not bw.one_block(384, 8, 2, 64)  # the tiny, the mid model's 8 rows
    assert not bw.one_block(520, 1, 1, 16)  # past 512 keys
    assert bw.one_block(40, 8, 8, 128, block_keys=40) and not bw.one_block(48, 1, 1, 16, block_keys=40)
    assert block_geometry(256, 3) == (1, 1, 3)  # a page is the smallest block
    assert block_geometry(1, 10, 256, 64) == (10, 10, 10)  # at most the row's pages
    assert block_geometry(4, 9, 20, 8) == (4, 2, 10)  # big blocks are whole tails; the map padded to tails
    with pytest.raises(ValueError, match="block_keys"):
        block_geometry(4, 4, 0)


def test_the_compiled_step_holds_nothing_the_size_of_the_capacity():
    """Decode at capacity 8,192 keys per row: no array in the optimized HLO has a dimension of
    the capacity (the reference's gathers are [B, 8192, ...]); the loop's blocks are 256 keys."""
    args = dict(q=jax.ShapeDtypeStruct((4, 1, 8, 64), jnp.float32),
                k_arena=jax.ShapeDtypeStruct((2, 2, 2049, 16, 64), jnp.float32),
                v_arena=jax.ShapeDtypeStruct((2, 2, 2049, 16, 64), jnp.float32),
                layer=jax.ShapeDtypeStruct((), jnp.int32), page_map=jax.ShapeDtypeStruct((4, 512), jnp.int32),
                lengths=jax.ShapeDtypeStruct((4,), jnp.int32), num_tokens=jax.ShapeDtypeStruct((4,), jnp.int32))
    dims = lambda hlo: {int(d) for shape in re.findall(r"\[([\d,]+)\]", hlo) for d in shape.split(",") if d}  # noqa: E731
    ours = jax.jit(paged_attention_blockwise).lower(**args).compile().as_text()
    arena_dims = {2049, 2 * 2 * 2049}  # the arena's pages, and its [L * Hkv * P, S, D] view (a bitcast) the gathers index
    assert max(dims(ours) - arena_dims) < 8192, sorted(dims(ours))[-5:]
    dense = jax.jit(paged_attention_reference).lower(**args).compile().as_text()
    assert 8192 in dims(dense)  # the check can fail


# ---- through the API, inside a user's jit -----------------------------------------------------------

LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=HEAD_DIM, page_size=4, num_pages=24, max_seqs=3,
                     max_pages_per_seq=6, dtype="float32")  # fmt: skip


def test_attend_in_a_users_jit_with_traced_rows_and_layers():
    """Traced slots (one out of range, one PAD), counts and layers through aj.attend: the "xla"
    backend == "reference" on served rows, zeros on rows it cannot serve; a bad layer gives zeros."""
    rng = np.random.default_rng(7)
    cache = aj.create(LAYOUT)
    slots = jnp.asarray([0, 1, 2])
    lengths = jnp.asarray([13, 24, 0])  # 24: the slot's whole capacity
    cache, ok = aj.reserve(cache, slots, lengths)
    assert np.asarray(ok).all()
    for layer in range(2):
        kv = jnp.asarray(rng.standard_normal((2, 3, 24, 2, HEAD_DIM)), jnp.float32)
        cache = aj.append(cache, layer, slots, kv[0], kv[1], num_tokens=lengths)

    @functools.partial(jax.jit, static_argnames="backend")
    def step(cache, q, slots, counts, layer, backend):
        return aj.attend(q, cache, layer, slots, num_tokens=counts, sliding_window=jnp.int32(9), backend=backend)

    q = jnp.asarray(rng.standard_normal((4, 3, 8, HEAD_DIM)), jnp.float32)
    rows, counts = jnp.asarray([1, 99, 0, aj.PAD_SLOT]), jnp.asarray([3, 2, 1, 0])
    for layer in (0, 1):
        got = np.asarray(step(cache, q, rows, counts, jnp.int32(layer), "xla"))
        want = np.asarray(step(cache, q, rows, counts, jnp.int32(layer), "reference"))
        np.testing.assert_allclose(got, want, atol=2e-6, rtol=0)
        assert np.abs(got[0]).sum() > 0 and np.abs(got[2, :1]).sum() > 0  # served rows: a real comparison
        assert not got[1].any() and not got[3].any() and not got[2, 1:].any()
    assert not np.asarray(step(cache, q, rows, counts, jnp.int32(5), "xla")).any(), "a layer out of range reads nothing"


# ---- model level: the same greedy tokens as the reference backend ------------------------------------


def _greedy_run(model, prompts, new_tokens, layout, chunk):
    """Chunked prefill of every prompt together, each row's last chunk in the last round
    (short rows wait with 0 tokens: ragged counts), then greedy decode. Each step is
    `aj.reserve` on the host (compiled once, shared by the backends) and one jit of the
    model's layers (append + attend) and head, traced anew per call of this function: the
    backend is read when it is traced. Returns (tokens i32[B, new_tokens], logits f32[B, V]
    per step)."""
    from flax import nnx

    from arena_jax.models.llama import token_positions

    graphdef, state = nnx.split(model)

    @jax.jit
    def layers(state, cache, tokens, slots, counts):  # tokens [B, T] -> logits at each row's last token [B, V]
        m = nnx.merge(graphdef, state)
        x, cache = m.hidden(tokens, token_positions(cache, slots, counts, tokens.shape[1]), cache, slots, counts)
        last = jnp.take_along_axis(x, jnp.maximum(counts - 1, 0)[:, None, None], axis=1)  # [B, 1, E]
        return m.logits(last)[:, 0], cache

    def step(cache, tokens):
        counts = jnp.asarray([len(row) for row in tokens], jnp.int32)
        cache, ok = aj.reserve(cache, slots, counts)
        assert bool(ok.all())
        padded = jnp.asarray([row + [0] * (tokens_wide - len(row)) for row in tokens], jnp.int32)
        logits, cache = layers(state, cache, padded, slots, counts)
        return cache, np.asarray(logits)

    cache, slots = aj.create(layout), jnp.arange(len(prompts), dtype=jnp.int32)
    rounds = max(-(-len(p) // chunk) for p in prompts)
    tokens_wide = chunk
    for r in range(rounds):
        rows = []
        for p in prompts:  # the row's chunk r, counted so that every row ends in the last round
            first = len(p) - (rounds - r) * chunk
            rows.append(p[max(first, 0):max(first + chunk, 0)])
        cache, logits = step(cache, rows)
    out_tokens, out_logits = [logits.argmax(-1)], [logits]
    tokens_wide = 1
    for _ in range(new_tokens - 1):
        cache, logits = step(cache, [[int(t)] for t in out_tokens[-1]])
        out_tokens.append(logits.argmax(-1))
        out_logits.append(logits)
    return np.stack(out_tokens, 1), out_logits


def test_greedy_steps_give_the_reference_backends_tokens(monkeypatch):
    """A tiny one-layer Mistral's chunked prefill and greedy decode on backend "xla" == on
    "reference": the same tokens, logits to summation order (float32). Contexts up to 89
    tokens on 4-token pages: two 64-key tail blocks per call (the online softmax across
    blocks), the window of 40 masking inside them, a 9-token row beside 83-token ones. (An
    8-bit arena is not compared here: a 1e-7 difference in a layer's output can move a value
    across a rounding boundary of the next layer's quantized K / V, a 1e-3 logit change on
    any two paths; the 8-bit rules are compared op by op above.)"""
    from arena_jax import models
    from arena_jax import arena_ops

    calls = []
    monkeypatch.setattr(arena_ops, "paged_attention_blockwise",
                        lambda *a, **k: calls.append(1) or paged_attention_blockwise(*a, **k))  # fmt: skip
    model = models.init_random(models.LlamaConfig.tiny(sliding_window=40, num_layers=1), seed=3, std=0.2)
    rng = np.random.default_rng(11)
    prompts = [rng.integers(1, 128, n).tolist() for n in (70, 9, 83)]
    layout = models.default_layout(model, 3, 96, page_size=4, dtype="float32")
    runs = {}
    for backend in ("reference", "xla"):
        monkeypatch.setenv(aj.BACKEND_ENV, backend)
        runs[backend] = _greedy_run(model, prompts, 6, layout, chunk=32)
        assert bool(calls) == (backend == "xla"), f"backend {backend}: blockwise calls {len(calls)}"
    np.testing.assert_array_equal(runs["xla"][0], runs["reference"][0])
    for got, want in zip(runs["xla"][1], runs["reference"][1]):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert len(set(runs["xla"][0].ravel().tolist())) > 3  # the model says something: a real comparison


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_rotated_and_int4_arenas_through_the_api(dtype):
    """Quantized arenas with rotated keys (int8's and int4's default): "xla" rotates q as the
    reference does and equals it, asked for or as the default off-GPU."""
    rng = np.random.default_rng(11)
    layout = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, page_size=4, num_pages=16, max_seqs=2,
                         max_pages_per_seq=6, dtype=dtype)  # fmt: skip
    assert layout.rotate_keys
    cache, slots, lengths = aj.create(layout), jnp.asarray([0, 1]), jnp.asarray([9, 21])
    cache, ok = aj.reserve(cache, slots, lengths)
    kv = jnp.asarray(rng.standard_normal((2, 2, 21, 2, 64)), jnp.float32)
    cache = aj.append(cache, 0, slots, kv[0], kv[1], num_tokens=lengths, backend="reference")
    q = jnp.asarray(rng.standard_normal((2, 2, 8, 64)), jnp.float32)
    counts = jnp.asarray([2, 1])
    want = np.asarray(aj.attend(q, cache, 0, slots, num_tokens=counts, backend="reference"))
    assert np.abs(want).sum() > 0
    got = np.asarray(aj.attend(q, cache, 0, slots, num_tokens=counts, backend="xla"))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    if jax.default_backend() == "cpu":  # the default here is "xla"
        np.testing.assert_array_equal(np.asarray(aj.attend(q, cache, 0, slots, num_tokens=counts)), got)
