"""The probe's decision rules (lbt/metrics/branches.py) on synthetic branches with a known answer."""

from __future__ import annotations

import math

import pytest

from lbt.metrics import branches as rules
from lbt.spec.objective import ACC, LOSS

B0 = 64


def test_local_critical_recovers_the_known_batch():
    # Shortfalls in points against k=1: 4x holds (0.9 <= 1), 8x does not (2.5 > 1, past the 0.3 floor).
    verdict = rules.local_critical({1: 0.0, 2: 0.2, 4: 0.9, 8: 2.5, 16: 9.0}, B0, tolerance=1.0, floor=0.3)
    assert (verdict.held, verdict.failed, verdict.resolved, verdict.batch) == (4 * B0, 8 * B0, True, 4 * B0)


def test_a_larger_batch_that_holds_after_one_that_failed_does_not_count():
    verdict = rules.local_critical({1: 0.0, 2: 1.5, 4: 0.1}, B0, tolerance=1.0, floor=0.0)
    assert verdict.batch == B0


def test_a_difference_within_the_noise_floor_is_not_resolved():
    verdict = rules.local_critical({1: 0.0, 2: 0.5, 4: 1.4}, B0, tolerance=1.0, floor=2.0)
    assert (verdict.held, verdict.failed, verdict.resolved, verdict.batch) == (2 * B0, 4 * B0, False, None)


def test_nothing_failed_is_a_lower_bound_not_an_answer():
    verdict = rules.local_critical({1: 0.0, 2: -0.5, 4: 0.3}, B0, tolerance=1.0, floor=0.1)
    assert (verdict.held, verdict.failed, verdict.batch) == (4 * B0, None, None)


def test_noise_floor_is_never_zero_while_the_seeds_differ_and_four_shrug_off_a_spike():
    assert rules.noise_floor([0.90, 0.88], ACC) == pytest.approx(2.0)  # points
    assert rules.noise_floor([2.10, 2.13], LOSS) == pytest.approx(0.03)  # nats
    # Two of three coincide: the median absolute deviation would say 0; the floor is their range.
    assert rules.noise_floor([0.7715, 0.7715, 0.7607], ACC) == pytest.approx(1.08)
    assert rules.noise_floor([2.10, 2.11, 9.0], LOSS) == pytest.approx(6.9)  # three cannot tell a spike
    assert rules.noise_floor([2.10, 2.11, 2.12, 9.0], LOSS) == pytest.approx(0.02)  # four can: Q_n
    assert rules.noise_floor([2.10, 2.11, 2.12, 2.12, 2.15, 9.0], LOSS) == pytest.approx(0.02)
    assert rules.noise_floor([2.1, math.nan], LOSS) == math.inf


def test_shortfall_counts_a_diverged_branch_as_failing_and_respects_direction():
    assert rules.shortfall(0.95, 0.97, ACC) == pytest.approx(2.0)
    assert rules.shortfall(2.0, 2.1, LOSS) == pytest.approx(-0.1)
    assert rules.shortfall(math.nan, 2.1, LOSS) == math.inf


def synthetic_branches(noise_scale: float, delta: float = 10_000.0, factors=(1, 2, 4, 8, 16, 32, 64, 128)):
    """Loss curves where batch B needs exactly model_ratio(B) times the samples of B0 (McCandlish):
    the k=1 curve L(s) = 2 exp(-s / 5000); branch k ends where k=1 was after delta / ratio(k)."""
    def loss(s: float) -> float:
        return 2.0 * math.exp(-s / 5000.0)

    curve = [(s, loss(s)) for s in [delta * i / 16 for i in range(17)]]
    ends = {k: loss(delta / rules.model_ratio(k * B0, B0, noise_scale)) for k in factors}
    return curve, ends


def test_samples_ratio_and_the_fitted_noise_scale_recover_the_model():
    curve, ends = synthetic_branches(noise_scale=1000.0)
    ratios = {k: rules.samples_ratio(curve, loss, 10_000.0, k) for k, loss in ends.items()}
    for k, ratio in ratios.items():
        assert ratio == pytest.approx(rules.model_ratio(k * B0, B0, 1000.0), rel=0.02)
    assert rules.fit_noise_scale(ratios, B0) == pytest.approx(1000.0, rel=0.03)


def test_loss_rule_recovers_the_known_critical_batch_exactly():
    # Within 0.05 nats of k=1 after delta samples: find the batch by the model, then by the rule.
    curve, ends = synthetic_branches(noise_scale=1000.0)
    gaps = {k: rules.shortfall(loss, ends[1], LOSS) / 1.0 for k, loss in ends.items()}
    known = max(k for k in ends if all(gaps[j] <= 0.05 for j in ends if j <= k))
    verdict = rules.local_critical(gaps, B0, tolerance=0.05, floor=0.0)
    assert verdict.batch == known * B0 and verdict.failed == 2 * known * B0


def test_samples_ratio_of_a_branch_without_progress_is_its_factor():
    curve = [(0.0, 2.0), (100.0, 1.0)]
    assert rules.samples_ratio(curve, 2.5, 100.0, 8) == 8.0  # worse than its start
    assert rules.samples_ratio(curve, math.inf, 100.0, 8) == 8.0  # diverged
    assert rules.samples_ratio(curve, 0.9, 100.0, 8) == 1.0  # better than k=1: no more samples needed


def test_predicted_need_and_largest_batch():
    checkpoints, noise = [100.0, 1000.0], [200.0, 2000.0]
    # Up to 1,000 samples at B_noise 200, the rest of the reach (4,000) at 2,000.
    need = rules.predicted_need(checkpoints, noise, 5000.0, 4 * B0, B0)
    expected = 1000 * rules.model_ratio(256, B0, 200.0) + 4000 * rules.model_ratio(256, B0, 2000.0)
    assert need == pytest.approx(expected)
    assert rules.predicted_need(checkpoints, noise, 5000.0, B0, B0) == pytest.approx(5000.0)
    budget = 6000.0
    largest = rules.largest_batch(checkpoints, noise, 5000.0, budget, B0, [1, 2, 4, 8, 16])
    fits = [k for k in (1, 2, 4, 8, 16) if rules.predicted_need(checkpoints, noise, 5000.0, k * B0, B0) <= budget]
    assert largest == max(fits) * B0 and largest < 16 * B0


def test_batch_schedule_doubles_when_the_critical_batch_reaches_twice_the_batch():
    schedule = rules.batch_schedule([100, 200, 400, 800], [64, 200, 130, 1024], B0)
    assert schedule == [(0, 64), (200, 128), (800, 1024)]
    # An early reading that later ones do not confirm does not raise the batch (cnn1d: 64, 2,048, 128, ...).
    assert rules.batch_schedule([1, 2, 3, 4, 5], [64, 2048, 128, 256, 2048], B0) == [(0, 64), (2, 128), (4, 256),
                                                                                    (5, 2048)]


def test_reference_is_the_median_of_the_k1_branches():
    assert rules.reference_value([0.818, 0.833, 0.835]) == pytest.approx(0.833)
    assert math.isnan(rules.reference_value([math.nan]))


# --- from branches to the answer for the budget ----------------------------------------------------------

def mccandlish(k: int, noise_scale: float) -> float:
    return rules.model_ratio(k * B0, B0, noise_scale)


FACTORS = (1, 2, 4, 8, 16, 32, 64, 128)


def test_a_saturated_metric_forgives_a_lag_that_a_still_falling_loss_does_not():
    """Accuracy flat from 1,000 samples on forgives a lag of 32x the samples; a loss still falling 0.1 nats
    per doubling of the budget forgives less than 1.41x."""
    budget = 50_000
    ratios = {k: mccandlish(k, 64.0) for k in FACTORS}  # r(k) = (1 + k) / 2: 32.5 at 64, 64.5 at 128
    flat = [(500, 0.50), (1000, 0.95), (10_000, 0.95), (budget, 0.95)]
    shortfalls = rules.budget_shortfalls(ratios, flat, budget, ACC)
    # E / r(k) stays at or above 1,000 samples up to k = 64 (1,538); at 128 (775) accuracy has not risen yet.
    assert all(shortfalls[k] == pytest.approx(0.0, abs=1e-9) for k in FACTORS if k <= 64)
    assert shortfalls[128] > 1.0 and rules.largest_within(shortfalls, 1.0) == 64
    ratios = {k: mccandlish(k, 640.0) for k in FACTORS}  # r(4) = 1.27, r(8) = 1.64
    falling = [(s, 3.0 - 0.1 * math.log2(s / 1000)) for s in (1000, 10_000, budget)]
    shortfalls = rules.budget_shortfalls(ratios, falling, budget, LOSS)
    for k in FACTORS:  # the slope times the lag: 0.1 nats per doubling of r
        assert shortfalls[k] == pytest.approx(0.1 * math.log2(ratios[k]))
    assert rules.largest_within(shortfalls, 0.05) == 4  # within 0.05 nats while r <= sqrt(2)


def test_a_diverged_factor_ends_the_answer_below_it_whatever_the_curve_says():
    shortfalls = {k: 0.0 for k in FACTORS}
    assert rules.largest_within(shortfalls, 1.0) == 128
    assert rules.largest_within(shortfalls, 1.0, frozenset({16})) == 8
    assert rules.largest_within({1: 0.0, 2: math.nan, 4: 0.0}, 1.0) == 1  # unknown is not within


def test_checkpoints_combine_by_the_share_of_training_each_stands_for():
    weights = rules.phase_weights([20_000, 50_000], 100_000)
    assert weights == pytest.approx([0.5, 0.5])  # the first from the start to the second, the last to the end
    combined = rules.combined_ratios([{2: 1.2, 4: 2.0}, {2: 1.0, 4: 1.2, 8: 2.0}], weights)
    assert combined == pytest.approx({2: 1.1, 4: 1.6})  # only factors every checkpoint measured


def test_the_budget_curve_interpolates_in_log_samples_and_extrapolates_below():
    points = [(1000, 0.90), (4000, 0.96), (16_000, 0.98)]
    assert rules.budget_value(points, 2000) == pytest.approx(0.93)
    assert rules.budget_value(points, 16_000) == pytest.approx(0.98)
    assert rules.budget_value(points, 500) == pytest.approx(0.87)  # the first segment's slope continued
    assert math.isnan(rules.budget_value([], 10))
