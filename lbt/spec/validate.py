"""Config value checks, written once: each raises a ConfigError naming the key and what it expects.

Every value is checked where it is used (a constructor, a builder), by one of
these, so the wording of a bad-value error is the same everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeVar

from lbt.errors import ConfigError

T = TypeVar("T")


def integer(key: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """An int (not a bool) in [minimum, maximum]; the default is a positive integer."""
    in_range = minimum <= value and (maximum is None or value <= maximum) if isinstance(value, int) else False
    if isinstance(value, bool) or not in_range:
        if maximum is not None:
            wanted = f"an integer from {minimum:,} to {maximum:,}"
        else:
            wanted = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
        raise ConfigError(f"{key} must be {wanted}, got {value!r}")
    return value


def number(key: str, value, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False) -> float:
    """A finite int or float (not a bool) in the interval from low to high (open ends where asked)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        raise ConfigError(f"{key} must be {_interval(low, high, low_open, high_open)}, got {value!r}")
    return float(value)


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        if low is None:
            return "a finite number"
        if low == 0:
            return "a positive number" if low_open else "a non-negative number"
        return f"a number {'>' if low_open else '>='} {low:g}"
    left = "(-inf" if low is None else f"{'(' if low_open else '['}{low:g}"
    return f"a number in {left}, {high:g}{')' if high_open else ']'}"


def one_of(key: str, value, choices: Sequence[T]) -> T:
    """One of `choices` (compared with ==; None allowed when listed), typed as they are (a Literal's values
    give the Literal)."""
    if value not in choices:
        shown = ", ".join("null" if c is None else str(c) for c in choices)
        raise ConfigError(f"{key} must be one of {shown}, got {value!r}")
    return choices[list(choices).index(value)]
