"""Host-side argument checks shared by `generate` and `Sampling`: integers are checked before
any cast to int32 (a bool, float or string is never an integer here; numpy integers are), and
numbers must be finite. Each failure is a ValueError naming the argument and the limit."""
from __future__ import annotations

import math
import numbers

import jax
import numpy as np

from arena_jax.hf.config import INT32_MAX

__all__ = ["INT32_MAX", "INT32_MIN", "is_int", "check_int", "check_number", "token_ids", "check_shape"]

INT32_MIN = -(2**31)


def is_int(value) -> bool:
    """A Python or numpy integer; not a bool (True is an int to Python, never a token or a size here)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def check_int(name: str, value, low: int = 0, high: int = INT32_MAX) -> int:
    if not is_int(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return int(value)


def check_number(name: str, value, *, low: float, high: float = math.inf, low_open: bool = False) -> float:
    """A finite real number in [low, high] ((low, high] when low_open)."""
    if not isinstance(value, numbers.Real) or isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isfinite(high):
        limit = f"in {'(' if low_open else '['}{low:g}, {high:g}]"
    else:
        limit = f"{'>' if low_open else '>='} {low:g}"
    if not (math.isfinite(value) and (value > low if low_open else value >= low) and value <= high):
        raise ValueError(f"{name} must be a finite number {limit}, got {value}")
    return value


def token_ids(name: str, ids, vocab_size: int | None) -> list[int]:
    """A sequence of token ids -> list[int], each an integer in [0, vocab_size) (vocab_size
    None: any integer; the range is checked once the vocabulary is known).

    Lists / tuples of Python or numpy integers, or a 1-D integer numpy / JAX array. A string,
    a float (3.7, or 3.0) or a bool is refused, not converted.
    """
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{name} is a string; pass token ids (e.g. tokenizer.encode(text).ids)")
    if isinstance(ids, (np.ndarray, jax.Array)):
        array = np.asarray(ids)
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a 1-D integer array, got {array.dtype}{list(array.shape)}")
        ids = array.tolist()
    try:
        ids = list(ids)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of token ids, got {ids!r}") from None
    for j, t in enumerate(ids):
        if not is_int(t):
            raise ValueError(f"{name}[{j}] = {t!r} is not an integer token id")
        if vocab_size is not None and not 0 <= t < vocab_size:
            raise ValueError(f"{name}[{j}] = {t} is outside [0, vocab_size={vocab_size})")
    return [int(t) for t in ids]


def check_shape(name: str, x, shape: tuple, expected: str) -> None:
    """An array argument of a step has `shape` (None: any size on that axis), checked when the
    step is traced (shapes are static): else a ValueError naming it and the `expected` axes."""
    got = tuple(np.shape(x))
    if len(got) != len(shape) or any(want is not None and n != want for n, want in zip(got, shape)):
        raise ValueError(f"{name} must be {expected}, got shape {list(got)}")
