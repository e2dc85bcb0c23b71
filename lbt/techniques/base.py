"""The plug-in interface: a technique is a small class with typed, no-op hooks.

Where each hook fires in a run (see lbt/train.py and lbt/trainer.py):

    model = build_model()
    for t in techniques: model = t.on_model(model)               # BN swaps, zero-init, ...
    optimizer = build_optimizer(model.parameters())
    for t in techniques: optimizer = t.on_optimizer(optimizer, model)  # param groups, LARS
    loss_fn = CrossEntropyLoss()
    for t in techniques: loss_fn = t.on_loss(loss_fn)            # label smoothing
    ddp = DistributedDataParallel(model)                          # when procs > 1
    hook = allreduce                                              # DDP's one communication hook,
    for t in techniques: hook = t.comm_hook(hook, ddp)            # composed: compression, measurements
    for epoch: plan = base_plan; for t in techniques: plan = t.epoch_plan(epoch, plan)  # batch ramp
    for epoch:
        for t in techniques: t.on_epoch_start(epoch, model)       # BN statistics reset
        for step:
            progress = Progress(samples_seen, global_batch, ...)
            scale = prod(t.lr_scale(progress))                    # scaling rules
            lr = base_lr * scale * prod(t.lr_factor(progress, scale))  # warmup, decay
            for worker in local workers: forward, backward        # no_sync but the last (or fused)
                (first worker alone, if a technique wants_worker_gradient:
                 t.on_worker_gradient(model, per_worker_batch, workers))  # gradient noise scale
            for t in techniques: t.after_backward(model, progress)  # clipping, measurements
            optimizer.step()
        for t in techniques: t.before_eval(model)                 # BN recalibration
        evaluate()

Techniques run in ascending `order` at every hook (a declared order, so a
recipe's list order does not matter): model surgery before initialisation
tweaks, group splitting before optimizers that read the groups.
"""

from __future__ import annotations

from typing import Callable, ClassVar, NamedTuple

import torch
from torch import nn

from lbt.config import BatchPlan

# A DDP communication hook without its state: reduces one gradient bucket across processes.
CommHook = Callable[["torch.distributed.GradBucket"], torch.futures.Future]


class Progress(NamedTuple):
    """Where the run is, in the units LR schedules use: samples seen (immutable; built every step)."""

    samples_seen: int
    step: int
    epoch: int
    global_batch: int  # of the current step
    base_global_batch: int  # as configured, before any batch ramp
    samples_per_epoch: int  # training samples per epoch (the dataset size)
    total_samples: int  # samples the whole run will see


class Technique:
    """Base class: every hook is a no-op; a technique overrides what it needs."""

    order: ClassVar[int] = 50
    name: ClassVar[str] = "technique"
    # True: the trainer back-propagates a process's first worker on its own
    # and calls on_worker_gradient with that single worker's gradient.
    wants_worker_gradient: ClassVar[bool] = False

    def on_model(self, model: nn.Module) -> nn.Module:
        return model

    def on_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return optimizer

    def on_loss(self, loss_fn: Callable) -> Callable:
        return loss_fn

    def comm_hook(self, inner: CommHook, ddp_model: nn.Module) -> CommHook:
        """The gradient allreduce with this technique's part added (real processes only).

        DDP takes a single communication hook, so techniques compose one: `inner`
        reduces a bucket so far (torch's allreduce, or a compressed one). Return it
        unchanged, a function that reads the bucket and calls it (measurements),
        or one that reduces the bucket itself (compression).
        """
        return inner

    def epoch_plan(self, epoch: int, plan: BatchPlan) -> BatchPlan:
        """The batch layout of `epoch`; called for every epoch before training starts."""
        return plan

    def on_epoch_start(self, epoch: int, model: nn.Module) -> None:
        pass

    def lr_scale(self, progress: Progress) -> float:
        """Multiplier of the target LR (scaling rules)."""
        return 1.0

    def lr_factor(self, progress: Progress, scale: float) -> float:
        """Multiplier shaping the LR over time (warmup, decay); `scale` is the product of lr_scale."""
        return 1.0

    def on_worker_gradient(self, model: nn.Module, per_worker_batch: int, workers: int) -> None:
        """Gradients hold the first local worker's gradient divided by `workers`."""

    def after_backward(self, model: nn.Module, progress: Progress) -> None:
        """After the step's gradient is averaged over all workers, before optimizer.step()."""

    def before_eval(self, model: nn.Module) -> None:
        pass

    def state_dict(self) -> dict:
        """What a checkpoint must keep for an exact resume (plain values and tensors)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """Scalars to log (TensorBoard tag -> value) and to keep in result.json."""
        return {}

    def describe(self) -> str:
        return self.name


def sort_techniques(techniques: list[Technique]) -> list[Technique]:
    return sorted(techniques, key=lambda t: t.order)


def learning_rate(base_lr: float, techniques: list[Technique], progress: Progress) -> tuple[float, float]:
    """base_lr x scaling x warmup x decay; returns (lr, scale)."""
    scale = 1.0
    for technique in techniques:
        scale *= technique.lr_scale(progress)
    lr = base_lr * scale
    for technique in techniques:
        lr *= technique.lr_factor(progress, scale)
    return lr, scale
