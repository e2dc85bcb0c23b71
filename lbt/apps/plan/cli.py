"""`lbt plan`'s command line: the table over W (lbt/cost/data_parallel.py) and, with plan.tensor_parallel, the
split table (lbt/cost/tensor_parallel.py); `plan_main(argv)` returns the exit code.

    lbt plan [overrides] [plan.KEY=VALUE ...]

The run it plans for is given as `lbt train` takes it (model=..., data=..., trainer.per_worker_batch=...); the
plan's own settings are `plan.KEY=VALUE`, Hydra overrides of `PlanSettings` (settings.py).
"""

from __future__ import annotations

import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from lbt.apps.compose import cfg_job_flag
from lbt.apps.plan.compute import (
    PlannedRun,
    compute_from_result,
    compute_from_step_ms,
    config_names,
    critical_batch_from_study,
    gpu_compute,
    model_memory,
    model_split,
    planned_run,
    profile_compute,
    read_run,
    run_parts,
    train_samples,
)
from lbt.apps.plan.output import (
    describe_split,
    format_split_table,
    format_table,
    memory_lines,
    plot,
    plot_splits,
    summarize,
    summarize_splits,
)
from lbt.apps.plan.settings import PlanSettings, check_run_overrides, split_args
from lbt.cost.data_parallel import NETWORKS, Compute, Network, gradient_bytes, scaling_rows, worker_counts
from lbt.cost.gpu import DEFAULT_UTILIZATION, GPUS, LAUNCH_BOUND_S, MEMORY_GB
from lbt.cost.memory import OPTIMIZER_SLOTS
from lbt.cost.tensor_parallel import split_rows, tensor_parallel_options
from lbt.data.base import DataShape
from lbt.engine.build import data_shape
from lbt.errors import ConfigError, first_line
from lbt.metrics.critical import run_optimizer
from lbt.spec.result import RunResult
from lbt.spec.targets import Target

HELP = """usage: lbt plan [overrides] [plan.KEY=VALUE ...]

Epoch time, speedup and scaling efficiency of synchronous data parallelism over W workers (GPUs): a worker's
compute (measured or predicted) and a ring-allreduce model of the network say where adding GPUs stops paying.

  lbt plan model=resnet20 data=cifar10 trainer.per_worker_batch=128 plan.network=25gbe
  lbt plan model=resnet20 data=cifar10 plan.gpu=h100 plan.precision=bf16 plan.network=ib-ndr
  lbt plan model=timm model.name=resnet50 data=cifar10 plan.gpu=h100
  lbt plan model=torchvision model.name=vit_b_16 data=imagefolder data.root=DIR plan.step_ms=120
  lbt plan plan.from_result=runs/train/X/result.json plan.network=ib-hdr plan.from_study=runs/study/Y
  lbt plan model=custom model._target_=mypackage.MyNet data=custom data.dataset=mypackage.my_data \\
           data.input_shape=[40] data.num_classes=2
  lbt plan plan.bandwidth_gbps=40 plan.latency_us=5 plan.compression=fp16 plan.overlap=0.5
  lbt plan model=mlp plan.tensor_parallel=auto plan.network=nvlink plan.critical_batch=1024
  lbt plan model=transformer1d plan.gpu=h100 plan.shard=fsdp plan.optimizer=adamw   (sharded: traffic, memory)
  lbt plan model=mlp --cfg job                 print the plan's settings and the model and data it plans

the run it plans, as lbt train takes it (nothing else of lbt train's config changes a plan):
  model=NAME model.KEY=VALUE   the model (conf/model/, default cnn1d): {models};
                               your own class: model=custom model._target_=package.module.Class
  data=NAME data.KEY=VALUE     the data (conf/data/, default mnist1d): its input shape, classes and N:
                               {data};
                               your own: data=custom data.dataset=FUNCTION data.input_shape=[DIMS] data.num_classes=N
  trainer.per_worker_batch=B   b, samples per worker per step (default: the from_result run's, else the
                               from_study recipe's per-GPU batch, else 64)

a worker's compute (default: profiled on this machine's GPU when it has one, else its CPU, with a warning):
  plan.device=auto plan.threads=N plan.repeats=20   where and how long to profile (auto, cpu, cuda)
  plan.step_ms=MS              a step measured elsewhere (e.g. on a GPU); the model only gives the gradient size
  plan.from_result=RESULT_JSON the model, data, b and N of a run's result.json, the compute from its samples/s
  plan.gpu=NAME                the model's FLOPs (torch FlopCounterMode, one forward + backward) over the
                               published dense peak of a GPU (lbt/cost/gpu.py): {gpus}
  plan.precision=fp32          with plan.gpu: whose peak (fp32, tf32, bf16, fp16; default: the from_result
                               run's trainer.precision, else fp32)
  plan.utilization={utilization:<11g} with plan.gpu: the share of the peak a step reaches (model FLOPs
                               utilisation; typical of large models, small ones reach far less)

the network, the table and the plot:
  plan.network=10gbe           a preset (lbt/cost/data_parallel.py, with sources): {networks}
  plan.bandwidth_gbps=G plan.latency_us=U   a link of your own (over the preset's figures)
  plan.compression=none        fp16 or bf16 halve the gradient's bytes (technique comm_compression)
  plan.overlap=0               the fraction of the backward pass the allreduce can hide behind (0-1)
  plan.delay=0                 gradient delay d (strategy=gradient_delay): step = max(compute, allreduce)
  plan.max_workers=1024        W = 1, 2, 4, ... up to it
  plan.train_samples=N         N, samples per epoch (default: the run's or the data's real training set)
  plan.critical_batch=B        mark W with b x W > B (b x DP with plan.tensor_parallel), or:
  plan.from_study=DIR          the critical batch of a study's answer (its summary.json): for plan.recipe=NAME,
                               else the from_result run's recipe, else the study's best
  plan.out=PNG                 the plot (default: plan.png beside from_result or from_study, else runs/plan/)

tensor parallelism (plan.tensor_parallel=auto|T, lbt/cost/tensor_parallel.py): W GPUs as DP data-parallel
workers x T tensor-parallel ranks that share each worker's batch, so the global batch is b x DP, not b x W.
The table lists, per W, data parallelism alone (DP x 1) and every DP x T split (auto: T = 2, 4, 8):
step = compute x (1 - s + s/T) + the split layers' activation allreduces among the T ranks
(forward and backward, Megatron-style Linear pairs) + the gradient allreduce over DP of the
parameters each rank holds; s = the split layers' share of the FLOPs. It marks the recommended
split of each W: the fastest epoch whose global batch stays <= the critical batch (the fastest
overall without one) and <= N. A T that does not divide a split layer's width is left out, with a note.

memory (lbt/cost/memory.py): parameters, gradients and plan.optimizer's state (sgd and lars: 1 tensor per
parameter; adamw, adam and lamb: 2; default: the from_result run's, else adamw) in fp32 per GPU, replicated (DDP)
and sharded over W GPUs (plan.shard=fsdp, as dist.shard=fsdp runs it: 1/W of it plus the largest block, gathered
whole); activations are not counted. With plan.gpu (or plan.gpu_memory_gb=GB) the plan names the fewest GPUs on
which the model trains, beside the most that keep accuracy (the critical batch). plan.shard=fsdp puts a sharded
step's traffic in the table: two all-gathers and a reduce-scatter, 1.5x the allreduce.
"""


def plan_help() -> str:
    """`lbt plan --help`, with the presets and conf/'s models and data as they are."""
    def listed(names: list[str], start: int) -> str:  # wrapped between entries, under the help's second column
        text = ", ".join(name.replace(" ", "\xa0") for name in names)
        return textwrap.fill(text, 116, initial_indent=" " * start, subsequent_indent=" " * 31,
                             break_on_hyphens=False).lstrip().replace("\xa0", " ")

    return HELP.format(models=listed(config_names("model"), 76), data=listed(config_names("data"), 31),
                       gpus=listed([f"{g.name} ({g.label})" for g in GPUS.values()], 87),
                       networks=listed([f"{n.name} ({n.bandwidth_gbps:g} Gb/s, {n.latency_us:g} us)"
                                        for n in NETWORKS.values()], 83), utilization=DEFAULT_UTILIZATION)


def plan_main(argv: list[str]) -> int:
    """`lbt plan ARGS`: print the table over W, write the PNG; 0 on success, 2 on a usage error (one
    `lbt: error:` line on stderr)."""
    if any(arg in ("-h", "--help") for arg in argv):
        print(plan_help(), end="")
        return 0
    try:
        shown, argv = cfg_job_flag(argv, "plan", "the plan's settings and the model and data it plans")
        settings, overrides = split_args(argv)
        # Composed before the keys are checked, so a mistyped key gets Hydra's "did you mean" as in lbt train.
        run = planned_run(overrides) if overrides or not settings.from_result else None
        check_run_overrides(overrides, settings.from_result)
        if shown:
            print(OmegaConf.to_yaml({"plan": vars(settings), **planned_parts(settings, run)}), end="")
            return 0
        inputs = plan_inputs(settings, run)
    except (ValueError, OSError, KeyError, ConfigError) as error:
        return usage_error(error)
    print_inputs(inputs, settings)
    title = (f"b={inputs.compute.per_worker_batch}, {inputs.compute.num_params:,} params, {inputs.network.name} "
             f"({inputs.network.bandwidth_gbps:g} Gb/s, {inputs.network.latency_us:g} us), N={inputs.train_samples:,}"
             + (f", {settings.compression}" if settings.compression != "none" else "")
             + (f", overlap {settings.overlap:g}" if settings.overlap else ""))
    if settings.tensor_parallel is not None:
        return plan_splits(inputs, settings, title)
    return plan_table(inputs, settings, title)


def plan_table(inputs: PlanInputs, settings: PlanSettings, title: str) -> int:
    """The data-parallel table, its summary, the memory per GPU and the plot."""
    rows = scaling_rows(inputs.compute, inputs.network, worker_counts(settings.max_workers), inputs.train_samples,
                        settings.compression, settings.overlap, inputs.critical_batch, settings.delay, settings.shard)
    optimizer = settings.optimizer or inputs.optimizer
    memory = model_memory(inputs.model, inputs.shape, optimizer)
    gpu_gb = settings.gpu_memory_gb or (MEMORY_GB[settings.gpu] if settings.gpu else None)
    return show(format_table(rows, settings.shard),
                summarize(rows, inputs.critical_batch, inputs.critical_name)
                + memory_lines(memory, optimizer, [r.workers for r in rows], gpu_gb),
                plot(rows, plot_path(settings), title, inputs.critical_batch))


def planned_parts(settings: PlanSettings, run: PlannedRun | None) -> dict:
    """The model and the data the plan is for, as a run's config holds them, and the per-worker batch given."""
    if settings.from_result:
        model, data = run_parts(read_run(settings.from_result))
    else:
        assert run is not None
        model, data = run.model, run.data
    parts: dict = {part.key: {"_target_": part.target, **part.kwargs} for part in (model, data)}
    return {**parts, "trainer": {"per_worker_batch": run.per_worker_batch if run else None}}


def network_of(settings: PlanSettings) -> Network:
    """The network preset, or a link of the user's own (plan.bandwidth_gbps, plan.latency_us) over its figures."""
    preset = NETWORKS[settings.network]
    if settings.bandwidth_gbps is None and settings.latency_us is None:
        return preset
    bandwidth = settings.bandwidth_gbps if settings.bandwidth_gbps is not None else preset.bandwidth_gbps
    latency = settings.latency_us if settings.latency_us is not None else preset.latency_us
    return Network("custom", bandwidth, latency, f"given on the command line (others from {preset.name})")


def plot_path(settings: PlanSettings) -> Path:
    """Where the plot goes: where the user says, else beside the input it was made from, else runs/plan/."""
    if settings.out:
        path = Path(settings.out)
    elif settings.from_result:
        path = Path(settings.from_result).parent / "plan.png"
    elif settings.from_study:
        path = Path(settings.from_study) / "plan.png"
    else:
        path = Path("runs/plan/plan.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def usage_error(error: BaseException) -> int:
    """A mistake the user can fix: one line on stderr, exit code 2."""
    message = first_line(error)
    print(f"lbt: error: {message}", file=sys.stderr, flush=True)
    return 2


def show(table: str, summary: list[str], plotted: Path) -> int:
    """The table, its summary lines and where the plot went; exit code 0."""
    print(f"\n{table}\n")
    for line in summary:
        print(line)
    print(f"plot: {plotted.resolve()}")
    return 0


@dataclass(frozen=True)
class PlanInputs:
    compute: Compute
    model: Target
    shape: DataShape
    name: str
    network: Network
    train_samples: int
    train_samples_from: str  # where N comes from, in words
    critical_batch: float | None
    critical_why: str | None = None  # whose critical batch (a study's answer for a recipe), in words
    critical_name: str | None = None  # the same in a few words, for the summary
    warnings: tuple[str, ...] = ()
    optimizer: str = "adamw"  # whose state the memory per GPU counts: the result's optimizer, else AdamW's


def plan_inputs(settings: PlanSettings, run: PlannedRun | None) -> PlanInputs:
    """The compute (from a result, a given step time, a GPU preset, or profiled here), the model, the
    network, N and the critical batch, with a warning for what the figures do not hold for."""
    result = read_run(settings.from_result) if settings.from_result else None
    study = critical_batch_from_study(settings.from_study, settings.recipe, result.recipe if result else None) \
        if settings.from_study else None
    given = run.per_worker_batch if run is not None else None
    if result is not None:
        model, data = run_parts(result)
        name = model.target
        b = given or result.per_worker_batch
        if b != result.per_worker_batch and not settings.gpu:
            raise ValueError(f"trainer.per_worker_batch={b} differs from the result's {result.per_worker_batch}: the "
                             "measured time holds for that batch only (plan.gpu predicts any batch)")
    else:
        assert run is not None
        model, data, name = run.model, run.data, run.name
        b = given or (study and study.per_worker_batch) or 64
    shape = data_shape(data)
    compute, warnings = worker_compute(settings, model, shape, b, name, result)
    n, n_from = (settings.train_samples, "given: plan.train_samples") if settings.train_samples \
        else train_samples(data, shape, result)
    if study is not None and study.per_worker_batch and study.per_worker_batch != b:
        warnings.append(f"the study ran {study.per_worker_batch} samples per GPU and this plan b={b}: the same "
                        f"critical batch is reached at another W than the study's {study.world_size} GPUs")
    critical = study.value if study is not None else settings.critical_batch
    optimizer = str(run_optimizer(result.config) or "").lower() if result is not None else ""
    return PlanInputs(compute, model, shape, name, network_of(settings), n, n_from, critical,
                      study.why if study else None, study.name if study else None, tuple(warnings),
                      optimizer if optimizer in OPTIMIZER_SLOTS else "adamw")


def worker_compute(settings: PlanSettings, model: Target, shape: DataShape, b: int, name: str,
                   run: RunResult | None) -> tuple[Compute, list[str]]:
    """A worker's compute per step, and warnings about what it holds for."""
    if settings.gpu:
        precision = settings.precision or run_precision(run)
        compute = gpu_compute(model, shape, b, GPUS[settings.gpu], precision, settings.utilization, name)
        launch_bound = compute.total_s < LAUNCH_BOUND_S
        return compute, [f"a predicted step of {compute.total_s * 1e3:.3f} ms is below what a GPU runs a training "
                         "step in: at this size a step is bound by kernel launches (a few us each), not FLOPs, so "
                         "the step times below are lower bounds; measure a real step and give plan.step_ms"] \
            if launch_bound else []
    if run is not None:
        configured = (run.config.get("trainer") or {}).get("device")
        on_cpu = run.device == "cpu" or (run.device is None and configured == "cpu")
        return compute_from_result(settings.from_result or "")[0], [
            f"{settings.from_result} was trained on a CPU: every step time below is that CPU's, not a GPU's, and its "
            "timing jitter reads as straggler loss at large W; for a GPU give plan.gpu=NAME (a published throughput) "
            "or plan.step_ms measured on one"] if on_cpu else []
    if settings.step_ms is not None:
        return compute_from_step_ms(settings.step_ms, model, shape, b, name), []
    has_gpu = torch.cuda.is_available()
    device = "cuda" if settings.device == "auto" and has_gpu else settings.device.replace("auto", "cpu")
    if device == "cuda" and not has_gpu:
        raise ValueError("plan.device=cuda: torch sees no GPU on this machine")
    compute = profile_compute(model, shape, b, settings.threads, settings.repeats, name=name, device=device)
    if device == "cuda":
        return compute, []
    where = "no GPU here: compute was profiled" if not has_gpu else "plan.device=cpu: compute was profiled"
    return compute, [f"{where} on this CPU, so every step time below is this CPU's, not a GPU's; for a GPU give "
                     "plan.gpu=NAME (a published throughput) or plan.step_ms measured on one"]


def run_precision(run: RunResult | None) -> str:
    """The precision a run trained in (its trainer.precision), fp32 without a run: lbt's default."""
    trainer = (run.config.get("trainer") or {}) if run is not None else {}
    return str(trainer.get("precision") or "fp32")


def print_inputs(inputs: PlanInputs, settings: PlanSettings) -> None:
    """The lines above the table: warnings, the compute, the gradient, the network, N and the model of a step."""
    compute, network = inputs.compute, inputs.network
    for warning in inputs.warnings:
        print(f"warning: {warning}")
    nbytes = gradient_bytes(compute.num_params, settings.compression)
    # The parts are medians; the table's W=1 row uses the mean step (what an epoch adds up to).
    mean_step = f"; mean step {compute.slowest_of(1) * 1e3:.2f} ms" if compute.step_samples else ""
    print(f"compute: {compute.total_s * 1e3:.3f} ms per worker step at b={compute.per_worker_batch} "
          f"(forward {compute.forward_s * 1e3:.3f} + backward {compute.backward_s * 1e3:.3f} + optimizer "
          f"{compute.optimizer_s * 1e3:.3f} ms{mean_step}; {compute.source})")
    if settings.gpu:
        print(f"gpu: {GPUS[settings.gpu].source}; utilisation assumed {settings.utilization:.0%} (plan.utilization): "
              "large transformers reach 35-55% of the peak, convolutional nets and small models far less")
    print(f"gradient: {compute.num_params:,} parameters -> {nbytes / 1e6:,.3f} MB per allreduce "
          f"({'fp32' if settings.compression == 'none' else settings.compression})")
    print(f"network: {network.name}, {network.bandwidth_gbps:g} Gb/s, {network.latency_us:g} us ({network.source})")
    print(f"N: {inputs.train_samples:,} training samples per epoch ({inputs.train_samples_from})")
    if inputs.critical_why:
        print(f"critical batch: B_crit={inputs.critical_batch:,.0f} ({inputs.critical_why})")
    print(f"model: step = slowest of W workers' compute + ring allreduce - min(allreduce, {settings.overlap:g} x "
          f"backward); epoch = N/(b W) steps")
    if settings.delay:
        print(f"gradient delay d={settings.delay}: each allreduce overlaps the next step's compute, delayed step = "
              "max(slowest compute, allreduce) (the epoch column uses it); sync step = the line above")


def plan_splits(inputs: PlanInputs, settings: PlanSettings, title: str) -> int:
    """plan.tensor_parallel: the split table, its summary and its plot."""
    try:
        split = model_split(inputs.model, inputs.shape, inputs.name)
        choices = tensor_parallel_options(settings.tensor_parallel or "auto", settings.max_workers)
    except ValueError as error:
        return usage_error(error)
    rows = split_rows(inputs.compute, split, inputs.network, worker_counts(settings.max_workers), choices,
                      inputs.train_samples, settings.overlap, inputs.critical_batch)
    for line in describe_split(split, inputs.compute.per_worker_batch, choices, inputs.name):
        print(line)
    return show(format_split_table(rows), summarize_splits(rows, inputs.critical_batch, inputs.critical_name),
                plot_splits(rows, plot_path(settings), title, inputs.critical_batch))


if __name__ == "__main__":
    sys.exit(plan_main(sys.argv[1:]))
