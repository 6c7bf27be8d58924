"""generate's options as objects (`models.options`): `Sampling`, `Serving`, `Parallelism` are
frozen and hashable, check their fields when made (a ValueError naming the field), give the
same run as the keywords they gather (every old keyword is still accepted), and an object
together with one of its own keywords is a TypeError.

Every old keyword is checked without a run: `options_from_keywords` builds the object written
out by hand (the keyword in its own field), and `generate`, stopped where it hands its work to
the `Scheduler`, hands it the same things from the keyword and from the object, the keyword's
value among them where the scheduler reads it (and something else without the keyword). Two
real runs (greedy with a stop token and logits, sampled) give the same tokens from keywords and
objects; they and the prefix cache's continuation share one model, one layout and one chunk
size, so the steps compile once for the module.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from typing import Any, Callable

import jax
import numpy as np
import pytest
from flax import nnx

import arena_jax as aj
from arena_jax import models
from arena_jax.models.options import PARALLEL_KEYS, SAMPLING_KEYS, SERVING_KEYS, options_from_keywords

GENERATE = importlib.import_module("arena_jax.models.generate")  # the module (`models.generate` is the function)
OPTION_KEYS = SAMPLING_KEYS + SERVING_KEYS + PARALLEL_KEYS

NEW = 6


@pytest.fixture(scope="module")
def model():
    return models.init_random(models.LlamaConfig.tiny(), seed=0, std=0.2)


# 7 pages of 8 tokens for 4 rows of up to 32 (the model's config: LlamaConfig.tiny()).
LAYOUT = models.LlamaConfig.tiny().kv_layout(page_size=8, num_pages=7, max_seqs=4, max_seq_len=32, dtype="float32")


@pytest.fixture(scope="module")
def layout():
    return LAYOUT


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 128, n).tolist() for n in (3, 12, 7, 17, 1)]


def _mesh(*axes):
    return jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(axes)), axes)


MESH = _mesh("data", "tensor", "heads")  # one device, three axes of size 1
OBJECT_NAMES = {models.Sampling: "sampling", models.Serving: "serving", models.Parallelism: "parallel"}


def _as_objects(keywords: dict) -> dict:
    """The same options as generate's objects (keywords that are not options stay keywords)."""
    out = {k: v for k, v in keywords.items() if k not in OPTION_KEYS}
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


def _weight_axes(model) -> set:
    """The mesh axes the model's weights are split over (none on one device)."""
    axes = set()
    for leaf in jax.tree.leaves(nnx.state(model)):
        for entry in getattr(getattr(leaf, "sharding", None), "spec", None) or ():
            axes.update(entry if isinstance(entry, tuple) else () if entry is None else (entry,))
    return axes


def _rows(handed: dict) -> tuple:
    """The per-row sampling settings the scheduler makes of the Sampling it is handed."""
    rows = handed["sampling"].rows(handed["batch_size"])
    return float(rows.temperature[0]), int(rows.top_k[0]), float(rows.top_p[0])


def _sharding(handed: dict):
    sharding = handed["cache"].sharding
    return None if sharding is None else (sharding.mesh, sharding.tensor_axis, sharding.data_axis)


class _Handed(Exception):
    """Raised in place of the Scheduler: generate stops where its work would start."""


def _handed(monkeypatch, model, prompts, keywords: dict) -> tuple[dict, tuple]:
    """What `generate(model, prompts, NEW, **keywords)` hands the Scheduler (its arguments by
    name) and the options it built, without running anything."""
    built = []

    def options(*args):
        built.append(real(*args))
        return built[-1]

    def scheduler(*args, **kwargs):
        raise _Handed(inspect.signature(real_scheduler.__init__).bind(None, *args, **kwargs).arguments)

    real, real_scheduler = GENERATE.options_from_keywords, GENERATE.Scheduler
    monkeypatch.setattr(GENERATE, "options_from_keywords", options)
    monkeypatch.setattr(GENERATE, "Scheduler", scheduler)
    try:
        with pytest.raises(_Handed) as stopped:
            models.generate(model, prompts, NEW, **keywords)
    finally:
        monkeypatch.undo()
    handed = dict(stopped.value.args[0])
    del handed["self"]
    (options,) = built
    return handed, options


def _comparable(handed: dict) -> dict:
    """The scheduler's arguments as values (the model and cache by where and how they are placed)."""
    out = dict(handed)
    out["model"] = _weight_axes(handed["model"])
    cache = handed["cache"]
    out["cache"] = (cache.k.shape, str(cache.k.dtype), _sharding(handed))
    out["index"] = None if handed["index"] is None else (type(handed["index"]), handed["index"].num_pages)
    tier = handed["tier"]
    out["tier"] = None if tier is None else (tier.host.num_pages, tier.policy, tier.free)
    out["seed"] = int(handed["seed"])
    return out


@dataclasses.dataclass(frozen=True)
class Keyword:
    """One old keyword: its value, the same option written as its object, and where the
    scheduler reads it: `read(handed)` is `want` with the keyword and something else without.
    `company`: keywords it needs beside it (its object holds those that are its own fields)."""

    value: Any
    obj: Any
    read: Callable[[dict], Any]
    want: Any
    company: dict = dataclasses.field(default_factory=dict)


KV_DTYPE = "float16"  # not the model's float32 (an int8 arena would run a calibration pass when sized)
POLICY = models.SwapPolicy(bandwidth_bytes_per_s=1e12)
KEYWORDS = {
    "temperature": Keyword(0.75, models.Sampling(temperature=0.75), lambda h: _rows(h)[0], 0.75),  # exact in float32
    "top_k": Keyword(20, models.Sampling(top_k=20), lambda h: _rows(h)[1], 20),
    "top_p": Keyword(0.5, models.Sampling(top_p=0.5), lambda h: _rows(h)[2], 0.5),
    "seed": Keyword(3, models.Sampling(seed=3), lambda h: int(h["seed"]), 3),
    "stop_tokens": Keyword([5, 7, 11], models.Sampling(stop_tokens=(5, 7, 11)), lambda h: h["stop"], {5, 7, 11}),
    "return_logits": Keyword(True, models.Sampling(return_logits=True), lambda h: h["return_logits"], True),
    "batch_size": Keyword(2, models.Serving(batch_size=2), lambda h: h["batch_size"], 2),
    "chunk_size": Keyword(4, models.Serving(chunk_size=4), lambda h: h["chunk_size"], 4),
    "layout": Keyword(LAYOUT, models.Serving(layout=LAYOUT), lambda h: h["layout"], LAYOUT),
    "kv_dtype": Keyword(KV_DTYPE, models.Serving(kv_dtype=KV_DTYPE), lambda h: (str(h["layout"].dtype), str(h["cache"].k.dtype)),
                        (KV_DTYPE, KV_DTYPE)),  # fmt: skip
    "prefix_cache": Keyword(True, models.Serving(prefix_cache=True), lambda h: type(h["index"]), aj.PrefixCache),
    "host_pages": Keyword(4, models.Serving(host_pages=4), lambda h: h["tier"] and h["tier"].host.num_pages, 4),
    "swap_policy": Keyword(POLICY, models.Serving(host_pages=4, swap_policy=POLICY), lambda h: h["tier"].policy, POLICY,
                           dict(host_pages=4)),  # fmt: skip
    # (arrivals: a keyword that is no option stays one beside the objects) chunk 32, the arena's
    # longest: the default budget 4 + 32 holds one chunk beside the 4 decode rows
    "mixed_steps": Keyword(True, models.Serving(mixed_steps=True), lambda h: h["mixed_chunks"], 1,
                           dict(arrivals=[0.0] * 5)),  # fmt: skip
    # chunk 8: the default budget 4 + 8 holds one chunk, 20 two
    "token_budget": Keyword(20, models.Serving(chunk_size=8, mixed_steps=True, token_budget=20),
                            lambda h: h["mixed_chunks"], 2, dict(chunk_size=8, mixed_steps=True)),  # fmt: skip
    "decode_block": Keyword(2, models.Serving(decode_block=2), lambda h: h["decode_block"], 2),
    # the cache on the mesh, the weights split over its (default) tensor axis
    "mesh": Keyword(MESH, models.Parallelism(mesh=MESH), lambda h: (_sharding(h), _weight_axes(h["model"])),
                    ((MESH, "tensor", None), {"tensor"})),  # fmt: skip
    "tensor_axis": Keyword("heads", models.Parallelism(mesh=MESH, tensor_axis="heads"),
                           lambda h: (_sharding(h), _weight_axes(h["model"])), ((MESH, "heads", None), {"heads"}),
                           dict(mesh=MESH)),  # fmt: skip
    "data_axis": Keyword("data", models.Parallelism(mesh=MESH, data_axis="data"), _sharding, (MESH, "tensor", "data"),
                         dict(mesh=MESH)),  # fmt: skip
}


def test_every_old_keyword_has_a_case():
    assert sorted(KEYWORDS) == sorted(OPTION_KEYS)


def _forms(name: str) -> tuple[dict, dict, dict]:
    """The keyword's run as keywords, as objects, and without it (its company alone)."""
    case = KEYWORDS[name]
    keywords = {**case.company, name: case.value}
    objects = {k: v for k, v in case.company.items() if k not in OPTION_KEYS}
    objects[OBJECT_NAMES[type(case.obj)]] = case.obj
    return keywords, objects, dict(case.company)


@pytest.mark.parametrize("name", KEYWORDS)
def test_each_old_keyword_builds_its_object(name):
    case = KEYWORDS[name]
    keywords, objects, company = _forms(name)
    options = {k: v for k, v in keywords.items() if k in OPTION_KEYS}  # what generate gathers as **options
    want = tuple(case.obj if isinstance(case.obj, cls) else cls() for cls in OBJECT_NAMES)
    assert options_from_keywords(None, None, None, options) == (*want, None)
    without = options_from_keywords(None, None, None, {k: v for k, v in company.items() if k in OPTION_KEYS})
    assert without != (*want, None)  # the keyword itself made the difference
    # the object given is taken as it is
    given = [objects.get(n) for n in OBJECT_NAMES.values()]
    built = options_from_keywords(*given, {})
    assert built[list(OBJECT_NAMES).index(type(case.obj))] is case.obj and built[3] is None


@pytest.mark.parametrize("name", KEYWORDS)
def test_generate_hands_each_old_keyword_on(model, prompts, monkeypatch, name):
    case = KEYWORDS[name]
    keywords, objects, company = _forms(name)
    by_keywords, options = _handed(monkeypatch, model, prompts, keywords)
    by_objects, object_options = _handed(monkeypatch, model, prompts, objects)
    without, _ = _handed(monkeypatch, model, prompts, company)
    assert options == object_options and case.obj in options[:3]
    assert any(o is case.obj for o in object_options)
    assert by_keywords["sampling"] is options[0] and by_objects["sampling"] is object_options[0]
    assert _comparable(by_keywords) == _comparable(by_objects)
    assert case.read(by_keywords) == case.want
    assert case.read(without) != case.want


# Two real runs, each from keywords and from objects. Every run in this module (and the prefix
# cache's continuation below) has this arena, these rows and this chunk: one compile of the steps.
SERVED = dict(layout=LAYOUT, batch_size=4, chunk_size=8, prefix_cache=True)
RUNS = {
    "greedy, a stop token, logits": dict(return_logits=True),
    "sampled": dict(temperature=0.8, top_k=20, top_p=0.9, seed=3),
}


def _same_run(old, new):
    assert new.tokens == old.tokens
    for name in ("preemptions", "prefill_calls", "decode_calls", "mixed_calls", "prefix_hit_tokens", "swap_outs", "evictions"):
        assert getattr(new, name) == getattr(old, name), name
    assert (new.logits is None) == (old.logits is None)
    if old.logits is not None:
        for a, b in zip(old.logits, new.logits):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("keywords", RUNS.values(), ids=RUNS.keys())
def test_keywords_and_objects_generate_the_same(model, prompts, keywords):
    greedy = models.generate(model, prompts, NEW, **SERVED)
    keywords = dict(SERVED, **keywords)
    if not keywords.get("temperature"):  # a token the first prompt generates 3rd stops it there
        keywords["stop_tokens"] = [greedy.tokens[0][2]]
    old = models.generate(model, prompts, NEW, **keywords)
    new = models.generate(model, prompts, NEW, **_as_objects(keywords))
    _same_run(old, new)
    if keywords.get("temperature"):
        assert old.tokens != greedy.tokens and old.logits is None
    else:
        assert old.tokens[0] == greedy.tokens[0][: greedy.tokens[0].index(greedy.tokens[0][2]) + 1]
        assert [len(x) for x in old.logits] == [len(t) for t in old.tokens] and greedy.logits is None


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
