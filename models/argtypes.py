"""argparse types for the CLIs: a bad value is an argparse error (usage + message, exit 2)
naming the limit, never a traceback later and never a silent clip or int32 wrap."""
from __future__ import annotations

import argparse
import math

from arena_jax.hf.config import INT32_MAX

__all__ = ["HelpWithDefaults", "INT32_MAX", "MAX_DECODE_BLOCK", "int_in", "positive_int", "seed", "float_in", "non_negative_float", "positive_float"]


MAX_DECODE_BLOCK = 1024  # decode steps per device call at most (`generate(decode_block=)`; results i32[block, 2, batch])


def int_in(low: int, high: int = INT32_MAX):
    """An integer in [low, high] (default high: int32's largest, as every count ends up an int32)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"expected an integer in [{low}, {high}], got {value}")
        return value

    parse.__name__ = f"integer in [{low}, {high}]"  # argparse shows it in "invalid <name> value"
    return parse


positive_int = int_in(1)
seed = int_in(0)  # numpy and JAX both take it; an int32 keeps the two equal


def _fmt(x: float) -> str:
    return f"{int(x):,}" if float(x).is_integer() else f"{x:g}"


def float_in(low: float, high: float = math.inf, *, low_open: bool = False):
    """A finite number in [low, high] ((low, high] with low_open); nan and inf are refused."""
    left = "(" if low_open else "["
    limit = f"in {left}{_fmt(low)}, {_fmt(high)}]" if math.isfinite(high) else f"{'>' if low_open else '>='} {_fmt(low)}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a finite number {limit}, got {text!r}") from None
        inside = (value > low if low_open else value >= low) and value <= high
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"expected a finite number {limit}, got {text}")
        return value

    parse.__name__ = f"number {limit}"
    return parse


non_negative_float = float_in(0.0)
positive_float = float_in(0.0, low_open=True)


class HelpWithDefaults(argparse.HelpFormatter):
    """Each option's help ends with its default, unless the help names it or there is none (None, a flag)."""

    def _get_help_string(self, action):
        text = action.help or ""
        none = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if action.option_strings and not none and "default" not in text:
            text += " (default: %(default)s)"
        return text
