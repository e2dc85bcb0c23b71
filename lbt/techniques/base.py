"""The plug-in interface: a technique is a small class with typed, no-op hooks.

Where each hook fires in a run (lbt/train.py builds, lbt/trainer.py loops):

    model = build_model()
    for t in techniques: t.check_together(techniques)             # refuse combinations that cannot work
    for t in techniques: model = t.on_model(model)               # BN swaps, zero-init, ...
    loss_fn = CrossEntropyLoss()
    for t in techniques: loss_fn = t.on_loss(loss_fn)            # label smoothing
    plans = [base_plan] * epochs
    for t in techniques: plans = t.plan_epochs(plans, num_train) # batch ramp
    for t in techniques: t.check_plan(plan) for each plan        # refuse a layout it cannot serve
    optimizer = create_optimizer(model)                           # once (lbt/optim/factory.py)
    for t in techniques: optimizer = t.on_optimizer(optimizer, model)  # local SGD's averaging optimizer
    schedule = build_schedule(...)                                # the LR (lbt/lr.py)
    ddp = DistributedDataParallel(model)                          # when procs > 1
    hook = allreduce                                              # DDP's one communication hook,
    for t in techniques: hook = t.comm_hook(hook, ddp)            # composed: compression, delay, measurements
    for epoch:
        for t in techniques: t.on_epoch_start(epoch, model)       # BN statistics reset
        for step:
            lr = lr_at(samples_seen, schedule)
            if a technique t.runs_workers(step):                  # local SGD between simulated workers:
                t.run_workers(step, one_worker_step, inputs, labels)  # each worker the step below, on its model
            else: one synchronous step:
                if a technique wants_worker_gradient(step):       # beside the step, changing nothing:
                    t.on_worker_gradient(worker 0's own gradient, per_worker_batch, workers)  # noise scale
                for worker in local workers: forward, backward    # no_sync but the last (or fused);
                                                                  # forward under trainer.precision's autocast
                    (t.simulated_comm: each simulated worker's gradient compressed, as on its GPU)
                precision.unscale(optimizer)                      # fp16: true gradients from here on
                for t in techniques: t.after_backward(model, progress)  # delay, clipping, measurements
                optimizer.step()
            allreduces += t.allreduces_at(step) (else 1 when W > 1)  # the run's communication count
            at evaluation steps (log-spaced, and each epoch's end):
                for t in techniques: t.before_eval(model)         # BN recalibration, local SGD's average
                evaluate(); for t in techniques: t.after_evaluate(model)  # the workers' own models back
                for t in techniques: t.after_eval(step, samples_seen, acc, loss)
        for t in techniques: plans = t.replan(epoch, samples_seen, plans, num_train)  # batch-size warmup
    for t in techniques: t.on_train_end(model)                    # local SGD's last average
    evaluate the test split (before_eval / after_evaluate around it)

Techniques run in ascending `order` at every hook (a declared order, so a
recipe's list order does not matter): model surgery before initialisation
tweaks, measurements before clipping.
"""

from __future__ import annotations

from typing import Callable, ClassVar, NamedTuple

import torch
from torch import nn

from lbt.config import BatchPlan
from lbt.errors import ConfigError

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


class Technique:
    """Base class: every hook is a no-op; a technique overrides what it needs."""

    order: ClassVar[int] = 50
    name: ClassVar[str] = "technique"
    # What stands in for the allreduce between the simulated workers of one process, when the
    # technique changes what an allreduce sends (compression); see lbt.techniques.comm_compression.
    simulated_comm = None
    # True: the technique stands in for the LR decay (a batch ramp), so a decaying schedule beside it
    # decays twice; the run warns.
    replaces_lr_decay: ClassVar[bool] = False
    # True: the LR scaling rule follows the batch the technique sets (an automatic batch ramp), not the
    # configured one.
    lr_follows_batch: ClassVar[bool] = False

    def check_together(self, techniques: list["Technique"]) -> None:
        """Refuse, with one ConfigError line, a combination with another listed technique that cannot work."""

    def on_model(self, model: nn.Module) -> nn.Module:
        return model

    def on_loss(self, loss_fn: Callable) -> Callable:
        return loss_fn

    def plan_epochs(self, plans: list[BatchPlan], num_train: int) -> list[BatchPlan]:
        """The batch layout of every epoch, decided before training starts (a batch ramp changes it).

        A plan's lr_factor is how the technique changes the LR: the schedule
        (lbt/lr.py) applies it from that epoch on.
        """
        return plans

    def replan(self, epoch: int, samples_seen: int, plans: list[BatchPlan], num_train: int) -> list[BatchPlan]:
        """At the end of epoch `epoch` (0-based), the layouts of every epoch, those after it decided from what
        the run measured (an automatic batch ramp); return `plans` unchanged to keep them."""
        return plans

    def check_plan(self, plan: BatchPlan) -> None:
        """Refuse, with one ConfigError line, a batch layout the technique cannot serve as real workers would."""

    def on_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer, built once; return it or a wrapper (local SGD's PostLocalSGDOptimizer).

        Called after check_plan, so a technique knows by then whether its workers are real.
        """
        return optimizer

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

    def wants_worker_gradient(self, step: int) -> bool:
        """True: at this step the trainer computes a process's first worker's gradient on its own, beside
        the step, and calls on_worker_gradient with it."""
        return False

    def on_worker_gradient(self, grads: list[torch.Tensor], per_worker_batch: int, workers: int) -> None:
        """The first local worker's own gradient (of its mean loss), one tensor per trainable parameter."""

    def after_backward(self, model: nn.Module, progress: Progress) -> None:
        """After the step's gradient is averaged over all workers, before optimizer.step()."""

    def runs_workers(self, step: int) -> bool:
        """True when this technique runs the step's simulated workers itself, each on its own model."""
        return False

    def run_workers(self, step: int, worker_step: Callable, inputs: torch.Tensor, labels: torch.Tensor):
        """Run `worker_step(inputs, labels) -> (loss, correct)` once per simulated worker (each a
        one-worker synchronous step); return the workers' mean loss and summed correct count."""
        raise NotImplementedError

    def allreduces_at(self, step: int) -> int | None:
        """Model-sized allreduces step `step` makes, when the technique changes how many (local SGD);
        None: one gradient allreduce per step, the synchronous default."""
        return None

    def before_eval(self, model: nn.Module) -> None:
        pass

    def after_evaluate(self, model: nn.Module) -> None:
        """After each evaluation pass: undo what before_eval changed only for it."""

    def on_train_end(self, model: nn.Module) -> None:
        """After the last step, before the final test evaluation and the saved model."""

    def after_eval(self, step: int, samples_seen: int, acc: float, loss: float) -> None:
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


def refuse_together(name: str, techniques: list[Technique], conflicts: dict[str, str]) -> None:
    """One ConfigError line when a technique named in `conflicts` (name -> why) is selected beside `name`."""
    for other in techniques:
        if other.name in conflicts:
            raise ConfigError(f"technique {name} with {other.name}: {conflicts[other.name]}; use one of them")


def sort_techniques(techniques: list[Technique]) -> list[Technique]:
    return sorted(techniques, key=lambda t: t.order)
