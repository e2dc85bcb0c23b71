"""Ghost batch normalization (Hoffer, Hubara, Soudry 2017, "Train longer, generalize better", sec. 4).

In training, BN statistics come from "ghost" batches of `virtual_batch`
samples instead of the whole batch a BN layer sees (the per-worker batch in
lbt), which keeps the regularizing noise of small-batch BN as the batch grows.
The layer and its math live in lbt/nn/batchnorm.py.

A batch that `virtual_batch` does not divide raises a ConfigError: lbt's
training batches are whole (drop_last), so a ragged batch means
virtual_batch does not divide trainer.per_worker_batch.
"""

from __future__ import annotations

from torch import nn

from lbt.nn import GhostBatchNorm, replace_batchnorms
from lbt.spec.validate import integer
from lbt.techniques.base import Technique


class GhostBN(Technique):
    """Swap the model's BatchNorm layers for GhostBatchNorm with ghost batches of `virtual_batch` samples.

    With virtual_batch == trainer.per_worker_batch it is plain BN. Do not
    combine with sync_bn (which would turn the ghost layers into SyncBatchNorm).
    """

    name = "ghost_bn"
    order = 1  # model surgery, before initialisation tweaks (zero_init_residual)

    def __init__(self, virtual_batch: int = 32):
        self.virtual_batch = integer("technique.ghost_bn.virtual_batch", virtual_batch)
        self.replaced: int | None = None

    def on_model(self, model: nn.Module) -> nn.Module:
        layers = replace_batchnorms(model, lambda bn: GhostBatchNorm.from_batchnorm(bn, self.virtual_batch))
        self.replaced = len(layers)
        return model

    def describe(self) -> str:
        layers = "" if self.replaced is None else f" in {self.replaced} BN layers"
        return f"ghost BN: statistics over ghost batches of {self.virtual_batch} samples{layers}"
