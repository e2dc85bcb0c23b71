"""AdamW's scaling rule and batch-size warmup, measured (bench/README.md, "Adaptive optimizers").

1. How good is the square-root rule? transformer1d on MNIST-1D, 10 epochs, recipe adamw_sqrt
   (Malladi et al. 2022). `lbt tune` at the base batch 64 only; its best values then run zero-shot
   at 16x and 64x under the square-root rule, the linear rule and no rule (3 seeds each); next to
   them the per-batch tuned result of `lbt tune` at 16x and 64x (the same budget as the base).
2. Does batch warmup save steps? Optimizer steps to reach the tuned base batch's final val
   accuracy minus 0.2 points, batch_ramp mode=auto (tuned) against every fixed batch of the grid
   (each tuned): cnn1d (fixed batches from bench/fair.py's tuned baseline, --fair) and transformer1d
   (fixed batches from part 1).

    python bench/adaptive.py --dir runs/bench/adaptive --fair runs/tune/fair      # ~2 h on 2 cores

Work runs in up to three processes side by side (one thread each); the same command again continues
what was interrupted (lbt tune keeps its trials; finished runs are read back). The tables are
printed and written to <dir>/adaptive.md; the last line holds the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

from lbt.spec.result import RunResult, read_result

TRANSFORMER = ["model=transformer1d"]
SEEDS = (1, 2, 3)
KAPPAS = (16, 64)
TARGET_DROP = 0.002  # the step target: the tuned base batch's final val accuracy minus 0.2 points


def lbt_script(commands: list[list[str]]) -> str:
    return " && ".join(" ".join([sys.executable, "-m", "lbt", *map(quote, c)]) for c in commands)


def quote(arg: str) -> str:
    return f"'{arg}'" if any(ch in arg for ch in "[],= ") and not arg.startswith("'") else arg


def run_parallel(scripts: list[str], folder: Path, name: str) -> None:
    """Each script in its own shell, side by side; fail loudly if one fails."""
    jobs = [subprocess.Popen(["bash", "-c", s], stdout=open(folder / f"{name}_{i}.log", "a"),
                             stderr=subprocess.STDOUT) for i, s in enumerate(scripts)]
    codes = [job.wait() for job in jobs]
    if any(codes):
        sys.exit(f"bench/adaptive.py: a process failed ({codes}); see {folder}/{name}_*.log")


def tune(folder: Path, recipe: str, world_sizes: str, trials: int, extra: list[str] = ()) -> list[str]:
    return ["tune", f"recipe={recipe}", f"dist.world_size={world_sizes}", f"tune.trials={trials}",
            f"tune.startup_trials={max(1, trials // 2)}", f"tune.seeds={len(SEEDS)}", "tune.untuned=false",
            "trainer.threads=1",
            f"tune.dir={folder}", *extra]


def cell(folder: Path, name: str) -> dict:
    return json.loads((folder / "cells" / f"{name}.json").read_text())


def train(run_dir: Path, overrides: list[str]) -> list[str]:
    return ["train", *overrides, "trainer.threads=1", "trainer.progress=false", f"hydra.run.dir={run_dir}"]


def results(folders: list[str | Path]) -> list[RunResult]:
    return [read_result(f) for f in folders]


def mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.2f} ± {100 * spread:.2f}"


def steps_to(result: RunResult, target: float) -> int | None:
    """The first evaluation step whose val accuracy reaches `target` (None: never in the run)."""
    return next((p.step for p in result.history if p.acc >= target), None)


def steps_row(name: str, runs: list[RunResult], target: float) -> tuple[str, float | None, list[RunResult]]:
    steps = [steps_to(r, target) for r in runs]
    reached = [s for s in steps if s is not None]
    median = statistics.median(reached) if len(reached) == len(runs) else None
    shown = ", ".join("-" if s is None else str(s) for s in steps)
    line = (f"| {name} | {shown} | {'-' if median is None else int(median)} | {runs[0].steps} | "
            f"{mean_std([r.final_acc for r in runs])} | {mean_std([r.test_acc for r in runs])} |")
    return line, median, runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("runs/bench/adaptive"))
    parser.add_argument("--fair", type=Path, default=Path("runs/tune/fair"),
                        help="bench/fair.py's folder: its tuned baseline cells are cnn1d's fixed batches")
    parser.add_argument("--trials", type=int, default=4, help="trials per cell, the same for every cell")
    parser.add_argument("--cnn-trials", type=int, default=6, help="trials of cnn1d's ramp (bench/fair.py's budget)")
    parser.add_argument("--no-transformer-ramp", dest="transformer_ramp", action="store_false",
                        help="skip transformer1d's ramp (its table row then says so)")
    args = parser.parse_args(argv)
    root = args.dir.absolute()
    root.mkdir(parents=True, exist_ok=True)
    base_dir, scaled_dir, ramp_dir = root / "base", root / "scaled", root / "ramp"

    # The per-batch tunes at 16x and 64x in the background; the base batch's tune here, then its best
    # values zero-shot at 16x and 64x under each rule, 3 seeds, in two processes.
    scaled_tune = lbt_script([tune(scaled_dir, "adamw_sqrt", "16,64", args.trials, TRANSFORMER)])
    scaled = subprocess.Popen(["bash", "-c", scaled_tune], stdout=open(root / "scaled.log", "a"),
                              stderr=subprocess.STDOUT)
    run_parallel([lbt_script([tune(base_dir, "adamw_sqrt", "1", args.trials, TRANSFORMER)])], root, "base")
    best = cell(base_dir, "recipe=adamw_sqrt,dist.world_size=1")["best"]["params"]
    values = [f"{k}={v}" for k, v in best.items()]
    zero_shot = {}
    commands = []
    for rule in ("adam_sqrt", "linear", "none"):
        for kappa in KAPPAS:
            for seed in SEEDS:
                run_dir = root / "zero_shot" / f"{rule}_w{kappa}" / f"seed_{seed}"
                zero_shot.setdefault((rule, kappa), []).append(run_dir)
                if not (run_dir / "result.json").is_file():
                    commands.append(train(run_dir, ["recipe=adamw_sqrt", *TRANSFORMER, *values,
                                                    f"schedule.scaling={rule}", f"dist.world_size={kappa}",
                                                    f"trainer.seed={seed}"]))
    if commands:
        run_parallel([lbt_script(commands[0::2]), lbt_script(commands[1::2])], root, "zero_shot")
    if scaled.wait():
        sys.exit(f"bench/adaptive.py: the 16x/64x tune failed; see {root}/scaled.log")
    # Batch warmup: cnn1d's ramp from 512 (8 x 64), then transformer1d's (--transformer-ramp).
    ramps = [tune(ramp_dir / "cnn1d", "batch_warmup", "8", args.cnn_trials)]
    if args.transformer_ramp:
        ramps.append(tune(ramp_dir / "transformer1d", "batch_warmup_adamw", "8", args.trials, TRANSFORMER))
    run_parallel([lbt_script(ramps)], root, "ramp")

    lines = report_rule(base_dir, scaled_dir, zero_shot, best)
    lines += report_warmup(args.fair, base_dir, scaled_dir, ramp_dir)
    (root / "adaptive.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def report_rule(base_dir: Path, scaled_dir: Path, zero_shot: dict, best: dict) -> list[str]:
    base = cell(base_dir, "recipe=adamw_sqrt,dist.world_size=1")
    lines = ["## How good is the square-root rule? (transformer1d, MNIST-1D, 10 epochs, test accuracy %, 3 seeds)",
             "",
             f"Tuned at batch 64 only: {', '.join(f'{k}={v:.4g}' for k, v in best.items())}; "
             f"test {mean_std(base['tuned']['test_acc'])}, val {mean_std(base['tuned']['val_acc'])}.", "",
             "| batch | sqrt rule (zero-shot) | linear rule (zero-shot) | no rule (zero-shot) | tuned at this batch | "
             "sqrt rule - tuned (points) |", "| --- | --- | --- | --- | --- | --- |"]
    gaps, tuned_lrs = {}, {1: best["optim.lr"]}
    for kappa in KAPPAS:
        tuned = cell(scaled_dir, f"recipe=adamw_sqrt,dist.world_size={kappa}")
        tuned_lrs[kappa] = tuned["best"]["params"]["optim.lr"] * kappa ** 0.5  # the peak the tuned run took
        arms = {rule: [r.test_acc for r in results(zero_shot[(rule, kappa)])]
                for rule in ("adam_sqrt", "linear", "none")}
        gaps[kappa] = 100 * (statistics.mean(tuned["tuned"]["test_acc"]) - statistics.mean(arms["adam_sqrt"]))
        lines.append(f"| {64 * kappa:,} ({kappa}x) | {mean_std(arms['adam_sqrt'])} | {mean_std(arms['linear'])} | "
                     f"{mean_std(arms['none'])} | {mean_std(tuned['tuned']['test_acc'])} | {gaps[kappa]:+.2f} |")
    # Li et al. 2024: Adam's best LR rises, then falls, with the batch. The tuned peak LR per batch:
    batches = sorted(tuned_lrs)
    slope = (math.log(tuned_lrs[batches[-1]]) - math.log(tuned_lrs[batches[0]])) / math.log(batches[-1] / batches[0])
    lines += ["", "Tuned peak LR per batch (base LR x sqrt(kappa)): " +
              ", ".join(f"{64 * k:,}: {tuned_lrs[k]:.3g}" for k in batches) +
              f"; fitted exponent of LR ~ batch^a over 64..{64 * batches[-1]:,}: a = {slope:.2f} "
              "(sqrt rule: 0.5, linear: 1).", ""]
    lines.append(f"headline: sqrt_rule_gap_16x={gaps[16]:+.2f} sqrt_rule_gap_64x={gaps[64]:+.2f} "
                 "(target <= 1.0 at 64x)")
    return lines


def report_warmup(fair: Path, base_dir: Path, scaled_dir: Path, ramp_dir: Path) -> list[str]:
    lines = ["", "## Does batch warmup save steps? (steps to the tuned base batch's final val accuracy - 0.2 points)",
             ""]
    cases = {
        "cnn1d": ([(w, fair / "cells" / f"recipe=baseline,dist.world_size={w}.json") for w in (1, 4, 16, 32, 64, 128)],
                  ramp_dir / "cnn1d" / "cells" / "recipe=batch_warmup,dist.world_size=8.json"),
        "transformer1d": ([(1, base_dir / "cells" / "recipe=adamw_sqrt,dist.world_size=1.json")] +
                          [(k, scaled_dir / "cells" / f"recipe=adamw_sqrt,dist.world_size={k}.json") for k in KAPPAS],
                          ramp_dir / "transformer1d" / "cells" / "recipe=batch_warmup_adamw,dist.world_size=8.json"),
    }
    headline = []
    for model, (fixed, ramp_cell) in cases.items():
        if not ramp_cell.is_file():
            lines += [f"### {model}: the ramp was not run (--no-transformer-ramp)", ""]
            headline.append(f"{model}_steps_saved=not run")
            continue
        fixed_runs = {w: results(json.loads(path.read_text())["tuned"]["folders"]) for w, path in fixed}
        target = statistics.mean(r.final_acc for r in fixed_runs[1]) - TARGET_DROP
        lines += [f"### {model}: target val accuracy {100 * target:.2f}%", "",
                  "| run (tuned) | steps to target, per seed | median | steps in run | final val % | final test % |",
                  "| --- | --- | --- | --- | --- | --- |"]
        best_fixed = None
        for w, runs in fixed_runs.items():
            line, median, _ = steps_row(f"fixed batch {64 * w:,}", runs, target)
            lines.append(line)
            if median is not None and (best_fixed is None or median < best_fixed[1]):
                best_fixed = (w, median, runs)
        ramp = json.loads(ramp_cell.read_text())
        ramp_runs = results(ramp["tuned"]["folders"])
        line, ramp_median, _ = steps_row("batch_ramp mode=auto from 512", ramp_runs, target)
        lines.append(line)
        schedules = [[int(b) for _, b in r.technique_curves.get("batch_ramp/global_batch", [])] for r in ramp_runs]
        lines += ["", f"Ramp's tuned values: {ramp['best']['params']}; batches reached per seed: {schedules}.", ""]
        if best_fixed and ramp_median is not None:
            saved = 1 - ramp_median / best_fixed[1]
            val_gap = 100 * (statistics.mean(r.final_acc for r in best_fixed[2])
                             - statistics.mean(r.final_acc for r in ramp_runs))
            test_gap = 100 * (statistics.mean(r.test_acc for r in best_fixed[2])
                              - statistics.mean(r.test_acc for r in ramp_runs))
            headline.append(f"{model}_steps_saved={100 * saved:.0f}% (vs batch {64 * best_fixed[0]:,}; val "
                            f"{val_gap:+.2f} test {test_gap:+.2f} points behind)")
        else:
            headline.append(f"{model}_steps_saved=n/a (ramp reached target: {ramp_median is not None}; "
                            f"a fixed batch reached it: {best_fixed is not None})")
    lines += ["", "headline: " + " ".join(headline) + " (target: >= 25% fewer steps, within 0.2 points)"]
    return lines


if __name__ == "__main__":
    main()
