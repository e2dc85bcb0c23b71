"""Step strategies: what one optimizer step is, when it is not plain synchronous SGD.

A run has exactly one strategy. `Synchronous` is lockstep data parallelism: every worker's gradient
is averaged (DDP's allreduce, or the simulated workers' sum) and every worker takes the same step.
The others change the step itself, so they are not techniques (which only hook into it):

    local SGD (lbt/engine/strategies/local_sgd.py): workers step on their own models and average
        them every H steps; simulated workers are run one by one, each on its own replica.
    gradient delay (lbt/engine/strategies/gradient_delay.py): the update at step t applies the
        averaged gradient of step t-d (double buffering at d=1).

Where each method is called (lbt/engine/build.py, trainer.py, step.py):

    strategy.setup(layout, techniques)           # per batch layout: refuse what it cannot run with
    optimizer = strategy.wrap_optimizer(optimizer, model)
    hook = strategy.comm_hook(allreduce, ddp)    # then wrapped by the techniques' comm hooks
    per step: strategy.run_step(step, synchronous_step, inputs, labels, layout)
              strategy.after_backward(model, progress)   # among the techniques', by `order`
              allreduces += strategy.allreduces_at(step)
    with strategy.evaluated(model): evaluate     # the model an evaluation scores
    strategy.on_train_end(model)                 # before the test split and the saved model
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ClassVar

import torch
from torch import nn

from lbt.spec.batching import BatchLayout
from lbt.techniques.base import CommHook, Progress, Technique

# One synchronous step over this process's workers of `layout`: (inputs, labels, layout) -> (loss, correct).
StepFunction = Callable[[torch.Tensor, torch.Tensor, BatchLayout], tuple[torch.Tensor, int]]


class StepStrategy:
    """Base class and the default: synchronous data-parallel SGD (every method leaves the step as it is)."""

    name: ClassVar[str] = "synchronous"
    # Where after_backward runs among the techniques' (measurements 80, clipping 90).
    order: ClassVar[int] = 85
    # Technique types it cannot run beside, each with why (checked by the engine).
    conflicts: ClassVar[dict[type, str]] = {}

    def setup(self, layout: BatchLayout, techniques: list[Technique]) -> None:
        """Refuse, with one ConfigError line, a layout or a technique it cannot run with."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        return optimizer

    def comm_hook(self, allreduce: CommHook, ddp_model: nn.Module) -> CommHook:
        """DDP's gradient allreduce between real processes, or what replaces it."""
        return allreduce

    def run_step(self, step: int, synchronous_step: StepFunction, inputs: torch.Tensor, labels: torch.Tensor,
                 layout: BatchLayout) -> tuple[torch.Tensor, int]:
        """Run step `step`; return this process's mean loss and its correct count (as synchronous_step does)."""
        return synchronous_step(inputs, labels, layout)

    def after_backward(self, model: nn.Module, progress: Progress) -> None:
        """After the step's gradient is averaged, before the optimizer steps (in `order` among techniques)."""

    def allreduces_at(self, step: int) -> int:
        """Model-sized allreduces step `step` makes (with more than one worker): one gradient allreduce."""
        return 1

    @contextmanager
    def evaluated(self, model: nn.Module) -> Iterator[None]:
        """The model an evaluation scores, during it (local SGD: the workers' average)."""
        yield

    def on_train_end(self, model: nn.Module) -> None:
        """After the last step, before the final test evaluation and the saved model."""

    def state_dict(self) -> dict:
        """What a checkpoint must keep for an exact resume, per rank."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def describe(self) -> str:
        return "synchronous SGD"



