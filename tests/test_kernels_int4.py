"""Pallas kernels over int4 arenas and over rotated keys (int4, int8, fp8) == their jnp
references, in interpret mode on CPU, on fresh random data.

Append quantizes in the kernel (rotating keys first with `rotate_keys=True`): codes and scales
must be bit-equal to `append_reference`. Rotated bf16 / fp16 keys (rotated by the kernel's
dots; float32 keys are rotated by XLA before the kernel, the reference's own product) are
compared on dyadic inputs (multiples of 1/16 of moderate size), whose rotation sums are exact in
float32 whatever the summation order; on arbitrary floats the two may round a sum differently
and move a code by one at a tie, which `test_rotated_append_on_arbitrary_floats` bounds. Attention dequantizes in the kernel and must
equal the reference within `kernel_cases.TOLERANCES` (keyed by q's dtype, the dots' dtype).

CI runs a lean grid that still covers every path once: int4 with and without rotation, int8
with rotation; GQA 1 / 4 / 8; pages 1 / 16; q in fp32 / bf16 / fp16 (fp16: the
dequantized-V path); head_dim 32 (one group), 64 (two) and 96 (three groups, a Paley
Hadamard, a tile padded to 128); split decode; a chunked prefill with a window; NaN stale
values and scales (bit-equal to a clean arena); NaN poison in one group's scale. The full grid
(every format x GQA 1/4/8 x pages 1/16/256 x q dtype) runs with ARENA_KERNEL_FULL=1.
"""
from __future__ import annotations

import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases
from cache_model import numpy_quantize4
from kernel_cases import TOLERANCES, full, on_device, random_bits
from pallas_kernels import BlockSizes, append_reference, paged_append, paged_attention, paged_attention_reference
from pallas_kernels.quant4 import dequantize_groups

ON_GPU = jax.default_backend() == "gpu"
FULL = os.environ.get("ARENA_KERNEL_FULL", "") not in ("", "0")
NUM_PAGES = 96
fill_ref = jax.jit(append_reference, static_argnames=("rotate_keys",))
attention_ref = jax.jit(paged_attention_reference, static_argnames=("sm_scale", "sliding_window", "rotate_keys"))


def split_format(fmt: str):
    """"int4+rot" -> ("int4", True)."""
    name, _, rot = fmt.partition("+")
    return name, rot == "rot"


def stale_arena(dtype, page_size, kv_heads, head_dim, seed, stale_scale=np.nan, layers=2):
    """(values, scales): random bytes everywhere (fp8: NaN patterns included), `stale_scale` scales."""
    rng = np.random.default_rng(seed)
    int4 = dtype == "int4"
    width = head_dim // 2 if int4 else head_dim
    values = random_bits(rng, (layers, kv_heads, NUM_PAGES, page_size, width), np.uint8 if int4 else dtype)
    scale_shape = (layers, kv_heads, NUM_PAGES, page_size) + ((head_dim // 32,) if int4 else ())
    scale_dtype = jnp.bfloat16 if int4 else jnp.float32
    return values, full(scale_shape, stale_scale, scale_dtype)


def dyadic(rng, shape, outliers=True):
    """Gaussian rows rounded to multiples of 1/16, one key channel in 7 scaled x20 (outliers)."""
    x = rng.standard_normal(shape)
    if outliers:
        x = x * np.where(np.arange(shape[-1]) % 7 == 3, 20.0, 1.0)
    return np.round(x * 16) / 16


def make_case(*, fmt, seed, head_dim, q_heads, kv_heads, page_size, q_dtype, lengths, num_tokens, tokens,
              stale_scale=np.nan, layer=1):
    """A filled arena (by the reference append, keys rotated for +rot) and the attention inputs."""
    dtype, rotate = split_format(fmt)
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    max_pages = int(-(-lengths.max() // page_size))
    page_map = kernel_cases.scrambled_page_map(seed, lengths, page_size, max_pages, NUM_PAGES)
    values, scales = stale_arena(dtype, page_size, kv_heads, head_dim, seed, stale_scale)
    n = int(lengths.max())
    k = on_device(dyadic(rng, (len(lengths), n, kv_heads, head_dim)), jnp.float32)
    v = on_device(rng.standard_normal((len(lengths), n, kv_heads, head_dim)), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    ka, va, ks, vs = fill_ref(values, values, layer, k, v, page_map, lens, lens, k_scale=scales, v_scale=scales,
                              rotate_keys=rotate)
    q = on_device(rng.standard_normal((len(lengths), tokens, q_heads, head_dim)), q_dtype)
    return dict(q=q, k_arena=ka, v_arena=va, layer=layer, page_map=page_map, lengths=lens,
                num_tokens=jnp.asarray(num_tokens, jnp.int32), k_scale=ks, v_scale=vs, rotate_keys=rotate)


def assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOLERANCES[jnp.dtype(dtype)])


def scale_at(case, row, pos, page_size):
    """The arena index of a row's position (layer, KV head 0, page, offset)."""
    pm = np.asarray(case["page_map"])
    return case["layer"], 0, pm[row, pos // page_size], pos % page_size


# fmt, head_dim, q_heads, kv_heads, page_size, q dtype, block sizes.
DECODE_CI = [
    ("int4+rot", 64, 8, 1, 16, jnp.bfloat16, BlockSizes(num_splits=4, block_k=16)),  # GQA 8, split decode
    ("int4", 32, 2, 2, 1, jnp.float32, None),  # GQA 1, one-token pages, FMA dots
    ("int4+rot", 96, 8, 2, 16, jnp.float16, None),  # GQA 4, padded tile, dequantized V
    ("int8+rot", 32, 4, 1, 1, jnp.float32, None),  # (fp8 + rotation: the 8-bit path with another conversion; full grid)
]
HEADS = {1: (2, 2), 4: (4, 1), 8: (8, 1)}  # GQA group -> (q_heads, kv_heads)
DECODE_FULL = [
    (fmt, d, *HEADS[g], s, qd, None)
    for fmt, d, g, s, qd in itertools.product(
        ("int4", "int4+rot", "int8+rot", "float8_e4m3fn+rot", "float8_e5m2+rot"), (32, 64), (1, 4, 8), (1, 16, 256),
        (jnp.float32, jnp.bfloat16, jnp.float16))
] if FULL else []


class _Int4Test:
    interpret: bool

    @pytest.mark.parametrize("fmt,head_dim,q_heads,kv_heads,page_size,q_dtype,block_sizes", DECODE_CI + DECODE_FULL)
    def test_decode_with_stale_nan_scales_and_poisoned_groups(self, fmt, head_dim, q_heads, kv_heads, page_size,
                                                              q_dtype, block_sizes):
        s = page_size
        lengths = (1, s - 1, s, s + 1, 3 * s + 3, 7) if s > 1 else (1, 2, 5, 9, 13, 7)
        lengths = tuple(max(n, 1) for n in lengths)
        kwargs = dict(fmt=fmt, seed=head_dim + q_heads + s, head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads,
                      page_size=s, q_dtype=q_dtype, lengths=lengths, num_tokens=(1, 1, 1, 1, 1, 0), tokens=1)
        dirty, clean = make_case(**kwargs, stale_scale=np.nan), make_case(**kwargs, stale_scale=0.0)
        run = lambda case: np.asarray(  # noqa: E731
            paged_attention(**case, interpret=self.interpret, block_sizes=block_sizes), np.float32)
        got = run(dirty)
        assert np.isfinite(got).all() and not got[5].any()  # stale NaN never read; the padded row is 0
        np.testing.assert_array_equal(got, run(clean))
        assert_close(got, attention_ref(**dirty), q_dtype)
        # A NaN in one group's scale (int4: the last group) of one token poisons exactly the
        # queries that attend to it: every lane of the KV head's query heads, on both paths.
        group = q_heads // kv_heads
        k_at, v_at = scale_at(clean, 1, 0, s), scale_at(clean, 4, 2, s)
        if fmt.startswith("int4"):
            k_at, v_at = k_at + (head_dim // 32 - 1,), v_at + (0,)
        k_scale, v_scale = np.array(clean["k_scale"]), np.array(clean["v_scale"])  # poisoned on the host: no compile
        k_scale[k_at], v_scale[v_at] = np.nan, np.nan
        poisoned = {**clean, "k_scale": jnp.asarray(k_scale), "v_scale": jnp.asarray(v_scale)}
        expected = np.zeros(clean["q"].shape, bool)
        expected[[1, 4], :, :group, :] = True
        np.testing.assert_array_equal(np.isnan(np.asarray(attention_ref(**poisoned), np.float32)), expected)
        np.testing.assert_array_equal(np.isnan(run(poisoned)), expected)

    @pytest.mark.parametrize("fmt,q_dtype", [("int4+rot", jnp.bfloat16)] + (
        [("int4", jnp.float32), ("int8+rot", jnp.float16), ("float8_e5m2+rot", jnp.float32)] if FULL else []))
    def test_chunked_prefill_with_window_equals_one_shot(self, fmt, q_dtype):
        """Prefill in chunks of 5 tokens (the kernel's quantizing append, then attention) ==
        the reference's one-shot prefill over the reference's one-shot arena: ragged rows (19,
        13, a padded one), a 10-token window, GQA 2, NaN stale scales. The arena after the
        chunks is bit-equal to the one-shot one (quantization is per token, or per token's group)."""
        dtype, rotate = split_format(fmt)
        head_dim, q_heads, kv_heads, page_size, window, chunk = 64, 4, 2, 8, 10, 5
        n = np.array([19, 13, 0])
        n_max = int(n.max())
        rng = np.random.default_rng(11)
        # bf16 keys: rotated in the kernel (exact sums: dyadic values stay dyadic in bf16).
        k = jnp.asarray(dyadic(rng, (3, n_max, kv_heads, head_dim)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((3, n_max, kv_heads, head_dim)), jnp.bfloat16)
        q = rng.standard_normal((3, n_max, q_heads, head_dim)).astype(np.float32)
        page_map = kernel_cases.scrambled_page_map(11, np.full(3, n_max), page_size, 3, NUM_PAGES)
        values, scales = stale_arena(dtype, page_size, kv_heads, head_dim, 11, layers=1)
        lens = jnp.asarray(n, jnp.int32)
        one_shot_arena = fill_ref(values, values, 0, k, v, page_map, lens, lens, k_scale=scales, v_scale=scales,
                                  rotate_keys=rotate)
        ka, va, ks, vs = one_shot_arena
        one_shot = np.asarray(attention_ref(jnp.asarray(q, q_dtype), ka, va, 0, page_map, lens, lens, k_scale=ks,
                                            v_scale=vs, sliding_window=window, rotate_keys=rotate), np.float32)
        arena = (values, values, scales, scales)
        for start in range(0, n_max, chunk):
            take = np.clip(n - start, 0, chunk)
            lc, cnt = jnp.asarray(start + take, jnp.int32), jnp.asarray(take, jnp.int32)
            pad = ((0, 0), (0, max(0, start + chunk - n_max)), (0, 0), (0, 0))
            kc, vc, qc = (np.pad(x[:, start : start + chunk], pad) for x in (k, v, q))
            arena = paged_append(arena[0], arena[1], 0, kc, vc, page_map, lc, cnt, k_scale=arena[2],
                                 v_scale=arena[3], rotate_keys=rotate, interpret=self.interpret)
            out = np.asarray(paged_attention(jnp.asarray(qc, q_dtype), arena[0], arena[1], 0, page_map, lc, cnt,
                                             k_scale=arena[2], v_scale=arena[3], sliding_window=window,
                                             rotate_keys=rotate, interpret=self.interpret), np.float32)
            assert np.isfinite(out).all() and not out[2].any()
            for b in range(3):
                assert_close(out[b, : take[b]], one_shot[b, start : start + take[b]], q_dtype)
        for got, want in zip(arena, one_shot_arena):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))

    # Append: lengths 1, S-1, S, S+1, long, a padded row; inputs in bf16 / fp16 / fp32; rows
    # exercising the rules (zeros, NaN, -inf, a tiny group, values near the input's max).
    @pytest.mark.parametrize("fmt,head_dim,page_size,x_dtype", [
        ("int4+rot", 64, 16, jnp.bfloat16),  # keys rotated by the kernel's bf16 dots
        ("int4+rot", 96, 1, jnp.float32),  # f32 keys: rotated by XLA first (`paged_append`)
        ("int4", 64, 1, jnp.float16),
        ("int8+rot", 32, 16, jnp.float16),
    ] + ([("int4+rot", 32, 1, jnp.float16), ("float8_e4m3fn+rot", 64, 16, jnp.bfloat16),
          ("int4", 64, 256, jnp.float32), ("int4", 96, 16, jnp.bfloat16)] if FULL else []))
    def test_append_matches_reference_bit_for_bit(self, fmt, head_dim, page_size, x_dtype):
        dtype, rotate = split_format(fmt)
        s, tokens = page_size, 9
        rng = np.random.default_rng(3)
        lengths = (1, max(s - 1, 1), s, s + 1, 2 * s + 10, 4)
        num_tokens = (1, max(s - 1, 1) if s < tokens else 1, min(2, s), min(s + 1, tokens), tokens, 0)
        values, scales = stale_arena(dtype, s, 2, head_dim, 3)
        scales = jnp.asarray(rng.standard_normal(scales.shape), scales.dtype)  # stale: stays where not written
        k = dyadic(rng, (6, tokens, 2, head_dim))
        big = 1024.0 if jnp.dtype(x_dtype) == jnp.dtype(jnp.float16) else 2.0**60
        k[4, 0], k[4, 1, 0, 3], k[4, 2, 1, 0], k[4, 3, 0, :3] = 0.0, np.nan, -np.inf, (big, -big, 1 / 16)
        k[4, 4, 0, 32:] = 2.0**-70  # int4 with head_dim 64: a tiny second group (stored as zeros)
        k, v = jnp.asarray(k, x_dtype), jnp.asarray(rng.standard_normal((6, tokens, 2, head_dim)), x_dtype)
        page_map = kernel_cases.scrambled_page_map(3, lengths, s, -(-max(lengths) // s), NUM_PAGES)
        args = (values, values, 1, k, v, page_map, jnp.asarray(lengths, jnp.int32), jnp.asarray(num_tokens, jnp.int32))
        got = paged_append(*args, k_scale=scales, v_scale=scales, rotate_keys=rotate, interpret=self.interpret)
        want = fill_ref(*args, k_scale=scales, v_scale=scales, rotate_keys=rotate)
        for g, w in zip(got, want):
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            if self.interpret:
                np.testing.assert_array_equal(g, w)
            else:  # Triton's f32 division may round a tie the other way: one code, one ulp of a scale
                np.testing.assert_allclose(g, w, rtol=2**-2, atol=1 if dtype != "int4" else 255)
        # The rules in the stored rows: zeros -> scale 0; NaN / inf -> scale NaN (every group).
        ks = np.asarray(got[2], np.float32)[1]
        pos = lambda t: (np.asarray(page_map)[4, (2 * s + 10 - tokens + t) // s], (2 * s + 10 - tokens + t) % s)  # noqa: E731
        (p0, o0), (p1, o1), (p2, o2), (p4, o4) = pos(0), pos(1), pos(2), pos(4)
        assert (ks[:, p0, o0] == 0).all()
        assert np.isnan(ks[0, p1, o1]).all() and np.isfinite(ks[1, p1, o1]).all() and np.isnan(ks[1, p2, o2]).all()
        if dtype == "int4" and not rotate:  # the unrotated codes are those of an independent numpy quantizer
            kx = np.asarray(k, np.float32)[4, 4, 0]
            want_codes, want_scale = numpy_quantize4(kx)
            np.testing.assert_array_equal(np.asarray(got[0])[1, 0, p4, o4], want_codes)
            np.testing.assert_array_equal(ks[0, p4, o4], np.asarray(want_scale, np.float32))
            if head_dim == 64:
                assert ks[0, p4, o4, 1] == 0
            back = np.asarray(dequantize_groups(got[0][1, 0, p4, o4], got[2][1, 0, p4, o4]))
            assert np.isfinite(back).all()

    def test_rotated_append_on_arbitrary_floats(self):
        """Arbitrary bf16 keys (no dyadic grid): kernel and reference may round a rotation sum
        differently, so a code may differ by one at a tie, and nothing more: the dequantized
        keys agree within one step of their group, and all but a few codes are equal."""
        rng = np.random.default_rng(5)
        head_dim, s = 64, 16
        values, scales = stale_arena("int4", s, 1, head_dim, 5)
        k = rng.standard_normal((2, 32, 1, head_dim)) * np.exp(rng.uniform(-3, 3, (2, 32, 1, 1)))
        k = jnp.asarray(k, jnp.bfloat16)  # rotated by the kernel's bf16 dot (f32 keys: by XLA, exactly as the reference)
        page_map = kernel_cases.scrambled_page_map(5, (32, 32), s, 2, NUM_PAGES)  # every page full
        lens = jnp.asarray([32, 32], jnp.int32)
        args = (values, values, 0, k, k, page_map, lens, lens)
        got = paged_append(*args, k_scale=scales, v_scale=scales, rotate_keys=True, interpret=self.interpret)
        want = fill_ref(*args, k_scale=scales, v_scale=scales, rotate_keys=True)
        live = (0, 0, np.asarray(page_map).reshape(-1)[:, None], np.arange(s)[None, :])
        g, w = (np.asarray(dequantize_groups(x[0][live], x[2][live])) for x in (got, want))
        step = np.repeat(np.asarray(want[2][live], np.float32), 32, axis=-1)
        assert (np.abs(g - w) <= step * 1.01).all()
        assert (np.asarray(got[0][live]) != np.asarray(want[0][live])).mean() < 0.01


class TestInt4Interpret(_Int4Test):
    interpret = True


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) kernels need a GPU; interpret class covers CPU")
class TestInt4Compiled(_Int4Test):
    interpret = False
