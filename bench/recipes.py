"""Recipe quality at 64x and 128x the base batch (bench/README.md, "Recipe quality").

Runs the fixed protocol through lbt's own study machinery: `lbt study` (a Hydra
multirun of the default study, here with the joblib launcher so both cores
work) for the recipes x world sizes x seeds, then `lbt report` over all of it,
then the table of mean ± std accuracy per recipe and global batch:

    python bench/recipes.py                          # the full protocol, test split
    python bench/recipes.py --split val              # tuning: scored on 10% held out of train
    python bench/recipes.py --recipes goyal2017 --world-sizes 128 --seeds 1 --split val optim.lr=0.05
    python bench/recipes.py --quick                  # smoke test: 7,000 samples, 2 epochs

Protocol: MNIST-1D 60,000 train / 10,000 test (data.num_samples=70000), cnn1d,
10 epochs at every batch, per_worker_batch 64, world_size 1, 16, 64, 128
(global batch 64 .. 8,192) simulated on one process; `--seeds` seeds at 64x and
128x, `--base-seeds` elsewhere. Trailing KEY=VALUE are Hydra overrides for
every job. The last line is `best_gap_64x=<points> best_gap_128x=<points>`:
how far the best recipe's mean accuracy lies below the base-batch baseline's
mean (positive = below, in percentage points).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BASELINE = "baseline"
RECIPES = [BASELINE, "goyal2017", "lars", "lamb", "smith2017_ramp"]
PER_WORKER_BATCH = 64
LARGE = (64, 128)  # the world sizes whose rows get --seeds seeds


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="study folder (default runs/bench_recipes/<time>)")
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated (default: %(default)s)")
    parser.add_argument("--world-sizes", default="1,16,64,128", help="global batch = 64 x W (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds at world size 64 and 128 (default 3)")
    parser.add_argument("--base-seeds", type=int, default=1, help="seeds at the other world sizes (default 1)")
    parser.add_argument("--split", choices=("test", "val"), default="test",
                        help="test: train on all 60k, score the test split (the final table); "
                             "val: data.val_fraction=0.1, score the 6k held out of train (tuning)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="jobs at a time, 1 thread each")
    parser.add_argument("--quick", action="store_true", help="7,000 samples, 2 epochs")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    args.recipes = [r for r in args.recipes.split(",") if r]
    args.world_sizes = sorted({int(w) for w in args.world_sizes.split(",") if w})
    if min(args.seeds, args.base_seeds, args.jobs) < 1 or not args.recipes or not args.world_sizes:
        parser.error("--seeds, --base-seeds and --jobs must be >= 1; recipes and world sizes non-empty")
    args.out = args.out or Path("runs/bench_recipes") / time.strftime("%Y-%m-%d_%H-%M-%S")
    return args


def study(args: argparse.Namespace, part: str, world_sizes: list[int], seeds: int) -> None:
    """One `lbt study` multirun into OUT/part (its jobs in numbered subfolders)."""
    sweep_dir = args.out / part
    if (sweep_dir / "multirun.yaml").exists() and (sweep_dir / "report.md").exists():
        print(f"{sweep_dir}: done already, reused", flush=True)
        return
    budget = ["data.num_samples=7000", "trainer.epochs=2"] if args.quick else \
        ["data.num_samples=70000", "trainer.epochs=10"]
    command = [
        sys.executable, "-m", "lbt", "study", "study=default",
        f"recipe={','.join(args.recipes)}",
        f"dist.world_size={','.join(map(str, world_sizes))}",
        f"trainer.seed={','.join(map(str, range(seeds)))}",
        "data=mnist1d", "model=cnn1d", f"trainer.per_worker_batch={PER_WORKER_BATCH}", "dist.procs=1",
        *budget, f"data.val_fraction={0.1 if args.split == 'val' else 0.0}",
        # One thread per job and jobs side by side: a batch-64 forward gains
        # nothing from a second thread, and two jobs keep both cores busy.
        "trainer.threads=1", f"hydra.sweep.dir={sweep_dir}", *args.overrides,
    ]
    if args.jobs > 1:  # Hydra's joblib launcher (a core dependency of lbt)
        command += ["hydra/launcher=local_parallel", f"hydra.launcher.n_jobs={args.jobs}"]
    jobs = len(args.recipes) * len(world_sizes) * seeds
    print(f"{part}: {jobs} jobs -> {sweep_dir}", flush=True)
    started = time.perf_counter()
    sweep_dir.mkdir(parents=True, exist_ok=True)
    with open(sweep_dir / "study.log", "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    print(f"{part}: exit {code} after {time.perf_counter() - started:.0f} s (log: {sweep_dir / 'study.log'})",
          flush=True)


def accuracy(job: dict, split: str) -> float:
    if job.get("error") or job.get("diverged"):
        return float("nan")
    # split test: no validation split (val_fraction 0), so the run evaluated test, named test;
    # val: the 10% held out of train.
    return float(job[f"final_{split}_acc"])


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values or not all(math.isfinite(v) for v in values):
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def table(summary: dict, split: str) -> tuple[str, dict[int, float]]:
    """Markdown table (accuracy in %, gap in points below the base-batch baseline) and best gap per world size."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for job in summary["jobs"]:
        cells.setdefault((job["series"], int(job["world_size"])), []).append(job)
    base_world = min(w for _, w in cells)
    reference, _ = mean_std([accuracy(j, split) for j in cells.get((BASELINE, base_world), [])])
    lines = [f"| recipe | world size | global batch | seeds | {split} acc (%) mean ± std | gap (points below "
             f"baseline @ {PER_WORKER_BATCH * base_world}) | steps | diverged/errors |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    best_gap: dict[int, float] = {}
    for (series, world), jobs in sorted(cells.items(), key=lambda kv: (RECIPES.index(kv[0][0])
                                                                         if kv[0][0] in RECIPES else 99, kv[0])):
        acc, std = mean_std([accuracy(j, split) for j in jobs])
        gap = 100 * (reference - acc)
        bad = sum(bool(j.get("diverged")) for j in jobs), sum(bool(j.get("error")) for j in jobs)
        shown = f"{100 * acc:.2f} ± {100 * std:.2f}" if math.isfinite(acc) else "n/a"
        gap_shown = f"{gap:+.2f}" if math.isfinite(gap) else "n/a"
        global_batch = int(jobs[0]["global_batch"] or PER_WORKER_BATCH * world)
        lines.append(f"| {series} | {world} | {global_batch:,} | {len(jobs)} | {shown} | {gap_shown} | "
                     f"{jobs[0].get('steps', 'n/a')} | {bad[0]}/{bad[1]} |")
        if series != BASELINE and math.isfinite(gap):
            best_gap[world] = min(best_gap.get(world, math.inf), gap)
    return "\n".join(lines), best_gap


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    small = [w for w in args.world_sizes if w not in LARGE]
    large = [w for w in args.world_sizes if w in LARGE]
    if small:
        study(args, "base_seeds", small, args.base_seeds)
    if large:
        study(args, "large", large, args.seeds)
    subprocess.run([sys.executable, "-m", "lbt", "report", str(args.out)], stdout=subprocess.DEVNULL, check=False)
    summary_file = args.out / "summary.json"
    if not summary_file.exists():
        sys.exit(f"bench/recipes.py: no report in {args.out}; see the study.log files there")
    summary = json.loads(summary_file.read_text())
    markdown, best_gap = table(summary, args.split)
    crit = summary.get("critical_batch") or {}  # lbt report's estimates: the fit and the gradient noise scale
    b_simple = crit.get("gns")
    text = markdown + (f"\n\nGradient-noise-scale critical batch (B_simple, median of {crit.get('series')}'s "
                       f"jobs): {b_simple:,.0f}\n" if b_simple else "\n")
    (args.out / "recipes_table.md").write_text(text)
    print(text)
    print(f"report: {args.out / 'report.md'}, curves: {args.out / 'accuracy_vs_batch.png'}")

    def shown(world: int) -> str:
        gap = best_gap.get(world)
        return "n/a" if gap is None else f"{gap:.2f}"

    print(f"best_gap_64x={shown(64)} best_gap_128x={shown(128)}")


if __name__ == "__main__":
    main()
