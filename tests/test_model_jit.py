"""`models.model_jit`: the module-level steps find their compiled program without hashing the
graphdef on every call, and give what the plain static-graphdef jit gives."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models import dense_baseline, model_jit


class Graph:
    """A stand-in graphdef that counts how often it is hashed."""

    hashes = 0

    def __init__(self, scale: float):
        self.scale = scale

    def __hash__(self):
        Graph.hashes += 1
        return hash(self.scale)

    def __eq__(self, other):
        return isinstance(other, Graph) and other.scale == self.scale


traces = []


@model_jit.model_jit(static_argnames=("twice",), donate_argnames=("buf",))
def scaled(graphdef, buf, x, twice=False):
    traces.append(graphdef.scale)
    y = buf + graphdef.scale * x
    return 2 * y if twice else y


def test_a_kept_graphdef_is_not_hashed_again_and_an_equal_one_compiles_nothing():
    traces.clear()
    g = Graph(3.0)
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(scaled(g, jnp.ones(4), x), 1 + 3 * np.arange(4.0))
    first = Graph.hashes  # the first call looks the graphdef up by value
    for _ in range(4):
        np.testing.assert_array_equal(scaled(g, jnp.ones(4), x), 1 + 3 * np.arange(4.0))
    assert Graph.hashes == first and traces == [3.0]
    twin = Graph(3.0)  # equal, another object: looked up by value once, the same program
    np.testing.assert_array_equal(scaled(twin, jnp.ones(4), x), 1 + 3 * np.arange(4.0))
    assert Graph.hashes > first and traces == [3.0]
    second = Graph.hashes
    np.testing.assert_array_equal(scaled(graphdef=twin, buf=jnp.ones(4), x=x, twice=True), 2 + 6 * np.arange(4.0))
    assert Graph.hashes == second and traces == [3.0, 3.0]  # `twice` is static: one more trace
    np.testing.assert_array_equal(scaled(Graph(5.0), jnp.zeros(4), x), 5 * np.arange(4.0))
    assert traces == [3.0, 3.0, 5.0]


def test_the_donated_argument_is_donated():
    buf = jnp.ones(4)
    scaled(Graph(1.0), buf, jnp.arange(4.0))
    assert buf.is_deleted()


def test_the_graphdefs_kept_are_bounded():
    for i in range(3 * model_jit.MAX_GRAPHDEFS):
        scaled(Graph(float(i)), jnp.zeros(2), jnp.ones(2))
    assert len(scaled._by_id) == len(scaled._by_value) == model_jit.MAX_GRAPHDEFS


def test_lower_and_wrapped_are_the_static_jits():
    g = Graph(2.0)
    text = scaled.lower(g, jnp.zeros(3), jnp.ones(3)).as_text()
    assert "stablehlo" in text or "HloModule" in text
    assert scaled.__wrapped__(g, jnp.zeros(3), jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]
    assert scaled.__name__ == "scaled" and "graphdef" in scaled.__wrapped__.__code__.co_varnames


@pytest.fixture(scope="module")
def tiny():
    model = models.init_random(models.LlamaConfig.tiny(), seed=11)
    return (model, *nnx.split(model))


def test_decode_step_matches_the_static_graphdef_jit(tiny):
    """Fresh random prompts, the same step both ways: every output bit for bit."""
    model, graphdef, state = tiny
    layout = models.default_layout(model, 3, 48, page_size=8)
    rng = np.random.default_rng()
    prompts = jnp.asarray(rng.integers(0, model.config.vocab_size, (3, 12)), jnp.int32)
    counts = jnp.asarray(rng.integers(1, 13, 3), jnp.int32)
    slots = jnp.arange(3, dtype=jnp.int32)
    empty = aj.create(layout)  # both runs start from its copies (an arena's id is drawn at creation)
    outs = []
    for prefill, decode in ((models.prefill, models.decode_step), (models.prefill._jit, models.decode_step._jit)):
        out = prefill(graphdef, state, jax.tree.map(jnp.copy, empty), prompts, slots, counts)
        for _ in range(4):
            out = decode(graphdef, state, out.cache, out.tokens, slots)
        outs.append(out)
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_dense_decode_matches_the_static_graphdef_jit(tiny):
    model, graphdef, state = tiny
    tokens = jnp.asarray(np.random.default_rng().integers(0, model.config.vocab_size, (2, 7)), jnp.int32)
    got = []
    for prefill, decode in ((dense_baseline.dense_prefill, dense_baseline.dense_decode),
                            (dense_baseline.dense_prefill._jit, dense_baseline.dense_decode._jit)):  # fmt: skip
        cache = dense_baseline.init_dense_cache(model.config, 2, 16, model.dtype)
        nxt, cache = prefill(graphdef, state, cache, tokens, jnp.full((2,), 7, jnp.int32))
        seq = [nxt]
        for _ in range(3):
            nxt, cache = decode(graphdef, state, cache, nxt)
            seq.append(nxt)
        got.append(np.stack(seq))
    np.testing.assert_array_equal(got[0], got[1])


def test_the_graphdef_hash_study_times_all_four_calls(capsys):
    """benchmarks/studies/graphdef_hash.py: both steps through both jits, and their table."""
    from arena_jax.benchmarks.studies import graphdef_hash

    row = graphdef_hash.measure(layers=2, scan=True, calls=3)
    assert (row["layers"], row["form"]) == (2, "scan") and row["hash_us"] > 0
    assert all(row[f"{step}, {jit}"] > 0 for step in ("paged", "dense") for jit in ("jax.jit", "model_jit"))
    assert graphdef_hash.main(["--calls", "2", "--layers", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("| 1 | list |")


def test_calls_from_several_threads_share_one_program():
    import concurrent.futures

    traces.clear()
    graphs = [Graph(7.0) for _ in range(4)]  # equal: one program
    x = jnp.arange(3.0)
    scaled(Graph(7.0), jnp.zeros(3), x)  # traced once here (JAX may trace twice under a race of first calls)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: scaled(graphs[i % 4], jnp.zeros(3), x), range(64)))
    for r in results:
        np.testing.assert_array_equal(r, 7 * np.arange(3.0))
    assert traces == [7.0]


def test_a_missing_or_unhashable_graphdef_is_named():
    with pytest.raises(TypeError, match="scaled.. missing its first argument, graphdef"):
        scaled()
    with pytest.raises(ValueError, match="scaled: graphdef must be hashable .* got a dict"):
        scaled({"not": "a graphdef"}, jnp.zeros(2), jnp.ones(2))
