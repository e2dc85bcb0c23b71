"""No weight decay on bias and normalization parameters (Goyal et al. 2017; timm's filter_bias_and_bn)."""

from __future__ import annotations

import inspect

import torch
from torch import nn

from lbt.optim.param_groups import param_groups
from lbt.techniques.base import Technique


def rebuild_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """The same optimizer class and hyper-parameters over new parameter groups."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


class NoBNWeightDecay(Technique):
    """Split parameters with `lbt.optim.param_groups`: bias/norm ones get weight_decay 0.

    The same filter marks them excluded from LARS/LAMB trust ratios.
    """

    name = "no_bn_weight_decay"
    order = 40

    def on_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        weight_decay = optimizer.defaults.get("weight_decay", 0.0)
        return rebuild_optimizer(optimizer, param_groups(model, weight_decay, exclude_bias_and_norm=True))
