"""LR scaling rule: multiply the base LR by a function of global_batch / base_batch."""

from __future__ import annotations

from lbt.lr import SCALING_RULES, scaling_factor
from lbt.errors import ConfigError
from lbt.techniques.base import Progress, Technique


class LRScaling(Technique):
    """`linear` (Goyal et al. 2017) or `sqrt` (Krizhevsky 2014) scaling of the base LR.

    The reference is the run's configured global batch: a batch ramp grows the
    batch *instead of* decaying the LR (Smith et al. 2017), so the LR must not
    grow with it.
    """

    name = "lr_scaling"
    order = 10

    def __init__(self, rule: str = "linear", base_batch: int = 64):
        if rule not in SCALING_RULES:
            raise ConfigError(f"technique.lr_scaling.rule must be one of {', '.join(SCALING_RULES)}, got {rule!r}")
        if isinstance(base_batch, bool) or not isinstance(base_batch, int) or base_batch < 1:
            raise ConfigError(f"technique.lr_scaling.base_batch must be a positive integer, got {base_batch!r}")
        self.rule, self.base_batch = rule, base_batch

    def lr_scale(self, progress: Progress) -> float:
        return scaling_factor(progress.base_global_batch, self.base_batch, self.rule)

    def describe(self) -> str:
        return f"{self.rule} scaling from base_batch {self.base_batch}"
