"""train/* over a window of steps: when to log, and the window's mean loss over all processes."""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch

from lbt.parallel.process_group import DistContext, all_reduce_sum


class WindowStats(NamedTuple):
    mean_loss: float  # over the window's steps and all workers
    loss_sum: float  # sum over processes of each process's step losses
    loss_count: int  # steps x processes: loss_sum / loss_count is the mean
    stop: bool  # some process was asked to stop (SIGTERM/SIGINT)
    samples_per_sec: float
    first_loss: float = math.nan  # the window's first step, averaged over processes (a run's initial loss)


class TrainWindow:
    """The steps since the last log step.

    Their losses stay on the device until a log step: reading a loss every step
    would make the host wait for the device every step.
    """

    def __init__(self, log_every: int, also_at: int | None = None):
        self.log_every, self.also_at = log_every, also_at
        self.losses: list[torch.Tensor] = []
        self.started = time.perf_counter()

    def should_log(self, step: int, last_of_epoch: bool) -> bool:
        """Every log_every steps, at the epoch's last step, and at `also_at` (the step of the peak LR)."""
        return (step + 1) % self.log_every == 0 or last_of_epoch or step == self.also_at

    def start(self) -> None:
        self.losses.clear()
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.losses.append(loss)

    def close(self, stop_requested: bool, ctx: DistContext, global_batch: int) -> WindowStats:
        """Sum the window over processes (every rank calls this at the same step) and start a new one."""
        steps = len(self.losses)
        totals = torch.tensor([torch.stack(self.losses).sum().item(), steps, float(stop_requested),
                               self.losses[0].item()], dtype=torch.float64)
        all_reduce_sum(totals, ctx)
        loss_sum = totals[0].item()
        samples_per_sec = steps * global_batch / (time.perf_counter() - self.started)
        self.start()
        count = int(totals[1].item())
        return WindowStats(loss_sum / count, loss_sum, count, totals[2].item() > 0, samples_per_sec,
                           totals[3].item() * steps / count)


def diverging(mean_loss: float, initial_loss: float, high_windows: int, factor: float | None) -> int:
    """The log windows in a row whose mean loss exceeds `factor` x the run's initial loss, this one included
    (0 when it does not; a non-finite loss counts as exceeding)."""
    if not math.isfinite(mean_loss):
        return high_windows + 1
    return high_windows + 1 if factor is not None and mean_loss > factor * initial_loss else 0
