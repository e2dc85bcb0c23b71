"""Synchronized BN: statistics over the whole global batch across processes (torch's nn.SyncBatchNorm).

For when a worker's batch is too small for good BN statistics: cross-GPU BN
(Peng et al. 2018, "MegDet"), distributed BN (Ying et al. 2018, "Image
Classification at Supercomputer Scale").

torch's SyncBatchNorm synchronizes across processes only, and only on CUDA
(its forward rejects CPU tensors once a process group is up). lbt's simulated
workers share one process, so SyncBatchNorm would not pool their statistics:
sync_bn refuses a run with simulated workers (dist.world_size != dist.procs).
"""

from __future__ import annotations

import torch
from torch import nn

from lbt.errors import ConfigError
from lbt.spec.batching import BatchLayout
from lbt.techniques.base import Technique


def runs_on_cuda(device: str | torch.device, cuda_available: bool) -> bool:
    """Whether trainer.device=`device` puts the model on CUDA (auto: CUDA when present), as
    lbt.parallel.process_group.pick_device decides."""
    kind = str(device).split(":")[0]
    return cuda_available and kind in ("auto", "cuda")


class SyncBN(Technique):
    """Convert every BatchNorm to nn.SyncBatchNorm (CUDA only; a ConfigError on CPU).

    `device` is trainer.device (the model is still on the CPU when on_model runs,
    so its parameters do not tell where it will train).
    """

    name = "sync_bn"
    order = 1  # model surgery, before initialisation tweaks (zero_init_residual)

    def __init__(self, device: str = "auto"):
        self.device = str(device)
        self.converted: int | None = None

    def check_layout(self, layout: BatchLayout) -> None:
        if layout.workers_per_proc > 1:
            raise ConfigError(f"technique.sync_bn pools BN statistics across processes, not across the "
                              f"{layout.workers_per_proc} simulated workers of one; run with "
                              "dist.procs=dist.world_size")

    def on_model(self, model: nn.Module) -> nn.Module:
        on_cuda = any(p.is_cuda for p in model.parameters()) or runs_on_cuda(self.device, torch.cuda.is_available())
        if not on_cuda:
            raise ConfigError(
                "technique.sync_bn: torch's SyncBatchNorm runs only on CUDA and this run is on CPU, where each "
                "worker's BN already sees its own per_worker_batch; drop sync_bn "
                "(or use ghost_bn to set a smaller BN batch)"
            )
        # Uses the default process group at forward time; with one process it is plain BN.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.converted = sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
        return model

    def describe(self) -> str:
        layers = "" if self.converted is None else f" ({self.converted} layers)"
        return f"synchronized BN across processes{layers}"
