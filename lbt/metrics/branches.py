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
    """The spread of k=1 branches that differ only in data order, in the metric's units: twice the median
    absolute deviation from their median. With two branches that is their difference; with three or more,
    one spiking seed does not move it (a single pair's difference once ranged from 0.0024 nats to a spike).
    Infinite with fewer than two finite values."""
    finite = np.array([v for v in values if math.isfinite(v)], dtype=float) / metric.unit_size
    if finite.size < 2:
        return math.inf
    return float(2 * np.median(np.abs(finite - np.median(finite))))


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
