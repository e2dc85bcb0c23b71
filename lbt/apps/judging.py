"""How every report judges a global batch: one definition each of the tolerance floor, "within the tolerance of
the base batch", the default target and the critical batch a sweep measures.

The study report (lbt/apps/report), the tune report (lbt/apps/tune/report.py) and the probe's outputs
(lbt/apps/probe) all state these numbers, and derive them here only, so a tolerance or a margin of 1 point means
the same in each. Metric (lbt/spec/objective.py) says which way is worse; these functions say how far.

A value is judged against the floor (`holds`: the study, which stores the floor in summary.json and draws it as
the band of its plot), or by its shortfall, the units it is worse than the reference (`within`: the probe, whose
rules in lbt/metrics/branches.py decide by shortfalls, and the tune). Both read "at most `tolerance` worse".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lbt.spec.objective import Metric


def tolerance_floor(reference: float, tolerance: float, metric: Metric) -> float:
    """The worst value still within `tolerance` (the metric's units) of `reference`: for accuracy the reference
    less that many points, for a loss the reference plus that many nats."""
    return metric.worse_by(reference, tolerance)


def holds(value: float, floor: float, metric: Metric) -> bool:
    """Whether `value` is at or beyond `floor` (tolerance_floor's); a NaN value (every seed lost) never is."""
    return metric.reached(value, floor)


def within(shortfall: float | None, tolerance: float) -> bool:
    """Whether a shortfall (how many units a value is worse than its reference: Metric.gap,
    lbt.metrics.branches.shortfall; negative when better) is at most `tolerance`. None, NaN or infinite (a lost
    run) never is."""
    return shortfall is not None and shortfall <= tolerance


def target_from(reference: float, metric: Metric) -> float | None:
    """The target when none is given: the base batch's value `reference` made worse by the metric's target
    margin (accuracy: 1 point lower); None when the reference was not measured (not finite)."""
    return metric.worse_by(reference, metric.target_margin) if math.isfinite(reference) else None


@dataclass(frozen=True)
class Bracket:
    """Where a sweep's critical batch lies: at or above `held`, below `failed`."""

    held: int | None  # the largest global batch tried that stayed within the tolerance (None: none did)
    failed: int | None  # the next batch tried past `held`, which did not (None: none larger was tried)


def critical_bracket(verdicts: Mapping[int, bool]) -> Bracket:
    """The critical batch a sweep measures, from each global batch tried and whether it held (`holds`, and the
    run did not diverge): the largest that held, bracketed by the next batch tried."""
    held = max((batch for batch, ok in verdicts.items() if ok), default=None)
    failed = None if held is None else min((batch for batch in verdicts if batch > held), default=None)
    return Bracket(held, failed)
