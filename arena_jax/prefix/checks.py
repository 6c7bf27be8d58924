"""Argument checks of `arena_jax.PrefixCache` (a ValueError naming the argument, before any change)."""
from __future__ import annotations

import numpy as np

from arena_jax.kv_cache import PAD_PAGE

__all__ = ["check_tag", "count", "token_ids", "page_ids", "common_prefix"]


def check_tag(tag) -> None:
    try:
        hash(tag)
    except TypeError:
        raise ValueError(f"tag must be hashable (a str, or a tuple of them), got {type(tag).__name__}") from None


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def count(value, name: str, high: int | None = None, why: str = "") -> int:
    """A non-negative integer, at most `high` (when given; `why`: the limit's reason)."""
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be at most {high}{f' ({why})' if why else ''}, got {int(value)}")
    return int(value)


def token_ids(ids, name: str) -> list[int]:
    """Token ids as a list of Python ints: integers (not bools, floats or strings) in [0, 2**31)."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of integer token ids, got a {type(ids).__name__}")
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"{name} must be a 1-D integer array of token ids, got {ids.dtype} {ids.shape}")
        ids = ids.tolist()
    try:
        ids = list(ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of integer token ids, got {type(ids).__name__}") from None
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise ValueError(f"{name}[{i}] is {t!r} ({type(t).__name__}): token ids are integers")
        if not 0 <= t < 2**31:
            raise ValueError(f"{name}[{i}]={int(t)} is outside the token ids' range [0, 2**31)")
    return [int(t) for t in ids]


def page_ids(pages: list, name: str, num_pages: int) -> list[int]:
    for i, p in enumerate(pages):
        if not _is_int(p):
            raise ValueError(f"{name}[{i}] is {p!r} ({type(p).__name__}): page ids are integers")
        if p == PAD_PAGE:
            raise ValueError(f"{name}[{i}] is PAD_PAGE ({PAD_PAGE}): every page a token lies in must be a real page")
        if not 0 <= p < num_pages:
            raise ValueError(f"{name}[{i}]={int(p)} is outside [0, num_pages={num_pages})")
    pages = [int(p) for p in pages]
    if len(set(pages)) != len(pages):
        raise ValueError(f"{name} names a page twice ({pages}): a sequence's pages are distinct")
    return pages


def common_prefix(a: tuple, b: tuple) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
