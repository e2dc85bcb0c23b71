"""A small 1-D CNN with BatchNorm, the default model for MNIST-1D."""

from __future__ import annotations

import torch
from torch import nn


class CNN1d(nn.Sequential):
    """`num_layers` x (conv stride 2 -> BatchNorm1d -> ReLU), global average pool, linear head.

    Each stride-2 convolution halves the length, which keeps the network cheap
    on a CPU. BatchNorm makes it sensitive to the per-worker batch, which is
    what large-batch studies must see. Takes inputs of shape (N, L) or (N, C, L).
    """

    def __init__(
        self,
        input_shape=(40,),
        num_classes: int = 10,
        channels: int = 64,
        num_layers: int = 3,
        kernel_size: int = 5,
    ):
        in_channels = 1 if len(input_shape) == 1 else int(input_shape[0])
        layers = []
        for i in range(num_layers):
            layers += [
                # No conv bias: the BatchNorm right after removes it anyway.
                nn.Conv1d(in_channels if i == 0 else channels, channels, kernel_size,
                          stride=2, padding=kernel_size // 2, bias=False),
                nn.BatchNorm1d(channels),
                nn.ReLU(inplace=True),
            ]
        super().__init__(*layers, nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # (N, L): one channel
            x = x.unsqueeze(1)
        return super().forward(x)
