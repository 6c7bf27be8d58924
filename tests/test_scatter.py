"""`pallas_kernels.scatter.set_at`, the arena's in-place writes: bit for bit what a set must
give (numpy on the bits) on fresh random data (NaN payloads, negative zeros and out-of-range
rows included) for every dtype an arena or its scales can hold (the plain scatter is not:
where XLA CPU upcasts, it canonicalizes the NaN payloads of untouched fp8 elements), and an
append to a bf16 /
fp8 arena compiles without converting the whole arena (XLA CPU in jaxlib 0.10 did:
`scatter.py`'s docstring)."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from pallas_kernels.scatter import set_at, upcasts

DTYPES = ["bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_set_at_equals_the_plain_scatter_bit_for_bit(dtype):
    dtype = jnp.dtype(dtype)
    rng = np.random.default_rng(len(dtype.name))
    bits = jnp.uint8 if dtype.itemsize == 1 else {2: jnp.uint16, 4: jnp.uint32}[dtype.itemsize]
    raw = rng.integers(0, np.iinfo(bits).max, (3, 2, 9, 4), dtype=np.uint64).astype(bits)  # every bit pattern, NaNs too
    x = jax.lax.bitcast_convert_type(jnp.asarray(raw), dtype)
    new = jax.lax.bitcast_convert_type(jnp.asarray(rng.integers(0, np.iinfo(bits).max, (5, 2, 4), dtype=np.uint64)
                                                   .astype(bits)), dtype)  # fmt: skip
    layer, pages = 1, [0, 8, 3, 9, 12]  # 9, 12: past the pages, dropped
    got = jax.jit(lambda a, v: set_at(a, (layer, slice(None), jnp.asarray(pages, jnp.int32)), v))(x, new)
    want = raw.copy()  # numpy on the bits: untouched elements keep theirs exactly (NaN payloads too)
    new_bits = np.asarray(jax.lax.bitcast_convert_type(new, bits))
    for i, p in enumerate(pages):
        if p < raw.shape[2]:
            want[layer, :, p] = new_bits[i]
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(got, bits)), want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_an_append_converts_no_whole_arena(dtype):
    """The compiled append of one token per row holds no conversion of the arena (which cost
    the arena's size per layer on jaxlib 0.10's CPU backend); the tokens land where a float32
    arena puts them."""
    layout = aj.KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, page_size=4, num_pages=64, max_seqs=2,
                         max_pages_per_seq=8, dtype=dtype, rotate_keys=False)  # fmt: skip
    slots = jnp.arange(2, dtype=jnp.int32)
    cache, _ = aj.reserve(aj.create(layout), slots, 3)
    k = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 2, 16)), jnp.float32)
    k = k.astype(dtype) if dtype == "bfloat16" else k  # a float arena stores its own dtype; fp8 quantizes
    step = jax.jit(functools.partial(aj.append, backend="reference"), static_argnums=(1,), donate_argnums=(0,))
    arena = re.escape(",".join(map(str, layout.arena_shape)))
    hlo = step.lower(cache, 1, slots, k, -k).compile().as_text()
    converts = [line.strip()[:160] for line in hlo.splitlines() if re.search(r"= \w+\[" + arena + r"\]\S* convert\(", line)]
    assert not converts, "\n".join(converts)
    out = step(cache, 1, slots, k, -k)
    pages = np.asarray(out.table.page_map)[:, 0]
    stored = np.asarray(out.k[1][:, pages, :3].astype(jnp.float32)).transpose(1, 2, 0, 3)  # [B, T, H, D]
    if dtype == "bfloat16":
        np.testing.assert_array_equal(stored, np.asarray(k.astype(jnp.float32)))
    assert upcasts(dtype) == (jax.default_backend() == "cpu" and (dtype != "bfloat16" or jax.__version_info__ < (0, 11)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float8_e5m2"])
def test_the_first_append_warns_where_writes_copy_the_arena_and_create_does_not(dtype, monkeypatch):
    """Issue 40, item 6: `aj.create` warned that "each append copies the arena" for every bf16
    arena on jax 0.10's CPU, the tour's too, which only sizes one and reserves / releases pages
    of another. Now the warning comes with the first append traced on such an arena (once per
    dtype), never from `create`, sizing or the allocator."""
    import warnings

    from arena_jax import arena_ops

    monkeypatch.setattr(arena_ops, "_WRITE_COPY_WARNED", set())
    layout = aj.KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, page_size=4, num_pages=7, max_seqs=1,
                         max_pages_per_seq=4, dtype=dtype)  # fmt: skip (7 pages: a shape no other test compiles)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.eval_shape(lambda: aj.create(layout))
        cache = aj.create(layout)
        cache, _ = aj.reserve(cache, [0], [3])
        cache = aj.release(cache, [0])
        before = [str(w.message) for w in caught if "cannot update" in str(w.message)]
        k = jnp.ones((1, 2, 1, 16), jnp.float32 if layout.quantized else dtype)
        for _ in range(2):
            cache, _ = aj.reserve(cache, [0], [2])
            cache = aj.append(cache, 0, [0], k, k, backend="xla")
    said = [str(w.message) for w in caught if "cannot update" in str(w.message)]
    assert before == [], before
    assert len(said) == int(upcasts(layout.storage_dtype)), said
    assert all("each append copies the arena" in m for m in said)
