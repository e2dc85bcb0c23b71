"""Typed schemas of the main config groups, and the batch arithmetic in one place.

The dataclasses are plain: the entry point (lbt/cli.py) registers them with
Hydra's ConfigStore, so a typo (`dist.wrold_size=4`) or a wrong type
(`trainer.per_worker_batch=abc`) fails when the config is composed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

from lbt.errors import ConfigError
from lbt.validate import integer, number, one_of

# Per-worker batch used when a run gives neither batch size.
DEFAULT_PER_WORKER_BATCH = 64
# Upper bounds that catch typos (an extra zero or two) before they cost hours or memory.
MAX_EPOCHS = 100_000
MAX_LOCAL_PROCS = 256
MAX_THREADS = 1024
MAX_LOADER_WORKERS = 256


@dataclass
class DistConfig:
    world_size: Optional[int] = None
    procs: Optional[int] = None
    backend: str = "auto"
    timeout_s: int = 120
    fuse_workers: Any = "auto"  # true, false or auto (lbt/fused.py: workers_per_pass)
    max_restarts: int = 0
    tensor_parallel: Any = 1  # an int, or "auto" (see `auto_tensor_parallel`)
    max_global_batch: Optional[int] = None


@dataclass
class TrainerConfig:
    per_worker_batch: Optional[int] = None
    global_batch: Optional[int] = None
    epochs: int = 10
    max_steps: Optional[int] = None
    seed: int = 0
    progress: bool = True
    log_every: int = 10
    evals: int = 20
    device: str = "auto"
    threads: Optional[int] = None
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    resume: Optional[str] = None
    precision: str = "fp32"
    compile: bool = False
    channels_last: bool = False
    loader_workers: Optional[int] = None


@dataclass
class ScheduleConfig:
    """The `schedule` node: everything the LR depends on (lbt/lr.py reads it)."""

    scaling: str = "none"
    weight_decay_scaling: str = "none"
    base_batch: int = 64
    warmup_epochs: float = 0.0
    warmup_samples: Optional[int] = None
    warmup_start: Optional[float] = None
    warmup_mode: str = "linear"
    decay: str = "cosine"
    final_factor: float = 0.0
    power: float = 2.0
    milestones: List[float] = field(default_factory=list)
    gamma: float = 0.1


def check_trainer(cfg: dict) -> None:
    """Range checks of the trainer node that the schema's types cannot express."""
    integer("trainer.epochs", cfg["epochs"], 1, MAX_EPOCHS)
    integer("trainer.log_every", cfg["log_every"])
    integer("trainer.evals", cfg["evals"], 0, 10_000)
    integer("trainer.checkpoint_every", cfg["checkpoint_every"], 0)
    integer("trainer.keep_checkpoints", cfg["keep_checkpoints"], 1, 1000)
    one_of("trainer.resume", cfg["resume"], (None, "auto"))
    one_of("trainer.device", cfg["device"], ("auto", "cpu", "cuda"))
    one_of("trainer.precision", cfg["precision"], ("fp32", "bf16", "fp16"))
    if cfg["loader_workers"] is not None:
        integer("trainer.loader_workers", cfg["loader_workers"], 0, MAX_LOADER_WORKERS)
    if cfg["max_steps"] is not None:
        integer("trainer.max_steps", cfg["max_steps"])
    if cfg["threads"] is not None:
        integer("trainer.threads", cfg["threads"], 1, MAX_THREADS)


def check_dist(cfg: dict, under_torchrun: bool) -> None:
    number("dist.timeout_s", cfg["timeout_s"], 0, 86_400, low_open=True)
    one_of("dist.backend", cfg["backend"], ("auto", "gloo", "nccl"))
    one_of("dist.fuse_workers", cfg["fuse_workers"], (True, False, "auto"))
    integer("dist.max_restarts", cfg["max_restarts"], 0, 1000)
    if under_torchrun and cfg["max_restarts"]:
        raise ConfigError("dist.max_restarts is for lbt's local launcher; under torchrun give --max-restarts "
                          "(lbt then resumes by itself)")
    if not under_torchrun and isinstance(cfg["procs"], int) and cfg["procs"] > MAX_LOCAL_PROCS:
        raise ConfigError(f"dist.procs={cfg['procs']}: lbt's local launcher starts at most {MAX_LOCAL_PROCS} "
                          "processes on one machine; use torchrun or a cluster launcher for more")


@dataclass(frozen=True)
class BatchPlan:
    """Who processes how many samples per optimizer step.

    world_size W data-parallel workers each run one forward pass of per_worker_batch b
    samples; procs P real processes each simulate W/P of those workers. With tensor
    parallelism (T > 1) each of those workers and processes is a group of T GPUs and
    T processes splitting the model (lbt/tensor_parallel.py): the run uses W x T GPUs.
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

    def grown(self, growth: int, grow: str, lr_factor: float = 1.0) -> BatchPlan:
        """This plan with the global batch multiplied by `growth`, through more workers or bigger ones."""
        if grow == "world_size":
            world_size = self.world_size * growth
            return replace(self, world_size=world_size, global_batch=world_size * self.per_worker_batch,
                           lr_factor=lr_factor)
        per_worker = self.per_worker_batch * growth
        return replace(self, per_worker_batch=per_worker, global_batch=per_worker * self.world_size,
                       lr_factor=lr_factor)

    def describe(self, num_train: int) -> str:
        simulated = f" x {self.workers_per_proc} simulated" if self.workers_per_proc > 1 else ""
        if self.tensor_parallel > 1:
            t = self.tensor_parallel
            each = f", each simulating {self.workers_per_proc} workers" if self.workers_per_proc > 1 else ""
            layout = (f"world_size={self.gpus} GPUs = DP {self.world_size} x TP {t} "
                      f"(procs={self.procs * t}: {self.procs} group(s) of {t}{each}) ")
        else:
            layout = f"world_size={self.world_size} (procs={self.procs}{simulated}) "
        return (
            layout +
            f"per_worker_batch={self.per_worker_batch} global_batch={self.global_batch} "
            f"steps/epoch={self.steps_per_epoch(num_train)}"
        )


def auto_tensor_parallel(world_size: int, per_worker_batch: int, max_global_batch: Optional[int]) -> int:
    """dist.tensor_parallel=auto: the smallest power of two T that keeps the global batch
    (per_worker_batch x world_size / T) at or below max_global_batch; the GPUs past that batch split
    the model instead of growing the batch (lbt/tensor_parallel.py)."""
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


def plan_batches(
    world_size: int,
    procs: int,
    per_worker_batch: Optional[int],
    global_batch: Optional[int],
    num_train: Optional[int] = None,
    tensor_parallel: int = 1,
) -> BatchPlan:
    """Check the batch arithmetic in one place and derive the missing batch size.

    world_size and procs count GPUs and processes; with tensor_parallel T > 1 the plan's
    workers are their data-parallel groups, world_size / T of them on procs / T processes.
    """
    world_size = integer("dist.world_size", world_size)
    procs = integer("dist.procs", procs)
    tensor_parallel = integer("dist.tensor_parallel", tensor_parallel)
    if world_size % procs:
        raise ConfigError(
            f"dist.procs={procs} does not divide dist.world_size={world_size}: "
            "each process must simulate the same number of workers"
        )
    if procs % tensor_parallel:
        raise ConfigError(
            f"dist.tensor_parallel={tensor_parallel} does not divide dist.procs={procs}: each tensor-parallel "
            "rank is a process of its own (give dist.procs a multiple of dist.tensor_parallel)"
        )
    if tensor_parallel > 1:
        try:
            plan = plan_batches(world_size // tensor_parallel, procs // tensor_parallel, per_worker_batch,
                                global_batch, num_train)
        except ConfigError as error:
            raise ConfigError(f"{error} (dist.world_size={world_size} GPUs with dist.tensor_parallel="
                              f"{tensor_parallel} are {world_size // tensor_parallel} data-parallel workers)") from None
        return replace(plan, tensor_parallel=tensor_parallel)
    if per_worker_batch is None and global_batch is None:
        per_worker_batch = DEFAULT_PER_WORKER_BATCH
    if per_worker_batch is not None:
        per_worker_batch = integer("trainer.per_worker_batch", per_worker_batch)
    if global_batch is not None:
        global_batch = integer("trainer.global_batch", global_batch)
        if global_batch % world_size:
            raise ConfigError(
                f"trainer.global_batch={global_batch} is not divisible by "
                f"dist.world_size={world_size}; give a multiple of {world_size} "
                "or set trainer.per_worker_batch instead"
            )
        derived = global_batch // world_size
        if per_worker_batch is not None and per_worker_batch != derived:
            raise ConfigError(
                f"trainer.per_worker_batch={per_worker_batch} and trainer.global_batch="
                f"{global_batch} disagree at dist.world_size={world_size} "
                f"({per_worker_batch} x {world_size} = {per_worker_batch * world_size}); give only one"
            )
        per_worker_batch = derived
    plan = BatchPlan(world_size, procs, per_worker_batch, per_worker_batch * world_size)
    if num_train is not None:
        check_fits(plan, num_train)
    return plan


def check_fits(plan: BatchPlan, num_train: int) -> None:
    if plan.steps_per_epoch(num_train) < 1:
        raise ConfigError(
            f"global_batch={plan.global_batch} is larger than the training set "
            f"({num_train} samples): no full step fits in an epoch"
        )


@dataclass(frozen=True)
class Budget:
    """The steps a run takes: each epoch's batch plan and step count (trainer.max_steps may end it early)."""

    plans: tuple[BatchPlan, ...]
    steps: tuple[int, ...]
    max_steps: Optional[int] = None  # trainer.max_steps, kept for `replanned`

    def replanned(self, plans: list[BatchPlan], num_train: int) -> Budget:
        """The budget of the same run with other batch layouts (an automatic batch ramp decided them)."""
        return make_budget(plans, num_train, self.max_steps)

    @property
    def total_steps(self) -> int:
        return sum(self.steps)

    @property
    def total_samples(self) -> int:
        return sum(n * plan.global_batch for plan, n in zip(self.plans, self.steps))

    @property
    def last_step_samples(self) -> int:
        """Samples seen when the run's last step starts."""
        last = max(e for e, n in enumerate(self.steps) if n) if self.total_steps else 0
        return max(0, self.total_samples - self.plans[last].global_batch)

    def samples_at(self, epochs: float) -> int:
        """Samples seen after `epochs` epochs of the steps the run takes, rounded up to a step boundary."""
        samples = 0.0
        for plan, steps in zip(self.plans, self.steps):
            samples += min(max(epochs, 0.0), 1.0) * steps * plan.global_batch
            epochs -= 1
        return self.step_boundary(samples)[1]

    def step_boundary(self, samples: float) -> tuple[int, int]:
        """(step, samples seen) at the first step boundary at or after `samples` (the end of the run at most)."""
        step = seen = 0
        for plan, steps in zip(self.plans, self.steps):
            epoch_samples = steps * plan.global_batch
            if samples <= seen + epoch_samples:
                # The tolerance keeps float noise in a fractional epoch from adding a whole step.
                n = max(0, math.ceil((samples - seen) / plan.global_batch - 1e-9))
                return step + n, seen + n * plan.global_batch
            step, seen = step + steps, seen + epoch_samples
        return step, seen


def make_budget(plans: list[BatchPlan], num_train: int, max_steps: Optional[int]) -> Budget:
    """Steps per epoch at each epoch's batch, cut off after max_steps in all."""
    steps, left = [], max_steps if max_steps is not None else math.inf
    for plan in plans:
        check_fits(plan, num_train)
        taken = int(min(plan.steps_per_epoch(num_train), left))
        steps.append(taken)
        left -= taken
    return Budget(tuple(plans), tuple(steps), max_steps)
