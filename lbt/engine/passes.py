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
samples for a BatchNorm model on CPU (`workers_per_pass`): such a pass stays in
cache, while a pass of thousands does not and a pass of 32 pays Python's
per-pass overhead. A model without BatchNorm runs as one pass, and so does every
model on CUDA, where small passes leave the GPU idle between kernels.
bench/results/2026-11-23-simulation.md has the measurements behind the rule;
bench/results/2026-12-03-batchnorm-cpu.md measured it again once the fused
pass's per-worker BatchNorm stopped copying the batch (lbt/nn/batchnorm.py).

Simulated workers share one module, so their BatchNorm running statistics are
kept apart per pass and averaged per step (`BufferMean`).
"""

from __future__ import annotations

import torch
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
    layers = replace_batchnorms(model, lambda bn: GhostBatchNorm.from_batchnorm(bn, per_worker_batch))
    return [layer for layer in layers if isinstance(layer, GhostBatchNorm)]


def set_per_worker_batch(layers: list[GhostBatchNorm], per_worker_batch: int) -> None:
    """Follow a per-worker batch that changes between epochs (batch ramp)."""
    for layer in layers:
        layer.virtual_batch = per_worker_batch


class BufferMean:
    """Per-step mean of the buffers over the virtual workers of one process.

    Simulated workers share one module, so without care worker 2's BN update
    would compound worker 1's. Each worker starts from the step's buffers; the
    process keeps the mean of their floating buffers (running stats) and the
    counters as one worker left them (num_batches_tracked moves by one per
    step, as on a real worker), matching real workers whose running stats are
    averaged (see lbt.parallel.process_group.average_buffers).
    """

    def __init__(self, model: torch.nn.Module):
        self.buffers = list(model.buffers())
        self.start: list[torch.Tensor] = []
        self.total: list[torch.Tensor | None] = []

    @property
    def active(self) -> bool:
        return bool(self.buffers)

    def begin_step(self) -> None:
        self.start = [b.detach().clone() for b in self.buffers]
        self.total = [torch.zeros_like(b) if b.is_floating_point() else None for b in self.buffers]

    def after_pass(self, weight: float, last: bool) -> None:
        """After a forward over a share `weight` of the process's workers."""
        for buffer, start, total in zip(self.buffers, self.start, self.total):
            if total is not None:
                total.add_(buffer, alpha=weight)
                if last:
                    buffer.copy_(total)
            if not last:
                buffer.copy_(start)
