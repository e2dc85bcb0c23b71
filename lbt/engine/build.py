"""Build a run's parts from its spec: data, model, techniques and step strategy, optimizer, LR schedule.

Every process builds its own parts (`build_parts`) from the same RunSpec, so every rank starts from
the same weights (seeded before the model is built) and the same schedule.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from lbt.data.base import DataShape, DataSplits
from lbt.engine.precision import check_channels_last
from lbt.engine.strategies.base import StepStrategy
from lbt.errors import ConfigError, first_line
from lbt.metrics.text_log import note, say_once
from lbt.optim.factory import refuse_split_layers
from lbt.parallel import fsdp, tensor_parallel
from lbt.parallel.process_group import DistContext
from lbt.spec.batching import BatchLayout, Budget, check_fits, make_budget
from lbt.spec.lr import Schedule, build_schedule
from lbt.spec.run import RunSpec
from lbt.spec.targets import Target, locate
from lbt.techniques.base import Technique, sort_techniques


def instantiate(target: Target, kind: type | tuple[type, ...], /, **kwargs: Any) -> Any:
    """Call a `_target_` that builds a `kind` with its keyword arguments (and `kwargs`); `_partial_: true`
    returns a function of the rest instead. A constructor that rejects its values is one ConfigError line
    naming the config key."""
    build = locate(f"{target.key}._target_", target.target, kind)
    arguments = {**copy.deepcopy(dict(target.kwargs)), **kwargs}  # copies: a build never changes the spec
    if target.partial:
        return functools.partial(build, **arguments)
    try:
        return build(**arguments)
    except ConfigError:
        raise
    except (TypeError, ValueError) as error:
        raise ConfigError(f"{target.key}: {first_line(error)}") from None


def part_key(part: Technique | StepStrategy) -> str:
    """Where a built part is configured, as errors name it: `technique.gns`, `strategy=local_sgd`."""
    return f"strategy={part.name}" if isinstance(part, StepStrategy) else f"technique.{part.name}"


def check_targets(spec: RunSpec) -> None:
    """Every dotted path the spec names imports and can build what its key expects (checked before a run
    starts: `model._target_=os.system` is refused, not called); a sharded run's techniques and optimizer."""
    locate("model._target_", spec.model.target, nn.Module)
    locate("data._target_", spec.data.target, DataSplits)
    locate("optim._target_", spec.optim.target, torch.optim.Optimizer)
    if isinstance(spec.optim.kwargs.get("optimizer_class"), str):
        optimizer_class = locate("optim.optimizer_class", spec.optim.kwargs["optimizer_class"], torch.optim.Optimizer)
        refuse_split_layers(optimizer_class, split_layers(spec))  # Muon, SOAP: whole matrices only
    if isinstance(spec.data.kwargs.get("dataset"), str):
        locate("data.dataset", spec.data.kwargs["dataset"], tuple)
    for technique in spec.techniques:
        built = locate(f"{technique.key}._target_", technique.target, (Technique, StepStrategy))
        if isinstance(built, type) and issubclass(built, StepStrategy):
            raise ConfigError(f"{technique.key}: {technique.target} is a step strategy, not a technique: give it "
                              f"as strategy._target_={technique.target}")
    if spec.strategy is not None:
        locate("strategy._target_", spec.strategy.target, StepStrategy)
    if spec.dist.shard == "fsdp" and spec.layout.procs > 1:  # sharded: refused before any process starts
        techniques, strategy = build_techniques(spec, quiet=True)
        refuse_unsharded([*techniques, strategy])


def split_layers(spec: RunSpec) -> bool:
    """Whether the run's processes hold shards of its layers (DTensors): tensor parallel, or FSDP over processes."""
    return spec.layout.tensor_parallel > 1 or (spec.dist.shard == "fsdp" and spec.layout.procs > 1)


def build_data(data: Target) -> DataSplits:
    return instantiate(data, DataSplits)


def data_shape(data: Target) -> DataShape:
    """A data config's input shape, classes and training-set size, without loading the data."""
    return instantiate(data, DataSplits, shape_only=True)


def build_model(model: Target, input_shape: tuple[int, ...], num_classes: int | None) -> nn.Module:
    """The model for data of this shape (an image folder's classes unknown before reading it: ImageNet's 1,000)."""
    return instantiate(model, nn.Module, input_shape=tuple(input_shape), num_classes=num_classes or 1000)


@dataclass
class Parts:
    """What one process builds from the spec before training."""

    data: DataSplits
    layout: BatchLayout  # the configured batch layout (epoch 0's, before any batch ramp)
    budget: Budget
    schedule: Schedule
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    techniques: list[Technique]
    strategy: StepStrategy


def build_parts(spec: RunSpec, ctx: DistContext, extra_techniques: list[Technique] | tuple = ()) -> Parts:
    """Data, techniques and strategy, the model (seeded, changed by techniques, placed and split), the
    optimizer, each epoch's batch layout, the step budget and the LR schedule."""
    data = build_data(spec.data)
    num_train = data.num_train
    check_fits(spec.layout, num_train)
    techniques, strategy = build_techniques(spec, extra_techniques)
    model = build_placed_model(spec, data, techniques, strategy, ctx)
    data = data.to(ctx.device)  # in-memory data lives on the device: batches are gathered there
    optimizer = instantiate(spec.optim, torch.optim.Optimizer)(model)  # after sharding: it steps on the shards
    refuse_split_layers(type(optimizer), split_layers(spec))  # built without the factory too
    if ctx.tensor_parallel > 1:
        tensor_parallel.unfuse(optimizer)
    loss_fn: Callable = nn.CrossEntropyLoss()
    for technique in techniques:
        loss_fn = technique.on_loss(loss_fn)
    layouts = epoch_layouts(spec, techniques, strategy, num_train)
    optimizer = strategy.wrap_optimizer(optimizer, model)  # after setup: it knows whether its workers are real
    budget = make_budget(layouts, num_train, spec.trainer.max_steps)
    schedule = build_schedule(spec.schedule, spec.base_lr, spec.layout.global_batch, budget, spec.betas, spec.eps)
    for technique in techniques:
        if technique.replaces_lr_decay and schedule.decay != "constant":
            say_once(f"lbt: warning: technique {technique.name} replaces the LR decay (Smith et al. 2017), but "
                f"schedule.decay={schedule.decay} decays it too; use schedule=constant, as recipe=smith2017_ramp "
                "does", stderr=True)
    return Parts(data, spec.layout, budget, schedule, model, optimizer, loss_fn, techniques, strategy)


def build_techniques(spec: RunSpec, extra: list[Technique] | tuple = (),
                     quiet: bool = False) -> tuple[list[Technique], StepStrategy]:
    """The techniques the spec lists (and `extra`, built objects such as a tuner's pruning hook), in their
    order, and the step strategy (synchronous SGD when none is chosen)."""
    for name in () if quiet else spec.unselected:
        note(f"technique.{name} is configured but not selected; ignored")
    techniques = sort_techniques([instantiate(target, Technique) for target in spec.techniques] + list(extra))
    strategy = build_strategy(spec)
    refuse_conflicts([strategy, *techniques])
    return techniques, strategy


def build_strategy(spec: RunSpec) -> StepStrategy:
    return StepStrategy() if spec.strategy is None else instantiate(spec.strategy, StepStrategy)


def refuse_conflicts(parts: list[Technique | StepStrategy]) -> None:
    """One line for the first pair whose one side declares the other's type among its conflicts."""
    for part in parts:
        for other in parts:
            why = next((why for kind, why in part.conflicts.items() if isinstance(other, kind)), None)
            if other is not part and why is not None:
                raise ConfigError(f"{part_key(part)} with {part_key(other)}: {why}; use one of them")


def build_placed_model(spec: RunSpec, data: DataSplits, techniques: list[Technique], strategy: StepStrategy,
                       ctx: DistContext) -> nn.Module:
    """The model, seeded (the same initial weights in every process and layout), checked against a sample,
    changed by the techniques, on the device, split under tensor parallelism, in its memory format."""
    torch.manual_seed(spec.trainer.seed)
    model = build_model(spec.model, data.input_shape, data.num_classes)
    check_model_takes(model, data)
    for technique in techniques:
        model = technique.on_model(model)
    model.to(ctx.device)
    if ctx.tensor_parallel > 1:
        refuse_comm_hooks([*techniques, strategy], ctx.tensor_parallel, ctx.dp_procs)
        tensor_parallel.parallelize(model, ctx.mesh, spec.model.name)
    if spec.trainer.channels_last:
        check_channels_last(data.input_shape)
        model.to(memory_format=torch.channels_last)
    if ctx.sharded:
        refuse_unsharded([*techniques, strategy])
        blocks = fsdp.shard_model(model, ctx.mesh["dp"], spec.trainer.precision, spec.model.name)
        shown = ", ".join(blocks[:4]) + (", ..." if len(blocks) > 4 else "")
        say_once(f"dist.shard=fsdp: {ctx.dp_procs} data-parallel ranks each hold 1/{ctx.dp_procs} of the model, "
                 f"gathered block by block ({len(blocks)} blocks: {shown})")
    return model


def epoch_layouts(spec: RunSpec, techniques: list[Technique], strategy: StepStrategy,
                  num_train: int) -> list[BatchLayout]:
    """Each epoch's batch layout, as the techniques lay them out (a batch ramp), each checked by the
    techniques and the strategy that must serve it."""
    layouts = [spec.layout] * spec.trainer.epochs
    for technique in techniques:
        layouts = technique.epoch_layouts(layouts, num_train)
    for layout in dict.fromkeys(layouts):  # each distinct layout, in order
        for technique in techniques:
            technique.check_layout(layout)
        strategy.setup(layout, techniques)
    return layouts


def check_model_takes(model: nn.Module, data: DataSplits) -> None:
    """One forward pass of two training samples, so a model that cannot read the data's samples fails
    with one line before training (e.g. a 2-D network on 1-D signals). In eval mode and with the RNG
    forked: no BatchNorm statistic and no random stream of the run is touched."""
    samples = torch.stack([data.train[i][0] for i in range(min(2, data.num_train))])
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(samples)
    except (RuntimeError, ValueError, TypeError, IndexError, AssertionError) as error:  # timm's ViTs assert
        first = first_line(error)
        raise ConfigError(f"the model cannot read this data's samples (shape {tuple(data.input_shape)}): {first}; "
                          "pick a model for this data (1-D signals: model=cnn1d or mlp; images: resnet20, "
                          "torchvision, timm; text (data=text): char_transformer; tokens (data=tokens): gpt)") from None
    finally:
        model.train(training)


def refuse_unsharded(parts: list[Technique | StepStrategy]) -> None:
    """What needs the replicated model or DDP's hooks cannot run sharded: one line for the first such part.

    A step strategy (local SGD, gradient delay) keeps whole models or gradients of its own; a DDP
    communication hook (compression, gns between real workers) has no DDP to hook into; a measurement of
    one worker's gradient (gns with simulated workers) takes a second backward that FSDP would reduce."""
    for part in parts:
        if isinstance(part, StepStrategy) and type(part) is not StepStrategy:
            why = "it replaces the synchronous step, which FSDP's reduce-scatter is"
        elif isinstance(part, Technique) and (type(part).comm_hook is not Technique.comm_hook
                                              or part.simulated_comm is not None or part.worker_gradient_every):
            why = "it reads or changes the gradient DDP sends between workers, and a sharded run has no DDP"
        else:
            continue
        raise ConfigError(f"{part_key(part)} with dist.shard=fsdp: {why}; use dist.shard=none")


def refuse_comm_hooks(parts: list[Technique | StepStrategy], tensor_parallel: int, dp_procs: int) -> None:
    """What works inside DDP's communication hook between real workers cannot run under tensor parallelism,
    which averages gradients without DDP; with all data-parallel workers simulated it never needed it."""
    for part in parts:
        base = StepStrategy if isinstance(part, StepStrategy) else Technique
        overrides = type(part).comm_hook is not base.comm_hook
        if dp_procs > 1 and overrides:
            raise ConfigError(f"{part_key(part)} works inside DDP's gradient allreduce between real "
                              f"workers, and a tensor-parallel run (dist.tensor_parallel={tensor_parallel}) averages "
                              "gradients without DDP: simulate the data-parallel workers (dist.procs="
                              f"{tensor_parallel}) or run with dist.tensor_parallel=1")

