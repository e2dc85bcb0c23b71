"""Parameter groups: one filter decides weight decay and trust-ratio exclusion.

Bias and normalization parameters (BatchNorm, LayerNorm, GroupNorm gains and
shifts) are few, scale-free or shift-only, and decaying them or giving them a
layer-wise trust ratio hurts large-batch training (You, Gitman, Ginsburg 2017
exclude them from LARS; Goyal et al. 2017 and timm's `filter_bias_and_bn`
exclude them from weight decay). Using the same predicate for both keeps the
two exclusions from drifting apart.
"""

from __future__ import annotations

from torch import Tensor, nn

# Group key read by lbt.optim.LARS and lbt.optim.LAMB: True means the parameters
# of this group get a trust ratio of 1 (plain SGD / Adam-style step).
EXCLUDE_FROM_TRUST = "exclude_from_trust"


def is_excluded(name: str, param: Tensor) -> bool:
    """True for bias and normalization parameters.

    Every bias and every norm-layer weight is a vector, so `ndim <= 1` catches
    them whatever the layer's name; the name check also catches a bias stored
    with more dimensions.
    """
    return param.ndim <= 1 or name.endswith(".bias")


def param_groups(model: nn.Module, weight_decay: float, exclude_bias_and_norm: bool) -> list[dict]:
    """Split `model`'s trainable parameters into optimizer parameter groups.

    With `exclude_bias_and_norm`, parameters matched by `is_excluded` get
    weight_decay 0 and `exclude_from_trust: True`; the rest get `weight_decay`
    and `exclude_from_trust: False`. Without it, every parameter is in one
    group with `weight_decay` and a trust ratio. Empty groups are left out and
    frozen parameters (requires_grad False) are skipped.
    """
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        excluded = exclude_bias_and_norm and is_excluded(name, param)
        (no_decay if excluded else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay, EXCLUDE_FROM_TRUST: False},
        {"params": no_decay, "weight_decay": 0.0, EXCLUDE_FROM_TRUST: True},
    ]
    return [g for g in groups if g["params"]]
