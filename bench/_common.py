"""Helpers shared by the speed benchmarks (bench/overhead.py, peers.py, simulation.py, ...).

lbt is always measured through its real code path: the config is composed
exactly as `lbt train OVERRIDES` composes it (`lbt.apps.compose.compose`), and
`lbt.engine.run` trains (TensorBoard logging, LR schedule, run folder and all). Its `samples_per_sec`
counts training steps only: evaluation and process start-up are excluded.

Ratios are measured side by side: the contenders of a comparison run in turns
inside one loop of repeats, so a load that comes and goes on the machine hits
them alike, and each figure is the median over the repeats.
"""

from __future__ import annotations

import contextlib
import io
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from lbt.apps.compose import compose as compose_config
from lbt.engine import build as engine
from lbt.engine import make_spec, run
from lbt.spec.result import RunResult, read_result
from lbt.spec.targets import target_of

REPO = Path(__file__).resolve().parent.parent

# MNIST-1D's 60,000 training samples less the 10% validation split: one epoch of data=mnist1d.
MNIST1D_TRAIN = 54_000

# Quiet CPU runs; every bench override list starts with these.
LBT_BASE = ["trainer.progress=false", "trainer.device=cpu"]


def compose(overrides: list[str]) -> tuple[dict, str]:
    """The resolved config as a plain dict (as `lbt train OVERRIDES` composes it) and the recipe name."""
    composed = compose_config(overrides, job_name="bench")
    return composed.config, composed.recipe


def run_lbt(overrides: list[str], quiet: bool = True) -> RunResult:
    """One `lbt.engine.run` in this process (procs=1) or spawned workers (procs>1)."""
    config, recipe = compose(LBT_BASE + list(overrides))
    spec = make_spec(config, recipe, list(overrides))
    with tempfile.TemporaryDirectory(prefix="lbt-bench-") as run_dir:
        sink = io.StringIO()
        with contextlib.redirect_stdout(sink) if quiet else contextlib.nullcontext():
            return run(spec, run_dir)


def timed_run(overrides: list[str], steps: int):
    """A contender for `interleaved`: one in-process run of exactly `steps` steps, returning its samples/s."""
    def run() -> float:
        result = run_lbt(overrides)
        if result.steps != steps:
            raise RuntimeError(f"{overrides}: ran {result.steps} steps, expected {steps}")
        return result.samples_per_sec
    return run


def run_lbt_subprocess(overrides: list[str], timeout: float = 900) -> RunResult:
    """One `python -m lbt train OVERRIDES` in a fresh process (as a user runs it); returns its result."""
    with tempfile.TemporaryDirectory(prefix="lbt-bench-") as run_dir:
        args = [sys.executable, "-m", "lbt", "train", *LBT_BASE, *overrides, f"hydra.run.dir={run_dir}"]
        done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        path = Path(run_dir) / "result.json"
        if done.returncode != 0 or not path.exists():
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        return read_result(path)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a timer read after it counts that work (a CPU runs in order)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_interval(values: list[float], level: float = 0.9, resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval of the median: how far the verdict could move with other repeats."""
    import random

    if len(values) < 2:
        return (median(values), median(values))
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


def spread(values: list[float]) -> str:
    """`median (min-max, n=5)`, the way every table shows a repeated figure."""
    if not values:
        return "n/a"
    return f"{median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f}, n={len(values)})"


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe_machine() -> str:
    load = load_average()
    return (
        f"machine: {os.cpu_count()} cores ({cpu_model()}), torch {torch.__version__}, "
        f"threads={torch.get_num_threads()}, python {platform.python_version()}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start"
    )


class LoadWatch:
    """Samples the 1-minute load average during a benchmark, to say whether the machine was busy.

    The benchmark itself keeps up to `own` cores busy; a load average well above
    that means other work shared the CPU while we measured.
    """

    def __init__(self, own: float):
        self.own = own
        self.samples: list[float] = []
        self.started = time.time()

    def sample(self) -> None:
        self.samples.append(load_average()[0])

    def verdict(self) -> str:
        if not self.samples:
            self.sample()
        peak = max(self.samples)
        busy = peak > self.own + 0.75
        state = "LOADED by other work" if busy else "quiet"
        return (f"load average during the run: median {median(self.samples):.2f}, max {peak:.2f} "
                f"(this benchmark alone: ~{self.own:g}) -> machine {state}")


def headline(name: str, value: float | str) -> None:
    """The last line of every bench script: `name=value`."""
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    print(f"{name}={text}", flush=True)


class Case:
    """One training setup both lbt and a contender run: model + data + per-worker batch, as lbt overrides."""

    def __init__(self, name: str, overrides: list[str], batch: int, steps: int, quick_steps: int):
        self.name, self.overrides, self.batch = name, overrides, batch
        self.steps, self.quick_steps = steps, quick_steps

    def lbt_overrides(self, steps: int, extra: list[str] = ()) -> list[str]:
        # Epochs enough, capped at `steps`: the run ends after `steps` optimizer steps at world_size 1.
        return [*self.overrides, f"trainer.per_worker_batch={self.batch}", "dist.world_size=1", "dist.procs=1",
                "trainer.epochs=1000", f"trainer.max_steps={steps}", *extra]


# MNIST-1D is 60,000 x 40 (the real data set, generated once and cached);
# resnet20 trains on synthetic CIFAR-shaped inputs (3 x 32 x 32, 10 classes).
CASES = {
    # cnn1d's steps last ~3 ms on a 2-core VM: 2,500 of them (~8 s) so a run outlasts the machine's jitter.
    "cnn1d": Case("cnn1d", ["model=cnn1d", "data=mnist1d"], batch=64, steps=2500, quick_steps=300),
    "resnet20": Case("resnet20", ["model=resnet20", "data=synthetic", "data.input_shape=[3,32,32]",
                                  "data.num_train=4096", "data.num_test=256"], batch=64, steps=20, quick_steps=6),
}


def build_data(config: dict):
    """The data splits of a resolved lbt config (in memory for mnist1d and synthetic)."""
    return engine.build_data(target_of(config["data"], "data"))


def build_model(config: dict, data):
    """Model, optimizer and loss from a resolved lbt config, the way lbt/engine/build.py builds them."""
    torch.manual_seed(config["trainer"]["seed"])
    model = engine.build_model(target_of(config["model"], "model"), tuple(data.input_shape), data.num_classes)
    optimizer = engine.instantiate(target_of(config["optim"], "optim"), torch.optim.Optimizer)(model)
    return model, optimizer, torch.nn.CrossEntropyLoss()


def interleaved(contenders: dict, repeats: int, watch: "LoadWatch | None" = None) -> dict[str, list[float]]:
    """Run every contender (name -> fn returning samples/s) once per repeat, in an order that
    alternates (ABBA...) so drift in the machine's load hits them alike; returns name -> values."""
    names = list(contenders)
    values: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            values[name].append(contenders[name]())
            if watch is not None:
                watch.sample()
    return values


def pair_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    return [a / b for a, b in zip(numerator, denominator)]
