"""`lbt plan`'s own settings (`plan.KEY=VALUE` on its command line), checked at once: one line per mistake.

The run it plans for is given as `lbt train` takes it (`model=resnet20 data=cifar10 trainer.per_worker_batch=128`);
everything else is a setting of the plan's, a Hydra override of `PlanSettings` like any key of a run's config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from lbt.cost.gpu import DEFAULT_UTILIZATION
from lbt.cost.tensor_parallel import tensor_parallel_options
from lbt.errors import ConfigError
from lbt.spec.run import Device, Shard
from lbt.spec.validate import integer, number

# The presets' names, as lbt/cost's tables key them (tests/test_plan.py checks they agree).
NetworkName = Literal["nvlink4", "nvlink", "ib-ndr", "400gbe", "ib-hdr", "100gbe", "ib-edr", "100g", "ib-fdr",
                      "25gbe", "10gbe", "1gbe"]
GpuName = Literal["v100", "a10", "l4", "l40s", "a100", "h100", "h200", "mi300x"]
Precision = Literal["fp32", "tf32", "bf16", "fp16"]
OptimizerName = Literal["sgd", "lars", "adamw", "adam", "lamb"]
Compression = Literal["none", "fp16", "bf16"]

MAX_STEP_MS = 10_000_000  # ms: a step of under 3 hours; larger ones overflowed the time arithmetic
MAX_PER_WORKER_BATCH = 1 << 24  # samples per GPU; larger ones reached torch as C++ errors


@dataclass(frozen=True)
class PlanSettings:
    # A worker's compute: profiled here (device, threads, repeats), given (step_ms), read from a run's result.json
    # (from_result: its model, data, b and samples/s), or predicted for a GPU preset (gpu, precision, utilization).
    step_ms: float | None = None
    from_result: str | None = None
    device: Device = "auto"
    threads: int | None = None
    repeats: int = 20
    gpu: GpuName | None = None
    precision: Precision | None = None  # default: the from_result run's trainer.precision, else fp32
    utilization: float = DEFAULT_UTILIZATION
    # The network and what rides on it.
    network: NetworkName = "10gbe"
    bandwidth_gbps: float | None = None  # custom, over the network preset's
    latency_us: float | None = None
    compression: Compression = "none"
    overlap: float = 0.0  # of the backward pass the allreduce can hide behind
    delay: int = 0  # gradient delay d (strategy=gradient_delay)
    tensor_parallel: str | None = None  # auto (T = 2, 4, 8) or a power of 2: the DP x T split table
    # Memory per GPU.
    shard: Shard = "none"
    optimizer: OptimizerName | None = None  # whose state; default: the from_result run's, else adamw
    gpu_memory_gb: float | None = None  # default: the gpu preset's datasheet
    # The table: W = 1, 2, 4, ... up to max_workers; N; the critical batch; where the plot goes.
    max_workers: int = 1024
    train_samples: int | None = None  # N; default: the run's or the data's training set
    critical_batch: float | None = None
    from_study: str | None = None
    recipe: str | None = None  # with from_study: whose answer
    out: str | None = None  # default: plan.png beside from_result or from_study, else runs/plan/plan.png

    def check(self) -> PlanSettings:
        self.check_numbers()
        self.check_together()
        return self

    def check_numbers(self) -> None:
        if self.step_ms is not None:
            number("plan.step_ms", self.step_ms, low=0, high=MAX_STEP_MS, low_open=True)
        number("plan.utilization", self.utilization, low=0, high=1, low_open=True)
        number("plan.overlap", self.overlap, low=0, high=1)
        integer("plan.delay", self.delay, 0)
        integer("plan.max_workers", self.max_workers, 1)
        integer("plan.repeats", self.repeats, 1)
        for key in ("threads", "train_samples"):
            if getattr(self, key) is not None:
                integer(f"plan.{key}", getattr(self, key), 1)
        for key in ("critical_batch", "bandwidth_gbps", "gpu_memory_gb"):
            if getattr(self, key) is not None:
                number(f"plan.{key}", getattr(self, key), low=0, low_open=True)
        if self.latency_us is not None:
            number("plan.latency_us", self.latency_us, low=0)
        if self.tensor_parallel is not None:
            try:
                tensor_parallel_options(self.tensor_parallel, self.max_workers)
            except ValueError as error:
                raise ConfigError(str(error)) from None

    def check_together(self) -> None:
        """Settings that exclude each other, or need another."""
        if self.step_ms is not None and self.gpu:
            raise ConfigError("plan.gpu predicts the step time that plan.step_ms gives: give one of them")
        if self.step_ms is not None and self.from_result:
            raise ConfigError("plan.from_result reads the step time that plan.step_ms gives: give one of them")
        if self.critical_batch is not None and self.from_study:
            raise ConfigError("plan.critical_batch and plan.from_study both give the critical batch: give one of them")
        if not self.gpu and (self.precision or self.utilization != DEFAULT_UTILIZATION):
            raise ConfigError("plan.precision and plan.utilization go with plan.gpu=NAME (a step predicted from the "
                              "model's FLOPs)")
        if self.recipe and not self.from_study:
            raise ConfigError("plan.recipe chooses whose answer plan.from_study takes: give plan.from_study=DIR")
        if self.tensor_parallel is not None and (self.compression != "none" or self.delay):
            raise ConfigError("plan.tensor_parallel: lbt's tensor-parallel runs average gradients without DDP's hooks, "
                              "so plan.compression and plan.delay do not apply to them; drop those")
        if self.shard == "fsdp" and (self.tensor_parallel is not None or self.compression != "none" or self.delay):
            raise ConfigError("plan.shard=fsdp plans sharded data parallelism: lbt runs it without DDP's hooks "
                              "(plan.compression, plan.delay), and the split table (plan.tensor_parallel) is for "
                              "replicated workers; drop those")


# What lbt plan took as options before, and the key that says it now: lbt train's for the run, plan.* for the rest.
RUN_KEYS = {"model": "model=NAME (your own class: model=custom model._target_=package.module.Class)",
            "data": "data=NAME", "dataset": "data.dataset=FUNCTION", "input_shape": "data.input_shape=[DIMS]",
            "num_classes": "data.num_classes=N", "per_worker_batch": "trainer.per_worker_batch=N",
            "b": "trainer.per_worker_batch=N", "N": "plan.train_samples=N"}
# lbt train keys that do not change a plan, and the setting that says what the user likely meant.
PLAN_SAYS = {"dist.shard": "plan.shard=fsdp", "dist.tensor_parallel": "plan.tensor_parallel=T",
             "dist.world_size": "plan.max_workers=W (the table runs W = 1, 2, 4, ... up to it)",
             "trainer.precision": "plan.precision with plan.gpu", "trainer.device": "plan.device",
             "trainer.threads": "plan.threads", "optim": "plan.optimizer (whose state the memory per GPU counts)",
             "trainer.global_batch": "trainer.per_worker_batch (the table runs its global batch over W)"}


def split_args(args: list[str]) -> tuple[PlanSettings, list[str]]:
    """(the plan's settings, the rest: `lbt train` overrides of the run it plans)."""
    from lbt.apps.compose import compose_settings

    for arg in args:
        refuse_old(arg)
    own = [a for a in args if a.lstrip("+~").startswith("plan.")]
    # `lbt plan --cfg job` shows them beside the run's.
    return compose_settings(PlanSettings, "plan", own).check(), [a for a in args if a not in own]


def refuse_old(arg: str) -> None:
    """An option of lbt plan's before its settings were Hydra overrides (`--network 25gbe`, `network=25gbe`): one line
    naming the key that gives it now."""
    fields = {f.name for f in dataclasses.fields(PlanSettings)}
    if arg.startswith("-"):
        flag = arg.split("=", 1)[0]
        name = flag.lstrip("-").replace("-", "_")
        new = RUN_KEYS.get(name) or (f"plan.{name}=VALUE" if name in fields else None)
        short = not flag.startswith("--")
        if new is None or short != (len(name) == 1):  # -b and -N, --network; not -network
            raise ConfigError("lbt plan takes Hydra overrides (model=NAME, trainer.per_worker_batch=N, "
                              f"plan.KEY=VALUE) and --cfg job, not {flag}; see lbt plan --help")
        raise ConfigError(f"{flag} is now {new} (lbt plan takes Hydra overrides)")
    key, given, value = arg.partition("=")
    if given and key not in ("model", "data") and (key in RUN_KEYS or key in fields):
        new = RUN_KEYS[key].split("=")[0] if key in RUN_KEYS else f"plan.{key}"
        raise ConfigError(f"{arg} is now {new}={value} (lbt plan takes Hydra overrides)")


def check_run_overrides(overrides: list[str], from_result: str | None) -> None:
    """The run's overrides set what a plan reads of it: the model, the data and trainer.per_worker_batch (and with
    plan.from_result the run's own model and data); any other key would change nothing, so it is refused."""
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in ("model", "data") or key.startswith(("model.", "data.")):
            if from_result:
                raise ConfigError(f"{arg}: plan.from_result plans the model and data of its run; give the model and "
                                  "data (model=..., data=...) or plan.from_result, not both")
        elif key != "trainer.per_worker_batch":
            meant = PLAN_SAYS.get(key)
            raise ConfigError(f"{arg}: lbt plan reads the model, the data and trainer.per_worker_batch of lbt train's "
                              "config, nothing else of it" + (f"; did you mean {meant}?" if meant else ""))
