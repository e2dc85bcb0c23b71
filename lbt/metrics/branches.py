"""Reading branched probes (`lbt probe`): the local critical batch at each checkpoint, and the answer for a budget.

Merrill, Arora, Groeneveld, Hajishirzi 2025, "Critical Batch Size Revisited" (arXiv:2505.23971, sec. 3):
from a checkpoint of a run at batch B0, branches at k x B0 each train the same number of samples; the
local critical batch is the largest batch whose branch does as well as the small batch's. lbt differs:

- "as well" is the study's own criterion (within 1 accuracy point, or 0.05 nats: `tolerance` in the
  metric's units), so the probe and a sweep answer the same question;
- each branch is held to the median of the k=1 branches over data orders, not to one of them;
- a difference no larger than the noise floor (the k=1 branches' spread over data orders) decides
  nothing: the checkpoint's critical batch is then "not resolved" (a lower bound), never a number;
- one checkpoint does not answer for a whole run (the critical batch grows over training), so
  `predicted_need` combines them with McCandlish et al.'s trade-off, fitted at each checkpoint.

Pure functions of numbers, no torch: lbt/apps/probe runs the branches and calls these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from lbt.spec.objective import Metric


def shortfall(value: float, reference: float, metric: Metric) -> float:
    """How much worse `value` is than `reference`, in the metric's units (accuracy points, nats);
    negative when better; infinite for a non-finite value (a diverged branch)."""
    if not math.isfinite(value):
        return math.inf
    return (metric.score(reference) - metric.score(value)) / metric.unit_size


def noise_floor(values: Sequence[float], metric: Metric) -> float:
    """The spread of k=1 branches that differ only in data order, in the metric's units. Up to three
    branches: their range (twice the median absolute deviation is 0 whenever two of three coincide, and
    77.15, 77.15, 76.07% once "resolved" a difference smaller than the seeds' own spread; three values
    cannot tell one spiking seed from a real spread). Four or more: Rousseeuw and Croux's Q_n, the
    C(h, 2)-th smallest pairwise difference (h = n // 2 + 1), which one spiking seed does not move.
    Infinite with fewer than two finite values."""
    finite = sorted(v / metric.unit_size for v in values if math.isfinite(v))
    if len(finite) < 2:
        return math.inf
    if len(finite) <= 3:
        return float(finite[-1] - finite[0])
    gaps = sorted(b - a for i, a in enumerate(finite) for b in finite[i + 1:])
    h = len(finite) // 2 + 1
    return float(gaps[h * (h - 1) // 2 - 1])


def reference_value(values: Sequence[float]) -> float:
    """What a larger batch's branch is held to: the median of the k=1 branches' values over data orders
    (one seed's branch is as noisy as any other's); NaN when none finished."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


@dataclass(frozen=True)
class LocalCritical:
    """The verdict at one checkpoint, as global batches."""

    held: int  # the largest batch whose branch, and every smaller one's, stayed within tolerance
    failed: int | None  # the next batch probed, which did not (None: every probed batch held)
    resolved: bool  # False: nothing failed (held is a lower bound), or the failing difference was within the floor

    @property
    def batch(self) -> int | None:
        """The local critical batch when resolved, else None."""
        return self.held if self.resolved else None


def local_critical(shortfalls: Mapping[int, float], base_batch: int, tolerance: float, floor: float) -> LocalCritical:
    """The largest k x base_batch whose branch and every smaller one's fell short of the k=1 branch by at
    most `tolerance` (shortfalls by factor k, in the metric's units). A shortfall past the tolerance but
    not past the noise floor stops the search unresolved: it cannot tell the batch from data order."""
    held = 1
    for factor in sorted(k for k in shortfalls if k > 1):
        gap = shortfalls[factor]
        if gap <= tolerance:
            held = factor
            continue
        return LocalCritical(held * base_batch, factor * base_batch, resolved=gap > floor)
    return LocalCritical(held * base_batch, None, resolved=False)


def samples_to_reach(curve: Sequence[tuple[float, float]], loss: float) -> float | None:
    """Samples (into the branch) at which a curve of (samples, loss) points, starting at (0, start loss),
    first reaches `loss`, interpolated linearly; None if it never does."""
    previous = None
    for samples, value in curve:
        if value <= loss:
            if previous is None:
                return float(samples)
            (s0, v0) = previous
            return s0 + (samples - s0) * (v0 - loss) / (v0 - value) if v0 > value else float(samples)
        previous = (samples, value)
    return None


def samples_ratio(reference: Sequence[tuple[float, float]], loss: float, samples: float, factor: int) -> float:
    """E(k B0) / E(B0): how many more samples batch k B0 needs than B0 for the same progress, read from one
    branch: it spent `samples` to reach `loss`, which the k=1 `reference` curve reached after fewer (or
    more). Clipped to [1, k], the range McCandlish's model allows (1: perfect scaling; k: no gain per step);
    a branch that made no progress, or diverged, counts as k."""
    needed = samples_to_reach(reference, loss) if math.isfinite(loss) else None
    if needed is None:
        end = reference[-1][1] if reference else math.inf
        return 1.0 if loss <= end else float(factor)
    return min(max(samples / max(needed, 1e-12), 1.0), float(factor))


def model_ratio(batch: float, base_batch: float, noise_scale: float) -> float:
    """McCandlish et al. 2018 (eq. 2.11): E = E_min (1 + B / B_noise), so E(B) / E(B0)."""
    return (1 + batch / noise_scale) / (1 + base_batch / noise_scale)


def fit_noise_scale(ratios: Mapping[int, float], base_batch: int) -> float:
    """The B_noise whose `model_ratio` best fits the measured ratios by factor (least squares in log),
    searched on a log grid from base_batch / 64 to 64 x the largest batch probed; an end of the grid is a
    bound (all ratios ~1: B_noise beyond the probed batches)."""
    batches = np.array([k * base_batch for k in ratios], dtype=float)
    observed = np.log(np.clip([ratios[k] for k in ratios], 1.0, [float(k) for k in ratios]))
    grid = np.exp(np.linspace(math.log(base_batch / 64), math.log(batches.max() * 64), 2001))
    model = np.log((1 + batches[None, :] / grid[:, None]) / (1 + base_batch / grid[:, None]))
    return float(grid[np.argmin(((model - observed[None, :]) ** 2).sum(axis=1))])


def predicted_need(checkpoints: Sequence[float], noise_scales: Sequence[float], reach: float, batch: int,
                   base_batch: int) -> float:
    """Samples a from-scratch run at `batch` needs to get where the base run was after `reach` samples.

    Training is cut into phases at the checkpoints (the first phase takes the first checkpoint's B_noise,
    each later one its own checkpoint's); each phase's samples cost `model_ratio` times as many at `batch`.
    """
    need, edges = 0.0, [0.0, *checkpoints[1:], math.inf]
    for (start, end), noise in zip(zip(edges, edges[1:]), noise_scales):
        covered = max(0.0, min(end, reach) - start)
        need += covered * model_ratio(batch, base_batch, noise)
    return need


def largest_batch(checkpoints: Sequence[float], noise_scales: Sequence[float], reach: float, budget: float,
                  base_batch: int, factors: Sequence[int]) -> int:
    """The largest k x base_batch (of `factors`, and every smaller one) predicted to get where the base run
    was after `reach` samples (its final value less the tolerance) within `budget` samples."""
    best = base_batch
    for factor in sorted(factors):
        if predicted_need(checkpoints, noise_scales, reach, factor * base_batch, base_batch) > budget:
            break
        best = factor * base_batch
    return best


def batch_schedule(checkpoints: Sequence[int], held: Sequence[int], base_batch: int) -> list[tuple[int, int]]:
    """(from samples, global batch): start at base_batch and double the batch whenever the local critical
    batch reaches twice the current one (Merrill et al. 2025, sec. 5). The critical batch grows over
    training, so one checkpoint's measurement is trusted only as far as every later one confirms it:
    the schedule follows min(held[i:]) at checkpoint i, which a single noisy early reading cannot push up."""
    schedule, batch = [(0, base_batch)], base_batch
    for i, at in enumerate(checkpoints):
        limit = min(held[i:])
        grown = batch
        while grown * 2 <= limit:
            grown *= 2
        if grown > batch:
            schedule.append((int(at), grown))
            batch = grown
    return schedule


# --- From branches to the answer for the user's budget ------------------------------------------------------
#
# McCandlish et al. 2018 (and Kaplan et al. 2020), read at a fixed sample budget E: a run at batch B makes the
# progress the small-batch run makes with E_eff = E / r(B) samples, r = E(B) / E(B0) >= 1 measured by the
# branches. Its shortfall at the end is the base batch's final-value-versus-budget curve F read at E_eff
# against F(E): nothing where the metric has saturated, the slope times the lag where it still falls.


def phase_weights(checkpoints: Sequence[float], budget: float) -> list[float]:
    """Each checkpoint's share of the budget when it stands for training from itself to the next (the first
    also for the start, the last up to the budget): the time weights of Merrill et al.'s Proposition 1."""
    edges = [0.0, *checkpoints[1:], budget]
    return [max(0.0, b - a) / budget for a, b in zip(edges, edges[1:])]


def combined_ratios(per_checkpoint: Sequence[Mapping[int, float]], weights: Sequence[float]) -> dict[int, float]:
    """r(k) over the whole run: the weighted mean of each checkpoint's samples ratio (the extra samples of
    each phase add up, as in `predicted_need`); a factor only where every checkpoint measured it."""
    common = set.intersection(*(set(r) for r in per_checkpoint)) if per_checkpoint else set()
    total = sum(weights)
    return {k: sum(w * r[k] for w, r in zip(weights, per_checkpoint)) / total for k in sorted(common)}


def budget_value(points: Sequence[Sequence[float]], samples: float) -> float:
    """F(samples): the final value of a base-batch run of that many samples, from (samples, final value)
    points of runs that ended there (short cooldowns and the base run's own end), linear in log samples
    between them; below the smallest, extrapolated from the two smallest (one point: its value)."""
    ordered = sorted((s, v) for s, v in points if s > 0 and math.isfinite(v))
    if not ordered:
        return math.nan
    if len(ordered) == 1 or samples >= ordered[-1][0]:
        return ordered[-1][1] if samples >= ordered[-1][0] else ordered[0][1]
    below = [p for p in ordered if p[0] <= samples]
    (s0, v0), (s1, v1) = (ordered[0], ordered[1]) if not below else (below[-1], ordered[len(below)])
    t = (math.log(samples) - math.log(s0)) / (math.log(s1) - math.log(s0))
    return v0 + t * (v1 - v0)


def budget_shortfalls(ratios: Mapping[int, float], points: Sequence[Sequence[float]], budget: float,
                      metric: Metric) -> dict[int, float]:
    """Factor k -> how much worse than F(budget) a from-scratch run at k x B0 ends: F read at budget / r(k)."""
    final = budget_value(points, budget)
    return {k: shortfall(budget_value(points, budget / max(r, 1.0)), final, metric) for k, r in ratios.items()}


def largest_within(shortfalls: Mapping[int, float], tolerance: float, failed: frozenset[int] = frozenset()) -> int:
    """The largest factor whose predicted shortfall, and every smaller factor's, is within the tolerance and
    none of whose branches diverged (`failed`); 1 when none."""
    held = 1
    for k in sorted(k for k in shortfalls if k > 1):
        if k in failed or not shortfalls[k] <= tolerance:
            break
        held = k
    return held


@dataclass(frozen=True)
class CheckpointRatios:
    """One checkpoint's samples ratios: measured by factor, and for every factor (the fitted noise scale's
    where a factor was not run); the factors whose branch diverged."""

    measured: dict[int, float]
    filled: dict[int, float]
    noise_scale: float
    diverged: tuple[int, ...]


ESTIMATORS = ("progress", "crossing")


def progress_ratio(start: float, reference_end: float, loss: float, factor: int) -> float:
    """E(k B0) / E(B0) from two branches' ends: the share of the k=1 branch's loss decrease, from the same
    start over the same samples, that the k branch made; a linear reading of the k=1 curve between its ends,
    where its first crossing of a noisy curve (`samples_ratio`) is ill-conditioned: at a held LR the k=1
    loss soon hovers at its noise level, and any end near that level reads as "reached long ago". Clipped
    to [1, k]; a branch that made no progress, or diverged, counts as k."""
    made, wanted = start - loss, start - reference_end
    if not math.isfinite(loss) or made <= 0:
        return float(factor)
    if wanted <= 0:
        return 1.0
    return min(max(wanted / made, 1.0), float(factor))


def smoothed_end(curve: Sequence[tuple[float, float]], share: float = 0.5) -> float:
    """The mean val loss over the last `share` of a branch's evaluations: the end a noisy curve stands for."""
    values = [v for _, v in curve]
    if not values:
        return math.inf
    tail = values[-max(1, round(share * len(values))):]
    return float(np.mean(tail)) if all(math.isfinite(v) for v in tail) else math.inf


def checkpoint_ratios(start: float, curves: Mapping[int, Sequence[tuple[float, float]]], diverged: Sequence[int],
                      base_batch: int, factors: Sequence[int], estimator: str = "progress") -> CheckpointRatios:
    """`curves`: each factor's branch as (samples into it, val loss) evaluations from the same start loss
    (k=1's included); `diverged`: the factors whose branch diverged."""
    reference = curves.get(1, [])
    measured = {}
    for k, curve in curves.items():
        if k in diverged or not curve:
            measured[k] = float(k)
        elif estimator == "crossing":
            measured[k] = samples_ratio([(0.0, start), *reference], curve[-1][1], curve[-1][0], k)
        else:
            measured[k] = progress_ratio(start, smoothed_end(reference), smoothed_end(curve), k)
    noise = fit_noise_scale(measured, base_batch) if len(measured) > 1 else float(base_batch)
    filled = {k: measured.get(k, model_ratio(k * base_batch, base_batch, noise)) for k in factors}
    return CheckpointRatios(measured, filled, noise, tuple(sorted(diverged)))


@dataclass(frozen=True)
class Prediction:
    factor: int  # the largest k x B0 predicted to hold for the budget
    ratios: dict[int, float]  # r(k) over the run
    shortfalls: dict[int, float]  # F(budget) - F(budget / r(k)), in the metric's units
    alone: list[int]  # the largest factor each checkpoint predicts alone
    failed: frozenset[int]  # factors a branch diverged at (and every larger one)


def predict(checkpoints: Sequence[float], per_checkpoint: Sequence[CheckpointRatios],
            points: Sequence[Sequence[float]], budget: float, tolerance: float, metric: Metric) -> Prediction:
    """The probe's answer for the budget: the checkpoints' ratios time-weighted (`combined_ratios`), read on
    the budget curve (`budget_shortfalls`); a factor fails where any checkpoint's branch diverged at it or
    below. Each checkpoint alone gives the interval's ends."""
    factors = sorted(set.union(*(set(c.filled) for c in per_checkpoint))) if per_checkpoint else [1]
    first = min((k for c in per_checkpoint for k in c.diverged), default=None)
    failed = frozenset(k for k in factors if first is not None and k >= first)
    ratios = combined_ratios([c.filled for c in per_checkpoint], phase_weights(checkpoints, budget))
    shortfalls = budget_shortfalls(ratios, points, budget, metric)
    alone = []
    for c in per_checkpoint:
        own = min(c.diverged, default=None)
        alone.append(largest_within(budget_shortfalls(c.filled, points, budget, metric), tolerance,
                                    frozenset(k for k in c.filled if own is not None and k >= own)))
    return Prediction(largest_within(shortfalls, tolerance, failed), ratios, shortfalls, alone, failed)


# How far from the sweep's answer the prediction has been, in doublings, on every workload bench/critical.py
# validates (bench/results/2026-12-02-critical.md): the interval is the prediction within it.
VALIDATED_DOUBLINGS = 1


def interval(factor: int, largest_factor: int) -> tuple[int, int]:
    """(low, high) factors around a predicted one: VALIDATED_DOUBLINGS either side, within the probed grid."""
    return max(1, factor >> VALIDATED_DOUBLINGS), min(largest_factor, factor << VALIDATED_DOUBLINGS)
