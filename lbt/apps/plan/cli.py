"""`lbt plan`'s command line: the table over W (lbt/cost/data_parallel.py) and, with --tensor-parallel, the
split table (lbt/cost/tensor_parallel.py); `plan_main(argv)` returns the exit code."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from lbt.apps.plan.compute import (
    compute_from_result,
    compute_from_step_ms,
    config_names,
    critical_batch_from_study,
    model_and_data,
    model_split,
    profile_compute,
)
from lbt.apps.plan.output import (
    describe_split,
    format_split_table,
    format_table,
    plot,
    plot_splits,
    summarize,
    summarize_splits,
)
from lbt.cost.data_parallel import NETWORKS, Compute, Network, gradient_bytes, scaling_rows, worker_counts
from lbt.cost.tensor_parallel import split_rows, tensor_parallel_options
from lbt.data.base import DataShape
from lbt.engine.build import data_shape
from lbt.errors import ConfigError
from lbt.spec.targets import Target

EPILOG = """examples:
  lbt plan --model resnet20 --data cifar10 --per-worker-batch 128 --network 25gbe
  lbt plan model=resnet20 data=cifar10 per_worker_batch=128 network=25gbe   (the same)
  lbt plan --from-result runs/train/X/result.json --network ib-fdr --critical-batch 2048
  lbt plan --model cnn1d --bandwidth-gbps 40 --latency-us 5 --compression fp16 --overlap 0.5
  lbt plan --model mlp --tensor-parallel auto --network nvlink --critical-batch 1024

tensor parallelism (--tensor-parallel auto|T, lbt/cost/tensor_parallel.py): W GPUs as DP data-parallel
workers x T tensor-parallel ranks that share each worker's batch, so the global batch is b x DP, not b x W.
The table lists, per W, data parallelism alone (DP x 1) and every DP x T split (auto: T = 2, 4, 8):
step = compute x (1 - s + s/T) + the split layers' activation allreduces among the T ranks
(forward and backward, Megatron-style Linear pairs) + the gradient allreduce over DP of the
parameters each rank holds; s = the split layers' share of the FLOPs. It marks the recommended
split of each W: the fastest epoch whose global batch stays <= the critical batch (the fastest
overall without one). A T that does not divide a split layer's width is left out, with a note."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lbt plan", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Epoch time, speedup and scaling efficiency of synchronous data parallelism over W workers "
                    "(measured compute + ring-allreduce model).")
    _compute_options(parser)
    _network_options(parser)
    parser.add_argument("--max-workers", type=int, default=1024)
    parser.add_argument("--train-samples", "-N", type=int, help="N, training samples per epoch (default 60000)")
    critical = parser.add_mutually_exclusive_group()
    critical.add_argument("--critical-batch", type=float, metavar="B_CRIT",
                          help="mark W with b x W > B_CRIT (b x DP with --tensor-parallel)")
    critical.add_argument("--from-study", metavar="DIR",
                          help="the critical batch a study's report led with (its summary.json)")
    parser.add_argument("--out", help="PNG plot of epoch time and efficiency (default: plan.png beside the "
                                      "--from-result or --from-study input, else runs/plan/plan.png)")
    return parser


def _compute_options(parser: argparse.ArgumentParser) -> None:
    """Where one worker's compute comes from: a model profiled here, a given step time, or a run's result."""
    source = parser.add_mutually_exclusive_group()
    parser.add_argument("--model", metavar="NAME_OR_CLASS",
                        help=f"the model: {', '.join(config_names('model'))} (conf/model/) or your own class as "
                             "package.module.Class; profiled on random data of --data's shape (default cnn1d)")
    source.add_argument("--step-ms", type=float, metavar="MS",
                        help="a worker's step time measured elsewhere (e.g. on a GPU), in ms, instead of "
                             "profiling this machine; the model only gives the gradient size")
    source.add_argument("--from-result", metavar="RESULT_JSON", help="take the compute time from a run's result.json")
    parser.add_argument("--data", choices=config_names("data"),
                        help="the data the model trains on (conf/data/): its input shape, classes and N "
                             "(default mnist1d)")
    parser.add_argument("--input-shape", type=int, nargs="+", help="input shape of one sample (overrides --data's)")
    parser.add_argument("--num-classes", type=int, help="classes (overrides --data's)")
    parser.add_argument("--per-worker-batch", "-b", type=int, help="b, samples per worker per step (default 64)")
    parser.add_argument("--threads", type=int, help="threads for the profiling run (default: torch's)")
    parser.add_argument("--repeats", type=int, default=20, help="profiled steps, after 3 warm-up steps (default 20)")


def _network_options(parser: argparse.ArgumentParser) -> None:
    """The network and what rides on it: bandwidth, latency, compression, overlap, delay, tensor parallelism."""
    presets = ", ".join(f"{n.name} ({n.bandwidth_gbps:g} Gb/s, {n.latency_us:g} us)" for n in NETWORKS.values())
    parser.add_argument("--network", default="10gbe", choices=sorted(NETWORKS), help=f"preset: {presets}")
    parser.add_argument("--bandwidth-gbps", type=float,
                        help="custom per-direction bandwidth, Gb/s (overrides --network)")
    parser.add_argument("--latency-us", type=float, help="custom per-message latency, us (overrides --network)")
    parser.add_argument("--compression", choices=["none", "fp16", "bf16"], default="none",
                        help="gradient compression (halves the bytes; technique comm_compression)")
    parser.add_argument("--overlap", type=float, default=0.0, metavar="FRACTION",
                        help="fraction of the backward pass the allreduce can overlap with (0-1, default 0)")
    parser.add_argument("--delay", type=int, default=0, metavar="D",
                        help="gradient delay d (technique gradient_delay; 1 = double buffering): each step's "
                             "allreduce overlaps the next step's compute, step = max(compute, allreduce); "
                             "the table shows the synchronous step beside it (default 0: synchronous)")
    parser.add_argument("--tensor-parallel", metavar="auto|T",
                        help="compare data parallelism alone with DP x T splits of each W (dist.tensor_parallel): "
                             "auto tries T = 2, 4, 8; a power of 2 T tries that one (see below)")


def _network(options: argparse.Namespace) -> Network:
    preset = NETWORKS[options.network]
    if options.bandwidth_gbps is None and options.latency_us is None:
        return preset
    bandwidth = options.bandwidth_gbps if options.bandwidth_gbps is not None else preset.bandwidth_gbps
    latency = options.latency_us if options.latency_us is not None else preset.latency_us
    if bandwidth <= 0 or latency < 0:
        raise ValueError("--bandwidth-gbps must be > 0 and --latency-us >= 0")
    return Network("custom", bandwidth, latency, f"given on the command line (others from {preset.name})")


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
    """`lbt plan ARGS`: print the table over W, write the PNG; 0 on success, 2 on a usage error."""
    parser = _parser()
    try:
        options = parser.parse_args(hydra_style(argv))
    except SystemExit as done:  # --help (0) or an argparse error (2, already printed)
        return int(done.code or 0)
    try:
        check_options(options)
        inputs = plan_inputs(options)
    except (ValueError, OSError, KeyError, ConfigError) as error:
        print(f"lbt plan: error: {error}", file=sys.stderr)
        return 2
    print_inputs(inputs, options)
    title = (f"b={inputs.compute.per_worker_batch}, {inputs.compute.num_params:,} params, {inputs.network.name} "
             f"({inputs.network.bandwidth_gbps:g} Gb/s, {inputs.network.latency_us:g} us), N={inputs.train_samples:,}"
             + (f", {options.compression}" if options.compression != "none" else "")
             + (f", overlap {options.overlap:g}" if options.overlap else ""))
    if options.tensor_parallel is not None:
        return plan_splits(inputs, options, title)
    rows = scaling_rows(inputs.compute, inputs.network, worker_counts(options.max_workers), inputs.train_samples,
                        options.compression, options.overlap, inputs.critical_batch, options.delay)
    return show(format_table(rows), summarize(rows, inputs.critical_batch),
                plot(rows, plot_path(options), title, inputs.critical_batch))


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
    critical_batch: float | None


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
    if options.from_result and options.model:
        raise ValueError("--from-result takes the model of its run: give --model or --from-result, not both")
    if options.step_ms is not None and not options.step_ms > 0:
        raise ValueError(f"--step-ms must be a positive time in ms, got {options.step_ms}")
    if options.tensor_parallel is not None and (options.compression != "none" or options.delay):
        raise ValueError("--tensor-parallel: lbt's tensor-parallel runs average gradients without DDP's hooks, "
                         "so --compression and --delay do not apply to them; drop those")


def plan_inputs(options: argparse.Namespace) -> PlanInputs:
    """The compute (from a result, a given step time, or profiled here), the model, the network and N."""
    critical_batch = options.critical_batch
    if options.from_study:
        critical_batch = critical_batch_from_study(options.from_study)
    if options.from_result:
        compute, model, shape = compute_from_result(options.from_result)
        if options.per_worker_batch and options.per_worker_batch != compute.per_worker_batch:
            raise ValueError(f"--per-worker-batch {options.per_worker_batch} differs from the result's "
                             f"{compute.per_worker_batch}: the measured time holds for that batch only")
        name = model.target
    else:
        name = options.model or "cnn1d"
        model, data = model_and_data(name, options.data or "mnist1d")
        shape = data_shape(data)
        shape = shape._replace(input_shape=tuple(options.input_shape or shape.input_shape),
                               num_classes=options.num_classes or shape.num_classes)
        b = options.per_worker_batch or 64
        compute = compute_from_step_ms(options.step_ms, model, shape, b, name) if options.step_ms is not None \
            else profile_compute(model, shape, b, options.threads, options.repeats, name=name)
    train_samples = options.train_samples or shape.num_train or 60000
    return PlanInputs(compute, model, shape, name, _network(options), train_samples, critical_batch)


def print_inputs(inputs: PlanInputs, options: argparse.Namespace) -> None:
    """The lines above the table: the compute, the gradient, the network and the model of a step."""
    compute, network = inputs.compute, inputs.network
    nbytes = gradient_bytes(compute.num_params, options.compression)
    # The parts are medians; the table's W=1 row uses the mean step (what an epoch adds up to).
    mean_step = f"; mean step {compute.slowest_of(1) * 1e3:.2f} ms" if compute.step_samples else ""
    print(f"compute: {compute.total_s * 1e3:.2f} ms per worker step at b={compute.per_worker_batch} "
          f"(forward {compute.forward_s * 1e3:.2f} + backward {compute.backward_s * 1e3:.2f} + optimizer "
          f"{compute.optimizer_s * 1e3:.2f} ms{mean_step}; {compute.source})")
    print(f"gradient: {compute.num_params:,} parameters -> {nbytes / 1e6:,.3f} MB per allreduce "
          f"({'fp32' if options.compression == 'none' else options.compression})")
    print(f"network: {network.name}, {network.bandwidth_gbps:g} Gb/s, {network.latency_us:g} us ({network.source})")
    print(f"model: step = slowest of W workers' compute + ring allreduce - min(allreduce, {options.overlap:g} x "
          f"backward); epoch = N/(b W) steps, N={inputs.train_samples:,}")
    if options.delay:
        print(f"gradient delay d={options.delay}: each allreduce overlaps the next step's compute, delayed step = "
              "max(slowest compute, allreduce) (the epoch column uses it); sync step = the line above")


def plan_splits(inputs: PlanInputs, options: argparse.Namespace, title: str) -> int:
    """`--tensor-parallel`: the split table, its summary and its plot."""
    try:
        split = model_split(inputs.model, inputs.shape, inputs.name)
        choices = tensor_parallel_options(options.tensor_parallel, options.max_workers)
    except ValueError as error:
        print(f"lbt plan: error: {error}", file=sys.stderr)
        return 2
    rows = split_rows(inputs.compute, split, inputs.network, worker_counts(options.max_workers), choices,
                      inputs.train_samples, options.overlap, inputs.critical_batch)
    for line in describe_split(split, inputs.compute.per_worker_batch, choices, inputs.name):
        print(line)
    return show(format_split_table(rows), summarize_splits(rows, inputs.critical_batch),
                plot_splits(rows, plot_path(options), title, inputs.critical_batch))


if __name__ == "__main__":
    sys.exit(plan_main(sys.argv[1:]))
