"""The spread of a value over seeds: what every table of repeated runs shows."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def mean_std(values: Sequence[float | None]) -> tuple[float, float]:
    """Mean and sample standard deviation of the finite values (NaN, NaN if none; std 0 for one value)."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return math.nan, math.nan
    return statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0
