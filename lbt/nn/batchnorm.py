"""Ghost batch normalization: BatchNorm statistics per chunk of a batch.

Hoffer, Hubara, Soudry 2017, "Train longer, generalize better", sec. 4. Used by
the technique ghost_bn (chunks smaller than a worker's batch) and by fused
simulation (lbt/engine/passes.py: one chunk per simulated worker).

Running statistics move once per forward, by the mean of the chunks'
statistics. BN's update is linear, so that equals averaging one update per
chunk, the way lbt averages the running stats of its workers
(`lbt.parallel.process_group.average_buffers`, `BufferMean`). Evaluation uses the running stats.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lbt.errors import ConfigError

_PLAIN_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def ghost_batch_norm(
    x: torch.Tensor,
    virtual_batch: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    momentum: float = 0.1,
) -> torch.Tensor:
    """Training-mode BN of x (N, C, *) with statistics per chunk of `virtual_batch` samples.

    Equals F.batch_norm applied to each chunk x[j*v:(j+1)*v]. Given running
    stats, they are updated in place by `momentum` towards the chunks' mean
    statistics (unbiased variance per chunk, as BN does).
    """
    n, c, rest = x.shape[0], x.shape[1], x.shape[2:]
    if n % virtual_batch:
        raise ConfigError(
            f"technique.ghost_bn.virtual_batch={virtual_batch} does not divide the batch of {n} samples "
            f"a BN layer sees; choose a divisor of trainer.per_worker_batch"
        )
    chunks = n // virtual_batch
    if chunks == 1:  # one chunk (a worker's own pass): plain BN, without the fold's copies
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    # One F.batch_norm call: chunk j's channels become channels j*C..j*C+C-1 of
    # a (v, chunks*C, *) tensor, so per-channel statistics are per-chunk ones.
    # A channels_last input (trainer.channels_last) is folded with its channels
    # innermost, so the output stays channels_last for the next convolution, as
    # plain BN's does; the copies are the same two.
    nhwc = x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last)
    folded = fold_channels_last(x, chunks) if nhwc else (
        x.reshape(chunks, virtual_batch, c, *rest).transpose(0, 1).reshape(virtual_batch, chunks * c, *rest))

    def tile(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.repeat(chunks)

    chunk_mean, chunk_var = tile(running_mean), tile(running_var)
    out = F.batch_norm(folded, chunk_mean, chunk_var, tile(weight), tile(bias), True, momentum, eps)
    if running_mean is not None and running_var is not None and chunk_mean is not None and chunk_var is not None:
        with torch.no_grad():
            # Each chunk moved its own copy of the running stats; keep their mean.
            running_mean.copy_(chunk_mean.view(chunks, c).mean(0))
            running_var.copy_(chunk_var.view(chunks, c).mean(0))
    if nhwc:
        return unfold_channels_last(out, chunks)
    return out.reshape(virtual_batch, chunks, c, *rest).transpose(0, 1).reshape(x.shape)


def fold_channels_last(x: torch.Tensor, chunks: int) -> torch.Tensor:
    """(chunks*v, C, H, W) in channels_last -> (v, chunks*C, H, W) in channels_last, chunk j's channels at
    j*C..j*C+C-1 (one copy: the channels-innermost view is contiguous)."""
    n, c, h, w = x.shape
    nhwc = x.permute(0, 2, 3, 1).reshape(chunks, n // chunks, h, w, c)
    return nhwc.permute(1, 2, 3, 0, 4).reshape(n // chunks, h, w, chunks * c).permute(0, 3, 1, 2)


def unfold_channels_last(out: torch.Tensor, chunks: int) -> torch.Tensor:
    """The inverse of `fold_channels_last` (one copy)."""
    v, folded_c, h, w = out.shape
    c = folded_c // chunks
    nhwc = out.permute(0, 2, 3, 1).reshape(v, h, w, chunks, c)
    return nhwc.permute(3, 0, 1, 2, 4).reshape(chunks * v, h, w, c).permute(0, 3, 1, 2)


class GhostBatchNorm(_BatchNorm):
    """A BatchNorm (1d, 2d or 3d input) whose training statistics come from ghost batches.

    Same parameters and buffers under the same names as nn.BatchNorm*d, so
    state_dicts load either way; eval mode is plain BN with running stats.
    """

    def __init__(self, num_features: int, virtual_batch: int = 32, eps: float = 1e-5,
                 momentum: float | None = 0.1, affine: bool = True, track_running_stats: bool = True,
                 device=None, dtype=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.virtual_batch = virtual_batch

    @classmethod
    def from_batchnorm(cls, bn: _BatchNorm, virtual_batch: int) -> "GhostBatchNorm":
        ghost = cls(bn.num_features, virtual_batch, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
        # Share the very tensors, so anything already holding them (an optimizer) stays valid.
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            setattr(ghost, name, getattr(bn, name))
        return ghost.train(bn.training)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"GhostBatchNorm expects (N, C, *) input, got shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        # The momentum rules of _BatchNorm.forward (None: cumulative average).
        momentum = 0.0 if self.momentum is None else self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        track = self.track_running_stats
        return ghost_batch_norm(
            input, self.virtual_batch, self.weight, self.bias, self.eps,
            self.running_mean if track else None, self.running_var if track else None, momentum,
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, virtual_batch={self.virtual_batch}"


def replace_batchnorms(module: nn.Module, make: Callable[[_BatchNorm], nn.Module]) -> list[nn.Module]:
    """Replace every nn.BatchNorm1d/2d/3d under `module` by make(layer), in place; return the new layers.

    Other BN flavours (GhostBatchNorm, SyncBatchNorm) are left as they are.
    """
    replaced = []
    for name, child in module.named_children():
        if isinstance(child, _PLAIN_BATCH_NORMS):
            new = make(child)
            setattr(module, name, new)
            replaced.append(new)
        else:
            replaced += replace_batchnorms(child, make)
    return replaced
