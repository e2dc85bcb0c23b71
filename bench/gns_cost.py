"""What `measure=[gns]` costs per step, and whether measuring every n-th step changes the estimate.

    python bench/gns_cost.py              # full: W=4,16,64,128 at b=64, 3 interleaved repeats, then the estimate
    python bench/gns_cost.py --quick      # a smoke run: 1 repeat, few steps, no estimate table

cnn1d on MNIST-1D (the default study's model and per-worker batch, b=64), all W workers simulated
on one process and one thread (as the study runs them), through `lbt.engine.run`. Per W, three
contenders in turns (ABBA): no measurement, `measure=[gns] technique.gns.every=1` (the extra pass
of one worker every step) and `every=auto` (the default).

The cost is read inside each measured run: the trainer times the extra pass as its own phase
(`step_seconds.measure_s`), so cost = measure_s / the whole step, from the same run and the same
minutes of the machine. Between runs, identical configurations on this VM differ by up to ~10% in
samples/s (the machine's speed drifts), more than the cost being measured; the paired wall-clock
ratio against the unmeasured run is printed as well, with its range, as the check that the pass does
not also slow the rest of the step.

Then the estimate (not with --quick): full 10-epoch runs at W=16 (batch 1,024), seeds 0-2, with
every=1 and every=auto: B_simple as the report reads it (median over the last 20% of training) and
the run's test accuracy (the parameters are bitwise the same either way: tests/test_measurement.py).
The last line is `gns_cost=<worst W's in-run cost with every=auto>`.
"""

from __future__ import annotations

import argparse

from _common import MNIST1D_TRAIN, LoadWatch, describe_machine, headline, interleaved, median, pair_ratios, run_lbt

from lbt.metrics.critical import gns_summary
from lbt.spec.result import RunResult
from lbt.techniques.gns import measure_every

BASE = ["model=cnn1d", "data=mnist1d", "trainer.per_worker_batch=64", "trainer.threads=1"]
WORLD_SIZES = [4, 16, 64, 128]
ARMS = {"none": [], "every=1": ["measure=[gns]", "technique.gns.every=1"],
        "every=auto": ["measure=[gns]", "technique.gns.every=auto"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, few steps, no estimate table")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3, quick 1)")
    parser.add_argument("--samples", type=int, default=200_000, help="samples per timed run (default 200,000)")
    parser.add_argument("--estimate-only", action="store_true", help="only the estimate table")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    samples = 20_000 if args.quick else args.samples
    print(describe_machine(), flush=True)
    watch = LoadWatch(own=1)
    rows = []
    for w in ([] if args.estimate_only else WORLD_SIZES):
        steps = max(4, samples // (64 * w))
        epochs = -(-steps * 64 * w // MNIST1D_TRAIN)  # the same steps for every arm, over epochs if need be
        common = [*BASE, f"dist.world_size={w}", f"trainer.max_steps={steps}", f"trainer.epochs={epochs}",
                  "trainer.evals=0"]
        results: dict[str, list[RunResult]] = {arm: [] for arm in ARMS}

        def contender(arm: str, common: list[str] = common, results: dict = results):
            def run() -> float:
                result = run_lbt(common + ARMS[arm])
                results[arm].append(result)
                return result.samples_per_sec
            return run

        for extra in ARMS.values():  # warm-up, unmeasured
            run_lbt([*BASE, f"dist.world_size={w}", "trainer.max_steps=2", "trainer.epochs=1", *extra])
        values = interleaved({arm: contender(arm) for arm in ARMS}, repeats, watch)
        rows.append((w, steps, values, results))
        print(f"W={w}: {steps} steps per run, done", flush=True)

    def in_run(result: RunResult) -> float:
        seconds = result.step_seconds
        return seconds.get("measure_s", 0.0) / sum(seconds.values())

    print()
    print("| W (batch) | steps/run | unmeasured samples/s | every=1: in-run cost (wall ratio) | "
          "every=auto: n, in-run cost (wall ratio) |")
    print("| --- | --- | --- | --- | --- |")
    worst = 0.0
    for w, steps, values, results in rows:
        cells = []
        for arm in ("every=1", "every=auto"):
            costs = [in_run(r) for r in results[arm]]
            wall = [1 - r for r in pair_ratios(values[arm], values["none"])]
            cells.append(f"{100 * median(costs):.1f}% ({100 * min(costs):.1f}-{100 * max(costs):.1f}) "
                         f"(wall {100 * median(wall):+.1f}%, {100 * min(wall):+.1f} to {100 * max(wall):+.1f})")
            if arm == "every=auto":
                worst = max(worst, median(costs))
        print(f"| {w} ({64 * w:,}) | {steps} | {median(values['none']):,.0f} | {cells[0]} | "
              f"n={measure_every('auto', w)}, {cells[1]} |")
    print(watch.verdict())
    if not args.quick:
        print("\nthe estimate: W=16 (batch 1,024), 10 epochs, B_simple over the last 20% of training (median) ...")
        print("| every | seed | B_simple, last 20% | test acc |")
        print("| --- | --- | --- | --- |")
        for arm in ("every=1", "every=auto"):
            for seed in (0, 1, 2):
                result = run_lbt([*BASE, "dist.world_size=16", f"trainer.seed={seed}", *ARMS[arm]])
                late = gns_summary(result.technique_curves["gns/b_simple"])
                shown = "none finite" if late is None else f"{late:,.0f}"
                print(f"| {arm} | {seed} | {shown} | {100 * result.test_acc:.2f} |", flush=True)
    if not args.estimate_only:
        headline("gns_cost", worst)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
