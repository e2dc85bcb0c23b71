"""Local SGD and post-local SGD: workers step on their own and average their models every `period` steps.

Lin, Stich, Patel, Jaggi 2020 ("Don't Use Large Mini-Batches, Use Local SGD"):
after `warmup_steps` synchronous steps (post-local SGD's start), each worker
applies its own gradient to its own model (parameters, optimizer state, BatchNorm
statistics) and the models' parameters are averaged every H steps: one
allreduce of the parameters per H steps instead of one of the gradients per
step. DiLoCo (Douillard et al. 2023) is the same idea with an outer optimizer.

Real processes (one worker each) run torch's own pieces: DDP's
`post_localSGD_hook` allreduces the gradients during the warm-up and sends
nothing afterwards (`post_local_gradient_allreduce=False`), and
`PostLocalSGDOptimizer` wraps the optimizer with a `PeriodicModelAverager`
that averages the parameters after the optimizer steps where
`averages_after(step)` holds. Simulated workers (dist.procs=1) keep k replicas
(`Replicas`) and average them on the same schedule.

Evaluations score the workers' average model without changing the run (each
worker's own parameters are put back afterwards); at the end of training the
workers average once more, so the final model (and the test score) is the
average. BatchNorm statistics are averaged at every evaluation as in any lbt run
(lbt.parallel.process_group.average_buffers). The run's allreduce count includes the warm-up's
gradient allreduces and the averages on the schedule (not the end's, nor the
evaluations').
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from lbt.engine.strategies.base import StepFunction, StepStrategy
from lbt.errors import ConfigError
from lbt.metrics.text_log import note
from lbt.spec.batching import BatchLayout
from lbt.spec.validate import integer
from lbt.techniques.base import CommHook, Technique
from lbt.techniques.batch_ramp import AutoBatchRamp, BatchRamp
from lbt.techniques.comm_compression import CommCompression
from lbt.techniques.gns import GradientNoiseScale


def averages_after(step: int, period: int, warmup_steps: int) -> bool:
    """Whether the workers average their parameters after optimizer step `step` (counted from 0).

    torch's PeriodicModelAverager: from the first local step (step == warmup_steps) on, every
    `period` steps; the first local step is averaged at once.
    """
    return step >= warmup_steps and (step - warmup_steps) % period == 0


def allreduces_at(step: int, period: int, warmup_steps: int) -> int:
    """Model-sized allreduces at step `step`: the gradient's during the warm-up, then the averages."""
    return 1 if step < warmup_steps or averages_after(step, period, warmup_steps) else 0


class Replicas:
    """k simulated workers' own models in one process: parameters, BatchNorm buffers, optimizer state.

    The trainer's model and optimizer stand in for one worker at a time: `enter(i)`
    points their tensors (and the optimizer's per-parameter state) at worker i's own,
    so a worker's step updates its replica in place.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, workers: int):
        self.model, self.optimizer = model, optimizer
        self.params = list(model.parameters())
        self.buffers = list(model.buffers())
        # Every worker starts from the synchronised model and optimizer state.
        self.worker_params = [[p.detach().clone() for p in self.params] for _ in range(workers)]
        self.worker_buffers = [[b.detach().clone() for b in self.buffers] for _ in range(workers)]
        self.worker_optim = [[copy.deepcopy(optimizer.state.get(p, {})) for p in self.params]
                             for _ in range(workers)]

    @property
    def workers(self) -> int:
        return len(self.worker_params)

    def enter(self, worker: int) -> None:
        for p, own in zip(self.params, self.worker_params[worker]):
            p.data = own
        for b, own in zip(self.buffers, self.worker_buffers[worker]):
            b.data = own
        for p, own in zip(self.params, self.worker_optim[worker]):
            self.optimizer.state[p] = own

    def average(self) -> list[torch.Tensor]:
        """The workers' mean parameters (each divided by k, then summed: as torch's averager does)."""
        k = self.workers
        return [cast(torch.Tensor, sum(own[j] / k for own in self.worker_params)) for j in range(len(self.params))]

    def set_all(self, params: list[torch.Tensor]) -> None:
        for own in self.worker_params:
            for mine, value in zip(own, params):
                mine.copy_(value)

    def average_buffers(self) -> None:
        """Floating buffers to the workers' mean in every replica, as average_buffers does for real workers."""
        for j, b in enumerate(self.buffers):
            if b.is_floating_point():
                mean = cast(torch.Tensor, sum(own[j] for own in self.worker_buffers)) / self.workers
                for own in self.worker_buffers:
                    own[j].copy_(mean)

    def state_dict(self) -> dict:
        return {"params": [[t.clone() for t in own] for own in self.worker_params],
                "buffers": [[t.clone() for t in own] for own in self.worker_buffers],
                "optim": copy.deepcopy(self.worker_optim)}

    def load_state_dict(self, state: dict) -> None:
        self.worker_params = [list(own) for own in state["params"]]
        self.worker_buffers = [list(own) for own in state["buffers"]]
        self.worker_optim = [list(own) for own in state["optim"]]


class LocalSGD(StepStrategy):
    """Average the workers' models every `period` steps after `warmup_steps` synchronous ones."""

    name = "local_sgd"
    conflicts = {
        CommCompression: "both replace DDP's allreduce",
        BatchRamp: "the replicas are made for one number of workers",
        AutoBatchRamp: "the replicas are made for one number of workers",
    }

    # Set by wrap_optimizer: the model and the optimizer (torch's PostLocalSGDOptimizer on real processes).
    model: nn.Module
    optimizer: Any

    def __init__(self, period: int = 4, warmup_steps: int = 0):
        self.period = integer("strategy.period", period, 1, 1_000_000)
        self.warmup_steps = integer("strategy.warmup_steps", warmup_steps, 0)
        self.workers = 1
        self.real = False
        self.hook_state: Any = None  # torch's PostLocalSGDState, real processes
        self.replicas: Replicas | None = None  # simulated workers, from the first local step

    def setup(self, layout: BatchLayout, techniques: list[Technique]) -> None:
        key = f"strategy.period={self.period}"
        if any(isinstance(t, GradientNoiseScale) for t in techniques) and layout.procs > 1:
            raise ConfigError("strategy=local_sgd with measure gns on real processes: after the warm-up no "
                              "gradient is averaged to measure the noise scale with; measure it with simulated "
                              "workers (dist.procs=1), where it is measured during the warm-up only")
        if layout.world_size == 1:
            note(f"{key}: one worker in all, so there is nothing to average: plain SGD")
        elif layout.workers_per_proc > 1 and layout.procs > 1:
            raise ConfigError(f"{key}: local SGD is simulated with all workers in one process (dist.procs=1) "
                              "or run for real with one process per worker (dist.procs=dist.world_size)")
        self.workers, self.real = layout.world_size, layout.procs > 1

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> torch.optim.Optimizer:
        self.model, self.optimizer = model, optimizer
        if not self.real:
            return optimizer
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        with warnings.catch_warnings():  # period 1 "needs no model averaging": lbt compares it on purpose
            warnings.simplefilter("ignore")
            averager = PeriodicModelAverager(period=self.period, warmup_steps=self.warmup_steps)
        self.optimizer = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
        return self.optimizer

    def comm_hook(self, allreduce: CommHook, ddp_model: nn.Module) -> CommHook:
        # Replaces the allreduce: global during the warm-up, none afterwards (the averager communicates).
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook

        self.hook_state = PostLocalSGDState(process_group=None, subgroup=None,
                                            start_localSGD_iter=self.warmup_steps,
                                            post_local_gradient_allreduce=False)
        return lambda bucket: post_localSGD_hook(self.hook_state, bucket)

    def run_step(self, step: int, synchronous_step: StepFunction, inputs: torch.Tensor, labels: torch.Tensor,
                 layout: BatchLayout) -> tuple[torch.Tensor, int]:
        """Synchronous during the warm-up and on real processes (torch's averager works after the optimizer);
        simulated workers' local steps run one after another, each on its own replica and its own chunk of
        the batch as a one-worker synchronous step; then the average on the schedule."""
        if self.real or self.workers == 1 or step < self.warmup_steps:
            return synchronous_step(inputs, labels, layout)
        if self.replicas is None:
            self.replicas = Replicas(self.model, self.optimizer, self.workers)
        one = replace(layout, world_size=1, procs=1, global_batch=layout.per_worker_batch)
        losses, correct = [], 0
        for worker, (x, y) in enumerate(zip(inputs.chunk(self.workers), labels.chunk(self.workers))):
            self.replicas.enter(worker)
            loss, right = synchronous_step(x, y, one)
            losses.append(loss)
            correct += right
        if averages_after(step, self.period, self.warmup_steps):
            self.replicas.set_all(self.replicas.average())
        return torch.stack(losses).mean(), correct

    def allreduces_at(self, step: int) -> int:
        return allreduces_at(step, self.period, self.warmup_steps)

    @contextmanager
    def evaluated(self, model: nn.Module) -> Iterator[None]:
        """Score the workers' average model; each worker's own parameters come back afterwards."""
        saved = None
        if self.replicas is not None:
            self.replicas.average_buffers()  # as average_buffers did on real workers just before
            saved = [p.data for p in self.replicas.params]
            for p, mean in zip(self.replicas.params, self.replicas.average()):
                p.data = mean
        elif self.real and self._local_phase_started():
            from torch.distributed.algorithms.model_averaging.utils import average_parameters

            saved = [p.data for p in model.parameters()]
            average_parameters(iter(list(model.parameters())), dist.group.WORLD)  # type: ignore[arg-type]  # sets p.data, keeps the saved
        try:
            yield
        finally:
            if saved is not None:
                for p, own in zip(model.parameters(), saved):
                    p.data = own

    def on_train_end(self, model: nn.Module) -> None:
        if self.replicas is not None:
            self.replicas.set_all(self.replicas.average())
        elif self.real and self._local_phase_started():
            from torch.distributed.algorithms.model_averaging.utils import average_parameters

            average_parameters(iter(list(model.parameters())), dist.group.WORLD)  # type: ignore[arg-type]

    def _local_phase_started(self) -> bool:
        return self.optimizer.averager.step > self.warmup_steps

    # -- checkpoints: each worker's own model ------------------------------------------------
    def state_dict(self) -> dict:
        if self.replicas is not None:
            return {"replicas": self.replicas.state_dict()}
        if self.real:  # this rank's own parameters and optimizer state (the main checkpoint has rank 0's)
            return {"params": [p.detach().clone() for p in self.model.parameters()],
                    "optim": copy.deepcopy(self.optimizer.optim.state_dict()), "hook_iter": self.hook_state.iter}
        return {}

    def load_state_dict(self, state: dict) -> None:
        if "replicas" in state:
            self.replicas = Replicas(self.model, self.optimizer, self.workers)
            self.replicas.load_state_dict(state["replicas"])
        elif self.real:
            if "params" in state:
                with torch.no_grad():
                    for p, own in zip(self.model.parameters(), state["params"]):
                        p.copy_(own)
                self.optimizer.optim.load_state_dict(state["optim"])
                self.hook_state.iter = state["hook_iter"]
            # Optimizer.load_state_dict gives the wrapped optimizer new param_groups; PostLocalSGDOptimizer
            # keeps the old list, where the trainer would set an LR nothing reads.
            self.optimizer.param_groups = self.optimizer.optim.param_groups

    def describe(self) -> str:
        warmup = f" after {self.warmup_steps} synchronous steps" if self.warmup_steps else ""
        return f"local SGD: models averaged every {self.period} steps{warmup}"
