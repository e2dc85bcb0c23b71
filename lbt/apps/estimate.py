"""How long work will take, said before it starts: a rate measured on this machine, a duration in words."""

from __future__ import annotations

import tempfile

from lbt.engine import run
from lbt.engine.build import data_shape
from lbt.spec.batching import make_budget
from lbt.spec.run import RunSpec


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def timed_rate(spec: RunSpec) -> float:
    """Samples per second of the run on this machine, from 20 steps of it (one epoch at most)."""
    quick = spec.with_trainer(max_steps=20, evals=0, checkpoint_every=0, progress=False, resume="never")
    with tempfile.TemporaryDirectory(prefix="lbt-timing-") as scratch:
        result = run(quick, scratch)
    return max(result.samples_per_sec, 1.0)


def run_samples(spec: RunSpec) -> int | None:
    """Samples the run trains in all (its epochs of the training set, or max_steps); None if unknown."""
    num_train = data_shape(spec.data).num_train
    if not num_train:
        return None
    return make_budget([spec.layout] * spec.trainer.epochs, num_train, spec.trainer.max_steps).total_samples
