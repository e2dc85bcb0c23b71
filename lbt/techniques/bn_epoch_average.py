"""BatchNorm statistics without moving averages (Akiba, Suzuki, Fukuda 2017)."""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lbt.techniques.base import Technique

# _BatchNorm also covers the per-worker (ghost) BN that fused simulation and
# ghost_bn put in place of nn.BatchNorm*d, whichever technique runs first.
_BATCH_NORMS = (_BatchNorm,)


def use_cumulative_average(model: nn.Module) -> int:
    """Switch every BatchNorm to a plain average of batch statistics (momentum=None)."""
    norms = [m for m in model.modules() if isinstance(m, _BATCH_NORMS)]
    for norm in norms:
        norm.momentum = None
    return len(norms)


class BNEpochAverage(Technique):
    """Evaluate with the exact mean of the last epoch's BN batch statistics.

    With few, large steps an exponential moving average (momentum 0.1) is
    dominated by early, stale statistics; Akiba et al. drop the moving average.
    Here every BN keeps the cumulative average (momentum=None) of the current
    epoch's batch statistics, reset at each epoch start. Averaging is linear, so
    real and simulated workers still agree.
    """

    name = "bn_epoch_average"
    order = 60

    def on_model(self, model: nn.Module) -> nn.Module:
        self.norms = use_cumulative_average(model)
        return model

    def on_epoch_start(self, epoch: int, model: nn.Module) -> None:
        for module in model.modules():
            if isinstance(module, _BATCH_NORMS):
                module.reset_running_stats()

    def describe(self) -> str:
        return f"BN epoch average ({self.norms} BN layers)" if hasattr(self, "norms") else self.name
