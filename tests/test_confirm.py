"""The confirm step's search (lbt/metrics/confirm.py) on synthetic grids whose sweep answer is known."""

from __future__ import annotations

import math

import pytest

from lbt.metrics.confirm import confirm_step
from lbt.spec.objective import ACC, LOSS

GRID = (1, 2, 4, 8, 16, 32, 64, 128)


def knee_at(knee: int, drop: float = 0.05, noise: float = 0.001):
    """Val accuracy by (factor, seed index): flat up to the knee, then `drop` per doubling past it."""
    def value(factor: int, seed: int) -> float:
        past = max(0.0, math.log2(factor / knee))
        return 0.95 - drop * past + noise * seed
    return value


def search(predicted: int, truth, metric=ACC, tolerance: float = 1.0, done=None):
    """Run the search to its answer; every run it asks for is trained once (a second ask fails the test)."""
    values = dict(done or {})
    trained = []
    while True:
        step = confirm_step(predicted, GRID, values, tolerance, metric)
        if step.answer is not None:
            return step, trained
        assert step.runs
        for run in step.runs:
            assert run not in values, f"{run} trained twice"
            values[run] = truth(*run)
            trained.append(run)


@pytest.mark.parametrize("knee", [1, 4, 16, 128])
@pytest.mark.parametrize("predicted", GRID)
def test_it_finds_the_sweeps_answer_from_any_prediction_never_training_a_run_twice(knee, predicted):
    step, trained = search(predicted, knee_at(knee))
    assert step.answer == knee and step.top == (knee == 128)
    off = round(math.log2(predicted / knee))
    # The base batch's two seeds; stepping down, one seed at each failing batch, two at the answer; stepping
    # up, two at each batch that holds; then one past the answer.
    most = 2 + off + 2 if off > 0 else 2 + 2 * (1 - off) + 1
    assert len(trained) <= most - (2 if predicted == 1 and knee == 1 else 0) - (1 if knee == 128 else 0)


def test_a_right_prediction_takes_the_base_runs_second_seed_two_at_the_batch_and_one_past_it():
    step, trained = search(16, knee_at(16), done={(1, 0): knee_at(16)(1, 0)})  # the probe's base run
    assert step.answer == 16 and trained == [(1, 1), (16, 0), (16, 1), (32, 0)]


def test_the_next_doubling_takes_its_second_seed_when_the_first_is_within_the_seeds_spread():
    """32 loses 1.2 points on its first seed: past the tolerance, but within it plus the base seeds' 0.5-point
    spread, so the second seed decides (and here brings the mean within tolerance: 32 holds)."""
    table = {(1, 0): 0.950, (1, 1): 0.955, (16, 0): 0.950, (16, 1): 0.950, (32, 0): 0.9405, (32, 1): 0.950,
             (64, 0): 0.80, (64, 1): 0.80}
    step, trained = search(16, lambda k, s: table[(k, s)])
    assert step.answer == 32 and (32, 1) in trained and (64, 1) not in trained


def test_a_diverged_run_fails_and_a_loss_criterion_reads_lower_as_better():
    diverged = {(k, s): (0.95 if k <= 8 else math.nan) for k in GRID for s in (0, 1)}
    step, trained = search(32, lambda k, s: diverged[(k, s)])
    assert step.answer == 8 and (32, 1) not in trained and (16, 1) not in trained  # one NaN seed decides
    loss = {(k, s): 2.0 + (0.0 if k <= 4 else 0.2 * math.log2(k / 4)) for k in GRID for s in (0, 1)}
    step, _ = search(4, lambda k, s: loss[(k, s)], metric=LOSS, tolerance=0.05)
    assert step.answer == 4
