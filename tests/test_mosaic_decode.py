"""The Mosaic GPU decode kernel (`pallas_kernels.gpu.mosaic_decode`, backend="mosaic"): what can be
checked without a GPU.

- It lowers, for an H100 (abstract device), to a Mosaic GPU custom call on both JAX lines
  (every `arena-bench kernels --compile-report` variant; on JAX 0.11 with TMA and wgmma).
- In Mosaic GPU's interpret mode (JAX >= 0.11; JAX 0.10's interpreter cannot take the
  transposed K operand) it equals the reference on fresh random data: scrambled pages, an
  unmapped page inside a row's length, stale NaN pages past the length and in the dead rows of
  the partly live last page, a length that fills its last page, an empty row, a padded row.
- What it cannot take is refused with a ValueError naming the backend to use, through
  `aj.attend` too; `aj.append` with it writes through the reference scatter.
It has never run on a GPU (pallas_kernels/README.md says how far it is verified).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import arena_jax as aj
from kernel_cases import TOLERANCES, attention_ref
from pallas_kernels.offline import sm90
from pallas_kernels.gpu.mosaic_decode import interpret_available, mosaic_paged_decode, mosaic_unsupported_reason
from pallas_kernels.offline.sm90_mosaic import MOSAIC_VARIANTS, lower_mosaic_call

needs_interpret = pytest.mark.skipif(
    not interpret_available(),
    reason=f"JAX {jax.__version__}'s Mosaic GPU interpret mode cannot run this kernel (a transposed wgmma operand: "
           "TransposeTransform has no `indices`); the JAX 0.11 CI line runs it")


def _case(seed, dtype, *, batch=3, kv_heads=2, group=4, head_dim=64, page_size=16, pages=12, layers=2, max_pages=4):
    """A dirty arena (NaN outside what the rows hold) and decode rows that exercise every rule."""
    rng = np.random.default_rng(seed)
    shape = (layers, kv_heads, pages, page_size, head_dim)
    k, v = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    perm = rng.permutation(pages - 1)  # the last page stays stale: NaN everywhere
    k[:, :, -1] = v[:, :, -1] = np.nan
    page_map = np.full((batch, max_pages), -1, np.int32)
    page_map[0, :3] = perm[:3]  # 2 full pages + 5 live keys of a third
    page_map[1, :2] = perm[3:5]  # exactly 2 full pages
    page_map[2, [0, 2]] = perm[5:7]  # page 1 unmapped (masked) inside the length
    lengths = np.array([2 * page_size + 5, 2 * page_size, 2 * page_size + 3], np.int32)
    for b in range(batch):  # stale NaN in the dead rows of each partly live page
        last = page_map[b, lengths[b] // page_size] if lengths[b] % page_size else -1
        if last >= 0:
            k[:, :, last, lengths[b] % page_size:] = v[:, :, last, lengths[b] % page_size:] = np.nan
    q = rng.standard_normal((batch, 1, kv_heads * group, head_dim)).astype(np.float32)
    num_tokens = np.array([1, 1, 1], np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), 1, jnp.asarray(page_map),
            jnp.asarray(lengths), jnp.asarray(num_tokens))


@pytest.mark.parametrize("variant", MOSAIC_VARIANTS, ids=lambda v: v.label.replace(" ", "-"))
def test_lowers_for_an_h100_with_tma_and_wgmma(variant):
    """Every compile-report variant (`sm90_mosaic.MOSAIC_VARIANTS`) lowers to one Mosaic GPU
    kernel for an H100. On JAX >= 0.11 its lowering also shows TMA copies (q, K, V in; the
    output out), both dots on wgmma, and a shared-memory plan within an H100's per-block limit."""
    facts = lower_mosaic_call(*variant.call())
    assert facts.lowered and facts.name == f"mosaic_paged_decode_g{variant.group}_p{variant.page_size}_d{variant.head_dim}"
    if interpret_available():  # JAX >= 0.11: the lowering dumps its facts
        assert facts.wgmma == 2 and facts.tma_loads >= 3 and facts.tma_stores >= 1, facts
        assert 0 < facts.smem <= sm90.SM90["smem_per_block"], facts
    else:
        assert facts.smem is None and facts.wgmma is None  # JAX 0.10 dumps nothing: n/a in the report


@needs_interpret
@pytest.mark.parametrize("dtype,page_size,head_dim", [(jnp.bfloat16, 16, 64), (jnp.float16, 32, 128)])
def test_equals_the_reference_in_interpret_mode(dtype, page_size, head_dim):
    args = _case(page_size, dtype, page_size=page_size, head_dim=head_dim)
    want = np.asarray(attention_ref(*args), np.float32)
    got = np.asarray(mosaic_paged_decode(*args, interpret=True), np.float32)
    assert np.isfinite(want).all() and np.abs(want).sum() > 0
    np.testing.assert_allclose(got, want, **TOLERANCES[jnp.dtype(dtype)])
    # an empty row and a padded row (num_tokens 0) give zeros; sm_scale is honoured
    q, k, v, layer, pm, lengths, n = args
    lengths, n = lengths.at[0].set(0), n.at[1].set(0)
    got = np.asarray(mosaic_paged_decode(q, k, v, layer, pm, lengths, n, sm_scale=0.5, interpret=True), np.float32)
    want = np.asarray(attention_ref(q, k, v, layer, pm, lengths, n, sm_scale=0.5), np.float32)
    assert (got[:2] == 0).all() and np.abs(want[2]).sum() > 0
    np.testing.assert_allclose(got, want, **TOLERANCES[jnp.dtype(dtype)])


@pytest.mark.parametrize("change,needle", [
    (dict(tokens=4), "decode only"),
    (dict(dtype="float32"), "bfloat16 / float16 arenas, not float32 arenas"),
    (dict(dtype="int8", quantized=True), "not 8-bit arenas"),
    (dict(q_dtype="float32"), "q in the arena's dtype"),
    (dict(sliding_window=8), "does not take sliding_window=8"),
    (dict(logits_soft_cap=30.0), "does not take logits_soft_cap=30.0"),  # an option added later: refused by name
    (dict(head_dim=80), "head_dim in (64, 128, 192, 256)"),
    (dict(page_size=8), "page_size in (16, 32, 64, 128)"),
    (dict(group=65), "up to 64 query heads"),
    (dict(sharded=True), "sharded cache"),
])
def test_unsupported_calls_name_the_backend_to_use(change, needle):
    base = dict(head_dim=128, page_size=16, group=4, dtype="bfloat16", interpret=False)
    assert mosaic_unsupported_reason(**base) is None
    reason = mosaic_unsupported_reason(**{**base, **change})
    assert needle in reason and "use backend='pallas' or 'reference'" in reason


LAYOUT = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=64, page_size=16, num_pages=16, max_seqs=2,
                     max_pages_per_seq=4, dtype="bfloat16")  # fmt: skip


def test_aj_attend_refuses_what_mosaic_cannot_take():
    cache = aj.create(LAYOUT)
    slots = jnp.asarray([0, 1])
    cache, _ = aj.reserve(cache, slots, 4)
    kv = jnp.ones((2, 4, 2, 64), jnp.bfloat16)
    cache = aj.append(cache, 0, slots, kv, kv, backend="mosaic")  # append: the reference scatter
    assert np.asarray(cache.table.written[0]).tolist() == [4, 4]
    with pytest.raises(ValueError, match="decode only .* use backend='pallas' or 'reference' for prefill"):
        aj.attend(jnp.ones((2, 4, 8, 64), jnp.bfloat16), cache, 0, slots, backend="mosaic")
    with pytest.raises(ValueError, match="does not take sliding_window=2"):
        aj.attend(jnp.ones((2, 1, 8, 64), jnp.bfloat16), cache, 0, slots, sliding_window=2, backend="mosaic")
    with pytest.raises(ValueError, match="q in the arena's dtype bfloat16"):
        aj.attend(jnp.ones((2, 1, 8, 64), jnp.float32), cache, 0, slots, backend="mosaic")


@needs_interpret
def test_aj_attend_with_mosaic_equals_reference():
    """Decode steps through the API: append (reference scatter) then attend with backend="mosaic"
    (interpret mode here) == backend="reference", rows ragged across pages, one padded."""
    cache = aj.create(LAYOUT)
    slots = jnp.asarray([0, aj.PAD_SLOT])
    rng = np.random.default_rng(3)
    cache, _ = aj.reserve(cache, slots, jnp.asarray([21, 0]))
    kv = [jnp.asarray(rng.standard_normal((2, 21, 2, 64)), jnp.bfloat16) for _ in range(2)]
    cache = aj.append(cache, 0, slots, *kv, num_tokens=jnp.asarray([21, 0]), backend="mosaic")
    q = jnp.asarray(rng.standard_normal((2, 1, 8, 64)), jnp.bfloat16)
    got = aj.attend(q, cache, 0, slots, backend="mosaic")
    want = aj.attend(q, cache, 0, slots, backend="reference")
    assert np.abs(np.asarray(want[0], np.float32)).sum() > 0 and (np.asarray(got[1], np.float32) == 0).all()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **TOLERANCES[jnp.dtype("bfloat16")])
