"""The data of each optimizer step, split into the batches of the virtual workers.

The order is defined by the global batch (see `lbt.data.sampling.shard_indices`), so
every (world_size, procs) layout with the same global batch trains on the same
samples at the same step.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from multiprocessing.context import BaseContext
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from lbt.data.base import InMemoryDataset, dataset_size
from lbt.data.sampling import shard_indices
from lbt.spec.batching import BatchLayout


def worker_context() -> BaseContext | None:
    """How DataLoader starts its workers: the default, unless this process is itself a joblib (loky) worker
    (hydra/launcher=local_parallel), whose default start method is loky's, which DataLoader's workers cannot
    use ("'Process' object has no attribute 'env'"); then the platform's own."""
    if type(multiprocessing.get_context()).__module__.startswith("multiprocessing"):
        return None
    return multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")


def loader_workers(requested: int | None, local_procs: int) -> int:
    """DataLoader worker processes per training process: as asked, or the process's share of the
    machine's cores less the one it trains on, at most 8 (trainer.loader_workers=null)."""
    if requested is not None:
        return requested
    return max(0, min(8, (os.cpu_count() or 1) // local_procs - 1))


class StepBatches:
    """Yields, per step, this process's (inputs, labels): its virtual workers'
    per_worker_batch samples one after another (worker-major), so chunk i of
    size per_worker_batch is local worker i's batch.

    In-memory datasets are gathered by index from the tensors, on the device they
    live on (the trainer moves them to the run's device once): one index_select per
    step, no per-sample Python work and no host round trip. Other datasets (image
    folders, CIFAR-10) go through one DataLoader, kept across epochs with persistent
    worker processes, whose batch sampler yields the process's indices of each step;
    on CUDA it pins host memory so the copy to the device is asynchronous.
    """

    def __init__(self, dataset: Dataset, layout: BatchLayout, rank: int, seed: int, device: torch.device,
                 num_workers: int = 0, memory_format: torch.memory_format = torch.contiguous_format):
        self.dataset = dataset
        self.world_size = layout.world_size
        self.per_worker_batch = layout.per_worker_batch
        self.workers_per_proc = layout.workers_per_proc
        first_worker = rank * layout.workers_per_proc
        self.local_workers = slice(first_worker, first_worker + layout.workers_per_proc)
        self.seed = seed
        self.device = device
        self.num_workers = num_workers
        self.memory_format = memory_format
        self.steps_per_epoch = layout.steps_per_epoch(dataset_size(dataset))
        self.steps: list[list[int]] = []  # the DataLoader's batch sampler: the steps being loaded
        self._loader: DataLoader | None = None

    def step_indices(self, epoch: int) -> torch.Tensor:
        """(steps, workers_per_proc * per_worker_batch): this process's indices per step."""
        b = self.per_worker_batch
        shards = shard_indices(dataset_size(self.dataset), self.world_size, self.seed, epoch)[self.local_workers]
        steps = shards[:, : self.steps_per_epoch * b].reshape(self.workers_per_proc, self.steps_per_epoch, b)
        # worker-major within a step: chunk i of a step's batch is local worker i's batch
        return steps.permute(1, 0, 2).reshape(self.steps_per_epoch, self.workers_per_proc * b)

    def epoch(self, epoch: int, start_step: int = 0, end_step: int | None = None
              ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of steps start_step .. end_step - 1 of `epoch` (to the epoch's end by default)."""
        indices = self.step_indices(epoch)[start_step:end_step]
        if isinstance(self.dataset, InMemoryDataset):
            x, y = self.dataset.x, self.dataset.y
            indices = indices.to(x.device)  # once per epoch, so each step's gather stays on the data's device
            for step in indices:
                yield self._to_device(x.index_select(0, step), y.index_select(0, step))
        else:
            self.steps = indices.tolist()
            for inputs, labels in self.loader():
                yield self._to_device(inputs, labels)

    def loader(self) -> DataLoader:
        if self._loader is None:
            self._loader = DataLoader(
                self.dataset,
                batch_sampler=_Steps(self),
                num_workers=self.num_workers,
                pin_memory=self.device.type == "cuda",
                persistent_workers=self.num_workers > 0,
                multiprocessing_context=worker_context() if self.num_workers else None,
            )
        return self._loader

    def _to_device(self, inputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = inputs.to(self.device, non_blocking=True).contiguous(memory_format=self.memory_format)
        return inputs, labels.to(self.device, non_blocking=True)


class _Steps:
    """A batch sampler that reads the steps its StepBatches is loading now (the loader outlives an epoch)."""

    def __init__(self, batches: StepBatches):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches.steps)

    def __len__(self) -> int:
        return len(self.batches.steps)


def eval_batches(dataset: Dataset, rank: int, procs: int, batch: int, device: torch.device, num_workers: int = 0,
                 memory_format: torch.memory_format = torch.contiguous_format):
    """This process's share (every procs-th sample) of an evaluation set, in batches.

    Every process gets as many batches as the largest share has: a share that runs out first gets empty
    ones, since a sharded model (dist.shard=fsdp) gathers its parameters with every forward, which all
    processes must make together."""
    largest_share = math.ceil(math.ceil(dataset_size(dataset) / procs) / batch)  # rank 0's, in batches
    count = 0
    for inputs, labels in _share_batches(dataset, rank, procs, batch, device, num_workers, memory_format):
        count += 1
        yield inputs, labels
    if count < largest_share:
        x, y = dataset[0]
        empty = (torch.as_tensor(x).unsqueeze(0)[:0].to(device).contiguous(memory_format=memory_format),
                 torch.as_tensor(y).unsqueeze(0)[:0].to(device))
        for _ in range(largest_share - count):
            yield empty


def _share_batches(dataset: Dataset, rank: int, procs: int, batch: int, device: torch.device, num_workers: int,
                   memory_format: torch.memory_format):
    if isinstance(dataset, InMemoryDataset):
        x, y = dataset.x[rank::procs], dataset.y[rank::procs]
        for start in range(0, len(y), batch):
            inputs = x[start : start + batch].to(device).contiguous(memory_format=memory_format)
            yield inputs, y[start : start + batch].to(device)
        return
    subset = torch.utils.data.Subset(dataset, range(rank, dataset_size(dataset), procs))
    loader = DataLoader(subset, batch_size=batch, num_workers=num_workers, pin_memory=device.type == "cuda",
                        multiprocessing_context=worker_context() if num_workers else None)
    for inputs, labels in loader:
        inputs = inputs.to(device, non_blocking=True).contiguous(memory_format=memory_format)
        yield inputs, labels.to(device, non_blocking=True)
