"""Pallas paged append == `append_reference` on fresh random inputs.

Each test class runs twice where a GPU exists (compiled and interpret=True); on CPU only the
interpret class runs. Shapes are tiny: interpret mode compiles a loop over the grid per shape.
Appends are exact copies (after the cast to the arena dtype), so results must be bit-equal.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kernel_cases
from pallas_kernels import BlockSizes, append_reference, paged_append

ON_GPU = jax.default_backend() == "gpu"


NUM_PAGES = 32  # one page-pool size for every test: jax.random.permutation compiles once
append_ref = jax.jit(append_reference)


def scrambled_page_map(seed, lengths, page_size, max_pages, num_pages=NUM_PAGES):
    return np.asarray(kernel_cases.scrambled_page_map(seed, lengths, page_size, max_pages, num_pages))


def make_inputs(*, seed, layers=2, kv_heads=2, page_size=8, head_dim=16, dtype=jnp.float32,
                lengths=(1, 7, 8, 9, 30, 5), num_tokens=(1, 5, 8, 9, 6, 0), tokens=9, max_pages=4):
    """Random stale arena, scrambled page table (-1 beyond each row's pages), new k/v.

    Data comes from numpy (fresh per seed, no per-shape compilation); the page table from
    jax.random.permutation."""
    rng = np.random.default_rng(seed)
    batch = len(lengths)
    shape = (layers, kv_heads, NUM_PAGES, page_size, head_dim)
    k_arena, v_arena = (jnp.asarray(rng.standard_normal(shape), dtype) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((batch, tokens, kv_heads, head_dim)), dtype) for _ in range(2))
    page_map = jnp.asarray(scrambled_page_map(seed, lengths, page_size, max_pages), jnp.int32)
    return k_arena, v_arena, k, v, page_map, jnp.asarray(lengths, jnp.int32), jnp.asarray(num_tokens, jnp.int32)


class _AppendTest:
    interpret: bool

    # lengths 1, S-1, S, S+1, long; tokens straddling page boundaries; a padded row (num_tokens 0).
    @pytest.mark.parametrize(
        "page_size,kv_heads,dtype,tokens",
        [
            (8, 1, jnp.float32, 9),
            (16, 2, jnp.bfloat16, 1),  # decode: one token per row
            (16, 4, jnp.float16, 5),
            (32, 2, jnp.float32, 3),
        ],
    )
    def test_matches_reference(self, page_size, kv_heads, dtype, tokens):
        s = page_size
        lengths = (1, s - 1, s, s + 1, 3 * s + 2, 4)
        num_tokens = tuple(min(n, tokens) for n in (1, s - 1, 2, s + 1, tokens, 0))
        k_arena, v_arena, k, v, page_map, lengths, num_tokens = make_inputs(
            seed=page_size + kv_heads, kv_heads=kv_heads, page_size=page_size, dtype=dtype, lengths=lengths,
            num_tokens=num_tokens, tokens=tokens, max_pages=4,
        )
        got = paged_append(k_arena, v_arena, 1, k, v, page_map, lengths, num_tokens, interpret=self.interpret)
        want = append_ref(k_arena, v_arena, 1, k, v, page_map, lengths, num_tokens)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))

    def test_unmapped_pages_and_small_blocks_under_jit_with_donation(self):
        """Traced layer, donated arena, a -1 page inside a row's range, tokens split in blocks of 2,
        and a row whose last tokens fall past its page table (32 positions; they are dropped)."""
        k_arena, v_arena, k, v, page_map, lengths, num_tokens = make_inputs(seed=3, lengths=(1, 7, 8, 35, 30, 5))
        page_map = page_map.at[4, 1].set(-1)  # row 4 holds 30 tokens; its 2nd page is unmapped
        want = append_ref(k_arena, v_arena, 0, k, v, page_map, lengths, num_tokens)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(k_arena, v_arena, layer):
            return paged_append(k_arena, v_arena, layer, k, v, page_map, lengths, num_tokens,
                                interpret=self.interpret, block_sizes=BlockSizes(block_tokens=2))

        got = step(k_arena, v_arena, jnp.int32(0))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))

    def test_all_rows_padded_writes_nothing(self):
        k_arena, v_arena, k, v, page_map, lengths, _ = make_inputs(seed=4)
        zeros = jnp.zeros_like(lengths)
        got = paged_append(k_arena, v_arena, 1, k, v, page_map, lengths, zeros, interpret=self.interpret)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(k_arena))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(v_arena))


class TestAppendInterpret(_AppendTest):
    interpret = True


@pytest.mark.skipif(not ON_GPU, reason="compiled Pallas (Triton) kernels need a GPU; interpret class covers CPU")
class TestAppendCompiled(_AppendTest):
    interpret = False


class TestAppendValidation:
    """Bad arguments raise ValueError naming the argument and the limit (no kernel runs)."""

    @pytest.mark.parametrize(
        "change,match",
        [
            (dict(layer=2), r"layer=2 out of range \[0, 2\)"),
            (dict(k_arena=jnp.zeros((2, 2, 32, 8))), "k_arena must be 5-D"),
            (dict(k_arena=jnp.zeros((2, 2, 32, 8, 16), jnp.int32)), "k_arena.dtype"),
            (dict(v_arena=jnp.zeros((2, 2, 32, 8, 16), jnp.bfloat16)), "must match"),
            (dict(k=jnp.zeros((6, 9, 3, 16))), "k has 3 heads"),
            (dict(v=jnp.zeros((6, 9, 2, 32))), "v head_dim 32"),
            (dict(page_map=jnp.zeros((5, 4), jnp.int32)), "page_map must be"),
            (dict(lengths=jnp.zeros((6,), jnp.float32)), "lengths must be an integer"),
            (dict(num_tokens=jnp.zeros((5,), jnp.int32)), r"num_tokens must have shape \(6,\)"),
        ],
    )
    def test_value_errors(self, change, match):
        k_arena, v_arena, k, v, page_map, lengths, num_tokens = make_inputs(seed=0)
        args = dict(k_arena=k_arena, v_arena=v_arena, layer=1, k=k, v=v, page_map=page_map, lengths=lengths,
                    num_tokens=num_tokens)
        args.update(change)
        with pytest.raises(ValueError, match=match):
            paged_append(**args, interpret=True)

    def test_head_dim_and_block_sizes_limits(self):
        for head_dim in (20, 264):  # not a multiple of 8; wider than 256
            arena = jnp.zeros((1, 1, 4, 8, head_dim))
            x = jnp.zeros((1, 1, 1, head_dim))
            with pytest.raises(ValueError, match=f"head_dim={head_dim}: the Pallas kernels take multiples of 8 up to 256"):
                paged_append(arena, arena, 0, x, x, jnp.zeros((1, 1), jnp.int32), jnp.ones(1, jnp.int32),
                             jnp.ones(1, jnp.int32))
        with pytest.raises(ValueError, match="block_tokens must be a power of two"):
            BlockSizes(block_tokens=3)
        with pytest.raises(ValueError, match="num_splits must be a positive int"):
            BlockSizes(num_splits=0)
        with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
            BlockSizes(block_k=8)
        with pytest.raises(ValueError, match="block_h must be a power of two"):
            BlockSizes(block_h=6)
