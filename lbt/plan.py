"""`lbt plan`: how long one epoch takes on W workers, before you rent them.

A cost model of one step of synchronous data-parallel SGD (every worker
computes its per-worker batch b, then the gradients are averaged by a ring
allreduce), evaluated for W = 1, 2, 4, ... workers:

    compute   = forward + backward + optimizer step of ONE worker at batch b (measured)
    slowest   = E[max of W workers' compute]: the step waits for its slowest worker
    allreduce = 2 (W-1)/W x bytes / bandwidth + 2 (W-1) x latency       (ring, Patarasuk & Yuan 2009)
    step      = slowest + allreduce - hidden,  hidden = min(allreduce, overlap x backward)
    epoch     = N / (b W) x step

With gradient delay (`--delay d`, technique gradient_delay; d=1 is double
buffering) a step's allreduce runs while the next step computes, so a step
costs max(slowest, allreduce) instead of their sum; the table then shows both.

bytes = 4 x parameters (fp32 gradients; halved by fp16/bf16 compression).
With W workers an epoch takes N/(bW) steps instead of N/b, so adding workers
pays only while allreduce(W) stays small against the compute it divides:
speedup(W) = epoch(1) / epoch(W), efficiency = speedup / W. Past the critical
batch (global batch b W > B_crit) the extra workers also cost accuracy.

`--tensor-parallel auto|T` compares, per W, data parallelism alone with DP x T splits (T ranks
share a worker's batch and split its dense layers: global batch b x DP); formulas in lbt/plan_tp.py.

No Hydra here: pure functions for the formulas (unit-tested), a short
profiling run for the compute time; the command line is lbt/plan_cli.py.
"""

from __future__ import annotations

import importlib
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from lbt.data.base import DataShape
from lbt.paths import conf_dir

BYTES_PER_FP32 = 4
# Backward costs about twice the forward (one matmul for the input gradient,
# one for the weight gradient), so ~2/3 of a step's compute; used when the
# backward time was not measured (from a result.json).
DEFAULT_BACKWARD_SHARE = 2.0 / 3.0


@dataclass(frozen=True)
class Network:
    name: str
    bandwidth_gbps: float  # per-direction bandwidth each worker can push, gigabits/s
    latency_us: float  # per message (one ring hop), microseconds
    source: str

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


# Typical values: link data rates per direction and small-message latencies as
# vendors and common benchmarks state them. They are upper bounds on what an
# allreduce reaches (NCCL typically gets 80-95% of the link rate, TCP less):
# measure yours (bench/allreduce.py, nccl-tests) and pass --bandwidth-gbps/--latency-us.
NETWORKS: dict[str, Network] = {
    n.name: n
    for n in (
        Network("nvlink", 2400.0, 5.0,
                "NVLink 3 (A100): 600 GB/s total = 300 GB/s per direction (NVIDIA A100 datasheet); "
                "nccl-tests show ~10-15 us for a tiny 2-GPU allreduce"),
        Network("ib-fdr", 54.5, 0.7,
                "InfiniBand FDR 4x: 56 Gb/s signalling, 54.5 Gb/s data (64b/66b); ~0.7 us MPI latency "
                "(Mellanox ConnectX-3)"),
        Network("100g", 97.0, 0.6,
                "100 Gb/s InfiniBand EDR 4x: 97 Gb/s data (64b/66b); ~0.6 us latency (ConnectX-4/5)"),
        Network("25gbe", 25.0, 10.0,
                "25 Gigabit Ethernet, TCP/IP (gloo, NCCL socket): ~10 us one-way through the kernel stack"),
        Network("10gbe", 10.0, 10.0,
                "10 Gigabit Ethernet, TCP/IP: ~7-10 us one-way latency"),
        Network("1gbe", 1.0, 50.0,
                "Gigabit Ethernet, TCP/IP: ~50 us one-way latency (ping round trips ~0.1 ms)"),
    )
}


# -- the formulas ---------------------------------------------------------------
def ring_allreduce_seconds(nbytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Time of a ring allreduce of `nbytes` over `workers` (0 for one worker).

    Reduce-scatter then all-gather: 2 (W-1) steps, each sending one W-th of the
    buffer to the next worker, so every worker sends 2 (W-1)/W x nbytes and
    waits for 2 (W-1) messages.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        return 0.0
    return ring_bytes_sent(nbytes, workers) / bandwidth_bytes_per_s + 2 * (workers - 1) * latency_s


def ring_bytes_sent(nbytes: float, workers: int) -> float:
    """Bytes each worker sends in a ring allreduce of `nbytes`: 2 (W-1)/W x nbytes (0 for one worker)."""
    return 2 * (workers - 1) / workers * nbytes


def step_seconds(compute_s: float, allreduce_s: float, overlap: float = 0.0, backward_s: float | None = None) -> float:
    """One synchronous step: compute, plus the allreduce time not hidden behind the backward pass.

    `overlap` in [0, 1] is the fraction of the backward during which gradients
    already travel (DDP sends a bucket as soon as its gradients are ready):
    at most overlap x backward_s of the allreduce is hidden. `backward_s`
    defaults to 2/3 of the compute.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if backward_s is None:
        backward_s = DEFAULT_BACKWARD_SHARE * compute_s
    hidden = min(allreduce_s, overlap * backward_s)
    return compute_s + allreduce_s - hidden


def overlapped_step_seconds(compute_s: float, allreduce_s: float) -> float:
    """One step with a delayed gradient (d >= 1): the allreduce of step t runs during step t+1's compute,
    so the slower of the two sets the pace (ChainerMN double buffering)."""
    return max(compute_s, allreduce_s)


def expected_max(samples, workers: int) -> float:
    """Mean time of the slowest of `workers` independent draws from the measured `samples`.

    A synchronous step ends when its slowest worker's gradient arrives, so step
    times that vary (other processes, interrupts, the allreduce threads sharing
    the cores) cost more as workers are added: the straggler effect (Dean &
    Barroso 2013, "The tail at scale"; Chen et al. 2016). With the samples
    sorted, x_1 <= ... <= x_n, the slowest of W draws is <= x_i with probability
    (i/n)^W, so E[max] = sum_i x_i ((i/n)^W - ((i-1)/n)^W); one worker: the mean.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    n = len(ordered)
    return sum(x * ((i / n) ** workers - ((i - 1) / n) ** workers) for i, x in enumerate(ordered, start=1))


def epoch_seconds(step_s: float, train_samples: int, global_batch: int) -> float:
    """N / B steps of `step_s` (fractional: lbt drops the last partial batch, N // B steps)."""
    return train_samples / global_batch * step_s


def gradient_bytes(num_params: int, compression: str = "none") -> float:
    """Bytes one worker's gradient takes on the wire: fp32, or half with fp16/bf16 compression."""
    if compression not in ("none", "fp16", "bf16"):
        raise ValueError(f"compression must be none, fp16 or bf16, got {compression!r}")
    return num_params * BYTES_PER_FP32 * (0.5 if compression != "none" else 1.0)


def worker_counts(max_workers: int) -> list[int]:
    """1, 2, 4, ... up to max_workers (max_workers itself included)."""
    if max_workers < 1:
        raise ValueError(f"--max-workers must be >= 1, got {max_workers}")
    counts, w = [], 1
    while w < max_workers:
        counts.append(w)
        w *= 2
    return counts + [max_workers]


@dataclass(frozen=True)
class Compute:
    """One worker's compute per step at its per-worker batch."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    per_worker_batch: int
    num_params: int
    source: str
    # Per-step totals as measured (a profile has them; a result.json only its mean).
    step_samples: tuple[float, ...] = ()

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def slowest_of(self, workers: int) -> float:
        """Expected compute of the slowest of `workers` workers (the mean step for one worker)."""
        if not self.step_samples:
            return self.total_s
        return expected_max(self.step_samples, workers)


@dataclass(frozen=True)
class Row:
    workers: int
    global_batch: int
    compute_s: float
    allreduce_s: float
    step_s: float
    epoch_s: float
    speedup: float
    efficiency: float
    slower: bool  # the epoch takes longer than with the previous (smaller) W
    beyond_critical: bool  # b x W > critical batch
    beyond_dataset: bool  # b x W > N: not even one step per epoch
    synchronous_step_s: float | None = None  # with --delay: the step without overlap, for comparison


def plan_rows(
    compute: Compute,
    network: Network,
    workers: list[int],
    train_samples: int,
    compression: str = "none",
    overlap: float = 0.0,
    critical_batch: float | None = None,
    delay: int = 0,
) -> list[Row]:
    """The table over W: step and epoch time, speedup vs W=1 and scaling efficiency."""
    nbytes = gradient_bytes(compute.num_params, compression)
    b = compute.per_worker_batch
    base_epoch = epoch_seconds(compute.slowest_of(1), train_samples, b)  # W=1: no communication
    rows: list[Row] = []
    for w in workers:
        comm = ring_allreduce_seconds(nbytes, w, network.bandwidth_bytes_per_s, network.latency_s)
        slowest = compute.slowest_of(w)
        synchronous = step_seconds(slowest, comm, overlap, compute.backward_s)
        step = overlapped_step_seconds(slowest, comm) if delay else synchronous
        epoch = epoch_seconds(step, train_samples, b * w)
        speedup = base_epoch / epoch
        rows.append(Row(
            workers=w, global_batch=b * w, compute_s=slowest, allreduce_s=comm, step_s=step,
            epoch_s=epoch, speedup=speedup, efficiency=speedup / w,
            slower=bool(rows) and epoch > rows[-1].epoch_s,
            beyond_critical=critical_batch is not None and b * w > critical_batch,
            beyond_dataset=b * w > train_samples,
            synchronous_step_s=synchronous if delay else None,
        ))
    return rows


# -- compute time -----------------------------------------------------------------
def config_names(group: str) -> list[str]:
    """The options of a config group (conf/model, conf/data): what `lbt train model=...` accepts."""
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def config_node(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml as a plain dict (its `_target_` and keyword arguments)."""
    from omegaconf import OmegaConf

    if name not in config_names(group):
        raise ValueError(f"no {group} {name!r}: choose one of {', '.join(config_names(group))} (conf/{group}/)")
    return OmegaConf.to_container(OmegaConf.load(conf_dir() / group / f"{name}.yaml"), resolve=True)


def model_node(name: str) -> dict:
    """--model: a config of conf/model/ (cnn1d, resnet20, ...) or your own class as a dotted path
    (`mypackage.MyNet`, built as `lbt train model._target_=mypackage.MyNet` builds it)."""
    if name == "custom":
        raise ValueError("--model custom: give your class itself, --model package.module.Class")
    if name in config_names("model"):
        return config_node("model", name)
    if "." in name:
        try:
            _locate(name)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"--model {name}: cannot import it ({error}); is its package on PYTHONPATH?") from None
        return {"_target_": name}
    raise ValueError(f"no model {name!r}: choose one of {', '.join(config_names('model'))} (conf/model/) "
                     "or give a class as package.module.Class")


def compute_from_step_ms(step_ms: float, model: dict, shape: DataShape, per_worker_batch: int, name: str) -> Compute:
    """A step time measured elsewhere (a GPU run): the model is only built to count its parameters.
    The step splits as forward 1/3, backward 2/3 (backward costs about twice the forward), which only
    --overlap reads."""
    import torch

    with torch.random.fork_rng(devices=[]):
        num_params = sum(p.numel() for p in build_model(model, shape).parameters())
    step = step_ms / 1e3
    return Compute(step / 3, 2 * step / 3, 0.0, per_worker_batch, num_params,
                   f"given: --step-ms {step_ms:g} at batch {per_worker_batch} ({name}, {num_params:,} parameters)")


def _locate(target: str):
    module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def data_shape(data: dict) -> DataShape:
    """A data config's input shape, classes and training-set size, without loading the data."""
    node = dict(data)
    return _locate(node.pop("_target_"))(**node, shape_only=True)


def build_model(model: dict, shape: DataShape):
    """The model of a model config for data of `shape` (an image folder's unknown classes: ImageNet's 1,000)."""
    node = dict(model)
    return _locate(node.pop("_target_"))(input_shape=shape.input_shape, num_classes=shape.num_classes or 1000,
                                         **node)


def profile_compute(
    model: dict,
    shape: DataShape,
    per_worker_batch: int,
    threads: int | None = None,
    repeats: int = 20,
    warmup: int = 3,
    name: str = "model",
) -> Compute:
    """Median forward, backward and SGD-step time of one worker at its batch, on random data (CPU)."""
    import torch

    previous_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = build_model(model, shape)
        net.train()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9, weight_decay=5e-4)
        classes = shape.num_classes or 1000
        if shape.token:  # a language model: token ids in, the next token at every position out
            x = torch.randint(0, classes, (per_worker_batch, *shape.input_shape), generator=generator)
            y = torch.randint(0, classes, (per_worker_batch, *shape.input_shape), generator=generator)
        else:
            x = torch.randn(per_worker_batch, *shape.input_shape, generator=generator)
            y = torch.randint(0, classes, (per_worker_batch,), generator=generator)
        loss_fn = torch.nn.CrossEntropyLoss()
        times: list[tuple[float, float, float]] = []  # forward, backward, optimizer per step
        for i in range(warmup + repeats):
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
            t3 = time.perf_counter()
            if i >= warmup:
                times.append((t1 - t0, t2 - t1, t3 - t2))
        num_params = sum(p.numel() for p in net.parameters())
        used = torch.get_num_threads()
    finally:
        torch.set_num_threads(previous_threads)
    forward, backward, opt = (statistics.median(t[k] for t in times) for k in range(3))
    return Compute(forward, backward, opt, per_worker_batch, num_params,
                   f"measured: {name} at batch {per_worker_batch}, input {shape.input_shape}, {used} threads, "
                   f"median of {repeats} steps (their spread gives the slowest-worker term)",
                   step_samples=tuple(sum(t) for t in times))


def compute_from_result(path: str | Path) -> tuple[Compute, int | None]:
    """Per-worker compute from a finished run's result.json; also its training-set size if known.

    The run's step time is global_batch / samples_per_sec, and each of its P
    processes ran W/P workers of b samples in it, so one worker's compute is
    step x P / W. A run with P > 1 also paid its own allreduce in that time,
    which this folds into the compute (an overestimate).
    """
    result = json.loads(Path(path).read_text())
    missing = [k for k in ("samples_per_sec", "per_worker_batch", "world_size", "config") if k not in result]
    if missing:
        raise ValueError(f"{path}: not an lbt result.json with timings (missing {', '.join(missing)})")
    if not result["samples_per_sec"] or result["samples_per_sec"] <= 0:
        raise ValueError(f"{path}: samples_per_sec is {result['samples_per_sec']!r}; the run did not train")
    config = result["config"]
    world, procs, b = int(result["world_size"]), int(result.get("procs") or 1), int(result["per_worker_batch"])
    step = b * world / float(result["samples_per_sec"])
    compute = step * procs / world
    shape = data_shape(config["data"])
    num_params = sum(p.numel() for p in build_model(config["model"], shape).parameters())
    source = (f"from {path}: {result['samples_per_sec']:,.0f} samples/s at world_size={world} procs={procs} "
              f"per_worker_batch={b}; forward:backward split assumed 1:2, optimizer folded in"
              + ("; includes that run's own allreduce" if procs > 1 else ""))
    # forward + backward + step together; the usual 1/3 : 2/3 split of forward and backward
    backward = DEFAULT_BACKWARD_SHARE * compute
    return Compute(compute - backward, backward, 0.0, b, num_params, source), shape.num_train


def critical_batch_from_study(study_dir: str | Path) -> float:
    path = Path(study_dir) / "summary.json"
    if not path.exists():
        raise ValueError(f"{path} not found: run `lbt report {study_dir}` first")
    crit = json.loads(path.read_text()).get("critical_batch") or {}
    value = crit.get("fit") or crit.get("gns")  # the steps-to-target fit where it could be made
    if value is None or not math.isfinite(float(value)):
        raise ValueError(f"{path} holds no critical_batch estimate (run the study with measure=[gns])")
    return float(value)


# -- output -----------------------------------------------------------------------
def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds:,.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:,.1f} ms"


def format_table(rows: list[Row]) -> str:
    delayed = bool(rows) and rows[0].synchronous_step_s is not None
    header = ["W", "global batch", "slowest compute ms", "allreduce ms", "step ms", "epoch", "speedup", "efficiency", "note"]
    if delayed:
        header[4:5] = ["sync step ms", "delayed step ms"]
    lines = [header]
    for r in rows:
        notes = []
        if r.slower:
            notes.append("SLOWER than W/2")
        if r.beyond_critical:
            notes.append("B > B_crit")
        if r.beyond_dataset:
            notes.append("B > N")
        steps = [_ms(r.synchronous_step_s), _ms(r.step_s)] if delayed else [_ms(r.step_s)]
        lines.append([
            str(r.workers), f"{r.global_batch:,}", _ms(r.compute_s), _ms(r.allreduce_s), *steps,
            _duration(r.epoch_s), f"{r.speedup:,.2f}x", f"{r.efficiency:.0%}", ", ".join(notes),
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        cells = [c.rjust(w) if i < len(line) - 1 else c for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def summarize(rows: list[Row], critical_batch: float | None) -> list[str]:
    best = min(rows, key=lambda r: r.epoch_s)
    lines = [f"fastest epoch: W={best.workers} ({_duration(best.epoch_s)}, {best.speedup:.1f}x W=1, "
             f"efficiency {best.efficiency:.0%})"]
    slower = [r.workers for r in rows if r.slower]
    if slower:
        lines.append(f"adding workers slows the epoch from W={slower[0]} on "
                     "(communication outgrows the compute it saves)")
    half = [r.workers for r in rows if r.efficiency < 0.5]
    if half:
        lines.append(f"scaling efficiency falls below 50% at W={half[0]}")
    if critical_batch is not None:
        beyond = [r.workers for r in rows if r.beyond_critical]
        last_ok = [r.workers for r in rows if not r.beyond_critical]
        if beyond:
            lines.append(f"critical batch B_crit={critical_batch:,.0f}: global batch exceeds it from W={beyond[0]} on "
                         f"(accuracy expected to suffer; largest safe W here: {last_ok[-1] if last_ok else 'none'})")
        else:
            lines.append(f"critical batch B_crit={critical_batch:,.0f}: not reached up to W={rows[-1].workers}")
    return lines


def plot(rows: list[Row], path: str | Path, title: str, critical_batch: float | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = [r.workers for r in rows]
    fig, (ax_time, ax_eff) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax_time.plot(ws, [r.epoch_s for r in rows], "o-", label="epoch time (model)")
    ax_time.plot(ws, [rows[0].epoch_s / w for w in ws], ":", color="gray", label="perfect scaling")
    ax_time.set_yscale("log")
    ax_time.set_ylabel("epoch time (s)")
    ax_eff.plot(ws, [r.efficiency for r in rows], "o-", color="tab:green", label="scaling efficiency")
    ax_eff.set_ylim(0, 1.05)
    ax_eff.set_ylabel("efficiency = speedup / W")
    slower = [r.workers for r in rows if r.slower]
    beyond = [r.workers for r in rows if r.beyond_critical]
    for ax in (ax_time, ax_eff):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers W")
        ax.grid(True, which="both", alpha=0.3)
        if slower:
            ax.axvline(slower[0], color="tab:red", linestyle="--", label=f"slower from W={slower[0]}")
        if beyond:
            ax.axvspan(beyond[0], ws[-1], color="tab:orange", alpha=0.15,
                       label=f"b·W > B_crit={critical_batch:,.0f}")
        ax.legend(fontsize=8)
    return save_figure(fig, path, title)


def save_figure(fig, path: str | Path, title: str) -> Path:
    """Title, tight layout, write the PNG (its folder made), close the figure."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
