"""How long work will take, said before it starts: a rate measured on this machine, a duration in words."""

from __future__ import annotations

import tempfile
import time

from torch import nn

from lbt.engine import run
from lbt.engine.build import data_shape
from lbt.spec.batching import make_budget
from lbt.spec.run import RunSpec
from lbt.techniques.base import Progress, Technique


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


TIMED_STEPS, WARM_STEPS = 20, 5


class StepClock(Technique):
    """When each step's backward ended: a timing run's rate without its first steps, which pay for start-up
    (the loader's workers, the allocator, lazy initialisation) and made "8.7 h" of a 21-minute probe."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def after_backward(self, model: nn.Module, progress: Progress) -> None:
        self.times.append(time.perf_counter())


def timed_rate(spec: RunSpec) -> float:
    """Samples per second of the run on this machine, from 20 steps of it (one epoch at most): the steps
    after the first 5, where the run trains in one process; the whole run's rate where it starts several."""
    quick = spec.with_trainer(max_steps=TIMED_STEPS, evals=0, checkpoint_every=0, progress=False, resume="never")
    clock = StepClock()
    in_process = quick.procs == 1 and not quick.dist.max_restarts
    with tempfile.TemporaryDirectory(prefix="lbt-timing-") as scratch:
        result = run(quick, scratch, [clock] if in_process else [])
    warm = clock.times[WARM_STEPS:]
    gaps = sorted(b - a for a, b in zip(warm, warm[1:]))
    if gaps and gaps[len(gaps) // 2] > 0:  # the median step: an epoch's evaluation between two steps is not one
        return max(result.samples_seen / max(result.steps, 1) / gaps[len(gaps) // 2], 1.0)
    return max(result.samples_per_sec, 1.0)


def run_samples(spec: RunSpec) -> int | None:
    """Samples the run trains in all (its epochs of the training set, or max_steps); None if unknown."""
    num_train = data_shape(spec.data).num_train
    if not num_train:
        return None
    return make_budget([spec.layout] * spec.trainer.epochs, num_train, spec.trainer.max_steps).total_samples
