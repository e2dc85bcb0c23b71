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

dist.fuse_workers=auto (the default) fuses where it is the faster of the two:
always for a model without BatchNorm (one pass and nothing to copy), and for a
BatchNorm model while the per-worker batch is below SEQUENTIAL_FROM. The fused
pass copies every BN activation twice (ghost_batch_norm's fold, and again in the
backward); k passes pay a per-pass overhead instead, which big passes hide.
On CPU (bench/simulation.py, cnn1d, global batch 4,096, 1 thread), fused / W=1
was 0.90 at b=1,024 and 0.93 at b=256 against 1.03 and 1.02 sequential, and
0.98 at b=64 against 0.64 sequential. On CUDA it always fuses: k small passes
leave a GPU idle between kernels (not measured here: no GPU).
"""

from __future__ import annotations

from torch import nn

from lbt.nn import GhostBatchNorm, replace_batchnorms


SEQUENTIAL_FROM = 256  # per-worker batch from which auto runs a BatchNorm model's workers one by one (CPU)


def fuse_passes(setting: bool | str, per_worker_batch: int, has_batchnorm: bool, device_type: str) -> bool:
    """Whether a process runs its simulated workers as one pass, for dist.fuse_workers=setting (pure)."""
    if setting != "auto":
        return setting
    return not has_batchnorm or device_type == "cuda" or per_worker_batch < SEQUENTIAL_FROM


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
