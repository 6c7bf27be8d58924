"""Which backend runs on which JAX (pallas_kernels/README.md, "JAX versions and backends"), and
what happens on a JAX whose Pallas Triton lowering is gone: simulated by hiding
`jax.experimental.pallas.triton` from the kernels (monkeypatch), as a JAX without it would."""
from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import pytest

import arena_jax as aj
import pallas_kernels
from arena_jax import api
from pallas_kernels import _common

LAYOUT = aj.KVLayout(num_layers=1, num_kv_heads=2, head_dim=24, page_size=4, num_pages=8, max_seqs=2,
                     max_pages_per_seq=4, dtype="float32")  # fmt: skip


@pytest.fixture
def no_triton(monkeypatch):
    """A JAX without the Pallas Triton lowering: the kernels' handle on it is None."""
    monkeypatch.setattr(_common, "plgpu", None)
    monkeypatch.setattr(api, "_FALLBACK_WARNED", set())


@pytest.fixture
def on_gpu(monkeypatch):
    """The host-side backend choice as it is made on a GPU (nothing runs on it)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.delenv(api.BACKEND_ENV, raising=False)


def test_defaults_with_triton(on_gpu, monkeypatch):
    assert pallas_kernels.triton_lowering_problem() is None  # JAX 0.10 and 0.11 have it
    assert api.default_backend() == "pallas"
    assert api._resolve_backend(None, LAYOUT, group=2) == "pallas"
    monkeypatch.setenv(api.BACKEND_ENV, "mosaic")  # never a default; chosen by name only
    assert api.default_backend() == "mosaic"


def test_default_on_cpu_is_the_reference(monkeypatch):
    monkeypatch.delenv(api.BACKEND_ENV, raising=False)
    assert jax.default_backend() == "cpu" and api.default_backend() == "reference"


def test_without_triton_the_default_falls_back_with_one_warning(no_triton, on_gpu):
    problem = pallas_kernels.triton_lowering_problem()
    assert "no Pallas Triton lowering" in problem and "backend='mosaic'" in problem and "backend='reference'" in problem
    with pytest.warns(RuntimeWarning, match="no Pallas Triton lowering.*using the jnp reference path"):
        assert api._resolve_backend(None, LAYOUT, group=2) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the second call is silent
        assert api._resolve_backend(None, LAYOUT, group=2) == "reference"


def test_without_triton_asking_for_pallas_names_the_backend_to_use(no_triton):
    cache = aj.create(LAYOUT)
    slots = jnp.asarray([0, 1])
    cache, _ = aj.reserve(cache, slots, 3)
    kv = jnp.ones((2, 3, 2, 24), jnp.float32)
    before = jax.device_get(cache.table)
    with pytest.raises(ValueError, match="backend='pallas' cannot take this layout: this JAX .* has no Pallas Triton "
                                         "lowering .* use backend='mosaic' .* or backend='reference'"):
        aj.append(cache, 0, slots, kv, kv, backend="pallas")
    with pytest.raises(ValueError, match="use backend='mosaic'"):
        aj.attend(jnp.ones((2, 1, 4, 24), jnp.float32), cache, 0, slots, backend="pallas")
    jax.tree.map(lambda a, b: (a == b).all() or pytest.fail("the cache changed"), jax.device_get(cache.table), before)
    # the kernels called directly: the same ValueError, not an internal traceback
    with pytest.raises(ValueError, match="no Pallas Triton lowering"):
        pallas_kernels.paged_attention(jnp.ones((1, 1, 4, 24)), cache.k, cache.v, 0, jnp.zeros((1, 4), jnp.int32),
                                       jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32), interpret=True)
    # the reference backend does not need Triton
    out = aj.attend(jnp.ones((2, 1, 4, 24), jnp.float32), aj.append(cache, 0, slots, kv, kv, backend="reference"), 0,
                    slots, backend="reference")
    assert out.shape == (2, 1, 4, 24) and bool(jnp.isfinite(out).all())
