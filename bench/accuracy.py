"""Accuracy at 64x the base batch: baseline vs large-batch recipes on MNIST-1D.

Every run is `lbt train` (the installed CLI, one subprocess per run) with the
same epoch budget at world_size 1 (global batch 64, the base batch) and
world_size 64 (global batch 4096), simulated on one process:

    python bench/accuracy.py                      # final table, test split
    python bench/accuracy.py --split val          # tuning: val/* from 10% held out of train
    python bench/accuracy.py --quick              # smoke test, under 2 minutes
    python bench/accuracy.py --all --seeds 2      # also lamb, akiba2017, smith2017_ramp
    python bench/accuracy.py --split val --recipes goyal2017 --world-sizes 64 optim.lr=0.05

Trailing KEY=VALUE arguments are Hydra overrides passed to every run (lbt's own
config keys), so a tuning sweep changes a recipe exactly as a user would.
Each run writes its own folder under --out (TensorBoard events, result.json,
train.log); a folder that already holds a result.json is reused, not rerun.
The last line printed is `accuracy_recovered=<points>`: the best technique
recipe's accuracy at the largest global batch minus the baseline's there.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from lbt.spec.result import RunResult, read_result

BASELINE = "baseline"
DEFAULT_RECIPES = [BASELINE, "goyal2017", "lars"]
EXTRA_RECIPES = ["lamb", "akiba2017", "smith2017_ramp"]
PER_WORKER_BATCH = 64  # the base batch: world_size 1 trains at global batch 64

# The protocol every run shares (README: "Accuracy at 64x the base batch").
COMMON = [
    "data=mnist1d",
    "model=cnn1d",
    f"trainer.per_worker_batch={PER_WORKER_BATCH}",
    "dist.procs=1",
    "trainer.progress=false",
]
FULL = {"num_samples": 70000, "epochs": 10}
QUICK = {"num_samples": 7000, "epochs": 2}


@dataclass(frozen=True)
class Job:
    recipe: str
    world_size: int
    seed: int
    run_dir: Path
    overrides: tuple[str, ...]

    @property
    def global_batch(self) -> int:
        return PER_WORKER_BATCH * self.world_size


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default runs/bench_accuracy/<timestamp>)")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: {QUICK['num_samples']} samples, {QUICK['epochs']} epochs")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per (recipe, batch): trainer.seed=0..N-1")
    parser.add_argument("--recipes", default=",".join(DEFAULT_RECIPES),
                        help="comma-separated recipes/ names (default: %(default)s)")
    parser.add_argument("--all", action="store_true", help=f"also run {', '.join(EXTRA_RECIPES)}")
    parser.add_argument("--split", choices=("val", "test"), default="test",
                        help="test: train on all 60k, report the test split (the final table). "
                             "val: data.val_fraction=0.1, report the 6k held out of train (tuning)")
    parser.add_argument("--world-sizes", default="1,64",
                        help="comma-separated world sizes, global batch = 64 x W (default: %(default)s)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="runs at a time, each with cores/jobs threads (default: one per core)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="Hydra overrides for every run, e.g. optim.lr=0.05")
    args = parser.parse_args(argv)
    args.recipes = [r for r in args.recipes.split(",") if r]
    if args.all:
        args.recipes += [r for r in EXTRA_RECIPES if r not in args.recipes]
    args.world_sizes = sorted({int(w) for w in args.world_sizes.split(",") if w})
    if args.seeds < 1 or args.jobs < 1 or not args.recipes or not args.world_sizes:
        parser.error("--seeds and --jobs must be >= 1; --recipes and --world-sizes must not be empty")
    if args.out is None:
        args.out = Path("runs/bench_accuracy") / time.strftime("%Y-%m-%d_%H-%M-%S")
    return args


def plan_jobs(args: argparse.Namespace) -> list[Job]:
    budget = QUICK if args.quick else FULL
    shared = COMMON + [
        f"data.num_samples={budget['num_samples']}",
        f"trainer.epochs={budget['epochs']}",
        f"data.val_fraction={0.1 if args.split == 'val' else 0.0}",
    ]
    # Explicit threads: a batch-64 forward gains nothing from a second thread, and
    # on a busy machine two threads per run made batch-64 runs ~15x slower.
    shared.append(f"trainer.threads={max(1, (os.cpu_count() or 1) // args.jobs)}")
    jobs = []
    for recipe in args.recipes:
        for world_size in args.world_sizes:
            for seed in range(args.seeds):
                run_dir = args.out / f"{recipe}_gb{PER_WORKER_BATCH * world_size}_seed{seed}"
                overrides = shared + [f"recipe={recipe}", f"dist.world_size={world_size}",
                                      f"trainer.seed={seed}", *args.overrides]
                jobs.append(Job(recipe, world_size, seed, run_dir, tuple(overrides)))
    return jobs


def run_job(job: Job) -> RunResult:
    """One `lbt train` run in its own folder; its output goes to train.log there."""
    result_file = job.run_dir / "result.json"
    if result_file.exists():
        return read_result(result_file)
    job.run_dir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "lbt", "train", *job.overrides, f"hydra.run.dir={job.run_dir}"]
    if (job.run_dir / "checkpoint").is_dir():  # an interrupted job continues (a fresh start there is refused)
        command.append("trainer.resume=auto")
    (job.run_dir / "command.txt").write_text(" ".join(command[2:]) + "\n")
    with open(job.run_dir / "train.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    if code != 0 or not result_file.exists():
        return RunResult(error=f"exit code {code}, see {job.run_dir / 'train.log'}")
    return read_result(result_file)


def accuracy(result: RunResult) -> float:
    """Final accuracy of the split the run evaluated (named test when val_fraction is 0)."""
    return result.final_acc if result.trained else float("nan")


def mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.fmean(finite) if len(finite) == len(values) and finite else float("nan")


def table(jobs: list[Job], results: dict[Job, RunResult], split: str) -> tuple[str, float]:
    """The markdown table and accuracy_recovered (points) at the largest global batch."""
    cells: dict[tuple[str, int], list[tuple[Job, RunResult]]] = {}
    for job in jobs:
        cells.setdefault((job.recipe, job.global_batch), []).append((job, results[job]))
    reference = mean([accuracy(r) for _, r in cells.get((BASELINE, PER_WORKER_BATCH), [])])
    lines = [
        f"| recipe | global batch | {split} acc (%) | gap to baseline @ {PER_WORKER_BATCH} (points) "
        f"| steps | wall time (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (recipe, global_batch), runs in cells.items():
        accs = [accuracy(r) for _, r in runs]
        acc = mean(accs)
        if any(r.failed for _, r in runs):
            shown = "error"
        elif any(r.diverged for _, r in runs):
            shown = "diverged"
        else:
            shown = f"{100 * acc:.2f}"
            if len(accs) > 1:
                shown += f" ± {100 * statistics.stdev(accs):.2f}"
        gap = f"{100 * (acc - reference):+.2f}" if math.isfinite(acc) and math.isfinite(reference) else "n/a"
        steps = runs[0][1].steps if not runs[0][1].failed else "n/a"
        wall = mean([float("nan") if r.failed else r.wall_seconds for _, r in runs])
        wall_shown = f"{wall:.0f}" if math.isfinite(wall) else "n/a"
        lines.append(f"| {recipe} | {global_batch} | {shown} | {gap} | {steps} | {wall_shown} |")
    largest = max(global_batch for _, global_batch in cells)
    at_largest = {recipe: mean([accuracy(r) for _, r in runs])
                  for (recipe, global_batch), runs in cells.items() if global_batch == largest}
    techniques = [a for recipe, a in at_largest.items() if recipe != BASELINE and math.isfinite(a)]
    base = at_largest.get(BASELINE, float("nan"))
    recovered = 100 * (max(techniques) - base) if techniques else float("nan")
    return "\n".join(lines), recovered


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    jobs = plan_jobs(args)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{len(jobs)} runs -> {args.out} (split={args.split}{', quick' if args.quick else ''})", flush=True)

    def one(job: Job) -> RunResult:
        result = run_job(job)
        acc = accuracy(result)
        state = result.error or ("diverged" if result.diverged else f"{args.split}_acc={100 * acc:.2f}")
        wall = "" if result.failed else f" ({result.wall_seconds:.0f}s)"
        print(f"  {job.recipe} global_batch={job.global_batch} seed={job.seed}: {state}{wall}", flush=True)
        return result

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = dict(zip(jobs, pool.map(one, jobs)))
    markdown, recovered = table(jobs, results, args.split)
    (args.out / "table.md").write_text(markdown + "\n")
    print()
    print(markdown)
    print()
    print(f"accuracy_recovered={recovered:.2f}")


if __name__ == "__main__":
    main()
