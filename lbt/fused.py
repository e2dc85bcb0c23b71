"""Fused simulation: a process's k virtual workers as one forward/backward, or a few.

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

dist.fuse_workers=true runs all k workers as one pass, false one pass per
worker, and auto (the default) groups them into passes of about PASS_SAMPLES
samples for a BatchNorm model on CPU (`workers_per_pass`). On 2 CPU cores a
pass of a few hundred samples is the fastest: its activations stay in cache,
while a pass of thousands does not and a pass of 32 pays Python's per-pass
overhead; and a fused pass of a BatchNorm model copies every BN activation twice
(ghost_batch_norm's fold, and again in the backward). bench/simulation.py, cnn1d,
global batch 4,096, 1 thread, samples/s against W=1 (one pass of 4,096), W = 2, 4,
16, 64, 128: one pass of all workers 0.85, 0.86, 0.88, 0.94, 0.96; one pass per
worker 1.12, 1.21, 1.26, 0.95 (b=64), 0.80 (b=32); auto 1.12, 1.20, 1.25, 1.12
(4 workers per pass), 1.10 (8 per pass). A model without
BatchNorm runs as one pass (nothing to copy; transformer1d at W=16 was 1.6x faster
fused than one pass per worker), and so does every model on CUDA, where small
passes leave the GPU idle between kernels (not measured here: no GPU).
"""

from __future__ import annotations

from torch import nn

from lbt.nn import GhostBatchNorm, replace_batchnorms


PASS_SAMPLES = 256  # auto's pass size for a BatchNorm model on CPU (bench/simulation.py)


def workers_per_pass(setting: bool | str, workers: int, per_worker_batch: int, has_batchnorm: bool,
                     device_type: str) -> int:
    """How many of a process's k simulated workers share one forward/backward, for dist.fuse_workers=setting
    (pure): k (one fused pass), 1 (one pass per worker), or for auto the most workers whose samples stay
    within PASS_SAMPLES, among the divisors of k."""
    if setting is True or (setting == "auto" and (not has_batchnorm or device_type == "cuda")):
        return workers
    if setting is False:
        return 1
    fit = max(1, PASS_SAMPLES // per_worker_batch)
    return max(g for g in range(1, min(fit, workers) + 1) if workers % g == 0)


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
