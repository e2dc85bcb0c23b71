"""`lbt plan`'s command line: the table over W (lbt/cost/data_parallel.py) and, with --tensor-parallel, the
split table (lbt/cost/tensor_parallel.py); `plan_main(argv)` returns the exit code."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
from omegaconf import OmegaConf

from lbt.apps.compose import cfg_job_flag
from lbt.apps.plan.compute import (
    compute_from_result,
    compute_from_step_ms,
    config_names,
    critical_batch_from_study,
    gpu_compute,
    model_and_data,
    model_memory,
    model_split,
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
from lbt.cost.data_parallel import NETWORKS, Compute, Network, gradient_bytes, scaling_rows, worker_counts
from lbt.cost.gpu import DEFAULT_UTILIZATION, GPUS, LAUNCH_BOUND_S, MEMORY_GB, PRECISIONS
from lbt.cost.memory import OPTIMIZER_SLOTS
from lbt.cost.tensor_parallel import split_rows, tensor_parallel_options
from lbt.data.base import DataShape
from lbt.engine.build import data_shape
from lbt.errors import ConfigError, first_line
from lbt.metrics.critical import run_optimizer
from lbt.spec.result import RunResult
from lbt.spec.targets import Target

MAX_STEP_MS = 10_000_000  # ms: a step of under 3 hours; larger ones overflowed the time arithmetic
MAX_PER_WORKER_BATCH = 1 << 24  # samples per GPU; larger ones reached torch as C++ errors

EPILOG = """examples:
  lbt plan --model resnet20 --data cifar10 --per-worker-batch 128 --network 25gbe
  lbt plan model=resnet20 data=cifar10 per_worker_batch=128 network=25gbe   (the same)
  lbt plan --model resnet20 --data cifar10 --gpu h100 --precision bf16 --network ib-ndr
  lbt plan model=timm model.name=resnet50 data=cifar10 gpu=h100   (lbt train's model.*/data.* overrides)
  lbt plan --model torchvision model.name=vit_b_16 --data imagefolder data.root=DIR --step-ms 120
  lbt plan --from-result runs/train/X/result.json --network ib-hdr --from-study runs/study/Y
  lbt plan --model mypackage.MyNet --data custom --dataset mypackage.my_data --input-shape 40 --num-classes 2
  lbt plan --model cnn1d --bandwidth-gbps 40 --latency-us 5 --compression fp16 --overlap 0.5
  lbt plan --model mlp --tensor-parallel auto --network nvlink --critical-batch 1024
  lbt plan --model transformer1d --gpu h100 --shard fsdp --optimizer adamw   (sharded: FSDP traffic, memory)

a worker's compute: profiled here (this machine's GPU when it has one, else its CPU, with a warning),
--step-ms measured elsewhere, a run's own samples/s (--from-result), or --gpu NAME: the model's FLOPs
(torch FlopCounterMode, one forward + backward) over that GPU's published dense peak at --precision x an
assumed --utilization (lbt/cost/gpu.py: the figures and their sources; the output states the ones used).
N, the training samples per epoch: --train-samples, else the run's or the data's real training set.

tensor parallelism (--tensor-parallel auto|T, lbt/cost/tensor_parallel.py): W GPUs as DP data-parallel
workers x T tensor-parallel ranks that share each worker's batch, so the global batch is b x DP, not b x W.
The table lists, per W, data parallelism alone (DP x 1) and every DP x T split (auto: T = 2, 4, 8):
step = compute x (1 - s + s/T) + the split layers' activation allreduces among the T ranks
(forward and backward, Megatron-style Linear pairs) + the gradient allreduce over DP of the
parameters each rank holds; s = the split layers' share of the FLOPs. It marks the recommended
split of each W: the fastest epoch whose global batch stays <= the critical batch (the fastest
overall without one) and <= N. A T that does not divide a split layer's width is left out, with a note.

memory (lbt/cost/memory.py): parameters, gradients and --optimizer's state in fp32 per GPU, replicated (DDP)
and sharded over W GPUs (--shard fsdp, dist.shard=fsdp: 1/W of it plus the largest block, gathered whole);
activations are not counted. With --gpu (or --gpu-memory-gb) the plan names the fewest GPUs on which the
model trains, beside the most that keep accuracy (the critical batch). --shard fsdp puts a sharded step's
traffic in the table: two all-gathers and a reduce-scatter, 1.5x the allreduce."""


class UsageError(ValueError):
    """A command line argparse rejects: one `lbt: error:` line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse prints usage and exits; lbt says one line
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="lbt plan", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Epoch time, speedup and scaling efficiency of synchronous data parallelism over W workers "
                    "(measured or predicted compute + ring-allreduce model).")
    _compute_options(parser)
    _gpu_options(parser)
    _network_options(parser)
    _memory_options(parser)
    parser.add_argument("--max-workers", type=int, default=1024)
    parser.add_argument("--train-samples", "-N", type=int,
                        help="N, training samples per epoch (default: the run's or the data's training set)")
    critical = parser.add_mutually_exclusive_group()
    critical.add_argument("--critical-batch", type=float, metavar="B_CRIT",
                          help="mark W with b x W > B_CRIT (b x DP with --tensor-parallel)")
    critical.add_argument("--from-study", metavar="DIR",
                          help="the critical batch of a study's answer (its summary.json): the largest global batch "
                               "within its tolerance, for --recipe, else the --from-result run's recipe, else the "
                               "study's best; b defaults to that recipe's per-GPU batch in the study")
    parser.add_argument("--recipe", help="with --from-study: whose answer to take (default: see --from-study)")
    parser.add_argument("--out", help="PNG plot of epoch time and efficiency (default: plan.png beside the "
                                      "--from-result or --from-study input, else runs/plan/plan.png)")
    return parser


def _compute_options(parser: argparse.ArgumentParser) -> None:
    """Where one worker's compute comes from: a model profiled here, a given step time, or a run's result."""
    source = parser.add_mutually_exclusive_group()
    parser.add_argument("--model", metavar="NAME_OR_CLASS",
                        help=f"the model: {', '.join(config_names('model'))} (conf/model/) or your own class as "
                             "package.module.Class; profiled on random data of --data's shape (default cnn1d); "
                             "lbt train's overrides of the model and data follow as they would there "
                             "(model.name=resnet50, data.input_shape=[3,64,64])")
    source.add_argument("--step-ms", type=float, metavar="MS",
                        help="a worker's step time measured elsewhere (e.g. on a GPU), in ms, instead of "
                             "profiling this machine; the model only gives the gradient size")
    source.add_argument("--from-result", metavar="RESULT_JSON",
                        help="take the model, data, b and N from a run's result.json, and the compute time "
                             "from its samples/s (or from --gpu)")
    parser.add_argument("--data", choices=config_names("data"),
                        help="the data the model trains on (conf/data/): its input shape, classes and N "
                             "(default mnist1d); custom: your own, with --dataset, --input-shape and "
                             "--num-classes")
    parser.add_argument("--dataset", metavar="FUNCTION",
                        help="with --data custom: your data's function, package.module.function (data.dataset), "
                             "called once to count its training set unless --train-samples gives N")
    parser.add_argument("--input-shape", type=dims, nargs="+", metavar="DIM",
                        help="input shape of one sample, e.g. 40 or 3 32 32 (overrides --data's)")
    parser.add_argument("--num-classes", type=int, help="classes (overrides --data's)")
    parser.add_argument("--per-worker-batch", "-b", type=int,
                        help="b, samples per worker per step (default: the --from-result run's, else the --from-study "
                             "recipe's per-GPU batch, else 64)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="where to profile: auto (this machine's GPU when it has one, else its CPU), cpu, cuda")
    parser.add_argument("--threads", type=int, help="threads for the profiling run (default: torch's)")
    parser.add_argument("--repeats", type=int, default=20, help="profiled steps, after 3 warm-up steps (default 20)")


def _gpu_options(parser: argparse.ArgumentParser) -> None:
    """A GPU preset instead of profiling: the model's FLOPs over a published peak x an assumed utilisation."""
    presets = ", ".join(f"{g.name} ({g.label})" for g in GPUS.values())
    parser.add_argument("--gpu", choices=list(GPUS), metavar="NAME",
                        help=f"predict a worker's step on this GPU from the model's FLOPs and the GPU's published "
                             f"dense peak (lbt/cost/gpu.py): {presets}")
    parser.add_argument("--precision", choices=list(PRECISIONS),
                        help="with --gpu: whose peak rate to use (default: the run's trainer.precision with "
                             "--from-result, else fp32, lbt's default; bf16 for trainer.precision=bf16)")
    parser.add_argument("--utilization", type=float, default=DEFAULT_UTILIZATION, metavar="FRACTION",
                        help=f"with --gpu: the share of the peak a step reaches (model FLOPs utilisation; default "
                             f"{DEFAULT_UTILIZATION:g}, typical of large models; small ones reach far less)")


def _network_options(parser: argparse.ArgumentParser) -> None:
    """The network and what rides on it: bandwidth, latency, compression, overlap, delay, tensor parallelism."""
    presets = ", ".join(f"{n.name} ({n.bandwidth_gbps:g} Gb/s, {n.latency_us:g} us)" for n in NETWORKS.values())
    parser.add_argument("--network", default="10gbe", choices=list(NETWORKS), metavar="NAME",
                        help=f"preset (sources: lbt/cost/data_parallel.py): {presets}")
    parser.add_argument("--bandwidth-gbps", type=float,
                        help="custom per-direction bandwidth, Gb/s (overrides --network)")
    parser.add_argument("--latency-us", type=float, help="custom per-message latency, us (overrides --network)")
    parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                        help="gradient compression (halves the bytes; technique comm_compression)")
    parser.add_argument("--overlap", type=float, default=0.0, metavar="FRACTION",
                        help="fraction of the backward pass the allreduce can overlap with (0-1, default 0)")
    parser.add_argument("--delay", type=int, default=0, metavar="D",
                        help="gradient delay d (strategy=gradient_delay; 1 = double buffering): each step's "
                             "allreduce overlaps the next step's compute, step = max(compute, allreduce); "
                             "the table shows the synchronous step beside it (default 0: synchronous)")
    parser.add_argument("--tensor-parallel", metavar="auto|T",
                        help="compare data parallelism alone with DP x T splits of each W (dist.tensor_parallel): "
                             "auto tries T = 2, 4, 8; a power of 2 T tries that one (see below)")


def _memory_options(parser: argparse.ArgumentParser) -> None:
    """Memory per GPU: replicated or sharded, the optimizer's state, the GPU's memory."""
    parser.add_argument("--shard", choices=["none", "fsdp"], default="none",
                        help="none: every GPU holds the whole model (DDP); fsdp: sharded (dist.shard=fsdp), whose "
                             "traffic the table then shows (default none; memory lines show both)")
    parser.add_argument("--optimizer", choices=list(OPTIMIZER_SLOTS), default=None,
                        help="whose state the memory per GPU counts (sgd and lars: 1 tensor per parameter; adamw, "
                             "adam and lamb: 2; default: --from-result's optimizer, else adamw)")
    parser.add_argument("--gpu-memory-gb", type=float, metavar="GB",
                        help="memory per GPU, for the fewest GPUs the model trains on (default: --gpu's datasheet)")


def dims(text: str) -> list[int]:
    """One --input-shape argument: 40, or a list as lbt train writes it, [3,32,32]."""
    try:
        values = [int(part) for part in text.strip("[]").split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape (give 40, or 3 32 32, or [3,32,32])") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a shape of positive sizes")
    return values


def _network(options: argparse.Namespace) -> Network:
    preset = NETWORKS[options.network]
    if options.bandwidth_gbps is None and options.latency_us is None:
        return preset
    bandwidth = options.bandwidth_gbps if options.bandwidth_gbps is not None else preset.bandwidth_gbps
    latency = options.latency_us if options.latency_us is not None else preset.latency_us
    if bandwidth <= 0 or latency < 0:
        raise ValueError("--bandwidth-gbps must be > 0 and --latency-us >= 0")
    return Network("custom", bandwidth, latency, f"given on the command line (others from {preset.name})")


def config_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Plan's own arguments apart from `lbt train`'s overrides of the model and the data (`model.name=resnet50`,
    `data.input_shape=[3,32,32]`, `+model.img_size=32`), which are composed as `lbt train` composes them."""
    args, overrides = [], []
    for arg in argv:
        key = arg.split("=", 1)[0]
        if arg.startswith("-") or not (arg.startswith(("+", "~")) or ("=" in arg and "." in key)):
            args.append(arg)  # --network 1gbe, network=1gbe, model=timm: plan's own
        elif key.lstrip("+~").split(".", 1)[0] in ("model", "data"):
            overrides.append(arg)
        else:
            raise ValueError(f"{arg}: lbt plan composes the model's and the data's overrides (model.KEY=VALUE, "
                             "data.KEY=VALUE) as lbt train does; the rest are its own options (b: per_worker_batch=N "
                             "or --per-worker-batch N; see lbt plan --help)")
    return args, overrides


def hydra_style(argv: list[str]) -> list[str]:
    """Accept `model=resnet20 per_worker_batch=128` as well as `--model resnet20 --per-worker-batch 128`,
    so `lbt plan` reads like the `lbt train` command it plans for."""
    args: list[str] = []
    for arg in argv:
        if not arg.startswith("-") and "=" in arg:
            key, value = arg.split("=", 1)
            args += [f"--{key.replace('_', '-').replace('.', '-')}", value]
        else:
            args.append(arg)
    return args


def plot_path(options: argparse.Namespace) -> Path:
    """Where the plot goes: where the user says, else beside the input it was made from, else runs/plan/."""
    if options.out:
        path = Path(options.out)
    elif options.from_result:
        path = Path(options.from_result).parent / "plan.png"
    elif options.from_study:
        path = Path(options.from_study) / "plan.png"
    else:
        path = Path("runs/plan/plan.png")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def plan_main(argv: list[str]) -> int:
    """`lbt plan ARGS`: print the table over W, write the PNG; 0 on success, 2 on a usage error (one
    `lbt: error:` line on stderr)."""
    try:
        shown, argv = cfg_job_flag(argv, "plan", "the plan's settings and the model and data it plans")
        args, overrides = config_overrides(argv)
        options = _parser().parse_args(hydra_style(args))
        options.overrides = overrides
        check_options(options)
        if shown:
            print(OmegaConf.to_yaml({"plan": own_settings(options), **planned_parts(options)}), end="")
            return 0
        inputs = plan_inputs(options)
    except SystemExit as done:  # --help
        return int(done.code or 0)
    except (ValueError, OSError, KeyError, ConfigError) as error:
        return usage_error(error)
    print_inputs(inputs, options)
    title = (f"b={inputs.compute.per_worker_batch}, {inputs.compute.num_params:,} params, {inputs.network.name} "
             f"({inputs.network.bandwidth_gbps:g} Gb/s, {inputs.network.latency_us:g} us), N={inputs.train_samples:,}"
             + (f", {options.compression}" if options.compression != "none" else "")
             + (f", overlap {options.overlap:g}" if options.overlap else ""))
    if options.tensor_parallel is not None:
        return plan_splits(inputs, options, title)
    rows = scaling_rows(inputs.compute, inputs.network, worker_counts(options.max_workers), inputs.train_samples,
                        options.compression, options.overlap, inputs.critical_batch, options.delay, options.shard)
    optimizer = options.optimizer or inputs.optimizer
    memory = model_memory(inputs.model, inputs.shape, optimizer)
    gpu_gb = options.gpu_memory_gb or (MEMORY_GB[options.gpu] if options.gpu else None)
    return show(format_table(rows, options.shard),
                summarize(rows, inputs.critical_batch, inputs.critical_name)
                + memory_lines(memory, optimizer, [r.workers for r in rows], gpu_gb),
                plot(rows, plot_path(options), title, inputs.critical_batch))


def own_settings(options: argparse.Namespace) -> dict:
    """The plan's options as `--cfg job` shows them: snake_case keys, as `key=value` gives them."""
    return {key: value for key, value in sorted(vars(options).items()) if key != "overrides"}


def planned_parts(options: argparse.Namespace) -> dict:
    """The model and the data the plan is for, as a run's config holds them."""
    if options.from_result:
        model, data = run_parts(read_run(options.from_result))
    else:
        model, data = model_and_data(options.model or "cnn1d", options.data or "mnist1d",
                                     [*data_overrides(options), *options.overrides])
    return {part.key: {"_target_": part.target, **part.kwargs} for part in (model, data)}


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


def check_options(options: argparse.Namespace) -> None:
    """Values argparse's types cannot check, and options that exclude each other."""
    if not 0.0 <= options.overlap <= 1.0:
        raise ValueError(f"--overlap must be in [0, 1], got {options.overlap}")
    if options.delay < 0:
        raise ValueError(f"--delay must be >= 0, got {options.delay}")
    for name in ("per_worker_batch", "max_workers", "train_samples", "threads", "repeats", "num_classes"):
        value = getattr(options, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if options.from_result and (options.model or options.data or options.overrides):
        raise ValueError("--from-result takes the model and data of its run: give --model/--data (and their "
                         "overrides) or --from-result, not both")
    if options.step_ms is not None and not 0 < options.step_ms <= MAX_STEP_MS:
        raise ValueError(f"--step-ms must be a positive time in ms up to {MAX_STEP_MS:,}, got {options.step_ms:g}")
    if options.per_worker_batch is not None and options.per_worker_batch > MAX_PER_WORKER_BATCH:
        raise ValueError(f"--per-worker-batch must be at most {MAX_PER_WORKER_BATCH:,}, got {options.per_worker_batch}")
    if getattr(options, "critical_batch", None) is not None and not 0 < options.critical_batch < math.inf:
        raise ValueError(f"--critical-batch must be a positive global batch, got {options.critical_batch:g}")
    if options.gpu and options.step_ms is not None:
        raise ValueError("--gpu predicts the step time that --step-ms gives: give one of them")
    if not options.gpu and (options.precision or options.utilization != DEFAULT_UTILIZATION):
        raise ValueError("--precision and --utilization go with --gpu NAME (a step predicted from the model's FLOPs)")
    if not 0.0 < options.utilization <= 1.0:
        raise ValueError(f"--utilization must be in (0, 1], got {options.utilization}")
    if options.recipe and not options.from_study:
        raise ValueError("--recipe chooses whose answer --from-study takes: give --from-study DIR")
    if options.tensor_parallel is not None and (options.compression != "none" or options.delay):
        raise ValueError("--tensor-parallel: lbt's tensor-parallel runs average gradients without DDP's hooks, "
                         "so --compression and --delay do not apply to them; drop those")
    if options.shard == "fsdp" and (options.tensor_parallel is not None or options.compression != "none"
                                    or options.delay):
        raise ValueError("--shard fsdp plans sharded data parallelism: lbt runs it without DDP's hooks "
                         "(--compression, --delay), and the split table (--tensor-parallel) is for replicated "
                         "workers; drop those")
    if options.gpu_memory_gb is not None and not options.gpu_memory_gb > 0:
        raise ValueError(f"--gpu-memory-gb must be > 0, got {options.gpu_memory_gb}")
    if options.input_shape is not None:
        options.input_shape = [d for arg in options.input_shape for d in arg]  # 3 32 32 and [3,32,32] alike


def data_overrides(options: argparse.Namespace) -> list[str]:
    """--data custom's required keys (conf/data/custom.yaml's ???) from --input-shape, --num-classes, --dataset."""
    if options.data != "custom":
        if options.dataset:
            raise ValueError("--dataset names your data's function: it goes with --data custom")
        return []
    if not (options.dataset and options.input_shape and options.num_classes):
        raise ValueError("--data custom is your own data, as lbt train's data=custom: give its function, its "
                         "samples' shape and its classes (--dataset package.module.function --input-shape 40 "
                         "--num-classes 2); N is its training set, counted by calling the function once, unless "
                         "--train-samples gives it")
    shape = ",".join(str(d) for d in options.input_shape)
    return [f"data.dataset={options.dataset}", f"data.num_classes={options.num_classes}",
            f"data.input_shape=[{shape}]"]


def plan_inputs(options: argparse.Namespace) -> PlanInputs:
    """The compute (from a result, a given step time, a GPU preset, or profiled here), the model, the
    network, N and the critical batch, with a warning for what the figures do not hold for."""
    run = read_run(options.from_result) if options.from_result else None
    study = critical_batch_from_study(options.from_study, options.recipe, run.recipe if run else None) \
        if options.from_study else None
    if run is not None:
        model, data = run_parts(run)
        name = model.target
        shape = data_shape(data)
        b = options.per_worker_batch or run.per_worker_batch
        if b != run.per_worker_batch and not options.gpu:
            raise ValueError(f"--per-worker-batch {b} differs from the result's {run.per_worker_batch}: the "
                             "measured time holds for that batch only (--gpu predicts any batch)")
    else:
        name = options.model or "cnn1d"
        model, data = model_and_data(name, options.data or "mnist1d", [*data_overrides(options), *options.overrides])
        if "name" in model.kwargs:  # model=timm model.name=resnet50: say which
            name = f"{name} {model.kwargs['name']}"
        shape = data_shape(data)
        shape = shape._replace(input_shape=tuple(options.input_shape or shape.input_shape),
                               num_classes=options.num_classes or shape.num_classes)
        b = options.per_worker_batch or (study and study.per_worker_batch) or 64
    compute, warnings = worker_compute(options, model, shape, b, name, run)
    n, n_from = (options.train_samples, "given: --train-samples") if options.train_samples \
        else train_samples(data, shape, run)
    if study is not None and study.per_worker_batch and study.per_worker_batch != b:
        warnings.append(f"the study ran {study.per_worker_batch} samples per GPU and this plan b={b}: the same "
                        f"critical batch is reached at another W than the study's {study.world_size} GPUs")
    critical = study.value if study is not None else options.critical_batch
    optimizer = str(run_optimizer(run.config) or "").lower() if run is not None else ""
    return PlanInputs(compute, model, shape, name, _network(options), n, n_from, critical,
                      study.why if study else None, study.name if study else None, tuple(warnings),
                      optimizer if optimizer in OPTIMIZER_SLOTS else "adamw")


def worker_compute(options: argparse.Namespace, model: Target, shape: DataShape, b: int, name: str,
                   run: RunResult | None) -> tuple[Compute, list[str]]:
    """A worker's compute per step, and warnings about what it holds for."""
    if options.gpu:
        precision = options.precision or run_precision(run)
        compute = gpu_compute(model, shape, b, GPUS[options.gpu], precision, options.utilization, name)
        launch_bound = compute.total_s < LAUNCH_BOUND_S
        return compute, [f"a predicted step of {compute.total_s * 1e3:.3f} ms is below what a GPU runs a training "
                         "step in: at this size a step is bound by kernel launches (a few us each), not FLOPs, so "
                         "the step times below are lower bounds; measure a real step and give --step-ms"] \
            if launch_bound else []
    if run is not None:
        configured = (run.config.get("trainer") or {}).get("device")
        on_cpu = run.device == "cpu" or (run.device is None and configured == "cpu")
        return compute_from_result(options.from_result)[0], [
            f"{options.from_result} was trained on a CPU: every step time below is that CPU's, not a GPU's, and its "
            "timing jitter reads as straggler loss at large W; for a GPU give --gpu NAME (a published throughput) "
            "or --step-ms measured on one"] if on_cpu else []
    if options.step_ms is not None:
        return compute_from_step_ms(options.step_ms, model, shape, b, name), []
    has_gpu = torch.cuda.is_available()
    device = "cuda" if options.device == "auto" and has_gpu else options.device.replace("auto", "cpu")
    if device == "cuda" and not has_gpu:
        raise ValueError("--device cuda: torch sees no GPU on this machine")
    compute = profile_compute(model, shape, b, options.threads, options.repeats, name=name, device=device)
    if device == "cuda":
        return compute, []
    where = "no GPU here: compute was profiled" if not has_gpu else "--device cpu: compute was profiled"
    return compute, [f"{where} on this CPU, so every step time below is this CPU's, not a GPU's; for a GPU give "
                     "--gpu NAME (a published throughput) or --step-ms measured on one"]


def run_precision(run: RunResult | None) -> str:
    """The precision a run trained in (its trainer.precision), fp32 without a run: lbt's default."""
    trainer = (run.config.get("trainer") or {}) if run is not None else {}
    return str(trainer.get("precision") or "fp32")


def print_inputs(inputs: PlanInputs, options: argparse.Namespace) -> None:
    """The lines above the table: warnings, the compute, the gradient, the network, N and the model of a step."""
    compute, network = inputs.compute, inputs.network
    for warning in inputs.warnings:
        print(f"warning: {warning}")
    nbytes = gradient_bytes(compute.num_params, options.compression)
    # The parts are medians; the table's W=1 row uses the mean step (what an epoch adds up to).
    mean_step = f"; mean step {compute.slowest_of(1) * 1e3:.2f} ms" if compute.step_samples else ""
    print(f"compute: {compute.total_s * 1e3:.3f} ms per worker step at b={compute.per_worker_batch} "
          f"(forward {compute.forward_s * 1e3:.3f} + backward {compute.backward_s * 1e3:.3f} + optimizer "
          f"{compute.optimizer_s * 1e3:.3f} ms{mean_step}; {compute.source})")
    if options.gpu:
        print(f"gpu: {GPUS[options.gpu].source}; utilisation assumed {options.utilization:.0%} (--utilization): "
              "large transformers reach 35-55% of the peak, convolutional nets and small models far less")
    print(f"gradient: {compute.num_params:,} parameters -> {nbytes / 1e6:,.3f} MB per allreduce "
          f"({'fp32' if options.compression == 'none' else options.compression})")
    print(f"network: {network.name}, {network.bandwidth_gbps:g} Gb/s, {network.latency_us:g} us ({network.source})")
    print(f"N: {inputs.train_samples:,} training samples per epoch ({inputs.train_samples_from})")
    if inputs.critical_why:
        print(f"critical batch: B_crit={inputs.critical_batch:,.0f} ({inputs.critical_why})")
    print(f"model: step = slowest of W workers' compute + ring allreduce - min(allreduce, {options.overlap:g} x "
          f"backward); epoch = N/(b W) steps")
    if options.delay:
        print(f"gradient delay d={options.delay}: each allreduce overlaps the next step's compute, delayed step = "
              "max(slowest compute, allreduce) (the epoch column uses it); sync step = the line above")


def plan_splits(inputs: PlanInputs, options: argparse.Namespace, title: str) -> int:
    """`--tensor-parallel`: the split table, its summary and its plot."""
    try:
        split = model_split(inputs.model, inputs.shape, inputs.name)
        choices = tensor_parallel_options(options.tensor_parallel, options.max_workers)
    except ValueError as error:
        return usage_error(error)
    rows = split_rows(inputs.compute, split, inputs.network, worker_counts(options.max_workers), choices,
                      inputs.train_samples, options.overlap, inputs.critical_batch)
    for line in describe_split(split, inputs.compute.per_worker_batch, choices, inputs.name):
        print(line)
    return show(format_split_table(rows), summarize_splits(rows, inputs.critical_batch, inputs.critical_name),
                plot_splits(rows, plot_path(options), title, inputs.critical_batch))


if __name__ == "__main__":
    sys.exit(plan_main(sys.argv[1:]))
