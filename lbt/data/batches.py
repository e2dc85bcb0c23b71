"""The data of each optimizer step, split into the batches of the virtual workers.

The order is defined by the global batch (see `lbt.dist.shard_indices`), so
every (world_size, procs) layout with the same global batch trains on the same
samples at the same step.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from lbt.config import BatchPlan
from lbt.data.base import InMemoryDataset
from lbt.dist import shard_indices


class StepBatches:
    """Yields, per step, this process's (inputs, labels): its virtual workers'
    per_worker_batch samples one after another (worker-major), so chunk i of
    size per_worker_batch is local worker i's batch.

    In-memory datasets are gathered by index from the tensors (one index_select
    per step, no per-sample Python work); other datasets go through a DataLoader
    whose batch sampler yields the process's indices of each step.
    """

    def __init__(self, dataset: Dataset, plan: BatchPlan, rank: int, seed: int, device: torch.device,
                 num_workers: int = 0):
        self.dataset = dataset
        self.world_size = plan.world_size
        self.per_worker_batch = plan.per_worker_batch
        self.workers_per_proc = plan.workers_per_proc
        first_worker = rank * plan.workers_per_proc
        self.local_workers = slice(first_worker, first_worker + plan.workers_per_proc)
        self.seed = seed
        self.device = device
        self.num_workers = num_workers
        self.steps_per_epoch = plan.steps_per_epoch(len(dataset))

    def step_indices(self, epoch: int) -> torch.Tensor:
        """(steps, workers_per_proc * per_worker_batch): this process's indices per step."""
        b = self.per_worker_batch
        shards = shard_indices(len(self.dataset), self.world_size, self.seed, epoch)[self.local_workers]
        steps = shards[:, : self.steps_per_epoch * b].reshape(self.workers_per_proc, self.steps_per_epoch, b)
        # worker-major within a step: chunk i of a step's batch is local worker i's batch
        return steps.permute(1, 0, 2).reshape(self.steps_per_epoch, self.workers_per_proc * b)

    def epoch(self, epoch: int, start_step: int = 0, end_step: int | None = None
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of steps start_step .. end_step - 1 of `epoch` (to the epoch's end by default)."""
        indices = self.step_indices(epoch)[start_step:end_step]
        if isinstance(self.dataset, InMemoryDataset):
            x, y = self.dataset.x, self.dataset.y
            for step in indices:
                yield self._to_device(x[step], y[step])
        else:
            loader = DataLoader(
                self.dataset,
                batch_sampler=indices.tolist(),
                num_workers=self.num_workers,
                pin_memory=self.device.type == "cuda",
            )
            for inputs, labels in loader:
                yield self._to_device(inputs, labels)

    def _to_device(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs.to(self.device, non_blocking=True), labels.to(self.device, non_blocking=True)


def eval_batches(dataset: Dataset, rank: int, procs: int, batch: int, device: torch.device):
    """This process's share (every procs-th sample) of an evaluation set, in batches."""
    if isinstance(dataset, InMemoryDataset):
        x, y = dataset.x[rank::procs], dataset.y[rank::procs]
        for start in range(0, len(y), batch):
            yield x[start : start + batch].to(device), y[start : start + batch].to(device)
        return
    subset = torch.utils.data.Subset(dataset, range(rank, len(dataset), procs))
    for inputs, labels in DataLoader(subset, batch_size=batch):
        yield inputs.to(device), labels.to(device)
