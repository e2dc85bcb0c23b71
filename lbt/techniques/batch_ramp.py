"""Grow the global batch instead of decaying the LR (Smith, Kindermans, Ying, Le 2017)."""

from __future__ import annotations

import bisect
import dataclasses

from lbt.config import BatchPlan
from lbt.errors import ConfigError
from lbt.techniques.base import Progress, Technique


def ramp_growth(epoch: float, milestones: list[float], factor: int, max_growth: int) -> tuple[int, int]:
    """(batch growth, LR decays) in force at `epoch`.

    Each milestone reached multiplies the batch by `factor` while the growth
    stays <= max_growth; milestones reached after that divide the LR by
    `factor` instead (Smith et al.: once the batch cannot grow, decay the LR).
    """
    reached = bisect.bisect_right(sorted(milestones), epoch)
    growth, decays = 1, 0
    for _ in range(reached):
        if growth * factor <= max_growth:
            growth *= factor
        else:
            decays += 1
    return growth, decays


class BatchRamp(Technique):
    """At each epoch milestone, multiply the global batch by `factor` (up to max_global_batch).

    grow=per_worker_batch makes each worker's forward larger; grow=world_size
    adds (simulated) workers, keeping per_worker_batch and so BN's batch.
    The LR scaling rule keeps the configured global batch as its reference: the
    ramp replaces LR decay, so the LR must not grow with it.
    """

    name = "batch_ramp"
    order = 5

    def __init__(self, milestones: list[float] = (3, 6, 8), factor: int = 2, max_global_batch: int | None = None,
                 grow: str = "per_worker_batch"):
        if grow not in ("per_worker_batch", "world_size"):
            raise ConfigError(f"technique.batch_ramp.grow must be per_worker_batch or world_size, got {grow!r}")
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
            raise ConfigError(f"technique.batch_ramp.factor must be an integer >= 2, got {factor!r}")
        if max_global_batch is not None and (not isinstance(max_global_batch, int) or max_global_batch < 1):
            raise ConfigError(f"technique.batch_ramp.max_global_batch must be a positive integer, got {max_global_batch!r}")
        self.milestones, self.factor = sorted(milestones), factor
        self.max_global_batch, self.grow = max_global_batch, grow
        self.max_growth: int | None = None

    def epoch_plan(self, epoch: int, plan: BatchPlan) -> BatchPlan:
        cap = self.max_global_batch or plan.global_batch * self.factor ** len(self.milestones)
        self.max_growth = max(1, cap // plan.global_batch)
        growth, _ = ramp_growth(epoch, self.milestones, self.factor, self.max_growth)
        if self.grow == "world_size":
            world_size = plan.world_size * growth
            return dataclasses.replace(plan, world_size=world_size, global_batch=plan.per_worker_batch * world_size)
        per_worker = plan.per_worker_batch * growth
        return dataclasses.replace(plan, per_worker_batch=per_worker, global_batch=per_worker * plan.world_size)

    def lr_factor(self, progress: Progress, scale: float) -> float:
        _, decays = ramp_growth(progress.epoch, self.milestones, self.factor, self.max_growth or 1)
        return self.factor ** -decays

    def describe(self) -> str:
        cap = f" up to {self.max_global_batch}" if self.max_global_batch else ""
        return f"batch x{self.factor} at epochs {self.milestones}{cap} (via {self.grow})"
