"""Label smoothing (Szegedy et al. 2016, "Rethinking the Inception Architecture", sec. 7)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from lbt.errors import ConfigError
from lbt.spec.validate import number
from lbt.techniques.base import Technique


def smooth_labels(targets: torch.Tensor, num_classes: int, eps: float) -> torch.Tensor:
    """(1 - eps) * one_hot(targets) + eps / num_classes, one row per sample.

    `targets` are class indices (N,) or probabilities (N, C). This is the
    target that `nn.CrossEntropyLoss(label_smoothing=eps)` trains against.
    """
    if targets.dim() == 1:
        targets = F.one_hot(targets, num_classes).float()
    return targets * (1.0 - eps) + eps / num_classes


class LabelSmoothing(Technique):
    """Train on cross-entropy against smoothed labels; validation loss stays plain cross-entropy."""

    name = "label_smoothing"
    order = 50

    def __init__(self, eps: float = 0.1):
        self.eps = number("technique.label_smoothing.eps", eps, low=0, high=1, high_open=True)

    def on_loss(self, loss_fn: Callable) -> Callable:
        if not isinstance(loss_fn, nn.CrossEntropyLoss):
            raise ConfigError(
                f"technique.label_smoothing smooths a cross-entropy loss, but the loss is {type(loss_fn).__name__}"
            )
        # torch's built-in is the same math as smooth_labels (a test pins it), in one fused kernel.
        return nn.CrossEntropyLoss(
            weight=loss_fn.weight, ignore_index=loss_fn.ignore_index, reduction=loss_fn.reduction,
            label_smoothing=self.eps,
        )

    def describe(self) -> str:
        return f"label smoothing eps={self.eps:g}"
