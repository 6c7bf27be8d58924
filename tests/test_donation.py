"""The arena is updated in place: donated buffers come back at the same address, and the
compiled step holds no full copy of the arena."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

import arena_jax as aj

LAYOUT = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=8, num_pages=64, max_seqs=4,
                     max_pages_per_seq=8, dtype="float32")
SLOTS = jnp.arange(4, dtype=jnp.int32)


@functools.partial(jax.jit, donate_argnames="cache")
def step(cache, k, v):
    """One decode-like step: reserve a token per slot, write it at every layer."""
    cache, ok = aj.reserve(cache, SLOTS, 1)
    slots = jnp.where(ok, SLOTS, aj.PAD_SLOT)
    for layer in range(LAYOUT.num_layers):
        cache = aj.append(cache, layer, slots, k, v)
    return cache


def inputs():
    k = jax.random.normal(jax.random.key(0), (4, 1, LAYOUT.num_kv_heads, LAYOUT.head_dim))
    return k, -k


def test_donated_step_returns_the_same_buffers():
    cache = aj.create(LAYOUT)
    k, v = inputs()
    for _ in range(3):
        k_ptr, v_ptr = cache.k.unsafe_buffer_pointer(), cache.v.unsafe_buffer_pointer()
        cache = step(cache, k, v)
        assert cache.k.unsafe_buffer_pointer() == k_ptr
        assert cache.v.unsafe_buffer_pointer() == v_ptr
    np.testing.assert_array_equal(cache.table.lengths, [3, 3, 3, 3])
    assert int(cache.stats.tokens_written) == 12


def test_public_ops_donate_too():
    cache = aj.create(LAYOUT)
    ptr = cache.k.unsafe_buffer_pointer()
    cache, _ = aj.reserve(cache, SLOTS, 5)
    k, v = inputs()
    cache = aj.append(cache, 0, SLOTS, k, v)
    cache = aj.release(cache, SLOTS[:2])
    assert cache.k.unsafe_buffer_pointer() == ptr


def arena_copies(hlo: str) -> list[str]:
    arena = re.escape("f32[" + ",".join(map(str, LAYOUT.arena_shape)) + "]")
    return [line.strip() for line in hlo.splitlines() if re.search(r"= " + arena + r"\S* copy(-start)?\(", line)]


def test_compiled_step_has_no_copy_of_the_arena():
    cache = aj.create(LAYOUT)
    hlo = step.lower(cache, *inputs()).compile().as_text()
    assert not arena_copies(hlo), "full arena copies in the step:\n" + "\n".join(arena_copies(hlo))
    assert "input_output_alias" in hlo  # the donated arena aliases the output
    # The check does see a copy when a step makes one (returning the donated arena twice).
    copying = jax.jit(lambda c: (c.k, c.k), donate_argnames="c").lower(cache).compile().as_text()
    assert arena_copies(copying)
