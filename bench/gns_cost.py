"""What `measure=[gns]` costs per step, and whether measuring every n-th step changes the estimate.

    python bench/gns_cost.py              # full: W=4,16,64,128 at b=64, 7 interleaved repeats, then the estimate
    python bench/gns_cost.py --quick      # a smoke run: 2 repeats, few steps, no estimate table

cnn1d on MNIST-1D (the default study's model and per-worker batch, b=64), all W workers simulated
on one process and one thread (as the study runs them), through `lbt.train.run`. Per W, three
contenders in turns (ABBA): no measurement, `measure=[gns] technique.gns.every=1` (the extra
pass of one worker every step) and `every=auto` (the default). Cost = 1 - samples/s of the
measured run / the unmeasured one, median of the per-repeat ratios, with their range.

Then the estimate (not with --quick): full 10-epoch runs at W=16 (batch 1,024), seeds 0-2, with
every=1 and every=auto: B_simple at the end of training, and the run's test accuracy (the
parameters are bitwise the same either way: tests/test_measurement.py).
The last line is `gns_cost=<worst W's cost with every=auto>`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    LoadWatch, describe_machine, headline, interleaved, median, pair_ratios, run_lbt, timed_run,
)

BASE = ["model=cnn1d", "data=mnist1d", "trainer.per_worker_batch=64", "trainer.threads=1", "trainer.epochs=1"]
WORLD_SIZES = [4, 16, 64, 128]
ARMS = {"none": [], "every=1": ["measure=[gns]", "technique.gns.every=1"],
        "every=auto": ["measure=[gns]", "technique.gns.every=auto"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, few steps, no estimate table")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 7, quick 2)")
    parser.add_argument("--samples", type=int, default=400_000,
                        help="samples per timed run (default 400,000: about 10 s of cnn1d at every W)")
    args = parser.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 7)
    samples = 20_000 if args.quick else args.samples
    print(describe_machine(), flush=True)
    watch = LoadWatch(own=1)
    costs: dict[str, dict[int, list[float]]] = {"every=1": {}, "every=auto": {}}
    rows = []
    for w in WORLD_SIZES:
        steps = max(4, samples // (64 * w))
        # A run of `steps` steps: one epoch capped (MNIST-1D's 54,000 training samples hold fewer at large W:
        # more epochs then, the same steps for every arm).
        epochs = -(-steps * 64 * w // 54_000)
        common = [*BASE, f"dist.world_size={w}", f"trainer.max_steps={steps}", f"trainer.epochs={epochs}",
                  "trainer.evals=0"]
        contenders = {arm: timed_run(common + extra, steps) for arm, extra in ARMS.items()}
        for arm, extra in ARMS.items():  # warm-up, unmeasured
            run_lbt([*BASE, f"dist.world_size={w}", "trainer.max_steps=2", *extra])
        values = interleaved(contenders, repeats, watch)
        for arm in ("every=1", "every=auto"):
            costs[arm][w] = [1 - r for r in pair_ratios(values[arm], values["none"])]
        rows.append((w, steps, values))
        print(f"W={w}: {steps} steps per run, done", flush=True)
    print()
    print("| W (batch) | steps/run | unmeasured samples/s | cost every=1 | cost every=auto (n) |")
    print("| --- | --- | --- | --- | --- |")
    from lbt.techniques.gns import measure_every
    for w, steps, values in rows:
        def show(arm: str) -> str:
            c = costs[arm][w]
            return f"{100 * median(c):.1f}% ({100 * min(c):.1f} to {100 * max(c):.1f})"
        print(f"| {w} ({64 * w:,}) | {steps} | {median(values['none']):,.0f} | {show('every=1')} | "
              f"{show('every=auto')} (n={measure_every('auto', w)}) |")
    print(watch.verdict())
    if not args.quick:
        print("\nthe estimate: W=16 (batch 1,024), 10 epochs, B_simple at the end of training ...", flush=True)
        print("| every | seed | B_simple | test acc |")
        print("| --- | --- | --- | --- |")
        found: dict[str, list[float]] = {}
        for arm in ("every=1", "every=auto"):
            for seed in (0, 1, 2):
                result = run_lbt(["model=cnn1d", "data=mnist1d", "trainer.per_worker_batch=64", "trainer.threads=1",
                                  "dist.world_size=16", f"trainer.seed={seed}", *ARMS[arm]])
                b_simple = result["technique_metrics"]["gns/b_simple"]
                found.setdefault(arm, []).append(b_simple)
                print(f"| {arm} | {seed} | {b_simple:,.0f} | {100 * result['test_acc']:.2f} |", flush=True)
        for arm, values in found.items():
            print(f"{arm}: B_simple {statistics.mean(values):,.0f} +- {statistics.stdev(values):,.0f} (3 seeds)")
    headline("gns_cost", max(median(costs["every=auto"][w]) for w in WORLD_SIZES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
