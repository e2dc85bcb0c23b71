"""The batch arithmetic in one place: who processes how many samples per step, and how many steps a run takes.

`batch_layout` checks the numbers a run gives (world size, processes, one of the two batch sizes) and
derives the missing batch; `make_budget` turns one layout per epoch into the steps the run takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lbt.errors import ConfigError
from lbt.spec.validate import integer

# Per-worker batch used when a run gives neither batch size.
DEFAULT_PER_WORKER_BATCH = 64


@dataclass(frozen=True)
class BatchLayout:
    """Who processes how many samples per optimizer step.

    world_size W data-parallel workers each run one forward pass of per_worker_batch b
    samples; procs P real processes each simulate W/P of those workers. With tensor
    parallelism (T > 1) each of those workers and processes is a group of T GPUs and
    T processes splitting the model (lbt/parallel/tensor_parallel.py): the run uses W x T GPUs.
    """

    world_size: int
    procs: int
    per_worker_batch: int
    global_batch: int
    # The LR multiplier of a batch ramp that can no longer grow the batch (Smith et al. 2017).
    lr_factor: float = 1.0
    tensor_parallel: int = 1

    @property
    def gpus(self) -> int:
        """The GPUs the run models: data-parallel workers x tensor-parallel ranks (dist.world_size)."""
        return self.world_size * self.tensor_parallel

    @property
    def workers_per_proc(self) -> int:
        return self.world_size // self.procs

    def steps_per_epoch(self, num_train: int) -> int:
        """Whole steps only (drop_last): the remainder of the shuffled epoch is not trained on."""
        return num_train // self.global_batch

    def grown(self, growth: int, grow: str, lr_factor: float = 1.0) -> BatchLayout:
        """This layout with the global batch multiplied by `growth`, through more workers or bigger ones."""
        if grow == "world_size":
            world_size = self.world_size * growth
            return replace(self, world_size=world_size, global_batch=world_size * self.per_worker_batch,
                           lr_factor=lr_factor)
        per_worker = self.per_worker_batch * growth
        return replace(self, per_worker_batch=per_worker, global_batch=per_worker * self.world_size,
                       lr_factor=lr_factor)

    def describe(self, num_train: int) -> str:
        """`world_size=64 (procs=1 x 64 simulated) per_worker_batch=64 global_batch=4096 steps/epoch=13`."""
        simulated = f" x {self.workers_per_proc} simulated" if self.workers_per_proc > 1 else ""
        if self.tensor_parallel > 1:
            t = self.tensor_parallel
            each = f", each simulating {self.workers_per_proc} workers" if self.workers_per_proc > 1 else ""
            layout = (f"world_size={self.gpus} GPUs = DP {self.world_size} x TP {t} "
                      f"(procs={self.procs * t}: {self.procs} group(s) of {t}{each}) ")
        else:
            layout = f"world_size={self.world_size} (procs={self.procs}{simulated}) "
        return (layout + f"per_worker_batch={self.per_worker_batch} global_batch={self.global_batch} "
                f"steps/epoch={self.steps_per_epoch(num_train)}")


def auto_tensor_parallel(world_size: int, per_worker_batch: int, max_global_batch: int | None) -> int:
    """dist.tensor_parallel=auto: the smallest power of two T that keeps the global batch
    (per_worker_batch x world_size / T) at or below max_global_batch; the GPUs past that batch split
    the model instead of growing the batch (lbt/parallel/tensor_parallel.py)."""
    if max_global_batch is None:
        raise ConfigError("dist.tensor_parallel=auto needs dist.max_global_batch, the global batch to stay at or "
                          "below (e.g. the critical batch `lbt report` measured)")
    cap = integer("dist.max_global_batch", max_global_batch)
    if per_worker_batch > cap:
        raise ConfigError(f"dist.max_global_batch={cap} is smaller than one worker's batch "
                          f"(trainer.per_worker_batch={per_worker_batch})")
    tensor_parallel = 1
    while per_worker_batch * world_size // tensor_parallel > cap:
        tensor_parallel *= 2
    if world_size % tensor_parallel:
        raise ConfigError(f"dist.tensor_parallel=auto: keeping the global batch at or below {cap} takes T="
                          f"{tensor_parallel}, which does not divide dist.world_size={world_size}")
    return tensor_parallel


def batch_layout(world_size: int, procs: int, per_worker_batch: int | None, global_batch: int | None,
                 num_train: int | None = None, tensor_parallel: int = 1) -> BatchLayout:
    """Check the batch arithmetic in one place and derive the missing batch size.

    world_size and procs count GPUs and processes; with tensor_parallel T > 1 the layout's
    workers are their data-parallel groups, world_size / T of them on procs / T processes.
    """
    world_size = integer("dist.world_size", world_size)
    procs = integer("dist.procs", procs)
    tensor_parallel = integer("dist.tensor_parallel", tensor_parallel)
    if world_size % procs:
        raise ConfigError(f"dist.procs={procs} does not divide dist.world_size={world_size}: "
                          "each process must simulate the same number of workers")
    if procs % tensor_parallel:
        raise ConfigError(f"dist.tensor_parallel={tensor_parallel} does not divide dist.procs={procs}: each "
                          "tensor-parallel rank is a process of its own (give dist.procs a multiple of "
                          "dist.tensor_parallel)")
    if tensor_parallel > 1:
        try:
            layout = batch_layout(world_size // tensor_parallel, procs // tensor_parallel, per_worker_batch,
                                  global_batch, num_train)
        except ConfigError as error:
            raise ConfigError(f"{error} (dist.world_size={world_size} GPUs with dist.tensor_parallel="
                              f"{tensor_parallel} are {world_size // tensor_parallel} data-parallel workers)") from None
        return replace(layout, tensor_parallel=tensor_parallel)
    per_worker_batch = _per_worker_batch(world_size, per_worker_batch, global_batch)
    layout = BatchLayout(world_size, procs, per_worker_batch, per_worker_batch * world_size)
    if num_train is not None:
        check_fits(layout, num_train)
    return layout


def _per_worker_batch(world_size: int, per_worker_batch: int | None, global_batch: int | None) -> int:
    """The per-worker batch given, or derived from the global batch given (they must agree when both are)."""
    if per_worker_batch is None and global_batch is None:
        return DEFAULT_PER_WORKER_BATCH
    if per_worker_batch is not None:
        per_worker_batch = integer("trainer.per_worker_batch", per_worker_batch)
    if global_batch is None:
        assert per_worker_batch is not None
        return per_worker_batch
    global_batch = integer("trainer.global_batch", global_batch)
    if global_batch % world_size:
        raise ConfigError(f"trainer.global_batch={global_batch} is not divisible by dist.world_size={world_size}; "
                          f"give a multiple of {world_size} or set trainer.per_worker_batch instead")
    derived = global_batch // world_size
    if per_worker_batch is not None and per_worker_batch != derived:
        raise ConfigError(f"trainer.per_worker_batch={per_worker_batch} and trainer.global_batch={global_batch} "
                          f"disagree at dist.world_size={world_size} ({per_worker_batch} x {world_size} = "
                          f"{per_worker_batch * world_size}); give only one")
    return derived


def check_fits(layout: BatchLayout, num_train: int) -> None:
    if layout.steps_per_epoch(num_train) < 1:
        raise ConfigError(f"global_batch={layout.global_batch} is larger than the training set "
                          f"({num_train} samples): no full step fits in an epoch")


@dataclass(frozen=True)
class Budget:
    """The steps a run takes: each epoch's batch layout and step count (trainer.max_steps may end it early)."""

    layouts: tuple[BatchLayout, ...]
    steps: tuple[int, ...]
    max_steps: int | None = None  # trainer.max_steps, kept for `relaid`

    def relaid(self, layouts: list[BatchLayout], num_train: int) -> Budget:
        """The budget of the same run with other batch layouts (an automatic batch ramp decided them)."""
        return make_budget(layouts, num_train, self.max_steps)

    @property
    def total_steps(self) -> int:
        return sum(self.steps)

    @property
    def total_samples(self) -> int:
        return sum(n * layout.global_batch for layout, n in zip(self.layouts, self.steps))

    @property
    def last_step_samples(self) -> int:
        """Samples seen when the run's last step starts."""
        last = max(e for e, n in enumerate(self.steps) if n) if self.total_steps else 0
        return max(0, self.total_samples - self.layouts[last].global_batch)

    def samples_at(self, epochs: float) -> int:
        """Samples seen after `epochs` epochs of the steps the run takes, rounded up to a step boundary."""
        samples = 0.0
        for layout, steps in zip(self.layouts, self.steps):
            samples += min(max(epochs, 0.0), 1.0) * steps * layout.global_batch
            epochs -= 1
        return self.step_boundary(samples)[1]

    def step_boundary(self, samples: float) -> tuple[int, int]:
        """(step, samples seen) at the first step boundary at or after `samples` (the end of the run at most)."""
        step = seen = 0
        for layout, steps in zip(self.layouts, self.steps):
            epoch_samples = steps * layout.global_batch
            if samples <= seen + epoch_samples:
                # The tolerance keeps float noise in a fractional epoch from adding a whole step.
                n = max(0, math.ceil((samples - seen) / layout.global_batch - 1e-9))
                return step + n, seen + n * layout.global_batch
            step, seen = step + steps, seen + epoch_samples
        return step, seen


def make_budget(layouts: list[BatchLayout], num_train: int, max_steps: int | None) -> Budget:
    """Steps per epoch at each epoch's batch, cut off after max_steps in all."""
    steps: list[int] = []
    left: float = max_steps if max_steps is not None else math.inf
    for layout in layouts:
        check_fits(layout, num_train)
        taken = int(min(layout.steps_per_epoch(num_train), left))
        steps.append(taken)
        left -= taken
    return Budget(tuple(layouts), tuple(steps), max_steps)
