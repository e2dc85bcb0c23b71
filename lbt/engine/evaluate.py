"""Evaluation: loss and top-1 accuracy of a model over a whole dataset, shared out over processes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lbt.data.batches import eval_batches
from lbt.engine.precision import Precision
from lbt.parallel.process_group import DistContext, all_reduce_sum


@torch.no_grad()
def evaluate(model: nn.Module, dataset: Any, ctx: DistContext, precision: Precision, batch: int = 1024,
             loader_workers: int = 0,
             memory_format: torch.memory_format = torch.contiguous_format) -> tuple[float, float]:
    """(mean loss, accuracy) over `dataset`, in eval mode; each process takes its share, the totals are summed.

    A language model's labels are (N, T) tokens: the mean is over tokens. A tensor-parallel group's
    ranks evaluate the same samples, so its totals count T times, in every ratio alike.
    """
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for inputs, labels in eval_batches(dataset, ctx.dp_rank, ctx.dp_procs, batch, ctx.device, loader_workers,
                                       memory_format):
        with precision.autocast():
            logits = model(inputs)
        totals[0] += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
        totals[1] += (logits.argmax(1) == labels).sum().item()
        totals[2] += labels.numel()
    all_reduce_sum(totals, ctx)
    return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()
