"""`model_jit`: a `jax.jit` whose first argument, a model's graphdef, is static and is not hashed
on every call.

A jit with a static `graphdef` (`nnx.split(model)[0]`) hashes it on every call to find the
compiled program, and the hash walks the whole graph: 35 us for the built-in tiny model, about
23 us a layer for a list of layers (0.74 ms at 32), against a tiny decode step's ~0.1 ms
(benchmarks/RESULTS.md, "The module-level steps' graphdef hash"). `model_jit(fn)` keeps that
jit for everything but calls (`lower`, `trace`, `eval_shape`, `__wrapped__`, ...) and calls a
jit of `fn` with the graphdef bound instead, found by the graphdef object's identity: a caller
that keeps `graphdef, state = nnx.split(model)` pays a dict lookup. A new but equal graphdef
object (`nnx.split` again) is hashed once and finds the same bound jit, so it compiles
nothing new. Results, traces and donation are those of the plain jit.
"""
from __future__ import annotations

import collections
import functools
import threading

import jax

__all__ = ["ModelJit", "model_jit"]

# Graphdefs remembered per function (by identity and by value), the least recently used dropped:
# as `steps.bound_steps`, a handful of models per process.
MAX_GRAPHDEFS = 8


class ModelJit:
    """`fn(graphdef, *args, **kwargs)` jitted with `graphdef` static (`model_jit`)."""

    def __init__(self, fn, static_argnames=(), donate_argnames=()):
        self._fn, self._static, self._donate = fn, tuple(static_argnames), tuple(donate_argnames)
        self._jit = jax.jit(fn, static_argnames=("graphdef", *self._static), donate_argnames=self._donate)
        self._by_id: collections.OrderedDict = collections.OrderedDict()  # id(graphdef) -> (graphdef, bound jit)
        self._by_value: collections.OrderedDict = collections.OrderedDict()  # graphdef -> bound jit
        self._lock = threading.Lock()  # callers on several threads share the two tables
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if args:
            graphdef, args = args[0], args[1:]
        elif "graphdef" in kwargs:
            graphdef = kwargs.pop("graphdef")
        else:
            raise TypeError(f"{self.__name__}() missing its first argument, graphdef (nnx.split(model)[0])")
        return self._bound(graphdef)(*args, **kwargs)

    def _bound(self, graphdef):
        with self._lock:
            entry = self._by_id.get(id(graphdef))
            if entry is not None and entry[0] is graphdef:
                self._by_id.move_to_end(id(graphdef))
                return entry[1]
            try:
                bound = self._by_value.get(graphdef)  # hashed here, once per graphdef object
            except TypeError:
                raise ValueError(f"{self.__name__}: graphdef must be hashable (nnx.split(model)[0]), got a "
                                 f"{type(graphdef).__name__}") from None  # fmt: skip
            if bound is None:
                bound = jax.jit(functools.partial(self._fn, graphdef), static_argnames=self._static,
                                donate_argnames=self._donate)  # fmt: skip
                _remember(self._by_value, graphdef, bound)
            _remember(self._by_id, id(graphdef), (graphdef, bound))  # holds the graphdef: its id stays its own
            return bound

    def __getattr__(self, name):  # lower, trace, eval_shape, _cache_size, ...: the static-graphdef jit's
        if name == "_jit":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self._jit, name)


def _remember(table: collections.OrderedDict, key, value) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > MAX_GRAPHDEFS:
        table.popitem(last=False)


def model_jit(fn=None, *, static_argnames=(), donate_argnames=()):
    """Decorator: `fn(graphdef, ...)` jitted with its graphdef static, called without hashing it
    (see the module's docstring). `static_argnames` / `donate_argnames`: as `jax.jit`'s, for the
    other arguments."""
    if fn is None:
        return functools.partial(model_jit, static_argnames=static_argnames, donate_argnames=donate_argnames)
    return ModelJit(fn, static_argnames, donate_argnames)
