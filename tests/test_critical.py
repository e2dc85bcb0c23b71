"""Critical batch size (lbt/metrics/critical.py): the steps-to-target fit recovers known curves,
the bootstrap interval covers the truth, and the small readers agree with hand values."""

import math
import re
import warnings

import numpy as np
import pytest

from lbt.metrics.critical import bootstrap_fit, crossing_step, fit_steps_to_target, gns_summary
from lbt.spec.result import EvalPoint

S_MIN, B_NOISE = 50.0, 1000.0
BATCHES = [64 * 2**k for k in range(8)]  # 64 .. 8192: about 830 steps down to 56


def true_steps(batch: float) -> float:
    return S_MIN * (1 + B_NOISE / batch)  # McCandlish et al. 2018, eq. 2.11


def noisy_points(seeds: int = 3, noise: float = 0.04, rng_seed: int = 0) -> dict[int, list[float]]:
    rng = np.random.default_rng(rng_seed)
    return {b: list(true_steps(b) * np.exp(noise * rng.standard_normal(seeds))) for b in BATCHES}


def history(*points: tuple[float, float]) -> list[EvalPoint]:
    return [EvalPoint(step=s, samples_seen=64 * s, global_batch=64, acc=a, loss=math.nan) for s, a in points]


# --- crossing_step -----------------------------------------------------------

def test_crossing_is_interpolated_between_the_evaluations_around_the_target():
    h = history((10, 0.3), (20, 0.5), (30, 0.9), (40, 0.6))
    assert crossing_step(h, 0.7) == pytest.approx(20 + 10 * (0.7 - 0.5) / (0.9 - 0.5))  # 25
    assert crossing_step(h, 0.5) == pytest.approx(20)  # reached exactly at an evaluation


def test_a_target_reached_at_the_first_evaluation_starts_from_step_0():
    h = history((10, 0.8), (20, 0.9))
    assert crossing_step(h, 0.4) == pytest.approx(5)  # from (0, 0)
    assert crossing_step(h, 0.4, start_acc=0.1) == pytest.approx(10 * 0.3 / 0.7)  # from chance level


def test_crossing_skips_nan_evaluations_and_is_none_when_never_reached():
    assert crossing_step(history((10, 0.3), (20, math.nan), (30, 0.9)), 0.6) == pytest.approx(20)
    assert crossing_step(history((10, 0.3), (20, 0.5)), 0.6) is None
    assert crossing_step([], 0.6) is None


# --- fit_steps_to_target -----------------------------------------------------

def test_fit_recovers_a_noiseless_curve_exactly():
    fit = fit_steps_to_target(BATCHES, [true_steps(b) for b in BATCHES])
    assert fit.s_min == pytest.approx(S_MIN, rel=1e-9)
    assert fit.b_noise == pytest.approx(B_NOISE, rel=1e-9)
    assert fit.b_crit == fit.b_noise
    assert fit.e_min == pytest.approx(S_MIN * B_NOISE, rel=1e-9)  # B_crit = E_min / S_min
    assert fit.rel_rms == pytest.approx(0, abs=1e-12) and fit.points == len(BATCHES)
    assert fit.steps_at(B_NOISE) == pytest.approx(2 * S_MIN)  # at B_crit: twice the minimum steps


@pytest.mark.parametrize("rng_seed", range(5))
def test_fit_and_bootstrap_recover_a_noisy_curve(rng_seed):
    """Acceptance: 8 batches x 3 seeds with 4% multiplicative noise; within 10%, interval covers B_crit."""
    fit, (low, high) = bootstrap_fit(noisy_points(rng_seed=rng_seed), resamples=300, seed=rng_seed)
    assert fit.s_min == pytest.approx(S_MIN, rel=0.10)
    assert fit.b_noise == pytest.approx(B_NOISE, rel=0.10)
    assert fit.points == 24 and 0.01 < fit.rel_rms < 0.08
    assert low < B_NOISE < high
    assert low < fit.b_crit < high and high / low < 1.5  # informative, not a vacuous interval


def test_relative_weighting_keeps_the_large_batches_in_the_fit():
    """A 10% miss at the smallest batch must not drag the asymptote S_min: plain least squares would."""
    steps = [true_steps(b) for b in BATCHES]
    steps[0] *= 1.10
    fit = fit_steps_to_target(BATCHES, steps)
    assert fit.s_min == pytest.approx(S_MIN, rel=0.05)


def test_fit_refuses_too_few_batches():
    with pytest.raises(ValueError, match="need at least 3 distinct batches.*got 2"):
        fit_steps_to_target([64, 64, 128, 128], [800, 820, 420, 410])


def test_fit_refuses_steps_that_do_not_fall_with_the_batch():
    with pytest.raises(ValueError, match="no critical batch: steps do not fall as the batch grows"):
        fit_steps_to_target([64, 128, 256, 512], [100, 104, 108, 112])


def test_fit_refuses_perfect_scaling():
    with pytest.raises(ValueError, match="no critical batch: .*perfect scaling"):
        fit_steps_to_target([64, 128, 256, 512], [6400 / 64 * 1.02, 6400 / 128, 6400 / 256, 6400 / 512 * 0.98])


def test_a_missed_budget_the_curve_already_exceeds_changes_nothing():
    """A batch that missed the target in fewer steps than the curve needs there is consistent with it."""
    free = fit_steps_to_target(BATCHES[:5], [true_steps(b) for b in BATCHES[:5]])
    held = fit_steps_to_target(BATCHES[:5], [true_steps(b) for b in BATCHES[:5]],
                               missed=[(b, 0.9 * true_steps(b)) for b in BATCHES[5:]])
    assert held == free and held.binding == ()
    assert held.b_crit == pytest.approx(B_NOISE, rel=1e-9)


def test_the_fit_is_held_at_a_missed_budget_and_is_the_best_fit_that_respects_it():
    """The points alone fit B_crit 1,000, whose curve needs 74 steps at 2,048; a run of 120 steps there missed
    the target, so the curve must pass at or above 120 there: S_min rises, B_crit falls, and no other curve
    through (2,048, >= 120) fits the points better (checked along the constraint on a fine grid)."""
    batches, steps = BATCHES[:4], [true_steps(b) for b in BATCHES[:4]]
    fit = fit_steps_to_target(batches, steps, missed=[(2048, 120.0), (4096, 60.0)])
    assert fit.binding == (2048.0,) and fit.steps_at(2048) == pytest.approx(120)
    assert fit.steps_at(4096) >= 60 and fit.s_min > S_MIN and fit.b_crit < B_NOISE / 2
    assert fit.points == 4 and fit.rel_rms > 0.01  # the points no longer lie on the curve

    def cost(s_min: float, b_noise: float) -> float:
        return sum((s_min * (1 + b_noise / b) / s - 1) ** 2 for b, s in zip(batches, steps))

    grid = np.linspace(0, 119.9 * 2048, 20001)  # c = S_min B_noise, with S_min = 120 - c / 2048 on the bound
    best = min(cost(120 - c / 2048, c / (120 - c / 2048)) for c in grid)
    assert cost(fit.s_min, fit.b_noise) <= best + 1e-9
    assert cost(fit.s_min, fit.b_noise) > cost(S_MIN, B_NOISE) + 0.01  # the bound costs fit: it was held


def test_missed_budgets_neither_count_as_batches_nor_pass_malformed():
    with pytest.raises(ValueError, match="need at least 3 distinct batches.*got 2"):
        fit_steps_to_target([64, 128], [800, 420], missed=[(256, 300), (512, 200)])
    with pytest.raises(ValueError, match="positive finite"):
        fit_steps_to_target(BATCHES[:3], [true_steps(b) for b in BATCHES[:3]], missed=[(2048, 0)])


@pytest.mark.parametrize("batches, steps", [([64, 128, 256], [100, 50]), ([64, 128, 256], [100, 0, 20]),
                                            ([64, 128, 256], [100, math.nan, 20])])
def test_fit_refuses_malformed_points(batches, steps):
    with pytest.raises(ValueError):
        fit_steps_to_target(batches, steps)


# --- bootstrap_fit -----------------------------------------------------------

def test_bootstrap_counts_and_skips_failed_resamples():
    # At batch 128 one seed is slow: a resample drawing it twice (1 in 4) falls 400 -> 250 -> 100,
    # as fast as 1/B, which has no critical batch; the other draws fit.
    points = {64: [400.0], 128: [120.0, 250.0], 256: [100.0]}
    with pytest.warns(UserWarning, match=r"bootstrap_fit: \d+ of 200 resamples showed no critical batch") as caught:
        fit, (low, high) = bootstrap_fit(points, resamples=200)
    skipped = int(re.search(r"(\d+) of 200", str(caught[0].message)).group(1))
    assert 30 <= skipped <= 70  # binomial(200, 1/4): 50 +- 6
    assert fit.b_crit == pytest.approx(fit_steps_to_target([64, 128, 128, 256], [400, 120, 250, 100]).b_crit)
    assert low < high


def test_bootstrap_refuses_points_with_no_critical_batch():
    with pytest.raises(ValueError, match="no critical batch"):
        bootstrap_fit({64: [100.0, 101.0], 128: [104.0], 256: [108.0]}, resamples=20)


def test_bootstrap_is_repeatable_and_silent_when_every_resample_fits():
    points = noisy_points()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first = bootstrap_fit(points, resamples=100, seed=3)
    assert bootstrap_fit(points, resamples=100, seed=3) == first


def test_bootstrap_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="at least one steps-to-target"):
        bootstrap_fit({64: [800.0], 128: [], 256: [250.0]})


# --- gns_summary -------------------------------------------------------------

def test_gns_summary_is_the_median_of_the_late_finite_points():
    curve = [(0, 5.0), (200, 10.0), (400, 20.0), (600, 30.0), (800, 40.0), (850, math.nan),
             (900, 1000.0), (950, math.inf), (1000, 60.0)]
    # last 20% of 1000 samples: 800 onwards -> finite 40, 1000, 60 -> median 60 (the spike does not pull it)
    assert gns_summary(curve) == pytest.approx(60.0)
    assert gns_summary(curve, last_fraction=0.5) == pytest.approx(50.0)  # 30, 40, 1000, 60
    assert gns_summary(curve, last_fraction=1.0) == pytest.approx(30.0)  # every finite point: 5 10 20 30 40 60 1000


def test_gns_summary_is_none_without_late_finite_points():
    assert gns_summary([(0, 5.0), (900, math.nan), (1000, math.nan)]) is None
    assert gns_summary([]) is None
