"""LARS on top of SGD with momentum (You, Gitman, Ginsburg 2017)."""

from __future__ import annotations

import torch
from torch import nn

from lbt.errors import ConfigError
from lbt.optim.lars import LARS
from lbt.optim.param_groups import param_groups
from lbt.techniques.base import Technique


class Lars(Technique):
    """Replace the configured SGD by LARS with SGD's momentum, weight decay and nesterov.

    local_lr = eta * ||w|| / (||g|| + wd * ||w||) per parameter tensor, applied
    to g + wd * w before momentum; bias and norm parameters are excluded from
    both the trust ratio and weight decay by lbt.optim.param_groups' filter.
    `clip` is the LARC variant (local LR clipped at the global LR).
    """

    name = "lars"
    order = 45

    def __init__(self, trust_coefficient: float = 0.001, eps: float = 1e-8, clip: bool = False):
        if not trust_coefficient > 0:
            raise ConfigError(f"technique.lars.trust_coefficient must be positive, got {trust_coefficient!r}")
        self.trust_coefficient, self.eps, self.clip = trust_coefficient, eps, clip

    def on_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        if not isinstance(optimizer, torch.optim.SGD):
            raise ConfigError(f"technique lars works on top of SGD (optim=sgd), not {type(optimizer).__name__}")
        sgd = optimizer.defaults
        return LARS(
            param_groups(model, sgd["weight_decay"], exclude_bias_and_norm=True), lr=sgd["lr"],
            momentum=sgd["momentum"], weight_decay=sgd["weight_decay"], nesterov=sgd["nesterov"],
            trust_coefficient=self.trust_coefficient, eps=self.eps, clip=self.clip,
        )

    def describe(self) -> str:
        return f"LARS eta={self.trust_coefficient:g}" + (" (LARC clip)" if self.clip else "")
