"""Pallas paged attention == `paged_attention_reference` on fresh random inputs.

Each kernel test class runs twice where a GPU exists (compiled and interpret=True); on CPU
only the interpret class runs. Shapes are tiny (interpret mode compiles a loop over the grid
per shape and static config), and cases reuse shapes so that compilations are shared.
Oracles: the jnp reference (itself checked against dense attention over a contiguous
cache), chunked prefill == one-shot prefill, NaN-filled stale pages == a clean arena.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases
from kernel_cases import TOLERANCES, attention_ref, fill_ref
from pallas_kernels import BlockSizes, paged_append, paged_attention

ON_GPU = jax.default_backend() == "gpu"
NUM_PAGES = 64  # one pool size for every test
HEAD_DIM = 16  # the smallest tile; other head sizes in test_head_sizes_page_sizes_and_groups



def scrambled_page_map(seed, lengths, page_size, max_pages):
    return kernel_cases.scrambled_page_map(seed, lengths, page_size, max_pages, NUM_PAGES)


def make_case(*, seed, lengths, num_tokens, tokens, q_heads, kv_heads, page_size, dtype=jnp.float32,
              layers=2, layer=1, max_pages=None, stale=np.nan, head_dim=HEAD_DIM):
    """A filled arena (live positions random, every other position `stale`) plus queries.

    Returns dict(q, k_arena, v_arena, layer, page_map, lengths, num_tokens)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths)
    batch = len(lengths)
    max_pages = max_pages or int(max(1, -(-lengths.max() // page_size)))
    page_map = scrambled_page_map(seed, lengths, page_size, max_pages)
    shape = (layers, kv_heads, NUM_PAGES, page_size, head_dim)
    arena = kernel_cases.full(shape, stale, dtype)
    n_max = int(max(lengths.max(), 1))
    k_seq, v_seq = (kernel_cases.on_device(rng.standard_normal((batch, n_max, kv_heads, head_dim)), dtype) for _ in range(2))
    lens = jnp.asarray(lengths, jnp.int32)
    k_arena, v_arena = fill_ref(arena, arena, layer, k_seq, v_seq, page_map, lens, lens)
    q = kernel_cases.on_device(rng.standard_normal((batch, tokens, q_heads, head_dim)), dtype)
    return dict(q=q, k_arena=k_arena, v_arena=v_arena, layer=layer, page_map=page_map, lengths=lens,
                num_tokens=jnp.asarray(num_tokens, jnp.int32))


def assert_close(got, want, dtype):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOLERANCES[jnp.dtype(dtype)])


def padded_rows_are_zero(out, num_tokens):
    t = np.arange(out.shape[1])[None, :]
    pad = t >= np.asarray(num_tokens)[:, None]
    return np.all(np.asarray(out, np.float32)[pad] == 0)


class _AttentionTest:
    interpret: bool

    def attend(self, case, **kwargs):
        return paged_attention(**case, interpret=self.interpret, **kwargs)

    # Decode: lengths 1, S-1, S, S+1, long, and a padded row; GQA ratios 1, 4, 8, 32/8; default
    # tiles (several splits on these shapes) and two explicit ones.
    @pytest.mark.parametrize(
        "q_heads,kv_heads,page_size,dtype,block_sizes",
        [
            (2, 2, 8, jnp.float32, BlockSizes(num_splits=1, pages_per_block=4)),  # group 1, one split
            (8, 2, 16, jnp.bfloat16, None),  # group 4
            (8, 1, 8, jnp.float16, BlockSizes(num_splits=16, pages_per_block=2)),  # group 8, more splits than blocks
            (32, 8, 16, jnp.bfloat16, None),  # Mistral-shaped heads (small head_dim)
        ],
    )
    def test_decode(self, q_heads, kv_heads, page_size, dtype, block_sizes):
        s = page_size
        case = make_case(seed=q_heads + s, lengths=(1, s - 1, s, s + 1, 5 * s + 3, 7), num_tokens=(1, 1, 1, 1, 1, 0),
                         tokens=1, q_heads=q_heads, kv_heads=kv_heads, page_size=s, dtype=dtype)
        got = self.attend(case, block_sizes=block_sizes)
        assert_close(got, attention_ref(**case), dtype)
        assert padded_rows_are_zero(got, case["num_tokens"])

    # Head sizes that are not powers of two (padded tiles), page sizes from 1 to 256 (a step
    # spans many pages, or a page spans many steps; 12 is not a power of two), odd GQA groups
    # (5, 6), a group split over programs (20 query heads per KV head in float32: block_h 16).
    @pytest.mark.parametrize(
        "head_dim,page_size,q_heads,kv_heads,dtype,tokens",
        [
            (96, 1, 5, 1, jnp.bfloat16, 1),  # Phi-3 head, one-token pages, group 5
            (80, 2, 12, 2, jnp.float16, 3),  # Phi-2 head, group 6, prefill
            (112, 256, 4, 2, jnp.float32, 1),  # a 256-token page over 16 steps of 16 keys
            (8, 12, 3, 3, jnp.float32, 5),  # head_dim 8 (tile 16), 12-token pages, MHA
            (256, 32, 4, 1, jnp.bfloat16, 4),  # Gemma head, multi-query
            (40, 4, 40, 2, jnp.float32, 1),  # group 20 > block_h 16: two programs per KV head
        ],
    )
    def test_head_sizes_page_sizes_and_groups(self, head_dim, page_size, q_heads, kv_heads, dtype, tokens):
        s = page_size
        lengths = (1, max(s - 1, 2), s + 1, 2 * s + 3) if s < 16 else (1, 15, s + 1, 40)
        case = make_case(seed=head_dim + s, lengths=lengths, num_tokens=(1, min(tokens, 2), tokens, tokens), tokens=tokens,
                         q_heads=q_heads, kv_heads=kv_heads, page_size=s, dtype=dtype, head_dim=head_dim, max_pages=13)
        got = self.attend(case)
        assert got.shape == case["q"].shape
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        assert_close(got, attention_ref(**case), dtype)

    # NaN in a row's own inputs (its query, or a K/V position its queries see) reaches the
    # output exactly where the reference puts it; NaN in K at positions masked for a query
    # (causally in the future, outside the window) does not. One split and a split-K merge.
    @pytest.mark.parametrize("tokens,block_sizes", [(4, BlockSizes(num_splits=1)), (1, BlockSizes(num_splits=4, block_k=16))])
    def test_nan_in_own_inputs_propagates(self, tokens, block_sizes):
        case = make_case(seed=5, lengths=(40, 36, 9), num_tokens=(tokens, tokens, 0), tokens=tokens, q_heads=4,
                         kv_heads=2, page_size=8, dtype=jnp.float32)
        layer, pm = case["layer"], np.asarray(case["page_map"])

        def poison(name, at):  # on the host: no compile per shape
            x = np.array(case[name])
            x[at] = np.nan
            return {**case, name: jnp.asarray(x)}

        def poison_kv(name, row, pos, kv_head, dim):
            return poison(name, (layer, kv_head, pm[row, pos // 8], pos % 8, dim))

        last = 40 - 1  # row 0's last position: only its last query sees it
        scenarios = {
            "q": (poison("q", (0, tokens - 1, 2, 5)), None),
            "visible k": (poison_kv("k_arena", 1, 3, 0, 7), None),
            "visible v": (poison_kv("v_arena", 1, 3, 1, 5), None),
            "future k": (poison_kv("k_arena", 0, last, 1, 0), None),
            "k outside the window": (poison_kv("k_arena", 1, 2, 0, 3), 16),
        }
        for name, (poisoned, window) in scenarios.items():
            got = np.asarray(self.attend(poisoned, sliding_window=window, block_sizes=block_sizes), np.float32)
            want = np.asarray(attention_ref(**poisoned, sliding_window=window), np.float32)
            nan = np.isnan(want)
            expected = np.zeros_like(nan)
            if name == "q":
                expected[0, tokens - 1, 2, :] = True
            elif name == "visible k":
                expected[1, :tokens, 0:2, :] = True
            elif name == "visible v":  # a NaN lane poisons the whole row of each query that sees it
                expected[1, :tokens, 2:4, :] = True
            elif name == "future k":
                expected[0, tokens - 1, 2:4, :] = True  # only the last query sees position 39
            np.testing.assert_array_equal(nan, expected, err_msg=f"reference, NaN in {name}")
            np.testing.assert_array_equal(np.isnan(got), nan, err_msg=f"kernel, NaN in {name}")
            assert_close(np.where(nan, 0, got), np.where(nan, 0, want), jnp.float32)

    def test_prefill_ragged_with_nan_stale_pages(self):
        """Several new tokens per row, ragged (incl. a padded row), causal over prefix + themselves.
        NaN in unwritten positions, in pages past the length and behind unmapped page-table
        entries gives finite output, bit-equal to the same run over a zero-filled arena."""
        kwargs = dict(seed=2, lengths=(8, 20, 33, 5), num_tokens=(8, 3, 6, 0), tokens=8, q_heads=8, kv_heads=2,
                      page_size=8, dtype=jnp.float16, max_pages=6)
        dirty, clean = make_case(**kwargs, stale=np.nan), make_case(**kwargs, stale=0.0)
        got = self.attend(dirty, sm_scale=0.3)
        assert np.all(np.isfinite(np.asarray(got, np.float32)))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(self.attend(clean, sm_scale=0.3)))
        assert_close(got, attention_ref(**clean, sm_scale=0.3), jnp.float16)
        assert padded_rows_are_zero(got, dirty["num_tokens"])

    @pytest.mark.parametrize("tokens,window", [(1, 5), (6, 1000)])
    def test_sliding_window(self, tokens, window):
        """Windows smaller and larger than the context (prefill windows smaller than the context
        are covered by the chunked-prefill test)."""
        case = make_case(seed=3 + tokens, lengths=(1, 17, 40, 64), num_tokens=(1, tokens, tokens, 0), tokens=tokens,
                         q_heads=4, kv_heads=1, page_size=8, dtype=jnp.bfloat16)
        got = self.attend(case, sliding_window=window)
        assert_close(got, attention_ref(**case, sliding_window=window), jnp.bfloat16)

    def test_chunked_prefill_equals_one_shot(self):
        """Append + attend chunk by chunk (Pallas both) == one-shot prefill, for chunks of 1 (token
        by token decode) and 5 tokens, rows of different lengths, a 10-token sliding window
        (smaller than the context, larger than a chunk), stale NaN everywhere unwritten."""
        n = np.array([19, 13, 0])
        window = 10
        rng = np.random.default_rng(11)
        q_heads, kv_heads, page_size, n_max = 8, 2, 8, int(n.max())
        k, v, q = (rng.standard_normal((3, n_max, h, HEAD_DIM)).astype(np.float32) for h in (kv_heads, kv_heads, q_heads))
        page_map = scrambled_page_map(11, np.full(3, n_max), page_size, 3)
        arena = kernel_cases.full((1, kv_heads, NUM_PAGES, page_size, HEAD_DIM), np.nan, jnp.float32)
        lens = jnp.asarray(n, jnp.int32)

        ka, va = paged_append(arena, arena, 0, k, v, page_map, lens, lens, interpret=self.interpret)
        one_shot = paged_attention(q, ka, va, 0, page_map, lens, lens, sliding_window=window, interpret=self.interpret)
        assert_close(one_shot, attention_ref(q, ka, va, 0, page_map, lens, lens, sliding_window=window), jnp.float32)
        one_shot = np.asarray(one_shot)

        for chunk in (1, 5):
            ka, va = arena, arena
            for start in range(0, n_max, chunk):
                take = np.clip(n - start, 0, chunk)
                lens, cnt = jnp.asarray(start + take, jnp.int32), jnp.asarray(take, jnp.int32)
                pad = ((0, 0), (0, max(0, start + chunk - n_max)), (0, 0), (0, 0))
                kc, vc, qc = (np.pad(x[:, start : start + chunk], pad) for x in (k, v, q))
                ka, va = paged_append(ka, va, 0, kc, vc, page_map, lens, cnt, interpret=self.interpret)
                out = np.asarray(paged_attention(qc, ka, va, 0, page_map, lens, cnt, sliding_window=window,
                                                 interpret=self.interpret))
                for b in range(3):
                    assert_close(out[b, : take[b]], one_shot[b, start : start + take[b]], jnp.float32)
                assert padded_rows_are_zero(out, take)


class TestAttentionInterpret(_AttentionTest):
    interpret = True


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) kernels need a GPU; interpret class covers CPU")
class TestAttentionCompiled(_AttentionTest):
    interpret = False


def test_reference_matches_dense_attention():
    """The oracle itself: paged reference == dense causal attention over a contiguous cache."""
    s, n = 8, 21
    case = make_case(seed=7, lengths=(n,), num_tokens=(n,), tokens=n, q_heads=4, kv_heads=2, page_size=s)
    rng = np.random.default_rng(7)  # make_case draws k, v, then q from the same stream
    k, v = (jnp.asarray(rng.standard_normal((1, n, 2, HEAD_DIM)), jnp.float32) for _ in range(2))
    q = case["q"]
    with jax.default_matmul_precision("highest"):  # a GPU's default float32 matmul is TF32
        dense = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    np.testing.assert_allclose(np.asarray(attention_ref(**case)), np.asarray(dense), atol=1e-5, rtol=1e-5)


class TestAttentionValidation:
    """Bad arguments raise ValueError naming the argument and the limit (no kernel runs)."""

    @pytest.mark.parametrize(
        "change,match",
        [
            (dict(q=jnp.zeros((2, 1, 6, HEAD_DIM))), "not a multiple of the arena's 4 KV heads"),
            (dict(q=jnp.zeros((2, 1, 8, 32))), "q head_dim 32"),
            (dict(q=jnp.zeros((2, 1, 8, HEAD_DIM), jnp.int32)), "q.dtype"),
            (dict(q=jnp.zeros((2, 8, HEAD_DIM))), "q must be 4-D"),
            (dict(layer=5), r"layer=5 out of range \[0, 2\)"),
            (dict(layer=jnp.zeros((2,), jnp.int32)), "layer must be an integer scalar"),
            (dict(page_map=jnp.zeros((3, 2), jnp.int32)), "page_map must be"),
            (dict(lengths=jnp.zeros((2, 1), jnp.int32)), r"lengths must have shape \(2,\)"),
            (dict(sliding_window=0), "sliding_window must be a positive int"),
            (dict(block_sizes=BlockSizes(pages_per_block=1)), r"pages_per_block \* page_size = 1 \* 8"),
        ],
    )
    def test_value_errors(self, change, match):
        arena = jnp.zeros((2, 4, NUM_PAGES, 8, HEAD_DIM))
        args = dict(q=jnp.zeros((2, 1, 8, HEAD_DIM)), k_arena=arena, v_arena=arena, layer=0,
                    page_map=jnp.zeros((2, 2), jnp.int32), lengths=jnp.ones(2, jnp.int32), num_tokens=jnp.ones(2, jnp.int32))
        args.update(change)
        with pytest.raises(ValueError, match=match):
            paged_attention(**args, interpret=True)


def _lower_for_cuda(fn, *args):
    from jax import export

    from pallas_kernels.offline.sm90 import h100_lowering  # JAX >= 0.11 must be told which GPU without one

    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    with h100_lowering():
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()


def test_triton_deprecation_warning_is_never_an_error():
    """JAX 0.11 warns `jax-pallas-triton` whenever our kernels lower for a GPU; the suite's
    warning filters (pyproject.toml) must show it, never raise it."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:  # the suite's filters stay; shown ones are recorded
        warnings.warn("The Pallas Triton backend is deprecated and will be removed in a future JAX version.",
                      DeprecationWarning, stacklevel=1)
    assert [type(w.message) for w in seen] == [DeprecationWarning], "the suite's filters must show it, not hide it"


@pytest.mark.parametrize("tokens,dtype,window", [(1, jnp.bfloat16, None), (64, jnp.float16, 128), (3, jnp.float32, None)])
def test_triton_lowering_on_any_host(tokens, dtype, window):
    """The kernels lower to Triton IR for CUDA (Mistral-shaped: 32 q / 8 kv heads, head_dim 128,
    page 16), on any host: this checks the Triton lowering rules (power-of-two tiles, dot
    shapes, masked gathers/scatters, in-place aliasing). PTX compilation itself needs a GPU."""
    sds = jax.ShapeDtypeStruct
    arena = sds((2, 8, 256, 16, 128), dtype)
    q, kv = sds((4, tokens, 32, 128), dtype), sds((4, tokens, 8, 128), dtype)
    rows = [sds((4, 16), jnp.int32), sds((4,), jnp.int32), sds((4,), jnp.int32)]
    layer = sds((), jnp.int32)
    txt = _lower_for_cuda(lambda *a: paged_attention(*a, sliding_window=window, interpret=False), q, arena, arena, layer, *rows)
    assert txt.count("__gpu$xla.gpu.triton") == 1
    txt = _lower_for_cuda(lambda *a: paged_append(*a, interpret=False), arena, arena, layer, kv, kv, *rows)
    assert txt.count("__gpu$xla.gpu.triton") == 1 and "output_operand_aliases" in txt
