"""One worker's compute per step for `lbt plan`: profiled here, given (--step-ms), or read from a run's result.

Models and data are composed and built as `lbt train` composes and builds them (lbt/apps/compose.py,
lbt/engine/build.py), so `--model resnet20 --data cifar10` means what `model=resnet20 data=cifar10` means.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path

import torch

from lbt.apps.compose import compose, conf_dir
from lbt.cost.data_parallel import DEFAULT_BACKWARD_SHARE, Compute
from lbt.cost.tensor_parallel import DenseSplit, dense_split
from lbt.data.base import DataShape
from lbt.engine.build import build_model, data_shape
from lbt.errors import ConfigError
from lbt.spec.result import ResultError, read_result
from lbt.spec.targets import Target, locate, target_of


def config_names(group: str) -> list[str]:
    """The options of a config group (conf/model, conf/data): what `lbt train model=...` accepts."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def model_and_data(model: str, data: str) -> tuple[Target, Target]:
    """--model (a config of conf/model/, or your own class as package.module.Class, built as
    `lbt train model=custom model._target_=...` builds it) and --data, composed as `lbt train` composes them."""
    if model == "custom":
        raise ValueError("--model custom: give your class itself, --model package.module.Class")
    if model in config_names("model"):
        overrides = [f"model={model}"]
    elif "." in model:
        try:
            locate("--model", model)
        except ConfigError as error:
            raise ValueError(str(error)) from None
        overrides = ["model=custom", f"model._target_={model}"]
    else:
        raise ValueError(f"no model {model!r}: choose one of {', '.join(config_names('model'))} (conf/model/) "
                         "or give a class as package.module.Class")
    try:
        config = compose([*overrides, f"data={data}"], job_name="lbt_plan").config
    except ConfigError as error:
        raise ValueError(str(error)) from None
    return target_of(config["model"], "model"), target_of(config["data"], "data")


def count_parameters(model: Target, shape: DataShape) -> int:
    with torch.random.fork_rng(devices=[]):
        return sum(p.numel() for p in build_model(model, shape.input_shape, shape.num_classes).parameters())


def compute_from_step_ms(step_ms: float, model: Target, shape: DataShape, per_worker_batch: int, name: str) -> Compute:
    """A step time measured elsewhere (a GPU run): the model is only built to count its parameters.
    The step splits as forward 1/3, backward 2/3 (backward costs about twice the forward), which only
    --overlap reads."""
    num_params = count_parameters(model, shape)
    step = step_ms / 1e3
    return Compute(step / 3, 2 * step / 3, 0.0, per_worker_batch, num_params,
                   f"given: --step-ms {step_ms:g} at batch {per_worker_batch} ({name}, {num_params:,} parameters)")


def example_batch(shape: DataShape, batch: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and labels of the data's shape: token ids and next tokens for a language model."""
    classes = shape.num_classes or 1000
    if shape.token:
        x = torch.randint(0, classes, (batch, *shape.input_shape), generator=generator)
        return x, torch.randint(0, classes, (batch, *shape.input_shape), generator=generator)
    x = torch.randn(batch, *shape.input_shape, generator=generator)
    return x, torch.randint(0, classes, (batch,), generator=generator)


def profile_compute(model: Target, shape: DataShape, per_worker_batch: int, threads: int | None = None,
                    repeats: int = 20, warmup: int = 3, name: str = "model") -> Compute:
    """Median forward, backward and SGD-step time of one worker at its batch, on random data (this machine)."""
    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = build_model(model, shape.input_shape, shape.num_classes).train()
        x, y = example_batch(shape, per_worker_batch, torch.Generator().manual_seed(0))
        times = timed_steps(net, x, y, warmup + repeats, name, shape)[warmup:]
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    forward, backward, opt = (statistics.median(t[k] for t in times) for k in range(3))
    return Compute(forward, backward, opt, per_worker_batch, sum(p.numel() for p in net.parameters()),
                   f"measured: {name} at batch {per_worker_batch}, input {shape.input_shape}, {used} threads, "
                   f"median of {repeats} steps (their spread gives the slowest-worker term)",
                   step_samples=tuple(sum(t) for t in times))


def timed_steps(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, name: str,
                shape: DataShape) -> list[tuple[float, float, float]]:
    """(forward, backward, optimizer) seconds of each of `steps` SGD steps on one batch."""
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
    loss_fn = torch.nn.CrossEntropyLoss()
    times = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        try:
            loss = loss_fn(net(x), y)
        except RuntimeError as error:
            raise ValueError(f"{name} cannot take inputs of shape {shape.input_shape} "
                             f"({str(error).splitlines()[0]}): choose the data it is meant for, "
                             "or give --input-shape") from None
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    return times


def compute_from_result(path: str | Path) -> tuple[Compute, Target, DataShape]:
    """Per-worker compute from a finished run's result.json, with its model and its data's shape.

    The run's step time is global_batch / samples_per_sec, and each of its P processes ran W/P workers
    of b samples in it, so one worker's compute is step x P / W. A run with P > 1 also paid its own
    allreduce in that time, which this folds into the compute (an overestimate).
    """
    try:
        result = read_result(path)
    except ResultError as error:
        raise ValueError(str(error)) from None
    if result.failed or not result.config:
        raise ValueError(f"{path}: not an lbt result.json of a finished run with timings")
    if not result.samples_per_sec > 0:
        raise ValueError(f"{path}: samples_per_sec is {result.samples_per_sec!r}; the run did not train")
    world, procs, b = result.world_size, result.procs, result.per_worker_batch
    compute = b * world / result.samples_per_sec * procs / world
    model, shape = target_of(result.config["model"], "model"), data_shape(target_of(result.config["data"], "data"))
    source = (f"from {path}: {result.samples_per_sec:,.0f} samples/s at world_size={world} procs={procs} "
              f"per_worker_batch={b}; forward:backward split assumed 1:2, optimizer folded in"
              + ("; includes that run's own allreduce" if procs > 1 else ""))
    backward = DEFAULT_BACKWARD_SHARE * compute  # forward + backward + step together, split 1/3 : 2/3
    return Compute(compute - backward, backward, 0.0, b, count_parameters(model, shape), source), model, shape


def critical_batch_from_study(study_dir: str | Path) -> float:
    """The critical batch a study's report measured (its summary.json)."""
    path = Path(study_dir) / "summary.json"
    if not path.exists():
        raise ValueError(f"{path} not found: run `lbt report {study_dir}` first")
    crit = json.loads(path.read_text()).get("critical_batch") or {}
    # The figure the report leads with (the sweep's own), else its diagnostics: the fit, then B_simple.
    value = crit.get("value") or crit.get("fit") or crit.get("gns")
    if value is None or not math.isfinite(float(value)):
        raise ValueError(f"{path} holds no critical_batch estimate (run the study with measure=[gns])")
    return float(value)


def model_split(model: Target, shape: DataShape, name: str) -> DenseSplit:
    """`dense_split` of a model (lbt plan's --model or a result's) on a batch of the data's shape."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = build_model(model, shape.input_shape, shape.num_classes)
    example, _ = example_batch(shape, 2, torch.Generator().manual_seed(0))
    try:
        return dense_split(net, example)
    except RuntimeError as error:
        raise ValueError(f"{name} cannot take inputs of shape {shape.input_shape} "
                         f"({str(error).splitlines()[0]}): choose the data it is meant for, or give --input-shape") \
            from None
