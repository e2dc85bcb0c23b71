"""Fused simulation: a process's k virtual workers as ONE forward/backward.

Running k forwards of b samples one after another costs more than one forward
of k*b samples (small batches use the hardware badly). The only layers in
which samples of a batch interact are BatchNorm layers, so the fused pass is
exact when every BatchNorm normalises each worker's b-sample chunk on its own,
which is ghost BN with ghost batches of per_worker_batch samples. The loss mean
over the k*b samples is the mean of the k workers' mean losses, so the gradient
is the same as in the sequential path.

Rule: fusing assumes samples interact only through BatchNorm (true of lbt's
models and torchvision's classifiers). Models with other cross-sample layers
must run with dist.fuse_workers=false.
"""

from __future__ import annotations

from torch import nn

from lbt.nn import GhostBatchNorm, replace_batchnorms


def per_worker_batchnorm(model: nn.Module, per_worker_batch: int) -> list[GhostBatchNorm]:
    """Make every BatchNorm compute statistics per worker chunk; return the layers to retune.

    A GhostBatchNorm already present (technique ghost_bn, ghost batches dividing
    per_worker_batch) already keeps workers apart and is left alone.
    """
    return replace_batchnorms(model, lambda bn: GhostBatchNorm.from_batchnorm(bn, per_worker_batch))


def set_per_worker_batch(layers: list[GhostBatchNorm], per_worker_batch: int) -> None:
    """Follow a per-worker batch that changes between epochs (batch ramp)."""
    for layer in layers:
        layer.virtual_batch = per_worker_batch
