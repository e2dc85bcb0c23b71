"""Zero-init residual: every residual block starts as its shortcut (Goyal et al. 2017, sec. 5.1).

With gamma = 0 in the last BN of a block, the block adds nothing at
initialisation, so the network starts effectively shallow and takes the large
LR of large-batch training more gently in the first steps.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lbt.techniques.base import Technique

# Block class name -> its last BN. lbt's ResNet20 and torchvision's (and timm's)
# ResNets all use these names; matching by name needs no torchvision import.
LAST_BN = {"BasicBlock": "bn2", "Bottleneck": "bn3"}


def last_bn_of_residual_blocks(model: nn.Module) -> list[_BatchNorm]:
    """The affine BN layer that ends each residual block of `model` (none for a model without blocks).

    Any BN flavour counts (BatchNorm2d, GhostBatchNorm, SyncBatchNorm), so the
    order relative to BN-swapping techniques does not matter.
    """
    found = []
    for module in model.modules():
        attribute = LAST_BN.get(type(module).__name__)
        bn = getattr(module, attribute, None) if attribute else None
        if isinstance(bn, _BatchNorm) and bn.weight is not None:
            found.append(bn)
    return found


class ZeroInitResidual(Technique):
    """Set gamma (the weight) of the last BN in each residual block to 0; beta is already 0."""

    name = "zero_init_residual"
    order = 2  # an initialisation tweak: after BN swaps (ghost_bn, sync_bn at 1)

    def __init__(self):
        self.zeroed: int | None = None

    def on_model(self, model: nn.Module) -> nn.Module:
        layers = last_bn_of_residual_blocks(model)
        with torch.no_grad():
            for bn in layers:
                bn.weight.zero_()
        self.zeroed = len(layers)
        return model

    def describe(self) -> str:
        if self.zeroed is None:
            return "zero-init residual: last BN gamma of each residual block set to 0"
        if self.zeroed == 0:
            return "zero-init residual: the model has no residual blocks, left unchanged"
        return f"zero-init residual: last BN gamma set to 0 in {self.zeroed} residual blocks"
