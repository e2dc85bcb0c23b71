"""The data of a step is defined by the global batch only."""

import os
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DistributedSampler

from lbt.data.base import InMemoryDataset
from lbt.data.batches import StepBatches
from lbt.data.sampling import epoch_seed, shard_indices
from lbt.spec.batching import BatchLayout


def test_shards_are_exactly_distributed_sampler():
    n, world_size, seed, epoch = 103, 4, 7, 3
    table = shard_indices(n, world_size, seed, epoch)
    for worker in range(world_size):
        sampler = DistributedSampler(range(n), num_replicas=world_size, rank=worker, shuffle=True,
                                     seed=epoch_seed(seed, epoch), drop_last=True)
        assert table[worker].tolist() == list(sampler)


def test_every_seed_and_epoch_orders_the_data_on_its_own():
    """Seeds are independent replicates: seed 1's epoch e is not seed 0's epoch e + 1 (as seed + epoch made it)."""
    orders = {(seed, epoch): tuple(shard_indices(1000, 1, seed, epoch)[0].tolist())
              for seed in range(4) for epoch in range(6)}
    assert len(set(orders.values())) == len(orders)
    assert orders[(1, 0)] != orders[(0, 1)] and orders[(2, 3)] != orders[(3, 2)]
    assert epoch_seed(0, 1) != epoch_seed(1, 0)


@pytest.mark.slow
def test_every_process_draws_the_same_shuffle_seed():
    """Workers are separate processes: the seed must not depend on Python's per-process hash salt."""
    code = "from lbt.data.sampling import epoch_seed; print(epoch_seed(5, 5), epoch_seed(0, 7))"
    seeds = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": salt},
                            capture_output=True, text=True, check=True).stdout for salt in ("1", "2")}
    assert seeds == {f"{epoch_seed(5, 5)} {epoch_seed(0, 7)}\n"}


def step_sets(world_size: int, procs: int, global_batch: int, n: int = 1000) -> list[list[set]]:
    data = InMemoryDataset(torch.arange(n).float().unsqueeze(1), torch.arange(n))
    per_worker = global_batch // world_size
    k = world_size // procs
    sets_per_proc = []
    for rank in range(procs):
        layout = BatchLayout(world_size, procs, per_worker, global_batch)
        batches = StepBatches(data, layout, rank, seed=0, device=torch.device("cpu"))
        steps = []
        for _, labels in batches.epoch(0):
            assert len(labels) == k * per_worker
            steps.append({int(i) for i in labels})
        sets_per_proc.append(steps)
    # union over processes, per step
    return [set().union(*(proc[s] for proc in sets_per_proc)) for s in range(len(sets_per_proc[0]))]


def test_same_global_batch_same_samples_per_step_for_every_layout():
    reference = step_sets(1, 1, 64)
    assert len(reference) == 1000 // 64
    for world_size, procs in [(4, 1), (4, 2), (4, 4), (16, 2), (64, 1)]:
        assert step_sets(world_size, procs, 64) == reference
    # every sample appears at most once per epoch
    seen = [i for step in reference for i in step]
    assert len(seen) == len(set(seen)) == (1000 // 64) * 64
