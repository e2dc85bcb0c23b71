"""Evaluation: loss and top-1 accuracy of a model over a whole dataset, shared out over processes; and the
weights it scores when the optimizer averages its iterates (schedule-free: `AveragedWeights`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lbt.data.base import InMemoryDataset
from lbt.data.batches import eval_batches
from lbt.engine.precision import Precision
from lbt.engine.strategies.base import StepStrategy
from lbt.errors import ConfigError
from lbt.nn.batchnorm import GhostBatchNorm
from lbt.parallel.process_group import DistContext, all_reduce_sum
from lbt.spec.lr import Schedule

if TYPE_CHECKING:
    from lbt.engine.build import Parts


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


# Training samples (the first ones, in order; at least one per-worker batch) from which BatchNorm statistics are
# recomputed at the averaged weights: 8 batches of 64, a few forward passes per evaluation.
NORM_SAMPLES = 512


def has_eval_mode(optimizer: Any) -> bool:
    """Whether an optimizer scores other weights than it steps from: schedule-free's train() / eval() pair
    (the `schedulefree` package, pytorch_optimizer's ScheduleFree*); torch's optimizers have neither."""
    return callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None))


class AveragedWeights:
    """The weights an evaluation scores, when the optimizer averages its iterates (schedule-free).

    Schedule-free (Defazio et al. 2024) steps from a point y between its latest iterate z and their running
    average x, and x is the model: `optimizer.eval()` moves the parameters to x, `optimizer.train()` back to y.
    lbt keeps the optimizer in train mode while it trains and in every checkpoint and snapshot (its state
    dict, with y as the parameters, is what continues the run exactly), and scores x:

        with averaged():   every evaluation (val, test; lbt probe's snapshots): x during it, then y back bit
                           for bit (restored from a copy: train()'s lerp rounds, and an evaluation must not
                           change the run it measures)
        averaged.keep()    at the end of training: x for good, for the test split and the saved final model

    BatchNorm's running statistics were gathered at y; at x they are recomputed from the first NORM_SAMPLES
    training samples (the package's advice), then put back after the evaluation. With an optimizer without
    an eval mode, `averaged()` only puts the model back in train mode and `keep()` does nothing.
    """

    def __init__(self, parts: Parts, ctx: DistContext, precision: Precision,
                 memory_format: torch.memory_format = torch.contiguous_format):
        inner: Any = getattr(parts.optimizer, "optim", parts.optimizer)  # under torch's PostLocalSGDOptimizer
        self.model = parts.model
        self.optimizer: Any = inner if has_eval_mode(inner) else None  # None: no eval mode, nothing to switch
        self.train_set, self.batch, self.ctx = parts.data.train, parts.layout.per_worker_batch, ctx
        self.precision, self.memory_format, self.kept = precision, memory_format, False
        if self.optimizer is not None:
            check_averaging(type(self.optimizer).__name__, parts.schedule, parts.strategy)
            self.optimizer.train()  # the package starts in eval mode and refuses to step there

    @contextmanager
    def __call__(self) -> Iterator[None]:
        """During an evaluation: the averaged weights; after it, the model in train mode and the weights and
        BN statistics as they were."""
        saved = None
        if self.optimizer is not None and not self.kept:
            saved = [t.detach().clone() for t in self._weights_and_norms()]
            self.optimizer.eval()
            self.recompute_norms()
        try:
            yield
        finally:
            if saved is not None:
                assert self.optimizer is not None
                self.optimizer.train()
                with torch.no_grad():
                    for tensor, value in zip(self._weights_and_norms(), saved):
                        tensor.copy_(value)
            self.model.train()

    def keep(self) -> None:
        """The averaged weights (and their BN statistics) from now on: training is over."""
        if self.optimizer is not None and not self.kept:
            self.optimizer.eval()
            self.recompute_norms()
            self.kept = True

    def _weights_and_norms(self) -> list[torch.Tensor]:
        assert self.optimizer is not None
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return params + [b for m in _norms(self.model) for b in m.buffers()]

    @torch.no_grad()
    def recompute_norms(self) -> None:
        """BatchNorm running statistics at the current weights: a cumulative average over the first
        NORM_SAMPLES training samples, in batches of the per-worker batch (what BN sees in training), the
        other modules in eval mode (no dropout). Every process takes the same samples (a tensor-parallel
        or sharded forward is a collective), so their statistics agree."""
        norms = _norms(self.model)
        if not norms:
            return
        saved = [(m.momentum, m.virtual_batch if isinstance(m, GhostBatchNorm) else None) for m in norms]
        self.model.eval()
        for m in norms:
            m.reset_running_stats()
            m.momentum = None  # a cumulative average over the batches
            if isinstance(m, GhostBatchNorm):  # fused workers, technique ghost_bn: chunks that divide the batch
                m.virtual_batch = math.gcd(m.virtual_batch, self.batch)
            m.train()
        try:
            samples = _first(self.train_set, max(NORM_SAMPLES, self.batch))
            for inputs, _ in eval_batches(samples, 0, 1, self.batch, self.ctx.device, memory_format=self.memory_format):
                with self.precision.autocast():
                    self.model(inputs)
        finally:
            for m, (momentum, virtual_batch) in zip(norms, saved):
                m.momentum = momentum
                if isinstance(m, GhostBatchNorm) and virtual_batch is not None:
                    m.virtual_batch = virtual_batch


def check_averaging(name: str, schedule: Schedule, strategy: StepStrategy) -> None:
    """One line for what schedule-free cannot run with: an LR that decays or drops after the warmup (it
    averages its iterates in place of a decay), and a step strategy that scores another model than the one
    the optimizer holds (local SGD's average of the workers' models)."""
    if schedule.decay != "constant" or schedule.drops:
        why = f"schedule.decay={schedule.decay}" if schedule.decay != "constant" else \
            "an LR that drops at milestones (step decay, or a batch ramp capped at its largest batch)"
        raise ConfigError(f"optim.optimizer_class={name} is schedule-free: it averages its iterates instead of "
                          f"decaying the LR, and needs the LR constant after the warmup, not {why}; use "
                          "schedule=constant (recipe=schedulefree)")
    base = StepStrategy
    if type(strategy).evaluated is not base.evaluated or type(strategy).wrap_optimizer is not base.wrap_optimizer:
        raise ConfigError(f"strategy={strategy.name} with optim.optimizer_class={name}: its evaluation scores "
                          "another model than the optimizer's, so schedule-free's averaged weights cannot be "
                          "switched in; use one of them")


def _norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]


def _first(dataset: Any, samples: int) -> Any:
    """The first `samples` samples of a dataset, in order."""
    samples = min(samples, len(dataset))
    if isinstance(dataset, InMemoryDataset):
        return InMemoryDataset(dataset.x[:samples], dataset.y[:samples])
    return torch.utils.data.Subset(dataset, range(samples))
