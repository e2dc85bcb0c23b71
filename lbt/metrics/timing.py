"""Where a step's time goes: data, compute (forward + backward), communication, optimizer."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable

import torch


class StepTimer:
    """Sums seconds per phase over a window of steps and over the whole run.

    The loop marks where each phase starts (`phase("data")`, `phase("compute")`, ...);
    a phase lasts until the next mark. On the CPU a mark is time.perf_counter(). On
    CUDA it is a CUDA event recorded on the stream, so a phase is the GPU's time from
    one mark to the next, and the events are read only when the window's means are
    asked for (at log steps, which synchronise anyway): timing never adds a
    synchronisation per step.

    Communication is timed around the DDP communication hook (the allreduce,
    compressed or not): from the first bucket handed to it to the last one
    completed, per step. It overlaps the backward pass, so compute + comm can
    exceed the step time; compute includes whatever allreduce wait the
    backward could not hide.
    """

    def __init__(self, device: torch.device | None = None):
        self.cuda = device is not None and device.type == "cuda"
        self.window: dict[str, float] = defaultdict(float)
        self.total: dict[str, float] = defaultdict(float)
        self.window_steps = self.total_steps = 0
        self._phase: str | None = None
        self._phase_start = None
        self._pending: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # CUDA spans not read yet
        self._comm_start = self._comm_end = None

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def phase(self, name: str | None) -> None:
        """End the running phase (its time counts) and start `name` (None: start none)."""
        now = self._mark()
        if self._phase is not None:
            self._span(self._phase, self._phase_start, now)
        self._phase, self._phase_start = name, now

    def drop(self) -> None:
        """Forget the running phase without counting it (the data wait that ended the epoch's batches)."""
        self._phase = None

    def _span(self, phase: str, start, end) -> None:
        if self.cuda:
            self._pending.append((phase, start, end))
        else:
            self.add(phase, end - start)

    def add(self, phase: str, seconds: float) -> None:
        self.window[phase] += seconds
        self.total[phase] += seconds

    def end_step(self) -> None:
        self.phase(None)
        if self._comm_start is not None:
            self._span("comm", self._comm_start, self._comm_end)
            self._comm_start = None
        self.window_steps += 1
        self.total_steps += 1

    def _read_events(self) -> None:
        if not self._pending:
            return
        self._pending[-1][2].synchronize()  # the newest event: every earlier one has completed too
        for phase, start, end in self._pending:
            self.add(phase, start.elapsed_time(end) / 1000)  # milliseconds
        self._pending.clear()

    def window_means(self) -> dict[str, float]:
        self._read_events()
        means = {f"perf/{k}_s": v / max(self.window_steps, 1) for k, v in self.window.items()}
        self.window.clear()
        self.window_steps = 0
        return means

    def run_means(self) -> dict[str, float]:
        self._read_events()
        return {f"{k}_s": v / max(self.total_steps, 1) for k, v in self.total.items()}

    def timed(self, hook: Callable) -> Callable:
        """`hook` (bucket -> future), recording when the step's first bucket left and its last one came back."""

        def timed_hook(bucket):
            if self._comm_start is None:
                self._comm_start = self._mark()

            def done(future):
                now = self._mark()
                # CUDA: the callback runs after the allreduce on its stream, so the last mark is the latest.
                self._comm_end = now if self.cuda or self._comm_end is None else max(self._comm_end, now)
                return future.value()

            return hook(bucket).then(done)

        return timed_hook
