"""Pallas kernels over 8-bit arenas (int8, float8_e4m3fn, float8_e5m2 with per-token scales) ==
their jnp references, in interpret mode on CPU, on fresh random data.

Append quantizes in the kernel: values and scales must be bit-equal to `append_reference` (same
rules, same ops; on a GPU, Triton's f32 division may move a value by one code at a rounding tie,
so the compiled class allows that). Attention dequantizes in the kernel: it must equal the
reference's float32 attention over `values * scale` within the tolerances below. Each case
covers something distinct: every 8-bit dtype, GQA groups 1 / 2 / 4 / 8, page sizes 4 / 8 /
16, q in fp32 / bf16 / fp16 (the dots' dtype; fp16 takes the dequantize-the-V-tile path), k, v
in fp32 / bf16 / fp16, decode with one and several splits, chunked prefill with a window ==
one-shot, NaN stale values *and* NaN-poisoned stale scales (bit-equal to a clean arena), bf16
scales, the zero / NaN / inf / saturation rules. Shapes are tiny: interpret mode compiles a
loop over the grid per shape, so each case is a new shape only where it covers a new path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases
from kernel_cases import TOLERANCES, attention_ref, fill_ref
from pallas_kernels import BlockSizes, paged_append, paged_attention
from pallas_kernels.quant import dequantize_rows

ON_GPU = jax.default_backend() == "gpu"
NUM_PAGES = 64
HEAD_DIM = 16  # the smallest 8-bit row (16 bytes)

# Kernel vs reference: kernel_cases.TOLERANCES, keyed by the dots' dtype (q's). Both see the same
# 8-bit values and scales; each is exact in bf16/fp16/fp32, so the kernel adds only the float
# path's roundings, as over float arenas.


def scrambled_page_map(seed, lengths, page_size, max_pages):
    return kernel_cases.scrambled_page_map(seed, lengths, page_size, max_pages, NUM_PAGES)


def stale_arena(dtype, page_size, kv_heads, layers=2, scale_dtype=jnp.float32, stale_scale=np.nan, seed=0):
    """Random 8-bit garbage (fp8: NaN bit patterns included) and `stale_scale` everywhere."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 256, (layers, kv_heads, NUM_PAGES, page_size, HEAD_DIM), dtype=np.uint8)
    values = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.dtype(dtype))
    scales = jnp.full((layers, kv_heads, NUM_PAGES, page_size), stale_scale, scale_dtype)
    return values, scales


def make_case(*, seed, dtype, lengths, num_tokens, tokens, q_heads, kv_heads, page_size, q_dtype=jnp.float32,
              stale_scale=np.nan, scale_dtype=jnp.float32, max_pages=None, layer=1):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    batch = len(lengths)
    max_pages = max_pages or int(-(-lengths.max() // page_size))
    page_map = scrambled_page_map(seed, lengths, page_size, max_pages)
    values, scales = stale_arena(dtype, page_size, kv_heads, scale_dtype=scale_dtype, stale_scale=stale_scale, seed=seed)
    n = int(lengths.max())
    # K with two outlier channels (x20), as real keys have; V plain.
    k = rng.standard_normal((batch, n, kv_heads, HEAD_DIM)) * np.where(np.arange(HEAD_DIM) % 7 == 3, 20.0, 1.0)
    v = rng.standard_normal((batch, n, kv_heads, HEAD_DIM))
    lens = jnp.asarray(lengths, jnp.int32)
    ka, va, ks, vs = fill_ref(values, values, layer, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), page_map,
                              lens, lens, k_scale=scales, v_scale=scales)
    q = jnp.asarray(rng.standard_normal((batch, tokens, q_heads, HEAD_DIM)), q_dtype)
    return dict(q=q, k_arena=ka, v_arena=va, layer=layer, page_map=page_map, lengths=lens,
                num_tokens=jnp.asarray(num_tokens, jnp.int32), k_scale=ks, v_scale=vs)


def assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOLERANCES[jnp.dtype(dtype)])


class _QuantizedTest:
    interpret: bool

    # Every 8-bit dtype once; GQA 8 / 1 / 4; pages 8 / 16 / 4; q fp32 / bf16 / fp16; scales
    # f32 / bf16; explicit splits (more than blocks) and the default tiles. Lengths 1, S-1,
    # S, S+1, long, and a padded row. Stale values are random bytes (fp8 NaN patterns
    # included) and stale scales NaN: the output must be bit-equal to the same arena with
    # stale scales 0, and finite.
    @pytest.mark.parametrize(
        "dtype,q_heads,kv_heads,page_size,q_dtype,scale_dtype,block_sizes",
        [
            ("int8", 8, 1, 8, jnp.float32, jnp.float32, BlockSizes(num_splits=16, block_k=16)),
            ("float8_e4m3fn", 2, 2, 16, jnp.bfloat16, jnp.bfloat16, None),
            ("float8_e5m2", 8, 2, 4, jnp.float16, jnp.float32, BlockSizes(num_splits=2)),
        ],
    )
    def test_decode_with_nan_poisoned_stale_scales(self, dtype, q_heads, kv_heads, page_size, q_dtype, scale_dtype,
                                                   block_sizes):
        s = page_size
        kwargs = dict(seed=s + q_heads, dtype=dtype, lengths=(1, s - 1, s, s + 1, 5 * s + 3, 7),
                      num_tokens=(1, 1, 1, 1, 1, 0), tokens=1, q_heads=q_heads, kv_heads=kv_heads, page_size=s,
                      q_dtype=q_dtype, scale_dtype=scale_dtype)
        dirty, clean = make_case(**kwargs, stale_scale=np.nan), make_case(**kwargs, stale_scale=0.0)
        got = paged_attention(**dirty, interpret=self.interpret, block_sizes=block_sizes)
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(got), np.asarray(
            paged_attention(**clean, interpret=self.interpret, block_sizes=block_sizes)))
        assert_close(got, attention_ref(**dirty), q_dtype)
        assert not np.asarray(got, np.float32)[5].any()  # the padded row
        # A NaN / inf in a row's own K or V is stored as a NaN scale: NaN reaches exactly the
        # queries that see that token (all lanes of the KV head's query heads), on both paths.
        pm, group = np.asarray(clean["page_map"]), q_heads // kv_heads
        at = lambda row, pos: (clean["layer"], 0, pm[row, pos // s], pos % s)  # noqa: E731
        poisoned = {**clean, "k_scale": clean["k_scale"].at[at(1, 0)].set(jnp.nan),
                    "v_scale": clean["v_scale"].at[at(4, 2)].set(jnp.nan)}
        expected = np.zeros(clean["q"].shape, bool)
        expected[[1, 4], :, :group, :] = True
        nan_ref = np.isnan(np.asarray(attention_ref(**poisoned), np.float32))
        nan_got = np.isnan(np.asarray(paged_attention(**poisoned, interpret=self.interpret, block_sizes=block_sizes),
                                      np.float32))
        np.testing.assert_array_equal(nan_ref, expected)
        np.testing.assert_array_equal(nan_got, expected)
        if dtype == "int8":  # the oracle itself: dequantize, then the float path
            k32, v32 = (dequantize_rows(clean[a], clean[s_]) for a, s_ in (("k_arena", "k_scale"), ("v_arena", "v_scale")))
            floats = {**clean, "k_arena": k32, "v_arena": v32, "k_scale": None, "v_scale": None}
            np.testing.assert_allclose(np.asarray(attention_ref(**clean)), np.asarray(attention_ref(**floats)),
                                       atol=1e-6, rtol=1e-6)

    def test_chunked_prefill_with_window_equals_one_shot(self):
        """Prefill in chunks of 5 tokens (append with the quantizing kernel, then attend) == the
        reference's one-shot prefill over the one-shot arena: ragged rows (19, 13 and a padded
        one), a 10-token window (smaller than the context, larger than a chunk), NaN stale
        scales. After the chunks the arena is bit-equal to the one-shot append's (quantization
        is per token, so chunking cannot change it)."""
        n = np.array([19, 13, 0])
        rng = np.random.default_rng(11)
        q_heads, kv_heads, page_size, n_max, window, chunk = 4, 2, 8, int(n.max()), 10, 5
        k, v, q = (rng.standard_normal((3, n_max, h, HEAD_DIM)).astype(np.float32) for h in (kv_heads, kv_heads, q_heads))
        page_map = scrambled_page_map(11, np.full(3, n_max), page_size, 3)
        values, scales = stale_arena("float8_e5m2", page_size, kv_heads, layers=1)
        lens = jnp.asarray(n, jnp.int32)
        one_shot_arena = fill_ref(values, values, 0, k, v, page_map, lens, lens, k_scale=scales, v_scale=scales)
        ka, va, ks, vs = one_shot_arena
        one_shot = np.asarray(attention_ref(q, ka, va, 0, page_map, lens, lens, k_scale=ks, v_scale=vs,
                                            sliding_window=window))
        arena = (values, values, scales, scales)
        for start in range(0, n_max, chunk):
            take = np.clip(n - start, 0, chunk)
            lc, cnt = jnp.asarray(start + take, jnp.int32), jnp.asarray(take, jnp.int32)
            pad = ((0, 0), (0, max(0, start + chunk - n_max)), (0, 0), (0, 0))
            kc, vc, qc = (np.pad(x[:, start : start + chunk], pad) for x in (k, v, q))
            kx, vx, ksx, vsx = paged_append(arena[0], arena[1], 0, kc, vc, page_map, lc, cnt, k_scale=arena[2],
                                            v_scale=arena[3], interpret=self.interpret)
            arena = (kx, vx, ksx, vsx)
            out = np.asarray(paged_attention(qc, kx, vx, 0, page_map, lc, cnt, k_scale=ksx, v_scale=vsx,
                                             sliding_window=window, interpret=self.interpret))
            assert np.isfinite(out).all() and not out[2].any()
            for b in range(3):
                assert_close(out[b, : take[b]], one_shot[b, start : start + take[b]], jnp.float32)
        for got, want in zip(arena, one_shot_arena):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    # Append: lengths 1, S-1, S, S+1, long, a padded row, tokens straddling pages, inputs in
    # bf16 / fp16, and rows that exercise the rules (a zero row, a NaN row, an inf row,
    # values past fp8's range). Values and scales bit-equal to the reference; nothing else moves.
    # (float8_e5m2 with float32 inputs: the chunked-prefill test.)
    @pytest.mark.parametrize("dtype,x_dtype,scale_dtype", [("int8", jnp.bfloat16, jnp.float32),
                                                          ("float8_e4m3fn", jnp.float16, jnp.bfloat16)])
    def test_append_matches_reference(self, dtype, x_dtype, scale_dtype):
        s, tokens = 8, 9
        rng = np.random.default_rng(3)
        lengths, num_tokens = (1, s - 1, s, s + 1, 3 * s + 2, 4), (1, s - 1, 2, s + 1, tokens, 0)
        values, scales = stale_arena(dtype, s, 2, scale_dtype=scale_dtype, seed=3)
        scales = jnp.asarray(rng.standard_normal(scales.shape), scale_dtype)  # stale, and must stay where not written
        big = float(jnp.finfo(x_dtype).max) / 2
        k = rng.standard_normal((6, tokens, 2, HEAD_DIM)) * 3
        k[4, 0], k[4, 1, 0, 3], k[4, 2, 1, 0], k[4, 3, 0, :3] = 0.0, np.nan, -np.inf, (big, -big, 1e-3)
        k, v = jnp.asarray(k, x_dtype), jnp.asarray(rng.standard_normal((6, tokens, 2, HEAD_DIM)), x_dtype)
        page_map = scrambled_page_map(3, lengths, s, 4)
        args = (values, values, 1, k, v, page_map, jnp.asarray(lengths, jnp.int32), jnp.asarray(num_tokens, jnp.int32))
        got = paged_append(*args, k_scale=scales, v_scale=scales, interpret=self.interpret)
        want = fill_ref(*args, k_scale=scales, v_scale=scales)
        for g, w in zip(got, want):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            if self.interpret:
                np.testing.assert_array_equal(g, w)
            else:  # Triton's f32 division may round a tie the other way: one code, one ulp of a scale
                np.testing.assert_allclose(g, w, rtol=2**-2, atol=1)
        # The rules, seen in the stored row: zeros -> scale 0; NaN / inf -> scale NaN, values 0.
        ks = np.asarray(got[2], np.float32)[1, :, :, :]
        pos = lambda t: (np.asarray(page_map)[4, (3 * s + 2 - tokens + t) // s], (3 * s + 2 - tokens + t) % s)  # noqa: E731
        (p0, o0), (p1, o1), (p2, o2) = pos(0), pos(1), pos(2)
        assert ks[0, p0, o0] == 0 and ks[1, p0, o0] == 0
        assert np.isnan(ks[0, p1, o1]) and np.isfinite(ks[1, p1, o1]) and np.isnan(ks[1, p2, o2])
        kd = np.asarray(dequantize_rows(got[0], got[2]))[1]
        assert (kd[:, p0, o0] == 0).all() and np.isfinite(kd[0, pos(3)[0], pos(3)[1]]).all()


class TestQuantizedInterpret(_QuantizedTest):
    interpret = True


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) kernels need a GPU; interpret class covers CPU")
class TestQuantizedCompiled(_QuantizedTest):
    interpret = False


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(k_scale=None), "k_scale and v_scale must be given exactly when the arena is 8-bit"),
        (dict(v_scale=jnp.zeros((2, 1, NUM_PAGES, 4), jnp.float32)), "v_scale must be"),
        (dict(k_scale=jnp.zeros((2, 2, NUM_PAGES, 8), jnp.float16), v_scale=jnp.zeros((2, 2, NUM_PAGES, 8), jnp.float16)),
         "k_scale.dtype must be float32 or bfloat16"),
        (dict(q=jnp.zeros((2, 1, 4, HEAD_DIM), jnp.int8)), "q.dtype"),
    ],
)
def test_value_errors(change, match):
    values = jnp.zeros((2, 2, NUM_PAGES, 8, HEAD_DIM), jnp.int8)
    scales = jnp.zeros((2, 2, NUM_PAGES, 8), jnp.float32)
    args = dict(q=jnp.zeros((2, 1, 4, HEAD_DIM)), k_arena=values, v_arena=values, layer=0,
                page_map=jnp.zeros((2, 2), jnp.int32), lengths=jnp.ones(2, jnp.int32), num_tokens=jnp.ones(2, jnp.int32),
                k_scale=scales, v_scale=scales)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        paged_attention(**args, interpret=True)
    with pytest.raises(ValueError, match="k_scale and v_scale must be given exactly"):  # a float arena has none
        paged_append(jnp.zeros((1, 1, 4, 8, 16)), jnp.zeros((1, 1, 4, 8, 16)), 0, jnp.zeros((1, 1, 1, 16)),
                     jnp.zeros((1, 1, 1, 16)), jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32),
                     jnp.ones(1, jnp.int32), k_scale=scales, v_scale=scales)
