"""generate's options as objects (`models.options`): `Sampling`, `Serving`, `Parallelism` are
frozen and hashable, check their fields when made (a ValueError naming the field), give the
same run as the keywords they gather (every old keyword is still accepted), and an object
together with one of its own keywords is a TypeError.

One tiny model and one small arena for the module, a few tokens per run: the steps compile
once per shape and are shared by the keyword and the object form of each case.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import jax
import numpy as np
import pytest

import models
from models.options import PARALLEL_KEYS, SAMPLING_KEYS, SERVING_KEYS

NEW = 6


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(), seed=0, std=0.2)


@pytest.fixture(scope="module")
def layout(model):
    # 7 pages of 8 tokens for 4 rows of up to 32: the longer prompts preempt.
    return model.config.kv_layout(page_size=8, num_pages=7, max_seqs=4, max_seq_len=32, dtype="float32")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 128, n).tolist() for n in (3, 12, 7, 17, 1)]


def _mesh(*axes):
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(axes)), axes)


def _as_objects(keywords: dict) -> dict:
    """The same options as generate's objects (keywords that are not options stay keywords)."""
    out = {k: v for k, v in keywords.items() if k not in SAMPLING_KEYS + SERVING_KEYS + PARALLEL_KEYS}
    for name, cls, keys in (("sampling", models.Sampling, SAMPLING_KEYS), ("serving", models.Serving, SERVING_KEYS),
                            ("parallel", models.Parallelism, PARALLEL_KEYS)):  # fmt: skip
        mine = {k: keywords[k] for k in keys if k in keywords}
        if mine:
            out[name] = cls(**mine)
    return out


def test_the_objects_are_exported_frozen_and_hashable(layout):
    assert models.Serving is models.options.Serving and models.Parallelism is models.options.Parallelism
    assert models.Sampling is models.options.Sampling
    objects = [
        models.Sampling(temperature=0.7, top_k=5, top_p=0.9, seed=3, stop_tokens=[1, 2], return_logits=True),
        models.Serving(batch_size=2, chunk_size=8, layout=layout, prefix_cache=True, host_pages=4,
                       swap_policy=models.SwapPolicy(bandwidth_bytes_per_s=1e9), mixed_steps=True, token_budget=12,
                       decode_block=2),  # fmt: skip
        models.Parallelism(mesh=_mesh("data", "tensor"), data_axis="data"),
    ]
    for obj in objects:
        field = dataclasses.fields(obj)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, field, getattr(obj, field))
        assert hash(obj) == hash(dataclasses.replace(obj)) and obj == dataclasses.replace(obj)
    assert objects[0].stop_tokens == (1, 2)  # a list is kept as a tuple: hashable
    assert len({models.Serving(), models.Serving(), models.Serving(batch_size=2)}) == 2



@pytest.mark.parametrize("cls", [models.Sampling, models.Serving, models.Parallelism])
def test_every_field_has_a_docstring(cls):
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    documented = {a.target.id for a, b in zip(body, body[1:]) if isinstance(a, ast.AnnAssign)
                  and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)}  # fmt: skip
    assert cls.__doc__ and documented == {f.name for f in dataclasses.fields(cls)}


CASES = {
    "sampled": dict(temperature=0.8, top_k=20, top_p=0.9, seed=3),
    "stop tokens": dict(stop_tokens=[5, 7, 11]),
    "no stop tokens": dict(stop_tokens=()),
    "logits": dict(return_logits=True),
    "batch and chunk": dict(batch_size=2, chunk_size=4),
    "kv_dtype": dict(kv_dtype="int8", layout=None),
    "prefix cache": dict(prefix_cache=True, host_pages=4),
    "host tier": dict(host_pages=8, swap_policy=models.SwapPolicy(bandwidth_bytes_per_s=1e12)),
    "mixed steps": dict(mixed_steps=True, chunk_size=8, token_budget=20, arrivals=[0.0] * 5),
    "decode blocks": dict(decode_block=2),
    "mesh": dict(mesh=_mesh("data", "tensor"), tensor_axis="tensor", data_axis="data"),
}


@pytest.mark.parametrize("keywords", CASES.values(), ids=CASES.keys())
def test_each_old_keyword_runs_as_its_object(model, layout, prompts, keywords):
    keywords = dict(dict(layout=layout), **keywords)
    if keywords["layout"] is None:
        del keywords["layout"]
    old = models.generate(model, prompts, NEW, **keywords)
    new = models.generate(model, prompts, NEW, **_as_objects(keywords))
    assert new.tokens == old.tokens
    for name in ("preemptions", "prefill_calls", "decode_calls", "mixed_calls", "prefix_hit_tokens", "swap_outs"):
        assert getattr(new, name) == getattr(old, name), name
    assert (new.logits is None) == (old.logits is None)
    if old.logits is not None:
        for a, b in zip(old.logits, new.logits):
            np.testing.assert_array_equal(a, b)


def test_a_prefix_cache_continues_with_the_objects(model, layout, prompts):
    """The state of an earlier call (cache, its PrefixCache) is given beside the objects."""
    serving = models.Serving(batch_size=4, chunk_size=8, prefix_cache=True)
    first = models.generate(model, prompts[:2], 2, serving=dataclasses.replace(serving, layout=layout))
    by_keywords = models.generate(model, prompts[:2], 2, batch_size=4, chunk_size=8, cache=first.cache,
                                  prefix_cache=first.prefix_cache)  # fmt: skip
    again = models.generate(model, prompts[:2], 2, serving=serving, cache=by_keywords.cache,
                            prefix_cache=by_keywords.prefix_cache)  # fmt: skip
    assert again.tokens == by_keywords.tokens == first.tokens
    assert again.prefix_hit_tokens == by_keywords.prefix_hit_tokens > 0
    with pytest.raises(ValueError, match=r"give it with Serving\(prefix_cache=True\)"):
        models.generate(model, prompts[:2], 2, serving=models.Serving(), cache=again.cache, prefix_cache=again.prefix_cache)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: models.Sampling(temperature=-1.0), "temperature must be a finite number >= 0"),
        (lambda: models.Sampling(top_k=0), r"top_k must be in \[1, "),
        (lambda: models.Sampling(top_p=1.5), r"top_p must be a finite number in \(0, 1\]"),
        (lambda: models.Sampling(seed=2**31), r"seed must be in \[-2147483648, 2147483647\]"),
        (lambda: models.Sampling(seed=1.5), "seed must be an integer, got 1.5"),
        (lambda: models.Sampling(stop_tokens=["7"]), r"stop_tokens\[0\] = '7' is not an integer token id"),
        (lambda: models.Sampling(stop_tokens="7"), "stop_tokens is a string"),
        (lambda: models.Sampling(return_logits=1), "return_logits must be a bool, got 1"),
        (lambda: models.Serving(batch_size=0), r"batch_size must be in \[1, 2147483647\], got 0"),
        (lambda: models.Serving(chunk_size=2.0), "chunk_size must be an integer, got 2.0"),
        (lambda: models.Serving(host_pages=-1), r"host_pages must be in \[0, "),
        (lambda: models.Serving(decode_block=2000), r"decode_block must be in \[1, 1024\], got 2000"),
        (lambda: models.Serving(mixed_steps="yes"), "mixed_steps must be a bool"),
        (lambda: models.Serving(prefix_cache=1), "prefix_cache must be a bool"),
        (lambda: models.Serving(token_budget=40), "token_budget is the mixed steps' size: give it with mixed_steps=True"),
        (lambda: models.Serving(mixed_steps=True, token_budget=0), r"token_budget must be in \[1, "),
        (lambda: models.Serving(swap_policy=25e9), "swap_policy must be a models.SwapPolicy, got float"),
        (lambda: models.Serving(layout="big"), "layout must be an arena_jax.KVLayout, got str"),
        (lambda: models.Serving(layout=models.LlamaConfig.tiny().kv_layout(num_pages=4), kv_dtype="int8"),
         "give kv_dtype only when generate sizes the arena"),
        (lambda: models.Parallelism(mesh="devices"), "mesh must be a jax.sharding.Mesh or None, got str"),
        (lambda: models.Parallelism(tensor_axis=1), "tensor_axis must be a mesh axis name"),
        (lambda: models.Parallelism(data_axis=("data",)), "data_axis must be a mesh axis name"),
    ],
)
def test_a_bad_field_is_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "keywords, message",
    [
        (dict(sampling=models.Sampling(), temperature=0.5), "got sampling= and temperature="),
        (dict(sampling=models.Sampling(), seed=1, stop_tokens=()), "got sampling= and seed=, stop_tokens="),
        (dict(serving=models.Serving(), batch_size=2), "got serving= and batch_size="),
        (dict(serving=models.Serving(), prefix_cache=True), "got serving= and prefix_cache="),
        (dict(parallel=models.Parallelism(), mesh=None), "got parallel= and mesh="),
        (dict(temprature=0.5), "unexpected keyword argument 'temprature'"),
    ],
)
def test_an_object_and_its_own_keyword_are_refused(model, keywords, message):
    with pytest.raises(TypeError, match=message):
        models.generate(model, [[1, 2]], 2, **keywords)


def test_an_object_of_the_wrong_kind_is_refused(model):
    with pytest.raises(ValueError, match="sampling must be a models.Sampling, got dict"):
        models.generate(model, [[1, 2]], 2, sampling=dict(temperature=0.5))
    with pytest.raises(ValueError, match="serving must be a models.Serving, got Sampling"):
        models.generate(model, [[1, 2]], 2, serving=models.Sampling())
