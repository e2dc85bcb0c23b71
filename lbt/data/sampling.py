"""The data order of a run: which samples each worker takes at each step.

The order is defined by the global batch, so every (world_size, procs) layout with the same
global batch trains on the same samples at the same step, as exact simulation needs (docs/simulation.md).
"""

from __future__ import annotations

import hashlib

import torch


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of (seed, epoch): a hash of both, so every pair orders the data independently.

    (seed + epoch, DistributedSampler's own rule, would make seed 1's epoch e seed 0's epoch e+1:
    runs with different seeds would share data orders and understate the spread between seeds.)
    """
    digest = hashlib.sha256(f"lbt-shuffle:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def shard_indices(num_samples: int, world_size: int, seed: int, epoch: int) -> torch.Tensor:
    """Sample order of one epoch, as a (world_size, samples_per_worker) table.

    Row v is exactly what `DistributedSampler(num_replicas=W, rank=v,
    shuffle=True, seed=epoch_seed(seed, epoch), drop_last=True)` yields at its
    epoch 0 (a test pins this), built once for all workers. Because worker v
    holds perm[v::W], the b-sample slices of step s over all workers cover
    perm[s*B:(s+1)*B]: the data of a step depends on the global batch B only,
    not on how it is split into workers.
    """
    generator = torch.Generator()
    generator.manual_seed(epoch_seed(seed, epoch))
    perm = torch.randperm(num_samples, generator=generator)
    per_worker = num_samples // world_size
    return perm[: per_worker * world_size].view(per_worker, world_size).t()


