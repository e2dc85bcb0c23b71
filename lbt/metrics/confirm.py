"""Confirming a predicted largest batch with full runs: which runs to train next, and when the answer is in.

A sweep's answer is the largest global batch on the power-of-two grid whose mean final value over its seeds
stays within the tolerance of the base batch's. Started at a prediction, the search trains only the runs that
decide that answer around it: the base batch's seeds, the predicted batch's, and the next doubling's first
seed (a batch's second seed only when its first does not fail clearly, by more than the seeds' own spread);
it steps down one doubling while the candidate fails and up while the next one holds. A diverged or failed run's
value is NaN and fails any tolerance. Pure functions of numbers: lbt/apps/probe/confirm.py trains the runs.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lbt.metrics.branches import shortfall
from lbt.spec.objective import Metric

SEEDS = 2  # a batch's verdict is the mean over this many seeds, as in the sweep a probe replaces


@dataclass(frozen=True)
class ConfirmStep:
    runs: tuple[tuple[int, int], ...]  # (factor, seed index) to train next; empty when the answer is in
    answer: int | None = None  # the factor the runs measure, when done
    top: bool = False  # the answer is the largest factor of the grid and it held: possibly more


def mean_value(values: Mapping[tuple[int, int], float], factor: int, metric: Metric) -> float:
    """The mean over a factor's seeds, a non-finite run counted at the metric's worst."""
    return statistics.fmean(v if math.isfinite(v) else metric.worst for (k, _), v in values.items() if k == factor)


def confirm_step(predicted: int, factors: Sequence[int], values: Mapping[tuple[int, int], float], tolerance: float,
                 metric: Metric) -> ConfirmStep:
    """The next runs to train, or the answer, from the finished runs' final values by (factor, seed index)."""
    grid = sorted(factors)

    def missing(factor: int, seeds: int = SEEDS) -> tuple[tuple[int, int], ...]:
        return tuple((factor, s) for s in range(seeds) if (factor, s) not in values)

    if missing(1):
        return ConfirmStep(missing(1))
    reference = mean_value(values, 1, metric)

    def holds(factor: int) -> bool:
        return shortfall(mean_value(values, factor, metric), reference, metric) <= tolerance

    pairs = [k for k in grid if not missing(k)]
    spread = max((abs(metric.score(values[(k, 0)]) - metric.score(values[(k, 1)])) / metric.unit_size
                  for k in pairs if all(math.isfinite(values[(k, s)]) for s in range(SEEDS))), default=0.0)
    def verdict(factor: int) -> bool | tuple[tuple[int, int], ...]:
        """Whether the factor holds, or the run it needs first: a first seed that fails clearly decides."""
        if (factor, 0) not in values:
            return ((factor, 0),)
        first = values[(factor, 0)]
        if not math.isfinite(first) or shortfall(first, reference, metric) > tolerance + spread:
            return False  # the second seed cannot bring the mean back within the tolerance
        return missing(factor) or holds(factor)

    candidate = max((k for k in grid if k <= predicted), default=grid[0])
    while True:
        if candidate > 1:
            found = verdict(candidate)
            if isinstance(found, tuple):
                return ConfirmStep(found)
            if not found:
                candidate //= 2
                continue
        after = candidate * 2
        if after not in grid:
            return ConfirmStep((), candidate, top=True)
        found = verdict(after)
        if isinstance(found, tuple):
            return ConfirmStep(found)
        if not found:
            return ConfirmStep((), candidate)
        candidate = after
