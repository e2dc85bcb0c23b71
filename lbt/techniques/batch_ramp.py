"""Grow the global batch instead of decaying the LR (Smith, Kindermans, Ying, Le 2017)."""

from __future__ import annotations

import bisect

from lbt.config import BatchPlan
from lbt.dist import note
from lbt.techniques.base import Technique
from lbt.validate import integer, number, one_of


def ramp_growth(epoch: float, milestones: list[float], factor: int, max_growth: int) -> tuple[int, int]:
    """(batch growth, LR divisions) in force at `epoch`.

    Each milestone reached multiplies the batch by `factor` while the growth
    stays <= max_growth; milestones reached after that divide the LR by
    `factor` instead (Smith et al.: once the batch cannot grow, decay the LR).
    """
    reached = bisect.bisect_right(sorted(milestones), epoch)
    growth, divisions = 1, 0
    for _ in range(reached):
        if growth * factor <= max_growth:
            growth *= factor
        else:
            divisions += 1
    return growth, divisions


class BatchRamp(Technique):
    """At each epoch milestone, multiply the global batch by `factor`, up to a cap.

    The cap is max_global_batch (default: no cap) and never more than the
    training set holds. grow=per_worker_batch makes each worker's forward
    larger; grow=world_size adds (simulated) workers, keeping per_worker_batch
    and so BN's batch. The LR scaling rule keeps the configured global batch
    as its reference: the ramp replaces LR decay, so the LR must not grow with it.
    """

    name = "batch_ramp"
    order = 5
    replaces_lr_decay = True

    def __init__(self, milestones: list[float] = (3, 6, 8), factor: int = 2, max_global_batch: int | None = None,
                 grow: str = "per_worker_batch"):
        self.grow = one_of("technique.batch_ramp.grow", grow, ("per_worker_batch", "world_size"))
        self.factor = integer("technique.batch_ramp.factor", factor, 2)
        if max_global_batch is not None:
            integer("technique.batch_ramp.max_global_batch", max_global_batch)
        self.milestones = sorted(number("technique.batch_ramp.milestones", m, low=0) for m in milestones)
        self.max_global_batch = max_global_batch
        self.cap: int | None = None  # the largest global batch the ramp reaches, once planned

    def plan_epochs(self, plans: list[BatchPlan], num_train: int) -> list[BatchPlan]:
        start = plans[0].global_batch
        cap = self.max_global_batch or start * self.factor ** len(self.milestones)
        if cap > num_train:
            note(f"technique.batch_ramp: the global batch stops growing at the {num_train:,} samples of the "
                 f"training set (asked: up to {cap:,}); later milestones divide the LR by {self.factor} instead")
            cap = num_train
        max_growth = max(1, cap // start)
        grown = []
        for epoch, plan in enumerate(plans):
            growth, divisions = ramp_growth(epoch, self.milestones, self.factor, max_growth)
            grown.append(plan.grown(growth, self.grow, plan.lr_factor / self.factor**divisions))
        self.cap = max(p.global_batch for p in grown)
        return grown

    def describe(self) -> str:
        cap = f" up to {self.cap:,}" if self.cap else ""
        return f"batch x{self.factor} at epochs {self.milestones}{cap} (via {self.grow})"
