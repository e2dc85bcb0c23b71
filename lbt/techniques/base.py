"""The plug-in interface: a technique is a small class with typed, no-op hooks.

Where each hook fires in a run (lbt/engine/build.py builds, lbt/engine/trainer.py loops,
lbt/engine/step.py steps):

    model = build_model()
    for t in techniques: model = t.on_model(model)                 # BN swaps, zero-init, ...
    loss_fn = CrossEntropyLoss()
    for t in techniques: loss_fn = t.on_loss(loss_fn)              # label smoothing
    layouts = [configured layout] * epochs
    for t in techniques: layouts = t.epoch_layouts(layouts, N)     # batch ramp
    for t in techniques: t.check_layout(layout) for each layout    # refuse a layout it cannot serve
    optimizer, schedule = ...                                       # lbt/optim/factory.py, lbt/spec/lr.py
    hook = the step strategy's allreduce                           # DDP's one communication hook (procs > 1),
    for t in techniques: hook = t.comm_hook(hook, ddp)             # composed: compression, measurements
    for epoch:
        for t in techniques: t.on_epoch_start(epoch, model)        # BN statistics reset
        for step:
            lr = lr_at(samples_seen, schedule)
            if a technique's worker_gradient_every divides step:  # beside the step, changing nothing:
                t.on_worker_gradient(worker 0's gradient, b, workers)  # the noise scale's small batch
            for each pass of the local workers: forward, backward  # no_sync but the last (or fused)
                (t.simulated_comm: each simulated worker's gradient compressed, as on its GPU)
            for t in techniques (and the strategy, by order): t.after_backward(model, progress)  # clipping
            optimizer.step()
            at evaluation steps: for t in techniques: t.after_eval(point)   # curves, a tuner's pruning
        for t in techniques: layouts = t.epoch_layouts(layouts, N, after_epoch=epoch)  # batch-size warmup

Techniques run in ascending `order` at every hook (a declared order, so a recipe's list order does not
matter): model surgery before initialisation tweaks, measurements before clipping. Two techniques that
cannot work together say so by type (`conflicts`); the engine refuses the pair in one line. What replaces
the step itself (local SGD, gradient delay) is a step strategy (lbt/engine/strategies/), not a technique.
"""

from __future__ import annotations

from typing import Callable, ClassVar, NamedTuple, Protocol

import torch
from torch import nn

from lbt.spec.batching import BatchLayout
from lbt.spec.result import EvalPoint

# A DDP communication hook without its state: reduces one gradient bucket across processes.
CommHook = Callable[["torch.distributed.GradBucket"], torch.futures.Future]


class Progress(NamedTuple):
    """Where the run is at a step (immutable; built every step)."""

    samples_seen: int
    step: int
    epoch: int
    global_batch: int  # of the current step
    samples_per_epoch: int  # training samples per epoch (the dataset size)
    # What the gradients of the step's backward were multiplied by (fp16 loss scaling, a device tensor;
    # 1.0 otherwise). after_backward sees true gradients; a comm_hook saw them scaled.
    grad_scale: torch.Tensor | float = 1.0


class SimulatedComm(Protocol):
    """What one allreduce sends, summed over the simulated workers of a process, as their GPUs would."""

    def send(self, model: nn.Module, sent: list[torch.Tensor] | None) -> list[torch.Tensor]: ...

    def receive(self, model: nn.Module, sent: list[torch.Tensor]) -> None: ...


class Technique:
    """Base class: every hook is a no-op; a technique overrides what it needs."""

    order: ClassVar[int] = 50
    name: ClassVar[str] = "technique"
    # Types this technique cannot run beside, each with why (checked both ways by the engine).
    conflicts: ClassVar[dict[type, str]] = {}
    # What stands in for the allreduce between the simulated workers of one process, when the
    # technique changes what an allreduce sends (compression); see lbt.techniques.comm_compression.
    simulated_comm: SimulatedComm | None = None
    # True: the technique stands in for the LR decay (a batch ramp), so a decaying schedule beside it
    # decays twice; the run warns.
    replaces_lr_decay: ClassVar[bool] = False
    # True: the LR scaling rule follows the batch the technique sets (an automatic batch ramp), not the
    # configured one.
    lr_follows_batch: ClassVar[bool] = False
    # Every this many steps the step computes worker 0's own gradient beside it, for on_worker_gradient
    # (None: never). A measurement sets it once it knows the layout (check_layout).
    worker_gradient_every: int | None = None

    def on_model(self, model: nn.Module) -> nn.Module:
        return model

    def on_loss(self, loss_fn: Callable) -> Callable:
        return loss_fn

    def epoch_layouts(self, layouts: list[BatchLayout], num_train: int, after_epoch: int | None = None,
                      samples_seen: int = 0) -> list[BatchLayout]:
        """The batch layout of every epoch (a batch ramp changes them); return `layouts` to keep them.

        Called before training (after_epoch None) and at the end of each epoch (after_epoch, 0-based, with
        the samples seen so far), when the epochs after it can still change (an automatic batch ramp).
        A layout's lr_factor is how the technique changes the LR: the schedule (lbt/spec/lr.py) applies
        it from that epoch on.
        """
        return layouts

    def check_layout(self, layout: BatchLayout) -> None:
        """Refuse, with one ConfigError line, a batch layout the technique cannot serve as real workers would."""

    def comm_hook(self, inner: CommHook, ddp_model: nn.Module) -> CommHook:
        """The gradient allreduce with this technique's part added (real processes only).

        DDP takes a single communication hook, so techniques compose one: `inner`
        reduces a bucket so far (torch's allreduce, or a compressed one). Return it
        unchanged, a function that reads the bucket and calls it (measurements),
        or one that reduces the bucket itself (compression).
        """
        return inner

    def on_epoch_start(self, epoch: int, model: nn.Module) -> None:
        pass

    def on_worker_gradient(self, grads: list[torch.Tensor], per_worker_batch: int, workers: int) -> None:
        """The first local worker's own gradient (of its mean loss), one tensor per trainable parameter."""

    def after_backward(self, model: nn.Module, progress: Progress) -> None:
        """After the step's gradient is averaged over all workers, before optimizer.step()."""

    def after_eval(self, point: EvalPoint) -> None:
        """After each evaluation of the held-out split (val, or test without a validation split)."""

    def state_dict(self) -> dict:
        """What a checkpoint must keep for an exact resume (plain values and tensors), per rank."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        """Scalars to log (TensorBoard tag -> value) and to keep in result.json."""
        return {}

    def curves(self) -> dict[str, list[list[float]]]:
        """Series over the run to keep in result.json: name -> [[samples_seen, value], ...]."""
        return {}

    def describe(self) -> str:
        return self.name


def sort_techniques(techniques: list[Technique]) -> list[Technique]:
    return sorted(techniques, key=lambda t: t.order)
