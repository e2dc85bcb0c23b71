"""Where a step's time goes: data, compute (forward + backward), communication, optimizer."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable


class StepTimer:
    """Sums seconds per phase over a window of steps and over the whole run.

    Communication is timed around the DDP communication hook (the allreduce,
    compressed or not): from the first bucket handed to it to the last one
    completed, per step. It overlaps the backward pass, so compute + comm can
    exceed the step time; compute includes whatever allreduce wait the
    backward could not hide.
    """

    def __init__(self):
        self.window: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)
        self.window_steps = self.total_steps = 0
        self._comm_start: float | None = None
        self._comm_end = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.window[phase] += seconds
        self.total[phase] += seconds

    def end_step(self) -> None:
        if self._comm_start is not None:
            self.add("comm", self._comm_end - self._comm_start)
            self._comm_start = None
        self.window_steps += 1
        self.total_steps += 1

    def window_means(self) -> dict[str, float]:
        means = {f"perf/{k}_s": v / max(self.window_steps, 1) for k, v in self.window.items()}
        self.window.clear()
        self.window_steps = 0
        return means

    def run_means(self) -> dict[str, float]:
        return {f"{k}_s": v / max(self.total_steps, 1) for k, v in self.total.items()}

    def timed(self, hook: Callable) -> Callable:
        """`hook` (bucket -> future), recording when the step's first bucket left and its last one came back."""

        def timed_hook(bucket):
            start = time.perf_counter()
            if self._comm_start is None:
                self._comm_start = start

            def done(future):
                self._comm_end = max(self._comm_end, time.perf_counter())
                return future.value()

            return hook(bucket).then(done)

        return timed_hook
