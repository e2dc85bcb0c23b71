"""What `lbt plan` plans with: one worker's compute per step (profiled here, given with plan.step_ms, predicted
for a GPU preset with plan.gpu, or read from a run's result), N (the run's or the data's real training set) and a
study's critical batch (the figure its answer gives, for a named recipe).

Models and data are composed and built as `lbt train` composes and builds them (lbt/apps/compose.py,
lbt/engine/build.py): `lbt plan model=resnet20 data=cifar10` plans what `lbt train model=resnet20 data=cifar10` runs.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lbt.apps.compose import compose, conf_dir
from lbt.apps.plan.settings import MAX_PER_WORKER_BATCH
from lbt.cost.data_parallel import DEFAULT_BACKWARD_SHARE, Compute
from lbt.cost.gpu import Gpu, gpu_seconds
from lbt.cost.memory import OPTIMIZER_SLOTS, ModelMemory
from lbt.cost.tensor_parallel import DenseSplit, dense_split
from lbt.data.base import DataShape
from lbt.engine.build import build_data, build_model, data_shape
from lbt.errors import ConfigError, first_line
from lbt.parallel.fsdp import shard_units
from lbt.spec.result import ResultError, RunResult, read_result
from lbt.spec.targets import Target, target_of
from lbt.spec.validate import integer


def config_names(group: str) -> list[str]:
    """The options of a config group (conf/model, conf/data): what `lbt train model=...` accepts."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@dataclass(frozen=True)
class PlannedRun:
    """What a plan reads of the run it plans for, composed as `lbt train OVERRIDES` composes it."""

    model: Target
    data: Target
    per_worker_batch: int | None  # trainer.per_worker_batch, None when not given
    name: str  # the model in words: its config's name (timm resnet50), or your class


def planned_run(overrides: list[str] | tuple = ()) -> PlannedRun:
    """The model, the data and trainer.per_worker_batch that `lbt train OVERRIDES` would run."""
    composed = compose(list(overrides), job_name="lbt_plan")
    model, data = target_of(composed.config["model"], "model"), target_of(composed.config["data"], "data")
    choice = composed.choices.get("model", "custom")
    name = model.target if choice == "custom" else choice
    if "name" in model.kwargs:  # model=timm model.name=resnet50: say which
        name = f"{name} {model.kwargs['name']}"
    b = (composed.config.get("trainer") or {}).get("per_worker_batch")
    if b is not None:
        integer("trainer.per_worker_batch", b, 1, MAX_PER_WORKER_BATCH)
    return PlannedRun(model, data, b, name)


def model_and_data(model: str = "cnn1d", data: str = "mnist1d",
                   overrides: list[str] | tuple = ()) -> tuple[Target, Target]:
    """A model and data of conf/ (`model_and_data("mlp", "mnist1d")`), with `lbt train`'s overrides of them."""
    run = planned_run([f"model={model}", f"data={data}", *overrides])
    return run.model, run.data


def count_parameters(model: Target, shape: DataShape) -> int:
    with torch.random.fork_rng(devices=[]):
        return sum(p.numel() for p in build_model(model, shape.input_shape, shape.num_classes).parameters())


def model_memory(model: Target, shape: DataShape, optimizer: str) -> ModelMemory:
    """The model's parameters, its largest block under dist.shard=fsdp (the whole model when it cannot be
    sharded by blocks) and `optimizer`'s state tensors per parameter (lbt/cost/memory.py)."""
    with torch.random.fork_rng(devices=[]):
        net = build_model(model, shape.input_shape, shape.num_classes)
    params = sum(p.numel() for p in net.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for _, block in shard_units(net)]
    largest = max(blocks) if len(blocks) > 1 else params
    return ModelMemory(params, largest, OPTIMIZER_SLOTS[optimizer])


def compute_from_step_ms(step_ms: float, model: Target, shape: DataShape, per_worker_batch: int, name: str) -> Compute:
    """A step time measured elsewhere (a GPU run): the model is only built to count its parameters.
    The step splits as forward 1/3, backward 2/3 (backward costs about twice the forward), which only
    plan.overlap reads."""
    num_params = count_parameters(model, shape)
    step = step_ms / 1e3
    return Compute(step / 3, 2 * step / 3, 0.0, per_worker_batch, num_params,
                   f"given: a step of {step_ms:g} ms at batch {per_worker_batch} ({name}, {num_params:,} parameters)")


def example_batch(shape: DataShape, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and labels of the data's shape: token ids and next tokens for a language model."""
    classes = shape.num_classes or 1000
    if shape.token:
        x = torch.randint(0, classes, (batch, *shape.input_shape), generator=generator)
        return x, torch.randint(0, classes, (batch, *shape.input_shape), generator=generator)
    x = torch.randn(batch, *shape.input_shape, generator=generator)
    return x, torch.randint(0, classes, (batch,), generator=generator)


def profile_compute(model: Target, shape: DataShape, per_worker_batch: int, threads: int | None = None,
                    repeats: int = 20, warmup: int = 3, name: str = "model", device: str = "cpu") -> Compute:
    """Median forward, backward and SGD-step time of one worker at its batch, on random data, on this
    machine's `device` ("cpu", or "cuda" for its GPU)."""
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    where = torch.device(device)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = build_model(model, shape.input_shape, shape.num_classes).train().to(where)
        x, y = example_batch(shape, per_worker_batch, torch.Generator().manual_seed(0))
        times = timed_steps(net, x.to(where), y.to(where), warmup + repeats, name, shape)[warmup:]
        used = f"{torch.get_num_threads()} threads" if where.type == "cpu" else torch.cuda.get_device_name(where)
    finally:
        torch.set_num_threads(previous_threads)
    forward, backward, opt = (statistics.median(t[k] for t in times) for k in range(3))
    return Compute(forward, backward, opt, per_worker_batch, sum(p.numel() for p in net.parameters()),
                   f"measured on this machine's {where.type.upper()}: {name} at batch {per_worker_batch}, input "
                   f"{shape.input_shape}, {used}, median of {repeats} steps (their spread gives the slowest-worker "
                   "term)", step_samples=tuple(sum(t) for t in times))


def timed_steps(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, name: str,
                shape: DataShape) -> list[tuple[float, float, float]]:
    """(forward, backward, optimizer) seconds of each of `steps` SGD steps on one batch (a GPU's queue is
    drained at each mark, so a part's time is its kernels', not their launches')."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()

    def now() -> float:
        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        return time.perf_counter()

    times = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        t0 = now()
        try:
            loss = loss_fn(net(x), y)
        except RuntimeError as error:
            raise ValueError(f"{name} cannot take inputs of shape {shape.input_shape} "
                             f"({str(error).splitlines()[0]}): choose the data it is meant for (data=NAME)") \
                from None
        t1 = now()
        loss.backward()
        t2 = now()
        optimizer.step()
        times.append((t1 - t0, t2 - t1, now() - t2))
    return times


def step_flops(model: Target, shape: DataShape, batch: int, name: str) -> tuple[float, float]:
    """FLOPs of one training step's forward and backward at `batch` (torch's FlopCounterMode: matmuls and
    convolutions). Counted on the meta device, where nothing is computed; a model that cannot run there
    is counted on this CPU at batch 2 and scaled to `batch` (FLOPs grow linearly with the batch)."""
    from torch.utils.flop_counter import FlopCounterMode

    def counted(device: str, n: int) -> tuple[float, float]:
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            net = build_model(model, shape.input_shape, shape.num_classes).train()
        if device == "meta":  # shapes only: no batch is made
            x = torch.empty(n, *shape.input_shape, device=device, dtype=torch.long if shape.token else torch.float)
            y = torch.empty(n, *(shape.input_shape if shape.token else ()), device=device, dtype=torch.long)
        else:
            x, y = example_batch(shape, n, torch.Generator().manual_seed(0))
        with FlopCounterMode(display=False) as forward:
            loss = torch.nn.functional.cross_entropy(net(x), y)
        with FlopCounterMode(display=False) as backward:
            loss.backward()
        return float(forward.get_total_flops()), float(backward.get_total_flops())

    try:
        return counted("meta", batch)
    except Exception:  # an op without a meta kernel (a model of yours): count on real tensors instead
        pass
    try:
        forward, backward = counted("cpu", 2)
    except RuntimeError as error:
        raise ValueError(f"{name} cannot take inputs of shape {shape.input_shape} ({str(error).splitlines()[0]}): "
                         "choose the data it is meant for (data=NAME)") from None
    return forward * batch / 2, backward * batch / 2


def gpu_compute(model: Target, shape: DataShape, per_worker_batch: int, gpu: Gpu, precision: str,
                utilization: float, name: str) -> Compute:
    """A worker's step on a GPU preset: the model's FLOPs at its batch over the GPU's published dense peak
    times an assumed utilisation (lbt/cost/gpu.py); the optimizer step is not counted."""
    forward, backward = step_flops(model, shape, per_worker_batch, name)
    forward_s, backward_s = (gpu_seconds(f, gpu, precision, utilization) for f in (forward, backward))
    rate = gpu.tflops[precision]
    source = (f"predicted for {gpu.label}: {name} at batch {per_worker_batch}, {(forward + backward) / 1e9:,.3f} "
              f"GFLOP per step (forward {forward / 1e9:,.3f} + backward {backward / 1e9:,.3f}; torch FlopCounterMode,"
              f" matmuls and convolutions) / ({rate:g} TFLOPS dense {precision} peak x {utilization:.0%} assumed "
              "utilisation); the optimizer step is not counted")
    return Compute(forward_s, backward_s, 0.0, per_worker_batch, count_parameters(model, shape), source)


def read_run(path: str | Path) -> RunResult:
    """A finished run's result.json, its config included; one line naming the file if it is not one."""
    try:
        result = read_result(path)
    except ResultError as error:
        raise ValueError(str(error)) from None
    if result.failed or not result.config:
        raise ValueError(f"{path}: not an lbt result.json of a finished run with timings")
    return result


def run_parts(result: RunResult) -> tuple[Target, Target]:
    """The model and the data a run was built from (its resolved config)."""
    try:
        return target_of(result.config.get("model"), "model"), target_of(result.config.get("data"), "data")
    except ConfigError as error:
        raise ValueError(str(error)) from None


def compute_from_result(path: str | Path) -> tuple[Compute, Target, DataShape]:
    """Per-worker compute from a finished run's result.json, with its model and its data's shape.

    The run's step time is global_batch / samples_per_sec, and each of its P processes ran W/P workers
    of b samples in it, so one worker's compute is step x P / W. A run with P > 1 also paid its own
    allreduce in that time, which this folds into the compute (an overestimate).
    """
    result = read_run(path)
    if not result.samples_per_sec > 0:
        raise ValueError(f"{path}: samples_per_sec is {result.samples_per_sec!r}; the run did not train")
    world, procs, b = result.world_size, result.procs, result.per_worker_batch
    compute = b * world / result.samples_per_sec * procs / world
    model, data = run_parts(result)
    shape = data_shape(data)
    source = (f"from {path}: {result.samples_per_sec:,.0f} samples/s at world_size={world} procs={procs} "
              f"per_worker_batch={b}; forward:backward split assumed 1:2, optimizer folded in"
              + ("; includes that run's own allreduce" if procs > 1 else ""))
    backward = DEFAULT_BACKWARD_SHARE * compute  # forward + backward + step together, split 1/3 : 2/3
    return Compute(compute - backward, backward, 0.0, b, count_parameters(model, shape), source), model, shape


def train_samples(data: Target, shape: DataShape, run: RunResult | None = None) -> tuple[int, str]:
    """N, the training samples an epoch of `lbt train` reads with this data (after its validation split), and
    where it comes from: the data's config where that says (lbt's own data), else the data read here to count
    it (your own data, an image folder), else a run's steps per epoch x its global batch."""
    name = data.kwargs.get("dataset") or data.target
    if shape.num_train:
        return shape.num_train, f"the training set of {name}, after its validation split"
    try:
        splits = build_data(data)
    except Exception as error:  # your data's function may raise anything: say so in one line
        reason = first_line(error)
        if run is not None and run.steps_per_epoch and run.global_batch:
            return run.steps_per_epoch * run.global_batch, (
                f"the run's {run.steps_per_epoch:,} steps per epoch x global batch {run.global_batch:,}; "
                f"{name} could not be read here to count it: {reason}")
        if isinstance(error, ConfigError):  # a mistake in the data's settings: that is the line to read
            raise ValueError(reason) from None
        raise ValueError(f"N, the training samples per epoch, is not known without reading {name}, and reading "
                         f"it failed ({type(error).__name__}: {reason}): give plan.train_samples=N") from None
    held = f", {len(splits.val):,} more held out for validation" if splits.val is not None else ""  # type: ignore[arg-type]
    return splits.num_train, f"the training set of {name}, read here to count it{held}"


@dataclass(frozen=True)
class StudyBatch:
    """The critical batch `lbt plan plan.from_study=DIR` takes: one recipe's largest global batch within the study's
    tolerance, the figure the report's answer gives (lbt/apps/report/answer.py), and at what world size."""

    value: float
    recipe: str
    world_size: int | None
    why: str  # which recipe, in words, and the study's own answer beside it

    @property
    def name(self) -> str:
        """Whose critical batch, in a few words."""
        return f"the study's answer for {self.recipe}"

    @property
    def per_worker_batch(self) -> int | None:
        return int(self.value) // self.world_size if self.world_size else None


def critical_batch_from_study(study_dir: str | Path, recipe: str | None = None,
                              run_recipe: str | None = None) -> StudyBatch:
    """The critical batch of a study, as its report's answer gives it (summary.json's gpu_answer, the
    same figure as its critical_batch.value): for `recipe` if given, else for `run_recipe` (the recipe of
    the plan.from_result run) when the study ran it, else for the study's answer, its best recipe."""
    path = Path(study_dir) / "summary.json"
    if not path.exists():
        raise ValueError(f"{path} not found: run `lbt report {study_dir}` first")
    try:
        summary = json.loads(path.read_text())
        if not isinstance(summary, dict):
            raise ValueError(f"a JSON {type(summary).__name__}, not an object")
    except ValueError as error:
        raise ValueError(f"{path}: not a readable summary.json ({error})") from None
    answer, crit = summary.get("gpu_answer") or {}, summary.get("critical_batch") or {}
    withheld = summary.get("answer_withheld") or answer.get("withheld") or crit.get("withheld")
    if withheld:
        raise ValueError(f"{path}: the study gives no answer ({withheld}), so no critical batch to plan with: "
                         "give plan.critical_batch=B")
    recipes = {r["recipe"]: r for r in answer.get("recipes") or [] if r.get("recipe")}
    best = answer.get("best") or {}
    if not recipes and crit.get("value"):  # a summary.json without per-recipe answers: the lead figure only
        best = {"recipe": crit.get("recipe") or "the study's best recipe", "global_batch": crit["value"]}
        recipes = {best["recipe"]: best}
    if not answer and not best:
        raise ValueError(f"{path} holds no answer of the study (no gpu_answer: written by an older lbt report?): "
                         f"run `lbt report {study_dir}` again, or give plan.critical_batch=B")
    if not best.get("global_batch"):
        raise ValueError(f"{path}: the study kept no recipe's global batch within its tolerance, so no critical "
                         "batch to plan with: give plan.critical_batch=B")
    if recipe is not None and recipe not in recipes:
        raise ValueError(f"plan.recipe={recipe}: the study in {study_dir} ran {', '.join(sorted(recipes))}")
    chosen = recipe or (run_recipe if run_recipe in recipes else best["recipe"])
    return study_batch(recipes[chosen], best, chosen == run_recipe and recipe is None)


def study_batch(entry: dict[str, Any], best: dict[str, Any], from_run: bool) -> StudyBatch:
    """One recipe's answer as a StudyBatch, its words saying whose figure it is and what the study answered."""
    name = entry["recipe"]
    if not entry.get("global_batch"):
        raise ValueError(f"the study kept no global batch of {name} within its tolerance (every batch tried was "
                         f"worse): no critical batch for it; choose plan.recipe={best['recipe']} (the study's "
                         "answer) or give plan.critical_batch=B")

    def says(e: dict[str, Any]) -> str:
        gpus = f"up to {e['world_size']} GPUs, " if e.get("world_size") else ""
        return f"{gpus}global batch {e['global_batch']:,}"

    why = f"the study's answer for {name}: {says(entry)}"
    why += (", the recipe of the plan.from_result run" if from_run else "")
    if name == best["recipe"]:
        why += ", its best recipe"
    else:
        why += f"; its best recipe, {best['recipe']}: {says(best)} (plan.recipe={best['recipe']})"
    return StudyBatch(float(entry["global_batch"]), name, entry.get("world_size"), why)


def model_split(model: Target, shape: DataShape, name: str) -> DenseSplit:
    """`dense_split` of a model (the planned run's or a result's) on a batch of the data's shape."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = build_model(model, shape.input_shape, shape.num_classes)
    example, _ = example_batch(shape, 2, torch.Generator().manual_seed(0))
    try:
        return dense_split(net, example)
    except RuntimeError as error:
        raise ValueError(f"{name} cannot take inputs of shape {shape.input_shape} "
                         f"({str(error).splitlines()[0]}): choose the data it is meant for (data=NAME)") from None
