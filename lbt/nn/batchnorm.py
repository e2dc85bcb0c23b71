"""Ghost batch normalization: BatchNorm statistics per chunk of a batch.

Hoffer, Hubara, Soudry 2017, "Train longer, generalize better", sec. 4. Used by
the technique ghost_bn (chunks smaller than a worker's batch) and by fused
simulation (lbt/engine/passes.py: one chunk per simulated worker).

How: chunk j of a (N, C, *) batch, x[j*v:(j+1)*v], is a contiguous view of it,
in NCHW and in channels_last alike. So each chunk goes through the very ATen
kernels F.batch_norm runs on a worker's own batch (`native_batch_norm`
forward, `native_batch_norm_backward` backward), reading the chunk in place and
writing into its slice of one output of the input's layout: no fold of the
batch into channels, no copy of it in the forward, and the numbers of each
worker's own BN, bit for bit (on CPU; tests/test_batchnorm.py). The backward's
kernel returns each chunk's input gradient in a buffer of its own, copied into
its slice while still in cache. The cost is one kernel call per chunk and layer
(bench/batchnorm.py measures it against the fold this replaced: one F.batch_norm
over the chunks folded into channels, and two copies of the batch each way).
On CUDA the same kernels run (torch's own CUDA ones; a worker's F.batch_norm may
pick cuDNN's there, so the two round differently on a GPU, as the fold did).
Under torch.compile, which cannot trace writes into views of one output, the
chunks' statistics are reductions over a (chunks, v, C, *) view of the batch
instead (`grouped_batch_norm`), which the compiler fuses across chunks.

Running statistics: each chunk moves its own copy of them, as a worker's BN
does; the layer keeps the mean of the copies. That is the average of the
workers' running stats that lbt takes (`lbt.parallel.process_group.average_buffers`,
`BufferMean`). Evaluation uses the running stats.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lbt.errors import ConfigError

_PLAIN_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_DENSE_FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}
_BACKWARD = torch.ops.aten.native_batch_norm_backward.default  # what F.batch_norm's autograd calls


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

    Equals F.batch_norm applied to each chunk x[j*v:(j+1)*v], bit for bit on CPU.
    Given running stats, each chunk updates a copy of them by `momentum`
    (unbiased variance, as BN does) and they become the copies' mean.
    """
    n = x.shape[0]
    if n % virtual_batch:
        raise ConfigError(
            f"technique.ghost_bn.virtual_batch={virtual_batch} does not divide the batch of {n} samples "
            f"a BN layer sees; choose a divisor of trainer.per_worker_batch"
        )
    chunks = n // virtual_batch
    if chunks == 1:  # one chunk (a worker's own pass): plain BN
        return F.batch_norm(x, running_mean, running_var, weight, bias, True, momentum, eps)
    if torch.compiler.is_compiling():
        # The per-chunk kernels write into views of one output, which torch.compile cannot trace; compiled, BN
        # is generated code (not the eager kernels) on real workers too, so the grouped form loses nothing.
        return grouped_batch_norm(x, chunks, weight, bias, eps, running_mean, running_var, momentum)
    chunk_mean, chunk_var = _copies(running_mean, chunks), _copies(running_var, chunks)
    out = _ChunkBatchNorm.apply(_dense(x), weight, bias, chunk_mean, chunk_var, virtual_batch, momentum, eps)
    with torch.no_grad():
        for running, copies in ((running_mean, chunk_mean), (running_var, chunk_var)):
            if running is not None and copies is not None:
                running.copy_(copies.mean(0))
    return out


def _copies(running: torch.Tensor | None, chunks: int) -> torch.Tensor | None:
    """One row of running stats per chunk, (chunks, C): what each simulated worker's BN would update."""
    return None if running is None else running.repeat(chunks, 1)


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x if it is contiguous or channels_last, else a contiguous copy: its chunks and the output's must share
    strides, and those two layouts keep every chunk a contiguous view."""
    layout = _DENSE_FORMATS.get(x.dim())
    if x.is_contiguous() or (layout is not None and x.is_contiguous(memory_format=layout)):
        return x
    return x.contiguous()


class _ChunkBatchNorm(torch.autograd.Function):
    """Training-mode BN per chunk of `chunk` samples of a dense x, by BN's own ATen kernels, chunk by chunk.

    Autograd over per-chunk F.batch_norm calls would cost a copy of the batch each way (torch.cat of the
    outputs, split's backward); here the forward writes each chunk's output in place (the `out=` kernel),
    and the backward copies each chunk's input gradient once. The weight and bias gradients are the chunks'
    ones summed in chunk order. `chunk_mean`/`chunk_var` (chunks, C), if given, are updated row by row.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                chunk_mean: torch.Tensor | None, chunk_var: torch.Tensor | None, chunk: int, momentum: float,
                eps: float) -> torch.Tensor:
        chunks = x.shape[0] // chunk
        out = torch.empty_like(x)  # x's strides (x is dense): each chunk's slice has its chunk's layout
        save_mean = x.new_empty((chunks, x.shape[1]), dtype=_stats_dtype(x, weight, bias, chunk_mean, chunk_var))
        save_invstd = torch.empty_like(save_mean)
        for x_j, out_j, mean_j, var_j, save_mean_j, save_invstd_j in zip(
                x.split(chunk), out.split(chunk), _rows(chunk_mean, chunks), _rows(chunk_var, chunks),
                save_mean.unbind(0), save_invstd.unbind(0)):
            torch.native_batch_norm(x_j, weight, bias, mean_j, var_j, True, momentum, eps,
                                    out=(out_j, save_mean_j, save_invstd_j))
        ctx.save_for_backward(x, weight, save_mean, save_invstd)
        ctx.chunk, ctx.eps = chunk, eps
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, save_mean, save_invstd = ctx.saved_tensors
        mask = [bool(need) for need in ctx.needs_input_grad[:3]]
        grad_x = torch.empty_like(x) if mask[0] else None
        grads_x = [None] * len(save_mean) if grad_x is None else grad_x.split(ctx.chunk)
        grad_weight = grad_bias = None
        for grad_j, x_j, mean_j, invstd_j, grad_x_j in zip(
                grad_out.split(ctx.chunk), x.split(ctx.chunk), save_mean.unbind(0), save_invstd.unbind(0), grads_x):
            grad_input_j, grad_weight_j, grad_bias_j = _BACKWARD(
                grad_j, x_j, weight, None, None, mean_j, invstd_j, True, ctx.eps, mask)
            if grad_x_j is not None:  # the kernel's buffer is still in cache
                grad_x_j.copy_(grad_input_j)
            if mask[1]:
                grad_weight = grad_weight_j if grad_weight is None else grad_weight.add_(grad_weight_j)
            if mask[2]:
                grad_bias = grad_bias_j if grad_bias is None else grad_bias.add_(grad_bias_j)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


def _stats_dtype(x: torch.Tensor, *params: torch.Tensor | None) -> torch.dtype:
    """The dtype the forward kernel keeps a chunk's mean and 1/std in (its `out=` form wants them given): on
    CPU the parameters' (float32 beside a bf16 input under autocast), else the input's. CUDA's kernel differs
    (float32 for any bf16/fp16 input, whatever the parameters), hence the one CUDA-only line."""
    if x.is_cuda:
        return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    given = [p for p in params if p is not None]
    return given[0].dtype if given else x.dtype


def _rows(t: torch.Tensor | None, chunks: int) -> Sequence[torch.Tensor | None]:
    """The rows of a (chunks, C) tensor (views), or a None for each chunk."""
    return [None] * chunks if t is None else t.unbind(0)


def grouped_batch_norm(
    x: torch.Tensor,
    chunks: int,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    running_mean: torch.Tensor | None = None,
    running_var: torch.Tensor | None = None,
    momentum: float = 0.1,
) -> torch.Tensor:
    """`ghost_batch_norm` with `chunks` chunks as reductions over a (chunks, v, C, *) view of x, broadcast back:
    what ghost_batch_norm runs under torch.compile, which fuses each step into one kernel for all chunks. Equal
    to it up to rounding (its sums run in another order); statistics in float32 for a bf16/fp16 input, as BN's."""
    grouped = x.unflatten(0, (chunks, -1))  # a view in either layout
    dims = [1, *range(3, grouped.dim())]
    stats = grouped.float() if x.dtype in (torch.float16, torch.bfloat16) else grouped
    var, mean = torch.var_mean(stats, dim=dims, correction=0, keepdim=True)
    scale = torch.rsqrt(var + eps)
    per_channel = [1, 1, -1] + [1] * (grouped.dim() - 3)
    if weight is not None:
        scale = scale * weight.reshape(per_channel)
    shift = -mean * scale if bias is None else bias.reshape(per_channel) - mean * scale
    out = (stats * scale + shift).to(x.dtype).flatten(0, 1)
    with torch.no_grad():
        count = grouped[0].numel() // grouped.shape[2]  # values behind each chunk's statistic of a channel
        unbiased = var * (count / max(count - 1, 1))
        for running, chunk_stat in ((running_mean, mean), (running_var, unbiased)):
            if running is not None:
                copies = torch.lerp(running, chunk_stat.reshape(chunks, -1).to(running.dtype), momentum)
                running.copy_(copies.mean(0))
    return out


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
