"""A BatchNorm-free MLP: the reference model for exact-simulation tests."""

from __future__ import annotations

import math

from torch import nn


class MLP(nn.Sequential):
    """Flatten, `num_layers` x (Linear -> ReLU) of width `hidden`, linear head.

    No BatchNorm and no dropout on purpose: each sample's gradient is then
    independent of the others in its batch and of any RNG, so W workers of
    batch b and one worker of batch b x W give the same update.
    num_layers=0 is a linear classifier.
    """

    def __init__(self, input_shape=(40,), num_classes: int = 10, hidden: int = 128, num_layers: int = 2):
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for _ in range(num_layers):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        super().__init__(*layers, nn.Linear(width, num_classes))
