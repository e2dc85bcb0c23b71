"""ResNet-20 for CIFAR (He et al. 2016, section 4.2), ~0.27M parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """conv3x3 -> BN -> ReLU -> conv3x3 -> `bn2`, plus the shortcut, then ReLU.

    Zero-init-residual techniques look for `bn2`: with its weight at zero the
    block starts as its shortcut (Goyal et al. 2017).
    """

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.stride = stride
        self.extra_channels = out_channels - in_channels

    def shortcut(self, x: torch.Tensor) -> torch.Tensor:
        """Option A of the paper: subsample and pad new channels with zeros (no parameters)."""
        if self.stride > 1:
            x = x[:, :, :: self.stride, :: self.stride]
        if self.extra_channels:
            half = self.extra_channels // 2
            x = F.pad(x, (0, 0, 0, 0, half, self.extra_channels - half))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet20(nn.Module):
    """conv3x3 -> 3 stages x 3 BasicBlocks (width, 2x, 4x channels) -> global pool -> linear.

    Shortcuts are option A (identity with zero-padded channels), as the paper
    uses on CIFAR; that keeps the count at 0.27M parameters for width=16.
    """

    shard_blocks = "blocks"  # dist.shard=fsdp gathers one block at a time (lbt/parallel/fsdp.py)

    def __init__(self, input_shape=(3, 32, 32), num_classes: int = 10, width: int = 16):
        super().__init__()
        self.conv1 = nn.Conv2d(int(input_shape[0]), width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        blocks, channels = [], width
        for stage, out_channels in enumerate((width, 2 * width, 4 * width)):
            for i in range(3):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(BasicBlock(channels, out_channels, stride))
                channels = out_channels
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(channels, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                # He et al. 2015 init, as the paper uses.
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.blocks(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
