"""lbt/apps/judging.py: the tolerance floor, "within the tolerance", the default target and the critical batch
that the study report, the tune report and the probe all state."""

import math

import pytest

from lbt.apps.judging import Bracket, critical_bracket, holds, target_from, tolerance_floor, within
from lbt.metrics.branches import shortfall
from lbt.spec.objective import ACC, LOSS


def test_the_floor_is_the_reference_made_worse_by_the_tolerance():
    assert tolerance_floor(0.90, 1.0, ACC) == pytest.approx(0.89)  # 1 point of accuracy lower
    assert tolerance_floor(0.90, 2.5, ACC) == pytest.approx(0.875)
    assert tolerance_floor(2.0, 0.05, LOSS) == pytest.approx(2.05)  # 0.05 nats of loss higher
    assert tolerance_floor(0.90, 0.0, ACC) == 0.90


def test_a_value_holds_at_or_beyond_the_floor_and_a_lost_run_never_does():
    floor = tolerance_floor(0.90, 1.0, ACC)
    assert holds(0.95, floor, ACC) and holds(floor, floor, ACC) and not holds(0.88, floor, ACC)
    assert not holds(math.nan, floor, ACC)  # every seed diverged: no final value
    ceiling = tolerance_floor(2.0, 0.05, LOSS)
    assert holds(1.9, ceiling, LOSS) and holds(ceiling, ceiling, LOSS) and not holds(2.1, ceiling, LOSS)
    assert not holds(math.inf, ceiling, LOSS) and not holds(math.nan, ceiling, LOSS)


def test_a_shortfall_is_within_the_tolerance_up_to_it_and_a_lost_one_never_is():
    assert within(-0.3, 1.0) and within(0.5, 1.0) and within(1.0, 1.0)  # better, a little worse, exactly at it
    assert not within(1.01, 1.0)
    assert not within(None, 1.0) and not within(math.nan, 1.0) and not within(math.inf, 1.0)


def test_the_floor_and_the_shortfall_agree_away_from_the_boundary():
    """The study judges by the floor, the probe and the tune by the shortfall: the same verdict either way."""
    for metric, reference, tolerance, values in [(ACC, 0.9, 1.0, [0.95, 0.8905, 0.8895, 0.5]),
                                                 (LOSS, 2.0, 0.05, [1.5, 2.049, 2.051, 3.0])]:
        floor = tolerance_floor(reference, tolerance, metric)
        for value in [*values, math.nan]:
            assert holds(value, floor, metric) == within(shortfall(value, reference, metric), tolerance), value


def test_the_default_target_is_the_reference_less_the_metric_margin():
    assert target_from(0.90, ACC) == pytest.approx(0.89)
    assert target_from(2.0, LOSS) == pytest.approx(2.05)
    assert target_from(math.nan, ACC) is None  # no base batch measured: no target


def test_the_critical_bracket_is_the_largest_batch_that_held_and_the_next_one_tried():
    assert critical_bracket({64: True, 128: True, 256: False, 512: False}) == Bracket(held=128, failed=256)
    assert critical_bracket({256: False, 64: True, 128: True}) == Bracket(128, 256)  # in any order
    assert critical_bracket({64: True, 128: True}) == Bracket(128, None)  # nothing larger tried
    assert critical_bracket({64: False, 128: False}) == Bracket(None, None)
    assert critical_bracket({}) == Bracket(None, None)
    # A larger batch that held past one that did not (seed noise): the sweep's figure is the largest that held.
    assert critical_bracket({64: True, 128: False, 256: True, 512: False}) == Bracket(256, 512)
