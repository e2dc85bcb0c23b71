"""Build the optimizer once: parameter groups first, then the optimizer class (timm's `create_optimizer_v2`).

One filter (lbt.optim.param_groups.is_excluded) decides which parameters get
no weight decay and no trust ratio, so `optim=sgd|lars|lamb` all read
`optim.no_bn_weight_decay` the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from lbt.errors import ConfigError
from lbt.optim.param_groups import param_groups
from lbt.spec.targets import locate
from lbt.spec.validate import number


def create_optimizer(model: nn.Module, optimizer_class: str | type, lr: float, weight_decay: float = 0.0,
                     no_bn_weight_decay: bool = False, **options) -> torch.optim.Optimizer:
    """`optimizer_class` (a class or its import path, e.g. torch.optim.SGD) over `model`'s parameter groups.

    With `no_bn_weight_decay`, bias and normalization parameters get weight
    decay 0 and `exclude_from_trust` (LARS and LAMB give them a trust ratio of
    1); the others get `weight_decay`. `lr` is the base LR, which the trainer
    replaces at every step by the schedule's (lbt/spec/lr.py).
    """
    number("optim.lr", lr, low=0, low_open=True)
    if isinstance(optimizer_class, str):
        optimizer_class = locate("optim.optimizer_class", optimizer_class, torch.optim.Optimizer)
    groups = param_groups(model, weight_decay, exclude_bias_and_norm=no_bn_weight_decay)
    if options.get("fused") == "auto":
        options["fused"] = _fused_kernel_for(optimizer_class, model)
    try:
        return optimizer_class(groups, lr=lr, weight_decay=weight_decay, **options)
    except (TypeError, ValueError) as error:  # torch.optim checks its hyper-parameters here
        raise ConfigError(f"optim: {str(error).splitlines()[0]}") from None


def _fused_kernel_for(optimizer_class: type, model: nn.Module) -> bool | None:
    """`fused=auto`: True where torch has a fused kernel for the optimizer on the parameters' device
    (AdamW on CPU and CUDA: one kernel for all tensors instead of a loop over them); None (torch's own
    default) elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    try:
        optimizer_class(params, fused=True)
    except (TypeError, RuntimeError, ValueError):
        return None
    return True
