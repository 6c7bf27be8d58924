"""The arena is updated in place: donated buffers come back at the same address, and the
compiled step holds no full copy of the arena."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from arena_jax import allocator

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


def test_prefix_ops_keep_the_arena_in_place():
    """The prefix cache's ops touch only the page table: no copy of the arena, same buffers back."""
    from arena_jax.models.steps import drop_page_rows, fork_page_rows, hold_page_rows

    cache = aj.create(LAYOUT)
    ptr = cache.k.unsafe_buffer_pointer()
    cache = step(cache, *inputs())  # a token in a page of each slot, at every layer
    pages, counts = jnp.arange(4, dtype=jnp.int32), jnp.ones((4,), jnp.int32)
    rows = jnp.full((4, LAYOUT.max_pages_per_seq), aj.PAD_PAGE, jnp.int32).at[:, 0].set(pages)
    dst = jnp.asarray([aj.PAD_SLOT, aj.PAD_SLOT, aj.PAD_SLOT, 3], jnp.int32)  # slot 3 again, from its page
    for fn, args in ((hold_page_rows, (pages, counts)), (fork_page_rows, (rows, counts, dst)), (drop_page_rows, (pages,))):
        hlo = fn.lower(cache, *args).compile().as_text()
        assert not arena_copies(hlo), f"{fn.__name__} copies the arena:\n" + "\n".join(arena_copies(hlo))
        cache = fn(cache, *args)
        assert cache.k.unsafe_buffer_pointer() == ptr
    assert int(cache.stats.pages_held) == 4 and int(cache.stats.holds_dropped) == 4 and int(cache.stats.prefix_forks) == 1
    assert int(cache.stats.rejected_rows) == 0 and int(cache.stats.pages_evicted) == 0  # the slots still map them


@pytest.mark.parametrize("which", ["decode_step", "mixed_step", "decode_block"])
def test_layer_scan_keeps_the_arena_in_place(which):
    """The model's decode step (and the mixed step: decode rows and prompt chunks; and a decode
    block: a while loop of decode steps) runs its layers in one `lax.scan` (a while loop)
    carrying the cache: the arena is updated in place inside the loop (no copy of it anywhere
    in the program), the donated arena still aliases the output, and the same buffers come back."""
    from flax import nnx

    from arena_jax import models

    cfg = models.LlamaConfig.tiny_family("gemma2")  # mixed windows: the traced per-layer window path
    model = models.init_random(cfg)
    layout = models.default_layout(model, 4, 32, page_size=8, dtype="float32")
    graphdef, state = nnx.split(model)
    cache = aj.create(layout)
    args = (SLOTS, SLOTS)
    if which == "mixed_step":  # slots 0, 1 decode; slots 2, 3 bring chunks of 5 and 8 tokens
        chunks = jnp.ones((2, 8), jnp.int32)
        decode = jnp.asarray([0, 1, aj.PAD_SLOT, aj.PAD_SLOT], jnp.int32)
        args = (SLOTS, decode, chunks, SLOTS[2:], jnp.asarray([5, 8], jnp.int32), SLOTS[2:], SLOTS)
    # the layer loop and, with reserve as XLA's ops, its copy-on-write loop (the native call copies inside)
    params, loops = state, 1 + (allocator._reserves_by_kernel(cache, SLOTS, False, allocator.RESERVE_KERNEL) is None)
    if which == "decode_block":  # 3 steps of slots 0-2 (the layer loop nested in the block's loop)
        from arena_jax.models.steps import bound_steps

        steps = bound_steps(graphdef, state)
        params, loops = steps.leaves, loops + 1  # and the block's loop around them
        args = (SLOTS, SLOTS.at[3].set(aj.PAD_SLOT), jnp.asarray([3, 3, 3, 0], jnp.int32), SLOTS, jnp.int32(0),
                models.GREEDY.rows(4))  # fmt: skip
        compiled = steps.decode_block.lower(params, cache, *args, length=3).compile()
    else:
        compiled = getattr(models, which).lower(graphdef, state, cache, *args).compile()
    hlo = compiled.as_text()
    arena = re.escape("f32[" + ",".join(map(str, layout.arena_shape)) + "]")
    copies = [line.strip() for line in hlo.splitlines() if re.search(r"= " + arena + r"\S* copy(-start)?\(", line)]
    assert not copies, "arena copies in the scanned step:\n" + "\n".join(copies)
    assert "input_output_alias" in hlo
    # the while loops that carry the arena: the layer loop and (XLA's reserve) its copy-on-write loop (no
    # trip unless a row copies a page; the blockwise attention's block loops, nested in the layer
    # loop on the "xla" backend, carry no arena); a decode block's loop around them
    assert len([w for w in re.findall(r"= \((.*)\) while\(", hlo) if re.search(arena, w)]) == loops
    ptr = cache.k.unsafe_buffer_pointer()
    out = compiled(params, cache, *args)
    out = out[0] if which == "decode_block" else out
    assert out.cache.k.unsafe_buffer_pointer() == ptr
    if which == "mixed_step":
        assert np.asarray(out.cache.table.lengths).tolist() == [1, 1, 5, 8]
    if which == "decode_block":
        assert np.asarray(out.cache.table.lengths).tolist() == [3, 3, 3, 0]


def test_a_one_row_step_over_a_short_table_keeps_the_arena_in_place():
    """One row, a 9-page table (the "xla" attention as one block): XLA CPU could fuse the
    append's update into the attention's gather of V, which then read the arena as it was before
    the append, and copy the whole arena twice per layer to allow it. `attend_impl` reads the
    arena through an optimization barrier so that the gather reads it as the append left it
    (JAX 0.11), and the gathers read a flat view of it (`blockwise._gather_block`), which JAX
    0.10's XLA, fusing past the barrier, does not fuse the update into either."""
    from flax import nnx

    from arena_jax import models

    model = models.init_random(models.LlamaConfig.tiny())
    layout = models.default_layout(model, 1, 144, page_size=16, dtype="float32")
    assert layout.max_pages_per_seq == 9
    graphdef, state = nnx.split(model)
    one = jnp.zeros((1,), jnp.int32)
    hlo = models.decode_step.lower(graphdef, state, aj.create(layout), one, one).compile().as_text()
    arena = re.escape("f32[" + ",".join(map(str, layout.arena_shape)) + "]")
    copies = [line.strip() for line in hlo.splitlines() if re.search(r"= " + arena + r"\S* copy(-start)?\(", line)]
    assert not copies, "arena copies in the one-row step:\n" + "\n".join(copies)
