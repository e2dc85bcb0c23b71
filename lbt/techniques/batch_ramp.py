"""Grow the global batch during training.

mode=milestones: at fixed epochs, instead of decaying the LR (Smith, Kindermans, Ying, Le 2017).
mode=auto: whenever the measured gradient noise scale outgrows the batch (McCandlish et al. 2018;
Merrill et al. 2025, "Critical Batch Size Revisited"; Gray et al. 2024).
mode=probe: the batch schedule `lbt probe` measured (its probe.json): double the batch where the local
critical batch reached twice the current one (Merrill et al. 2025, sec. 5).
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from lbt.errors import ConfigError
from lbt.metrics.text_log import note, say_once
from lbt.spec.batching import BatchLayout
from lbt.spec.validate import integer, number, one_of
from lbt.techniques.base import Technique
from lbt.techniques.gns import GradientNoiseScale

MODES = ("milestones", "auto", "probe")


def batch_ramp(mode: str = "milestones", milestones: Sequence[float] = (3, 6, 8), factor: int = 2,
               max_global_batch: int | None = None, grow: str = "per_worker_batch", threshold: float = 1.0,
               ema_decay: float = 0.95, probe: str | None = None) -> Technique:
    """The `technique.batch_ramp` node: a BatchRamp (milestones), an AutoBatchRamp (auto) or a ProbeBatchRamp."""
    one_of("technique.batch_ramp.mode", mode, MODES)
    if mode == "probe":
        if probe is None:
            raise ConfigError("technique.batch_ramp.mode=probe needs technique.batch_ramp.probe=DIR/probe.json "
                              "(written by `lbt probe`)")
        return ProbeBatchRamp(read_batch_schedule(probe), max_global_batch, grow)
    if probe is not None:
        raise ConfigError("technique.batch_ramp.probe is read by mode=probe only")
    if mode == "auto":
        return AutoBatchRamp(factor, max_global_batch, grow, threshold, ema_decay)
    return BatchRamp(milestones, factor, max_global_batch, grow)


def ramp_growth(epoch: float, milestones: list[float], factor: int, max_growth: int) -> tuple[int, int]:
    """(batch growth, LR divisions) in force at `epoch`.

    Each milestone reached multiplies the batch by `factor` while the growth
    stays <= max_growth; milestones reached after that divide the LR by
    `factor` instead (Smith et al.: once the batch cannot grow, decay the LR).
    """
    reached = bisect.bisect_right(sorted(milestones), epoch)
    growth, divisions = 1, 0
    for _ in range(reached):
        if growth * factor <= max_growth:
            growth *= factor
        else:
            divisions += 1
    return growth, divisions


class BatchRamp(Technique):
    """At each epoch milestone, multiply the global batch by `factor`, up to a cap.

    The cap is max_global_batch (default: no cap) and never more than the
    training set holds. grow=per_worker_batch makes each worker's forward
    larger; grow=world_size adds (simulated) workers, keeping per_worker_batch
    and so BN's batch. The LR scaling rule keeps the configured global batch
    as its reference: the ramp replaces LR decay, so the LR must not grow with it.
    """

    name = "batch_ramp"
    order = 5
    replaces_lr_decay = True

    def __init__(self, milestones: Sequence[float] = (3, 6, 8), factor: int = 2, max_global_batch: int | None = None,
                 grow: str = "per_worker_batch"):
        self.grow = one_of("technique.batch_ramp.grow", grow, ("per_worker_batch", "world_size"))
        self.factor = integer("technique.batch_ramp.factor", factor, 2)
        if max_global_batch is not None:
            integer("technique.batch_ramp.max_global_batch", max_global_batch)
        self.milestones = sorted(number("technique.batch_ramp.milestones", m, low=0) for m in milestones)
        self.max_global_batch = max_global_batch
        self.cap: int | None = None  # the largest global batch the ramp reaches, once laid out

    def epoch_layouts(self, layouts: list[BatchLayout], num_train: int, after_epoch: int | None = None,
                      samples_seen: int = 0) -> list[BatchLayout]:
        if after_epoch is not None:  # decided before training
            return layouts
        start = layouts[0].global_batch
        cap = self.max_global_batch or start * self.factor ** len(self.milestones)
        if cap > num_train:
            note(f"technique.batch_ramp: the global batch stops growing at the {num_train:,} samples of the "
                 f"training set (asked: up to {cap:,}); later milestones divide the LR by {self.factor} instead")
            cap = num_train
        max_growth = max(1, cap // start)
        grown = []
        for epoch, layout in enumerate(layouts):
            growth, divisions = ramp_growth(epoch, self.milestones, self.factor, max_growth)
            grown.append(layout.grown(growth, self.grow, layout.lr_factor / self.factor**divisions))
        self.cap = max(p.global_batch for p in grown)
        return grown

    def describe(self) -> str:
        cap = f" up to {self.cap:,}" if self.cap else ""
        return f"batch x{self.factor} at epochs {self.milestones}{cap} (via {self.grow})"


def auto_ramp_batch(global_batch: int, b_simple: float, threshold: float, factor: int, cap: int) -> int:
    """The next epoch's global batch: x factor, again and again, while the measured noise scale
    exceeds `threshold` x the batch and the grown batch stays <= cap.

    B_simple estimates the critical batch, the batch past which more samples per step stop
    saving steps (McCandlish et al. 2018, eq. 2.12 and sec. 2.3); it does not depend on the
    batch it is measured at, so one measurement may justify several doublings. Unmeasured
    (NaN) or negative: keep the batch.
    """
    if not math.isfinite(b_simple):
        return global_batch
    while b_simple > threshold * global_batch and global_batch * factor <= cap:
        global_batch *= factor
    return global_batch


class AutoBatchRamp(GradientNoiseScale):
    """Batch-size warmup from the measured noise scale: measure B_simple every step (as measure=[gns]
    does, beside the step), and at each epoch's end grow the batch for the epochs after it
    (`auto_ramp_batch`), through more simulated workers or bigger ones, never past
    max_global_batch or the training set.

    Unlike the milestone ramp, this does not replace LR decay: the LR (and Adam's betas
    under adam_sqrt) follow the configured scaling rule at the batch reached. Decisions are
    made at epoch ends because a batch layout lives for an epoch in lbt (lbt/data/batches.py);
    they are kept in checkpoints with the run's batch layouts, so a resumed run decides nothing twice.
    """

    name = "batch_ramp"
    order = 5
    lr_follows_batch = True

    def __init__(self, factor: int = 2, max_global_batch: int | None = None, grow: str = "per_worker_batch",
                 threshold: float = 1.0, ema_decay: float = 0.95):
        # Every step: its decisions change the run, and a free measurement (real workers) takes every step too.
        super().__init__(ema_decay=number("technique.batch_ramp.ema_decay", ema_decay, 0, 1, high_open=True), every=1)
        self.grow = one_of("technique.batch_ramp.grow", grow, ("per_worker_batch", "world_size"))
        self.factor = integer("technique.batch_ramp.factor", factor, 2)
        self.max_global_batch = (None if max_global_batch is None
                                 else integer("technique.batch_ramp.max_global_batch", max_global_batch))
        self.threshold = number("technique.batch_ramp.threshold", threshold, low=0, low_open=True)
        self.changes: list[list[float]] = []  # [samples seen, epoch, new global batch, B_simple] per decision

    def check_layout(self, layout: BatchLayout) -> None:
        if layout.world_size == 1:
            raise ConfigError("technique.batch_ramp.mode=auto measures the noise scale by comparing one worker's "
                              "gradient with the global batch's: give dist.world_size >= 2 (simulated workers are "
                              "enough)")

    def combine_processes(self, worker_sq: torch.Tensor, procs: int) -> torch.Tensor:
        """Worker 0's measurement, the one a run simulating all workers in one process takes: the decisions,
        which change the run, are then the same however the workers are laid out on processes."""
        dist.broadcast(worker_sq, src=0)
        return worker_sq

    def epoch_layouts(self, layouts: list[BatchLayout], num_train: int, after_epoch: int | None = None,
                      samples_seen: int = 0) -> list[BatchLayout]:
        if after_epoch is None or after_epoch + 1 >= len(layouts):
            return layouts
        epoch, current = after_epoch, layouts[after_epoch + 1]
        cap = min(self.max_global_batch or num_train, num_train)
        b_simple = self.estimator.b_simple
        target = auto_ramp_batch(current.global_batch, b_simple, self.threshold, self.factor, cap)
        if target == current.global_batch:
            return layouts
        grown = current.grown(target // current.global_batch, self.grow)
        self.changes.append([samples_seen, epoch + 1, grown.global_batch, b_simple])
        say_once(f"batch_ramp: B_simple={b_simple:,.0f} > {self.threshold:g} x {current.global_batch:,}: global batch "
                 f"{current.global_batch:,} -> {grown.global_batch:,} from epoch {epoch + 2} "
                 f"(world_size={grown.world_size}, per_worker_batch={grown.per_worker_batch})")
        return layouts[: epoch + 1] + [grown] * (len(layouts) - epoch - 1)

    def metrics(self) -> dict[str, float]:
        # Its own names, so measure=[gns] beside it does not log into the same tags.
        return {key.replace("gns/", "batch_ramp/"): value for key, value in super().metrics().items()}

    def curves(self) -> dict[str, list[list[float]]]:
        return {"batch_ramp/b_simple": list(self.curve),
                "batch_ramp/global_batch": [[samples, batch] for samples, _, batch, _ in self.changes]}

    def state_dict(self) -> dict:
        return {**super().state_dict(), "changes": [list(c) for c in self.changes]}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.changes = [list(c) for c in state.get("changes", [])]

    def describe(self) -> str:
        cap = f" up to {self.max_global_batch:,}" if self.max_global_batch else ""
        return (f"batch x{self.factor} while B_simple > {self.threshold:g} x batch, at epoch ends{cap} "
                f"(via {self.grow})")


def read_batch_schedule(path: str) -> list[tuple[int, int]]:
    """probe.json's `batch_schedule` as (from samples, global batch), or one line saying why not."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "probe.json"
    try:
        entries = json.loads(file.read_text())["batch_schedule"]
        schedule = [(int(e["from_samples"]), int(e["global_batch"])) for e in entries]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"technique.batch_ramp.probe={path}: not a probe.json with a batch_schedule "
                          f"({type(error).__name__}: {error})") from None
    if not schedule or schedule != sorted(schedule) or any(b <= 0 for _, b in schedule):
        raise ConfigError(f"technique.batch_ramp.probe={path}: its batch_schedule is empty or out of order")
    return schedule


class ProbeBatchRamp(Technique):
    """The batch schedule `lbt probe` measured, laid out before training: each epoch runs at the batch the
    schedule holds at the samples seen when it starts (a batch layout lives for an epoch), grown from the
    configured layout by more workers or bigger ones. The LR follows the scaling rule at the batch reached."""

    name = "batch_ramp"
    order = 5
    lr_follows_batch = True

    def __init__(self, schedule: list[tuple[int, int]], max_global_batch: int | None = None,
                 grow: str = "per_worker_batch"):
        self.grow = one_of("technique.batch_ramp.grow", grow, ("per_worker_batch", "world_size"))
        self.schedule = schedule
        self.max_global_batch = max_global_batch
        self.batches: list[int] = []

    def epoch_layouts(self, layouts: list[BatchLayout], num_train: int, after_epoch: int | None = None,
                      samples_seen: int = 0) -> list[BatchLayout]:
        if after_epoch is not None:  # decided before training
            return layouts
        start, seen, laid = layouts[0], 0, []
        cap = min(self.max_global_batch or num_train, num_train)
        for _ in layouts:
            batch = min(max(b for at, b in self.schedule if at <= seen or at == self.schedule[0][0]), cap)
            if batch % start.global_batch:
                raise ConfigError(f"technique.batch_ramp.mode=probe: the schedule's batch {batch:,} is not a multiple "
                                  f"of this run's global batch {start.global_batch:,} (probe with the same batch)")
            layout = start.grown(batch // start.global_batch, self.grow) if batch > start.global_batch else start
            laid.append(layout)
            seen += layout.steps_per_epoch(num_train) * layout.global_batch
        self.batches = [layout.global_batch for layout in laid]
        return laid

    def describe(self) -> str:
        return f"probe's batch schedule: {' -> '.join(f'{b:,}' for b in self.batches)} by epoch (via {self.grow})"
