"""The run spec: the composed config turned, once, into frozen typed parts, every value checked here.

    config (a plain dict, composed by lbt/apps/compose.py)
      -> build_spec(config, launch) -> RunSpec(trainer, dist, schedule, layout, model, data, optim, techniques,
                                               strategy)

After this, nothing reads the config by string: the engine takes the spec's parts. The field names
are the config's keys (`trainer.epochs` is `spec.trainer.epochs`), and lbt/apps/compose.py derives
Hydra's schemas from these dataclasses, so a mistyped key fails when the config is composed.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, get_args

from lbt.errors import ConfigError, closest
from lbt.spec.batching import DEFAULT_PER_WORKER_BATCH, BatchLayout, auto_tensor_parallel, batch_layout
from lbt.spec.lr import BranchLR, ScheduleSpec
from lbt.spec.targets import Target, target_of
from lbt.spec.validate import integer, number, one_of

# Upper bounds that catch typos (an extra zero or two) before they cost hours or memory.
MAX_EPOCHS = 100_000
MAX_SEED = 2**63 - 1  # torch's generators take a signed 64-bit seed
MAX_LOCAL_PROCS = 256
MAX_THREADS = 1024
MAX_LOADER_WORKERS = 256
# dist.shard: none keeps the whole model on every data-parallel rank (DDP); fsdp shards it (lbt/parallel/fsdp.py).
Shard = Literal["none", "fsdp"]
SHARDS: tuple[Shard, ...] = get_args(Shard)
BRANCH_LR: tuple[BranchLR, ...] = get_args(BranchLR)
Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16", "fp16"]
Backend = Literal["auto", "gloo", "nccl"]


@dataclass(frozen=True)
class TrainerSpec:
    """The `trainer` node (conf/trainer/default.yaml says what each key means)."""

    per_worker_batch: int | None = None
    global_batch: int | None = None
    epochs: int = 10
    max_steps: int | None = None
    seed: int = 0
    progress: bool = True
    log_every: int = 10
    evals: int = 20
    device: Device = "auto"
    threads: int | None = None
    checkpoint_every: int = 1
    keep_checkpoints: int = 2
    resume: Literal["auto"] | None = None
    precision: Precision = "fp32"
    compile: bool = False
    channels_last: bool = False
    loader_workers: int | None = None
    # A run diverged when its train loss is not finite, or exceeds diverge_factor x its first step's loss
    # for diverge_log_steps log steps in a row (null factor: only a non-finite loss); it stops then.
    diverge_factor: float | None = 10.0
    diverge_log_steps: int = 3
    # The run ends at the first evaluation of the val split whose accuracy is at or above stop_at_val_acc (or
    # whose loss is at or below stop_at_val_loss): AlgoPerf ends a run at its target. Steps to the target are
    # what they would be in the whole run; the LR schedule still spans trainer.epochs.
    stop_at_val_acc: float | None = None
    stop_at_val_loss: float | None = None
    # lbt probe (lbt/apps/probe): the base run saves its whole state at these samples seen, which does not
    # change the run; a branch starts from such a snapshot of the run in `branch_from` at `branch_at` samples,
    # trains `branch_samples` more at its own batch, and stops early (diverged) when its train loss passes
    # `branch_diverge` x the val loss it started from. `branch_lr`: the branch's LR follows the base run's
    # schedule, holds the value it starts at, or cools down from it linearly to 0 over the branch.
    snapshot_samples: tuple[int, ...] = ()
    branch_from: str | None = None
    branch_at: int | None = None
    branch_samples: int | None = None
    branch_diverge: float = 3.0
    branch_lr: BranchLR = "follow"

    def check(self) -> TrainerSpec:
        """Range checks the schema's types cannot express."""
        integer("trainer.epochs", self.epochs, 1, MAX_EPOCHS)
        integer("trainer.seed", self.seed, 0, MAX_SEED)
        integer("trainer.log_every", self.log_every)
        integer("trainer.evals", self.evals, 0, 10_000)
        integer("trainer.checkpoint_every", self.checkpoint_every, 0)
        integer("trainer.keep_checkpoints", self.keep_checkpoints, 1, 1000)
        one_of("trainer.resume", self.resume, (None, "auto"))
        one_of("trainer.device", self.device, get_args(Device))
        one_of("trainer.precision", self.precision, get_args(Precision))
        optional = (("loader_workers", self.loader_workers, 0, MAX_LOADER_WORKERS),
                    ("max_steps", self.max_steps, 1, None), ("threads", self.threads, 1, MAX_THREADS))
        for key, value, low, high in optional:
            if value is not None:
                integer(f"trainer.{key}", value, low, high)
        for samples in self.snapshot_samples:
            integer("trainer.snapshot_samples", samples)
        branch = (self.branch_from, self.branch_at, self.branch_samples)
        if any(v is not None for v in branch) and None in branch:
            raise ConfigError("a branch needs trainer.branch_from, trainer.branch_at and trainer.branch_samples")
        if self.branch_at is not None:
            integer("trainer.branch_at", self.branch_at)
            integer("trainer.branch_samples", self.branch_samples)
        number("trainer.branch_diverge", self.branch_diverge, low=1, low_open=True)
        one_of("trainer.branch_lr", self.branch_lr, BRANCH_LR)
        if self.diverge_factor is not None:
            number("trainer.diverge_factor", self.diverge_factor, low=1, low_open=True)
        integer("trainer.diverge_log_steps", self.diverge_log_steps, 1, 1000)
        if self.stop_at_val_acc is not None and self.stop_at_val_loss is not None:
            raise ConfigError("trainer.stop_at_val_acc and trainer.stop_at_val_loss are both set: give one target")
        if self.stop_at_val_acc is not None:
            number("trainer.stop_at_val_acc", self.stop_at_val_acc, low=0, high=1, low_open=True)
        if self.stop_at_val_loss is not None:
            number("trainer.stop_at_val_loss", self.stop_at_val_loss, low=0, low_open=True)
        return self

    @property
    def stop_at_val(self) -> tuple[str, float] | None:
        """(metric name, target) of trainer.stop_at_val_acc / _loss, or None."""
        if self.stop_at_val_acc is not None:
            return "acc", self.stop_at_val_acc
        return None if self.stop_at_val_loss is None else ("loss", self.stop_at_val_loss)


@dataclass(frozen=True)
class DistSpec:
    """The `dist` node (conf/dist/default.yaml). In a RunSpec, world_size, procs and tensor_parallel are resolved."""

    world_size: int | None = None
    procs: int | None = None
    backend: Backend = "auto"
    timeout_s: int = 120
    fuse_workers: bool | Literal["auto"] = "auto"  # true, false or auto (lbt/engine/passes.py: workers_per_pass)
    max_restarts: int = 0
    tensor_parallel: int | str = 1  # a number, or "auto" (see `auto_tensor_parallel`)
    max_global_batch: int | None = None
    # More processes than cores (or than the memory left holds) are refused unless this is true
    # (lbt/parallel/launcher.py: check_resources).
    allow_oversubscribe: bool = False
    shard: Shard = "none"


@dataclass(frozen=True)
class Launch:
    """What the machine says before a run starts: torchrun's process count (None: lbt's own launcher)
    and how many processes a run starts when dist.procs is not given (the CUDA devices, at least 1)."""

    torchrun_procs: int | None = None
    default_procs: int = 1


@dataclass(frozen=True)
class RunSpec:
    """One run, checked: the parts the engine builds and runs (lbt/engine/build.py)."""

    trainer: TrainerSpec
    dist: DistSpec
    schedule: ScheduleSpec
    layout: BatchLayout  # the configured batch layout (epoch 0's, before any batch ramp)
    model: Target
    data: Target
    optim: Target
    techniques: tuple[Target, ...]
    base_lr: float  # optim.lr: the LR at schedule.base_batch, before scaling
    recipe: str
    overrides: tuple[str, ...]
    config: Mapping[str, Any]  # the resolved config: kept in result.json; its run-defining keys tie checkpoints
    unselected: tuple[str, ...] = ()  # technique nodes configured (by a recipe) but deselected: noted, not built
    strategy: Target | None = None  # the step strategy (strategy=local_sgd): None is synchronous SGD

    @property
    def procs(self) -> int:
        """The processes the run starts (tensor-parallel ranks included)."""
        return self.layout.procs * self.layout.tensor_parallel

    @property
    def gpus(self) -> int:
        """The GPUs the run models (dist.world_size): data-parallel workers x tensor-parallel ranks."""
        return self.layout.gpus

    @property
    def betas(self) -> tuple[float, float] | None:
        """Adam's betas of the optimizer config, which schedule.scaling=adam_sqrt moves with the batch."""
        betas = self.optim.kwargs.get("betas")
        return None if betas is None else (betas[0], betas[1])

    @property
    def eps(self) -> float | None:
        return self.optim.kwargs.get("eps")

    def identity(self) -> dict[str, Any]:
        """The run-defining part of the config (see `run_identity`)."""
        return run_identity(self.config, self.layout.per_worker_batch, self.layout.global_batch)

    def with_trainer(self, **changes: Any) -> RunSpec:
        """The same run with trainer values changed (a restart resumes: trainer.resume=auto)."""
        trainer = replace(self.trainer, **changes)
        config = {**self.config, "trainer": {**self.config["trainer"], **changes}}
        return replace(self, trainer=trainer, config=config)


def from_node(cls: type, node: Mapping[str, Any] | None, where: str) -> Any:
    """A spec dataclass from its config node; a key it does not have is one line naming the closest one."""
    node = dict(node or {})
    names = [f.name for f in fields(cls)]
    for key in node:
        if key not in names:
            close = closest(str(key), names)
            hint = f"; did you mean {where}.{close}?" if close else f" (keys: {', '.join(names)})"
            raise ConfigError(f"{where}.{key}: no such key in {where}{hint}")
    for f in fields(cls):  # lists in the config, tuples in the (frozen) spec
        if isinstance(f.default, tuple) and f.name in node:
            node[f.name] = tuple(node[f.name] or ())
    return cls(**node)


def build_spec(config: Mapping[str, Any], launch: Launch = Launch(), recipe: str | None = None,
               overrides: list[str] | tuple[str, ...] | None = None) -> RunSpec:
    """Check a composed config once and turn it into a RunSpec (world size, processes, T and batches resolved)."""
    resolved: dict[str, Any] = copy.deepcopy(dict(config))
    resolved["recipe"] = recipe or resolved.get("recipe") or "custom"
    resolved["overrides"] = list(overrides or resolved.get("overrides") or [])
    trainer = from_node(TrainerSpec, resolved.get("trainer"), "trainer").check()
    dist = resolve_dist(from_node(DistSpec, resolved.get("dist"), "dist"), trainer, launch)
    resolved["dist"] = {**resolved.get("dist", {}), "world_size": dist.world_size, "procs": dist.procs,
                        "tensor_parallel": dist.tensor_parallel}
    layout = batch_layout(int(dist.world_size or 1), int(dist.procs or 1), trainer.per_worker_batch,
                          trainer.global_batch, tensor_parallel=int(dist.tensor_parallel))
    if layout.tensor_parallel > 1 and trainer.precision == "fp16":
        raise ConfigError(f"trainer.precision=fp16 with dist.tensor_parallel={layout.tensor_parallel}: torch's "
                          "GradScaler cannot unscale split (DTensor) and replicated gradients together; use bf16")
    optim = target_of(resolved.get("optim"), "optim")
    base_lr = number("optim.lr", optim.kwargs.get("lr"), low=0, low_open=True)
    schedule = from_node(ScheduleSpec, resolved.get("schedule"), "schedule").check()
    check_adam_settings(schedule, optim)
    techniques, unselected = techniques_of(resolved.get("technique"))
    strategy = target_of(resolved["strategy"], "strategy") if resolved.get("strategy") is not None else None
    return RunSpec(trainer, dist, schedule, layout, target_of(resolved.get("model"), "model"),
                   target_of(resolved.get("data"), "data"), optim, techniques, base_lr, resolved["recipe"],
                   tuple(resolved["overrides"]), resolved, unselected, strategy)


def resolve_dist(dist: DistSpec, trainer: TrainerSpec, launch: Launch) -> DistSpec:
    """dist's checks, and its defaults filled: procs (torchrun's, else the launch's default), world_size (procs),
    tensor_parallel (a number; `auto` from the batch cap)."""
    under_torchrun = launch.torchrun_procs is not None
    number("dist.timeout_s", dist.timeout_s, 0, 86_400, low_open=True)
    one_of("dist.backend", dist.backend, get_args(Backend))
    one_of("dist.fuse_workers", dist.fuse_workers, (True, False, "auto"))
    integer("dist.max_restarts", dist.max_restarts, 0, 1000)
    one_of("dist.allow_oversubscribe", dist.allow_oversubscribe, (True, False))
    one_of("dist.shard", dist.shard, SHARDS)
    if dist.shard == "fsdp" and dist.fuse_workers is True:
        raise ConfigError("dist.fuse_workers=true with dist.shard=fsdp: a sharded model runs its simulated workers "
                          "one pass each (BatchNorm per worker would need the model changed after sharding); "
                          "use dist.fuse_workers=auto")
    for key in ("world_size", "procs"):  # null means "as many as there are"; 0 is a mistake, not "unset"
        if getattr(dist, key) is not None:
            integer(f"dist.{key}", getattr(dist, key))
    if under_torchrun and dist.max_restarts:
        raise ConfigError("dist.max_restarts is for lbt's local launcher; under torchrun give --max-restarts "
                          "(lbt then resumes by itself)")
    if not under_torchrun and isinstance(dist.procs, int) and dist.procs > MAX_LOCAL_PROCS:
        raise ConfigError(f"dist.procs={dist.procs}: lbt's local launcher starts at most {MAX_LOCAL_PROCS} "
                          "processes on one machine; use torchrun or a cluster launcher for more")
    if under_torchrun and dist.procs not in (None, launch.torchrun_procs):
        raise ConfigError(f"dist.procs={dist.procs} but torchrun started {launch.torchrun_procs} processes")
    procs = dist.procs or launch.torchrun_procs or launch.default_procs
    world_size = dist.world_size or procs
    tensor_parallel = resolve_tensor_parallel(dist, trainer, world_size, procs)
    return replace(dist, world_size=world_size, procs=procs, tensor_parallel=tensor_parallel)


def resolve_tensor_parallel(dist: DistSpec, trainer: TrainerSpec, world_size: int, procs: int) -> int:
    """dist.tensor_parallel as a number: `auto` becomes the T that keeps the global batch under the cap."""
    value = dist.tensor_parallel
    if value == "auto":
        if trainer.global_batch is not None:
            raise ConfigError("dist.tensor_parallel=auto sets the global batch from trainer.per_worker_batch and "
                              "dist.max_global_batch; give trainer.per_worker_batch, not trainer.global_batch")
        value = auto_tensor_parallel(integer("dist.world_size", world_size),
                                     trainer.per_worker_batch or DEFAULT_PER_WORKER_BATCH, dist.max_global_batch)
        if procs % value:
            raise ConfigError(f"dist.tensor_parallel=auto chose T={value} (global batch at or below "
                              f"{dist.max_global_batch}), which does not divide dist.procs={procs}: start "
                              f"a multiple of {value} processes")
    elif isinstance(value, (str, bool)):
        raise ConfigError(f"dist.tensor_parallel={value}: give a number of processes per group or auto")
    return integer("dist.tensor_parallel", value)


def techniques_of(node: Mapping[str, Any] | None) -> tuple[tuple[Target, ...], tuple[str, ...]]:
    """The technique nodes with a `_target_` (built), and the names of those without one: options a recipe
    set for a technique the command line then deselected."""
    built, unselected = [], []
    for name, technique in (node or {}).items():
        if isinstance(technique, Mapping) and technique.get("_target_"):
            built.append(target_of(technique, f"technique.{name}"))
        else:
            unselected.append(str(name))
    return tuple(built), tuple(unselected)


def check_adam_settings(schedule: ScheduleSpec, optim: Target) -> None:
    """schedule.scaling=adam_sqrt moves Adam's betas and eps: the optimizer must have them, in range."""
    if schedule.scaling != "adam_sqrt":
        return
    betas, eps = optim.kwargs.get("betas"), optim.kwargs.get("eps")
    if betas is None or eps is None:
        raise ConfigError("schedule.scaling=adam_sqrt scales Adam's betas and eps, and this optimizer has none: "
                          "use optim=adamw (or lamb), or schedule.scaling=sqrt")
    if len(betas) != 2:
        raise ConfigError(f"optim.betas must hold two numbers, got {list(betas)}")
    for beta in betas:
        number("optim.betas", beta, low=0, high=1, high_open=True)
    number("optim.eps", eps, low=0)


# Config keys that may differ between a checkpoint and the run that resumes it (docs/faults.md):
# the budget (to extend a run), how it is run and shown, where data lives, and labels. Every other
# key defines the run (model, data, batches, world size, optimizer, schedule, techniques, seed).
MAY_CHANGE = (
    "trainer.epochs", "trainer.max_steps", "trainer.resume", "trainer.progress", "trainer.log_every",
    "trainer.evals", "trainer.device", "trainer.threads", "trainer.checkpoint_every", "trainer.keep_checkpoints",
    "trainer.compile", "trainer.channels_last", "trainer.loader_workers", "trainer.snapshot_samples",
    "trainer.stop_at_val_acc", "trainer.stop_at_val_loss",
    "dist.procs",  # checked on its own: the per-process files need the same count
    # Not dist.fuse_workers: fused and sequential passes round differently, and a resumed run that
    # switches drifts from the straight one (0.25 in loss after 64 steps), so it is part of the run.
    "dist.backend", "dist.timeout_s", "dist.max_restarts", "dist.allow_oversubscribe",
    "data.data_dir", "data.root", "recipe", "overrides", "tune", "study", "extra_sweeps",
)


def run_identity(config: Mapping[str, Any], per_worker_batch: int, global_batch: int) -> dict[str, Any]:
    """The run-defining part of a resolved config, as dotted keys: every key but MAY_CHANGE.

    The batch sizes are the derived ones, so `global_batch=128` and `per_worker_batch=64` at
    world size 2 are the same run.
    """
    flat = {key: value for key, value in _flatten(config).items() if not _may_change(key)}
    if flat.get("dist.shard") == "none":  # the default, dropped: a config that lacks the key ties the same run
        del flat["dist.shard"]
    flat["trainer.per_worker_batch"], flat["trainer.global_batch"] = per_worker_batch, global_batch
    return flat


# Keys that cannot change what a run computes or for how long: how it is run and shown, where data lives,
# labels. A probe's folder (and a study's) holds one experiment: every other key of its config defines it.
RESULT_FREE = (
    "trainer.resume", "trainer.progress", "trainer.threads", "trainer.checkpoint_every", "trainer.keep_checkpoints",
    "trainer.loader_workers", "dist.backend", "dist.timeout_s", "dist.max_restarts", "dist.allow_oversubscribe",
    "data.data_dir", "data.root", "recipe", "overrides", "tune", "study", "extra_sweeps",
)


def result_identity(config: Mapping[str, Any], per_worker_batch: int, global_batch: int) -> dict[str, Any]:
    """What decides a run's result, as dotted keys: `run_identity` and the budget (epochs, steps, evaluations),
    but not RESULT_FREE's keys, so reordered overrides or an added trainer.threads=1 are the same experiment."""
    flat = {key: value for key, value in _flatten(config).items() if not result_free(key)}
    flat["trainer.per_worker_batch"], flat["trainer.global_batch"] = per_worker_batch, global_batch
    return flat


def result_free(key: str) -> bool:
    """Whether a config key (dotted, or an override's key, `+`/`~` and Hydra's own included) cannot change a
    result: RESULT_FREE's keys and Hydra's settings (its launcher, folders, logging)."""
    key = key.lstrip("+~")
    return key.startswith(("hydra.", "hydra/")) or any(key == k or key.startswith(k + ".") for k in RESULT_FREE)


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(node, Mapping):
        return {prefix: node}
    flat: dict[str, Any] = {}
    for key, value in node.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def identity_differences(saved: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """`key (saved -> new)` for each run-defining key whose value differs, sorted."""
    missing = object()

    def shown(value: Any) -> str:
        return "absent" if value is missing else json.dumps(value)

    def same(a: Any, b: Any) -> bool:  # json: NaN equals NaN, as it reads back from the manifest
        return a == b or (a is not missing and b is not missing and json.dumps(a) == json.dumps(b))

    return [f"{key} ({shown(saved.get(key, missing))} -> {shown(new.get(key, missing))})"
            for key in sorted(saved.keys() | new.keys()) if not same(saved.get(key, missing), new.get(key, missing))]
