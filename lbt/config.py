"""Typed schemas of the main config groups, and the batch arithmetic.

The dataclasses are plain: the entry point registers them with Hydra's
ConfigStore, so a typo (`dist.wrold_size=4`) or a wrong type
(`trainer.per_worker_batch=abc`) fails when the config is composed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from lbt.errors import ConfigError

# Per-worker batch used when a run gives neither batch size.
DEFAULT_PER_WORKER_BATCH = 64


@dataclass
class DistConfig:
    world_size: Optional[int] = None
    procs: Optional[int] = None
    backend: str = "auto"
    timeout_s: int = 120
    fuse_workers: bool = True


@dataclass
class TrainerConfig:
    per_worker_batch: Optional[int] = None
    global_batch: Optional[int] = None
    epochs: int = 10
    max_steps: Optional[int] = None
    seed: int = 0
    progress: bool = True
    log_every: int = 10
    device: str = "auto"
    threads: Optional[int] = None
    checkpoint_every: int = 1
    resume: Optional[str] = None


@dataclass(frozen=True)
class BatchPlan:
    """Who processes how many samples per optimizer step.

    world_size W workers each run one forward pass of per_worker_batch b
    samples; procs P real processes each simulate W/P of those workers.
    """

    world_size: int
    procs: int
    per_worker_batch: int
    global_batch: int

    @property
    def workers_per_proc(self) -> int:
        return self.world_size // self.procs

    def steps_per_epoch(self, num_train: int) -> int:
        return num_train // self.global_batch

    def describe(self, num_train: int) -> str:
        simulated = f" x {self.workers_per_proc} simulated" if self.workers_per_proc > 1 else ""
        return (
            f"world_size={self.world_size} (procs={self.procs}{simulated}) "
            f"per_worker_batch={self.per_worker_batch} global_batch={self.global_batch} "
            f"steps/epoch={self.steps_per_epoch(num_train)}"
        )


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def plan_batches(
    world_size: int,
    procs: int,
    per_worker_batch: Optional[int],
    global_batch: Optional[int],
    num_train: Optional[int] = None,
) -> BatchPlan:
    """Check the batch arithmetic in one place and derive the missing batch size."""
    world_size = _positive_int("dist.world_size", world_size)
    procs = _positive_int("dist.procs", procs)
    if world_size % procs:
        raise ConfigError(
            f"dist.procs={procs} does not divide dist.world_size={world_size}: "
            "each process must simulate the same number of workers"
        )
    if per_worker_batch is None and global_batch is None:
        per_worker_batch = DEFAULT_PER_WORKER_BATCH
    if per_worker_batch is not None:
        per_worker_batch = _positive_int("trainer.per_worker_batch", per_worker_batch)
    if global_batch is not None:
        global_batch = _positive_int("trainer.global_batch", global_batch)
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
    if num_train is not None and plan.steps_per_epoch(num_train) < 1:
        raise ConfigError(
            f"global_batch={plan.global_batch} is larger than the training set "
            f"({num_train} samples): no full step fits in an epoch"
        )
    return plan


# Upper bounds that catch typos (an extra zero or two) before they cost hours or memory.
MAX_EPOCHS = 100_000
MAX_LOCAL_PROCS = 256
MAX_THREADS = 1024


def check_trainer(cfg: TrainerConfig | dict) -> None:
    """Range checks the schema's types cannot express."""
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    _positive_int("trainer.epochs", get("epochs"))
    if get("epochs") > MAX_EPOCHS:
        raise ConfigError(f"trainer.epochs={get('epochs')} is more than {MAX_EPOCHS:,}; use trainer.max_steps to cap a run")
    if get("threads") is not None and get("threads") > MAX_THREADS:
        raise ConfigError(f"trainer.threads={get('threads')} is more than {MAX_THREADS}")
    _positive_int("trainer.log_every", get("log_every"))
    if isinstance(get("checkpoint_every"), bool) or not isinstance(get("checkpoint_every"), int) \
            or get("checkpoint_every") < 0:
        raise ConfigError(f"trainer.checkpoint_every must be a non-negative integer, got {get('checkpoint_every')!r}")
    if get("resume") not in (None, "auto"):
        raise ConfigError(f"trainer.resume must be null or auto, got {get('resume')!r}")
    if get("max_steps") is not None:
        _positive_int("trainer.max_steps", get("max_steps"))
    if get("threads") is not None:
        _positive_int("trainer.threads", get("threads"))
    if get("device") not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"trainer.device must be auto, cpu or cuda, got {get('device')!r}")


def check_dist(cfg: dict, under_torchrun: bool) -> None:
    timeout = cfg.get("timeout_s")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86_400:
        raise ConfigError(f"dist.timeout_s must be a number of seconds in (0, 86400], got {timeout!r}")
    if cfg.get("backend") not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"dist.backend must be auto, gloo or nccl, got {cfg.get('backend')!r}")
    procs = cfg.get("procs")
    if not under_torchrun and isinstance(procs, int) and procs > MAX_LOCAL_PROCS:
        raise ConfigError(f"dist.procs={procs}: lbt's local launcher starts at most {MAX_LOCAL_PROCS} processes "
                          "on one machine; use torchrun or a cluster launcher for more")


def lr_is_sane(lr) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError(f"optim.lr must be a positive number, got {lr!r}")
