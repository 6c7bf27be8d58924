"""The attention contract's options and rules on both backends, on fresh random data:
logit soft-capping, traced windows, masked means masked (NaN / inf), one dtype rule.

Pallas kernels (interpret mode on CPU; compiled where a GPU exists) == the jnp reference
(`paged_attention_reference`, which states the rules), and both == a float64 oracle over
the values the arena holds. Shapes are tiny and each case compiles one kernel: together
the cases cover GQA 1 / 4 / 8, pages 1 / 16 / 256, decode with split-K, prefill and chunked
prefill, static and traced windows (smaller and larger than the context, and invalid traced
values), float and 8-bit arenas, and q of another dtype than the arena (f32 and f16 q over
a bf16 arena: the peers' grid).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_reference import hf_reference  # noqa: F401  (a fixture: skips / fails as the CI line says where torch is absent)
from kernel_cases import TOLERANCES, fill_ref, full, on_device, random_bits
from pallas_kernels import BlockSizes, paged_attention, paged_attention_reference
from pallas_kernels.quant import is_quantized

ON_GPU = jax.default_backend() == "gpu"
HEAD_DIM = 16
LANE = 3  # the lane a poison is written to

reference = jax.jit(paged_attention_reference, static_argnames=("sm_scale", "sliding_window", "logits_soft_cap"))
reference_traced = jax.jit(paged_attention_reference, static_argnames=("sm_scale", "logits_soft_cap"))


def page_map_of(rng, lengths, page_size, max_pages, num_pages, extra=()):
    """i32[B, max_pages]: pages 1.. in a random order (page 0 stays stale: unmapped entries
    index it if anything reads them), -1 past each row's length; `extra`: (row, logical page,
    -1 or a fresh stale page) overrides (a mapped page beyond the length, a hole)."""
    perm = rng.permutation(np.arange(1, num_pages))
    needed = -(-np.asarray(lengths) // page_size)
    pm = np.where(np.arange(max_pages)[None, :] < needed[:, None], perm[: len(lengths) * max_pages].reshape(-1, max_pages), -1)
    spare = iter(perm[len(lengths) * max_pages :])
    for row, logical, page in extra:
        pm[row, logical] = next(spare) if page == "stale" else page
    return jnp.asarray(pm, jnp.int32)


def make_case(*, seed, arena, q_dtype, lengths, num_tokens, tokens, q_heads, kv_heads, page_size, max_pages,
              poison=(), extra_pages=(), stale=np.nan):
    """Arena (float: `stale` wherever unwritten; 8-bit: random bytes, NaN scales) holding each row's
    tokens, with `poison` (kind "k"/"v", row, position, kv head, value) written into the inputs
    before the append (an 8-bit append stores a NaN / inf row as a NaN scale). Returns the
    paged_attention kwargs; the random draws do not depend on `poison` or `stale`."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    batch, n = len(lengths), int(lengths.max())
    num_pages = batch * max_pages + 1 + len(extra_pages)
    page_map = page_map_of(rng, lengths, page_size, max_pages, num_pages, extra_pages)
    k = rng.standard_normal((batch, n, kv_heads, HEAD_DIM)) * 1.5
    v = rng.standard_normal((batch, n, kv_heads, HEAD_DIM))
    q = on_device(rng.standard_normal((batch, tokens, q_heads, HEAD_DIM)), q_dtype)
    for kind, row, pos, head, value in poison:
        (k if kind == "k" else v)[row, pos, head, LANE] = value
    shape = (1, kv_heads, num_pages, page_size, HEAD_DIM)
    lens = jnp.asarray(lengths, jnp.int32)
    if is_quantized(arena):
        values = random_bits(rng, shape, arena)
        scales = full(shape[:4], np.nan, jnp.float32)
        ka, va, ks, vs = fill_ref(values, values, 0, on_device(k, jnp.float32), on_device(v, jnp.float32),
                                  page_map, lens, lens, k_scale=scales, v_scale=scales)
        arrays = dict(k_arena=ka, v_arena=va, k_scale=ks, v_scale=vs)
    else:
        stale_arena = full(shape, stale, arena)
        ka, va = fill_ref(stale_arena, stale_arena, 0, on_device(k, arena), on_device(v, arena), page_map, lens, lens)
        arrays = dict(k_arena=ka, v_arena=va)
    return dict(q=q, layer=0, page_map=page_map, lengths=lens, num_tokens=jnp.asarray(num_tokens, jnp.int32), **arrays)


def oracle(case, *, window=None, cap=None):
    """float64 dense attention over the values the arena holds (8-bit: values * scale)."""
    q = np.asarray(case["q"], np.float64)
    batch, tokens, q_heads, head_dim = q.shape
    ka, va = (np.asarray(case[a]).astype(np.float32).astype(np.float64)[0] for a in ("k_arena", "v_arena"))
    if "k_scale" in case:
        ka = ka * np.asarray(case["k_scale"], np.float64)[0][..., None]
        va = va * np.asarray(case["v_scale"], np.float64)[0][..., None]
    kv_heads, _, page_size, _ = ka.shape
    pm, lengths, num_new = (np.asarray(case[a]) for a in ("page_map", "lengths", "num_tokens"))
    out = np.zeros(q.shape)
    for b in range(batch):
        live = [j for j in range(lengths[b]) if pm[b, j // page_size] >= 0]
        for t in range(num_new[b]):
            p = lengths[b] - num_new[b] + t
            keys = [j for j in live if j <= p and (window is None or j > p - window)]
            for h in range(q_heads):
                kh = h // (q_heads // kv_heads)
                kk = np.stack([ka[kh, pm[b, j // page_size], j % page_size] for j in keys])
                vv = np.stack([va[kh, pm[b, j // page_size], j % page_size] for j in keys])
                s = kk @ q[b, t, h] * head_dim**-0.5
                if cap is not None:
                    s = cap * np.tanh(s / cap)
                w = np.exp(s - s.max())
                out[b, t, h] = w @ vv / w.sum()
    return out


def close(got, want, dtype, scale=1.0):
    tol = {k: v * scale for k, v in TOLERANCES[jnp.dtype(dtype)].items()}
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), **tol)


# name: (arena, q dtype, q / kv heads, page size, max pages, lengths, num_tokens, tokens, cap, window, traced, blocks)
CASES = {
    # GQA 8, one-token pages, f32 q over a bf16 arena (the peers' grid), split-K decode.
    "decode-gqa8-p1-bf16/f32q": ("bfloat16", jnp.float32, 8, 1, 1, 32, (1, 9, 30, 5), (1, 1, 1, 0), 1, 2.0, 7, True, None),
    # GQA 4, chunked prefill (new tokens after a prefix), f16 q over a bf16 arena.
    "chunked-gqa4-p16-bf16/f16q": ("bfloat16", jnp.float16, 8, 2, 16, 2, (23, 17, 6), (7, 3, 6), 7, 1.5, 5, False,
                                   None),
    # GQA 1, a 256-token page; a traced window larger than the context is no window.
    "prefill-gqa1-p256-f32": ("float32", jnp.float32, 2, 2, 256, 1, (40, 3), (4, 3), 4, None, 300, True, None),
    # 8-bit: int8 split decode with a traced window; e4m3 chunked prefill with fp16 q (V tile dequantized).
    "decode-gqa4-p16-int8": ("int8", jnp.bfloat16, 8, 2, 16, 3, (40, 12, 3), (1, 1, 1), 1, 2.0, 6, True,
                             BlockSizes(num_splits=3, block_k=16)),
    "chunked-gqa8-p4-e4m3/f16q": ("float8_e4m3fn", jnp.float16, 8, 1, 4, 4, (13, 9), (5, 2), 5, 2.0, 4, False, None),
}


class _OptionsTest:
    interpret: bool

    @pytest.mark.parametrize("name", list(CASES))
    def test_options_equal_reference_and_float64(self, name):
        """Soft-cap and windows (static, or traced through a jit) == the reference == float64; the
        reference's traced window == its static one; dots in q's dtype even over a bf16 arena."""
        arena, q_dtype, q_heads, kv_heads, page, max_pages, lengths, num_new, tokens, cap, window, traced, blocks = \
            CASES[name]
        case = make_case(seed=len(name), arena=arena, q_dtype=q_dtype, lengths=lengths, num_tokens=num_new, tokens=tokens,
                         q_heads=q_heads, kv_heads=kv_heads, page_size=page, max_pages=max_pages)
        want = np.asarray(reference(**case, sliding_window=window, logits_soft_cap=cap), np.float64)
        if traced:
            kernel = jax.jit(lambda c, w: paged_attention(**c, sliding_window=w, logits_soft_cap=cap, block_sizes=blocks,
                                                          interpret=self.interpret))
            got = kernel(case, jnp.int32(window))
            np.testing.assert_array_equal(np.asarray(reference_traced(**case, sliding_window=jnp.int32(window),
                                                                      logits_soft_cap=cap), np.float64), want)
        else:
            got = paged_attention(**case, sliding_window=window, logits_soft_cap=cap, block_sizes=blocks,
                                  interpret=self.interpret)
        assert got.dtype == q_dtype and np.isfinite(np.asarray(got, np.float32)).all()
        close(got, want, q_dtype)
        exact = oracle(case, window=window if window < 256 else None, cap=cap)
        close(got, exact, q_dtype)
        close(want, exact, q_dtype)
        if q_dtype == jnp.float32:  # f32 q over a bf16 arena: float32 accuracy (the arena's bf16 would be ~4e-3)
            assert np.abs(np.asarray(got, np.float64) - exact).max() < 1e-5
        if traced and name.startswith("decode-gqa8"):  # invalid traced values: <= 0 admits no key, huge is none
            no_window = np.asarray(reference(**case, logits_soft_cap=cap), np.float64)
            for w in (0, -7, 2**31 - 1):
                got_w = np.asarray(kernel(case, jnp.int32(w)), np.float64)
                ref_w = np.asarray(reference_traced(**case, sliding_window=jnp.int32(w), logits_soft_cap=cap), np.float64)
                if w <= 0:
                    assert not got_w.any() and not ref_w.any(), f"window {w}: queries must see no key"
                else:
                    np.testing.assert_array_equal(ref_w, no_window)
                    close(got_w, no_window, q_dtype)

    # Masked means masked: NaN / inf outside every mask contributes nothing (output bit-equal to
    # a clean arena's), and inside a mask poisons exactly the whole rows of the queries that
    # attend to it, on both backends. Rows: 0 has length 20 and a stale page mapped past it;
    # 1 has length 9 and a hole (logical page 1 unmapped); stale positions past each length,
    # and physical page 0 (what an unmapped entry would index), hold NaN (8-bit: random bytes,
    # NaN scales). Window 8, 2 KV heads x 2 query heads; prefill (6 tokens) and split-K decode.
    POISON = (
        ("v", 0, 6, 0, np.nan),  # loaded (the window's first page) but out of every query's window
        ("k", 0, 17, 0, np.nan),  # causally later for the first 3 of 6 new tokens (14..19)
        ("v", 0, 10, 1, np.inf),  # window edge: seen by positions 14..17, not 18, 19
        ("k", 1, 0, 1, -np.inf),  # window edge: seen by positions 3..7, not 8
        ("v", 1, 8, 0, np.nan),  # the last new token: seen by itself only
    )
    WINDOW, LENGTHS = 8, (20, 9)

    def expected_nan(self, num_new, tokens):
        out = np.zeros((2, tokens, 4), bool)
        holes = {(1, 1)}
        for _, row, pos, head, _ in self.POISON:
            if (row, pos // 4) in holes or pos >= self.LENGTHS[row]:
                continue
            for t in range(num_new[row]):
                p = self.LENGTHS[row] - num_new[row] + t
                if p - self.WINDOW < pos <= p:
                    out[row, t, 2 * head : 2 * head + 2] = True
        return out

    @pytest.mark.parametrize("arena,q_dtype,tokens", [("float32", jnp.float32, 6), ("float32", jnp.float32, 1),
                                                      ("int8", jnp.bfloat16, 6), ("int8", jnp.bfloat16, 1),
                                                      ("float8_e5m2", jnp.float16, 6)])
    def test_masked_means_masked(self, arena, q_dtype, tokens):
        num_new = (tokens, tokens)
        kwargs = dict(seed=21, arena=arena, q_dtype=q_dtype, lengths=self.LENGTHS, num_tokens=num_new, tokens=tokens,
                      q_heads=4, kv_heads=2, page_size=4, max_pages=6, extra_pages=((0, 5, "stale"), (1, 1, -1)))
        dirty = make_case(**kwargs, poison=self.POISON)
        clean = make_case(**kwargs, stale=0.0)
        blocks = BlockSizes(num_splits=3, block_k=16) if tokens == 1 else None  # decode: split-K
        run = {
            "pallas": lambda c: paged_attention(**c, sliding_window=self.WINDOW, block_sizes=blocks,
                                                interpret=self.interpret),
            "reference": lambda c: reference(**c, sliding_window=self.WINDOW),
        }
        expected = np.broadcast_to(self.expected_nan(num_new, tokens)[..., None], (2, tokens, 4, HEAD_DIM))
        assert expected.any() and not expected.all()
        outs = {}
        for backend, fn in run.items():
            got, ok = np.asarray(fn(dirty), np.float64), np.asarray(fn(clean), np.float64)
            np.testing.assert_array_equal(np.isnan(got), expected, err_msg=f"{backend}: NaN lanes")
            assert np.isfinite(ok).all()
            np.testing.assert_array_equal(np.where(expected, 0, got), np.where(expected, 0, ok),
                                          err_msg=f"{backend}: a masked poison moved an output")
            outs[backend] = got
        close(np.nan_to_num(outs["pallas"]), np.nan_to_num(outs["reference"]), q_dtype)


class TestOptionsInterpret(_OptionsTest):
    interpret = True


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) kernels need a GPU; interpret class covers CPU")
class TestOptionsCompiled(_OptionsTest):
    interpret = False


def test_soft_cap_is_gemma2s(hf_reference):
    """The reference's soft-capped attention == Hugging Face transformers' Gemma 2 eager
    attention (`attn_weights / softcap; tanh; * softcap` after scaling, then the causal mask)."""
    torch, _ = hf_reference  # the Hugging Face stack, as in the parity tests (on every CI line)
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    n, q_heads, kv_heads, scale, cap = 11, 4, 2, 0.3, 2.5
    case = make_case(seed=5, arena="float32", q_dtype=jnp.float32, lengths=(n,), num_tokens=(n,), tokens=n,
                     q_heads=q_heads, kv_heads=kv_heads, page_size=4, max_pages=3)
    ours = np.asarray(reference(**case, sm_scale=scale, logits_soft_cap=cap))
    pm = np.asarray(case["page_map"])[0]
    k, v = (np.asarray(case[a])[0][:, pm[np.arange(n) // 4], np.arange(n) % 4] for a in ("k_arena", "v_arena"))
    causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)[None, None]

    class Module:
        num_key_value_groups, training, head_dim = q_heads // kv_heads, False, HEAD_DIM

    t = lambda x: torch.from_numpy(np.ascontiguousarray(x))  # noqa: E731
    hf, _ = eager_attention_forward(Module(), t(np.asarray(case["q"])[0].transpose(1, 0, 2))[None], t(k)[None],
                                    t(v)[None], causal, scaling=scale, softcap=cap)
    np.testing.assert_allclose(ours[0], hf[0].numpy(), atol=2e-6, rtol=2e-6)
