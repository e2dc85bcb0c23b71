"""The critical batch size, measured two ways for the study report (numpy only).

1. From steps to a target accuracy or loss (Shallue et al. 2019, "Measuring the Effects of
   Data Parallelism on Neural Network Training"): `crossing_step` reads one run's
   steps-to-target, `fit_steps_to_target` fits McCandlish et al.'s trade-off curve
   through those steps across batches, `bootstrap_fit` puts an interval on it.
2. From the gradient noise scale B_simple logged during training: `gns_summary`; it is the critical
   batch of plain SGD's step only (`b_simple_undefined` says why not for another optimizer).

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training"
(eq. 2.11, sec. 2.3): at batch B, the steps S and samples E = B S needed to reach a
given loss trade off as

    S = S_min (1 + B_noise / B),   E = E_min (1 + B / B_noise),
    so (S / S_min - 1)(E / E_min - 1) = 1, and B_crit = E_min / S_min = B_noise.

Below B_crit doubling the batch nearly halves the steps; above it, it barely helps.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lbt.spec.objective import ACC, Metric
from lbt.spec.result import EvalPoint


def crossing_step(history: Sequence[EvalPoint], target: float, *, start_acc: float | None = None,
                  metric: Metric = ACC) -> float | None:
    """The fractional step at which the held-out `metric` first reaches `target`; None if it never does.

    `history` holds a run's evaluations (EvalPoint: step, samples_seen, global_batch, acc, loss) in
    ascending step. Reaching is the metric's (acc >= target, loss <= target). The crossing is
    interpolated linearly between the last evaluation short of `target` and the first one that
    reaches it, which removes the evaluation interval's staircase from steps-to-target (Shallue
    et al. 2019 count steps to a target). If the first evaluation already reaches `target`, the
    run is taken to start at (step 0, `start_acc`): pass chance level (1 / classes) where it is
    known; the default, the metric's start (accuracy 0), gives the later, more conservative
    crossing. A loss has no known start: the first evaluation counts at its own step.
    Non-finite values are skipped.
    """
    start = metric.start if start_acc is None else start_acc
    prev_step, prev = 0.0, None if start is None else metric.score(start)
    goal = metric.score(target)
    if prev is not None and prev >= goal:
        return 0.0
    for point in history:
        step, value = float(point.step), float(getattr(point, metric.name))
        if not math.isfinite(value):
            continue
        score = metric.score(value)
        if score >= goal:
            return step if prev is None else prev_step + (step - prev_step) * (goal - prev) / (score - prev)
        prev_step, prev = step, score
    return None


@dataclass(frozen=True)
class CriticalFit:
    """S = s_min (1 + b_noise / B) fitted to steps-to-target; every size in samples or steps."""

    s_min: float  # steps to target with an infinite batch
    b_noise: float  # the noise scale of the fit, in samples; equals b_crit
    rel_rms: float  # root-mean-square relative residual of the fitted steps (0.05: 5%)
    points: int  # (batch, steps) points fitted
    binding: tuple[float, ...] = ()  # batches that missed the target whose budget the fit is held at

    @property
    def e_min(self) -> float:
        """Samples to target with a tiny batch: E_min = S_min B_noise."""
        return self.s_min * self.b_noise

    @property
    def b_crit(self) -> float:
        """The critical batch, E_min / S_min = B_noise (McCandlish et al. 2018, sec. 2.3)."""
        return self.b_noise

    def steps_at(self, batch: float) -> float:
        """The fitted steps to target at `batch`, for drawing the curve."""
        return self.s_min * (1 + self.b_noise / batch)


def fit_steps_to_target(batches: Sequence[float] | np.ndarray, steps: Sequence[float] | np.ndarray,
                        missed: Sequence[tuple[float, float]] = ()) -> CriticalFit:
    """Least-squares fit of S = S_min (1 + B_noise / B) to points (B_i, S_i); seeds may repeat a B.

    S = S_min + (S_min B_noise) / B is linear in 1/B, so the fit is one weighted linear solve.
    Residuals are relative, (fit - S_i) / S_i (weights 1 / S_i^2): steps span orders of magnitude
    across batches and seed noise is multiplicative, so plain least squares would fit only the
    small batches. Raises ValueError with fewer than 3 distinct batches or a non-positive
    S_min or B_noise (the points show no critical batch).

    `missed` holds (B_j, budget_j): batches where the target was missed in budget_j steps. Their steps to
    target are censored, known only to exceed the budget (AlgoPerf counts them infinite), so dropping them
    would let the curve pass below a budget that did not suffice: above the fitted batches that overstates
    the critical batch, below them it understates it. The fit keeps S(B_j) >= budget_j as constraints
    (`binding`: the batches whose bound holds with equality); they add no residual and do not count toward
    the 3 batches.
    """
    b = np.asarray(batches, dtype=float)
    s = np.asarray(steps, dtype=float)
    if b.shape != s.shape or b.ndim != 1:
        raise ValueError(f"need one step count per batch, got {b.size} batches and {s.size} step counts")
    bounds = np.asarray(missed, dtype=float).reshape(-1, 2)
    if not all(np.all(np.isfinite(v)) and np.all(v > 0) for v in (b, s, bounds)):
        raise ValueError("batches and steps must be positive finite numbers")
    if np.unique(b).size < 3:
        raise ValueError(f"need at least 3 distinct batches to fit a critical batch, got {np.unique(b).size}")
    # Minimise sum(((a + c / B_i) - S_i) / S_i)^2 over a = S_min, c = S_min B_noise, with a + c / B_j >= budget_j.
    design = np.stack([1 / s, 1 / (b * s)], axis=1)
    (a, c), binding = constrained_lstsq(design, np.stack([np.ones(len(bounds)), 1 / bounds[:, 0]], axis=1),
                                        bounds[:, 1])
    held = f" (held at the missed budgets at {', '.join(f'{bounds[j, 0]:,.0f}' for j in binding)})" if binding else ""
    if c <= 0:
        raise ValueError(f"no critical batch: steps do not fall as the batch grows{held}")
    if a <= 0:
        raise ValueError(f"no critical batch: steps fall as fast as 1/batch at every batch (perfect scaling){held}; "
                         "add larger batches")
    rel_rms = float(np.sqrt(np.mean((design @ np.array([a, c]) - 1) ** 2)))
    return CriticalFit(s_min=float(a), b_noise=float(c / a), rel_rms=rel_rms, points=int(b.size),
                       binding=tuple(float(bounds[j, 0]) for j in binding))


def constrained_lstsq(design: np.ndarray, floors: np.ndarray, floor_values: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """argmin |design x - 1|^2 subject to floors x >= floor_values, and the indices of the floors that bind.

    The problem is a convex quadratic program in 2 unknowns, so its minimum is the best feasible one among the
    minima with 0, 1 or 2 floors held as equalities (an active set names at most as many constraints as
    unknowns); each is one linear (KKT) solve, and the floors are few (one per missed batch).
    """
    gram, rhs = 2 * design.T @ design, 2 * design.T @ np.ones(len(design))
    best: tuple[float, np.ndarray, list[int]] | None = None
    indices = range(len(floors))
    active: list[int]
    for active in [[]] + [[j] for j in indices] + [list(pair) for pair in itertools.combinations(indices, 2)]:
        g = floors[active]
        kkt = np.block([[gram, g.T], [g, np.zeros((len(active), len(active)))]])
        try:
            x = np.linalg.solve(kkt, np.concatenate([rhs, floor_values[active]]))[:2]
        except np.linalg.LinAlgError:  # two floors at one batch: the pair names no point
            continue
        if np.all(floors @ x >= floor_values * (1 - 1e-9)):
            cost = float(np.sum((design @ x - 1) ** 2))
            if best is None or cost < best[0] - 1e-12:
                best = (cost, x, active)
    if best is None:  # only where rounding fails every candidate: batches or steps spanning ~12 orders of magnitude
        raise ValueError("no fit meets the missed budgets: batches or steps too far apart to solve")
    return best[1], best[2]


def bootstrap_fit(points_by_batch: Mapping[float, Sequence[float]], resamples: int = 1000, seed: int = 0,
                  level: float = 0.9) -> tuple[CriticalFit, tuple[float, float]]:
    """The fit to every point, and a percentile bootstrap interval of B_crit at `level`.

    `points_by_batch` maps a global batch to its seeds' steps-to-target. Each resample
    draws, within every batch, as many seeds as it has, with replacement, and refits.
    A draw of n seeds has only (n - 1) / n of the seeds' variance, so each drawn log-step is
    moved away from its batch's mean log-step by sqrt(n / (n - 1)); with 3 seeds a 90%
    interval then covered the true B_crit ~85% of the time in simulation, against ~78% without.
    Resamples whose fit fails are skipped with a warning that counts them; if all fail,
    ValueError. The point fit raises as `fit_steps_to_target` does.
    """
    if not 0 < level < 1:
        raise ValueError(f"level must lie in (0, 1), got {level}")
    groups = [(float(batch), np.asarray(steps, dtype=float)) for batch, steps in points_by_batch.items()]
    if any(steps.size == 0 for _, steps in groups):
        raise ValueError("every batch needs at least one steps-to-target value")
    batches = np.concatenate([np.full(steps.size, batch) for batch, steps in groups])
    fit = fit_steps_to_target(batches, np.concatenate([steps for _, steps in groups]))

    logs = [np.log(steps) for _, steps in groups]
    inflation = [math.sqrt(v.size / (v.size - 1)) if v.size > 1 else 1.0 for v in logs]
    rng = np.random.default_rng(seed)
    b_crits = []
    for _ in range(resamples):
        drawn = np.exp(np.concatenate([v.mean() + k * (rng.choice(v, size=v.size) - v.mean())
                                       for v, k in zip(logs, inflation)]))
        try:
            b_crits.append(fit_steps_to_target(batches, drawn).b_crit)
        except ValueError:
            continue
    if not b_crits:
        raise ValueError(f"no critical batch: all {resamples} bootstrap resamples failed to fit")
    if len(b_crits) < resamples:
        warnings.warn(f"bootstrap_fit: {resamples - len(b_crits)} of {resamples} resamples showed no critical "
                      "batch and were skipped", stacklevel=2)
    low, high = np.quantile(b_crits, [(1 - level) / 2, (1 + level) / 2])
    return fit, (float(low), float(high))


def gns_summary(curve: Sequence[tuple[float, float]], last_fraction: float = 0.2) -> float | None:
    """Median B_simple over the last `last_fraction` of training, in samples seen; None if no finite point there.

    `curve` holds (samples_seen, b_simple) points of one run; training is taken to span
    0 to the largest samples_seen. The noise scale grows as training proceeds (McCandlish
    et al. 2018, sec. 3), so its late value is the one that bounds the useful batch. The
    median, not the mean: B_simple is a ratio whose estimated denominator |G|^2 can come
    close to 0, so single points spike by orders of magnitude. NaN and infinite points
    are ignored; finite negative ones (a noisy tr(Sigma) estimate) are kept, so dropping
    them does not bias the median upward.
    """
    if not 0 < last_fraction <= 1:
        raise ValueError(f"last_fraction must lie in (0, 1], got {last_fraction}")
    if not curve:
        return None
    end = max(float(samples) for samples, _ in curve)
    start = (1 - last_fraction) * end
    late = [float(b) for samples, b in curve if samples >= start and math.isfinite(float(b))]
    return float(np.median(late)) if late else None


def run_optimizer(config: Mapping | None) -> str | None:
    """The optimizer class a run's resolved config names (`SGD`, `LARS`, `AdamW`): optim.optimizer_class, or
    optim._target_ when that is the class itself; None when the config does not say (an old result.json)."""
    optim = (config or {}).get("optim") or {}
    name = str(optim.get("optimizer_class") or optim.get("_target_") or "").rsplit(".", 1)[-1]
    return name or None


def b_simple_undefined(optimizer: str | None) -> str | None:
    """Why B_simple is no critical batch for runs stepped by `optimizer` (a class name, `LARS`), or None
    where it is one: plain SGD, or an optimizer not known. McCandlish et al. derive B_simple for a step
    along the raw minibatch gradient; LARS, LAMB and AdamW rescale it (per layer, per coordinate), so
    the measured ratio is no longer the batch where that step stops gaining."""
    if optimizer is None or optimizer == "SGD":
        return None
    return f"not defined for {optimizer} (its step is not the raw gradient B_simple is derived for)"
