"""lbt probe's two engine pieces (lbt/apps/probe): the base run's snapshots and a branch's start.

A snapshot is the base run's whole state after N samples seen, saved between two steps without changing
the run. A branch is an ordinary run (its own world size, so its own global batch and simulated workers)
that starts from a snapshot instead of from scratch:

- model and optimizer state as the base run had them; the optimizer's moments carry over unchanged
  (SGD's momentum and Adam's first moment estimate the mean gradient, which the batch does not change;
  Adam's second moment shrinks with the gradient noise at a larger batch and adapts within 1 / (1 - beta2)
  steps), and BN's running statistics are the base run's rank 0's;
- the LR of the base run's schedule at the same samples seen, scaled by the recipe's rule for the
  branch's batch, and re-warmed: it climbs linearly from the base run's LR to the scaled one over the
  first REWARM of the branch's samples;
- the data after the snapshot: the rest of the same epoch's order at the branch's batch (the probe puts
  snapshots where every probed batch has a step boundary), then the next epochs;
- its LR after the start (`trainer.branch_lr`): the base run's schedule on (follow), frozen (hold: the
  batch measured without the decay that follows, which would hide its difference), or a linear cooldown
  to 0 over the branch (the end of a shorter run, Haegele et al. 2024);
- evaluations at `trainer.evals` points evenly spaced over the branch, and its end;
- the divergence rule of every run counts from the base run's first loss; and it also stops, counted as
  diverged, when its train loss (logged every step) passes `trainer.branch_diverge` x
  the val loss the base run had at the snapshot, and chance level (log of the classes): late in training
  one batch's loss can be several times the val loss without anything having gone wrong.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

from lbt.engine.checkpoint import full_state, load_buffers, load_model_and_optimizer, own_buffers, save_snapshot
from lbt.engine.step import LoopState
from lbt.errors import ConfigError
from lbt.spec.batching import make_budget
from lbt.spec.lr import BranchLR, lr_at

if TYPE_CHECKING:
    from lbt.engine.trainer import Trainer

REWARM = 0.2  # of a branch's samples


def take_snapshot(trainer: Trainer, run_dir: str) -> None:
    """The run's state now into run_dir/snapshots/ (every rank calls; rank 0 writes), with the
    held-out loss and accuracy here (evaluated now unless this step just was)."""
    s, history = trainer.state, trainer.result.history
    layout = trainer.budget.layouts[min(s.epoch, len(trainer.budget.layouts) - 1)]
    point = history[-1] if history and history[-1].step == s.step else trainer.validate(layout)
    state = {"model": full_state(trainer.model.state_dict(), trainer.ctx),
             "optimizer": full_state(trainer.optimizer.state_dict(), trainer.ctx),
             "buffers": own_buffers(trainer.model),
             "loop": asdict(s), "global_batch": layout.global_batch,
             "total_samples": trainer.schedule.total_samples, "point": asdict(point)}
    if trainer.ctx.is_main:
        save_snapshot(run_dir, s.samples_seen, state)


def start_branch(trainer: Trainer, snapshot: dict, samples: int, diverge: float, lr: BranchLR = "follow") -> None:
    """Set the trainer to continue `snapshot` for `samples` samples at its own batch (see the module)."""
    load_model_and_optimizer(trainer.model, trainer.optimizer, snapshot, trainer.ctx)
    load_buffers(trainer.model, snapshot["buffers"])
    base, layout = LoopState(**snapshot["loop"]), trainer.budget.layouts[0]
    epoch, offset = base.epoch, base.step_in_epoch * snapshot["global_batch"]
    layouts = list(trainer.budget.layouts) + [layout]  # room for a branch that starts late in the last epoch
    steps_here = layout.steps_per_epoch(trainer.data.num_train)
    if offset >= steps_here * layout.global_batch:  # past this batch's last whole step: the next epoch
        epoch, offset = epoch + 1, 0
    if offset % layout.global_batch:
        raise ConfigError(f"trainer.branch_at={base.samples_seen}: the snapshot lies {offset:,} samples into its "
                          f"epoch, not on a step boundary of global batch {layout.global_batch}")
    start = epoch * steps_here + offset // layout.global_batch
    steps = math.ceil(samples / layout.global_batch)
    trainer.set_budget(make_budget(layouts, trainer.data.num_train, start + steps))
    branch_lr = replace(trainer.schedule, total_samples=snapshot["total_samples"])
    at = base.samples_seen
    ratio = lr_at(at, replace(branch_lr, global_batch=snapshot["global_batch"])) / max(lr_at(at, branch_lr), 1e-30)
    trainer.schedule = replace(branch_lr, rewarm_from=at, rewarm_samples=round(REWARM * samples),
                               rewarm_start=min(1.0, ratio), branch_lr=lr, branch_from=at, branch_samples=samples)
    evals = trainer.settings.evals
    trainer.eval_steps = frozenset(start + max(1, round(steps * i / evals)) for i in range(1, evals + 1))
    # The divergence rule's level is the base run's first loss, not the branch's: late in training one
    # minibatch's loss can be a tenth of the next one's, and a branch's first would trip 10x on ordinary steps.
    trainer.state = LoopState(step=start, samples_seen=at, epoch=epoch, step_in_epoch=offset // layout.global_batch,
                              initial_loss=base.initial_loss)
    classes = trainer.data.num_classes
    trainer.diverge_above = max(diverge * float(snapshot["point"]["loss"]), math.log(classes) if classes else 0.0)
