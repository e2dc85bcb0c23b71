"""What simulating W workers costs: samples/s at a fixed global batch, W simulated workers vs one.

    python bench/simulation.py            # full: B=4096, W=1,2,4,16,64,128, 9 interleaved repeats
    python bench/simulation.py --quick    # under 2 minutes: 3 steps per run, 2 repeats
    python bench/simulation.py --global-batch 8192 --threads 2

cnn1d on MNIST-1D, global batch B fixed, per_worker_batch = B / W, all W
simulated on one process, through `lbt.engine.run`:
- fused (dist.fuse_workers=true): one forward/backward over the
  B samples, BatchNorm statistics per b-sample worker chunk;
- sequential (dist.fuse_workers=false): W forward/backward passes of b samples;
- auto (the default, dist.fuse_workers=auto): passes of about 256 samples, each
  fusing that many workers (lbt/engine/passes.py: workers_per_pass);
all relative to W=1 (one worker of batch B) in the same repeat. Target: auto
>= 0.95 of W=1 at every W, each median with a 90% bootstrap interval of the
per-repeat ratios. Warm-up excluded (one short
unmeasured run per configuration); configurations alternate order between repeats.

Then real processes on this machine (each a fresh `python -m lbt train`, so
start-up is excluded but each run's first step is cold, alike for all):
W=2 on P=2 processes (gloo over loopback, cores split between them) against
W=2 simulated on P=1 and W=1 on P=1, at the same B.
The last line is `simulation_ratio=<worst auto W's median ratio to W=1>`.
"""

from __future__ import annotations

import argparse
import os

from _common import (
    MNIST1D_TRAIN,
    LoadWatch,
    describe_machine,
    headline,
    interleaved,
    median,
    median_interval,
    pair_ratios,
    run_lbt,
    run_lbt_subprocess,
    spread,
    timed_run,
)

from lbt.engine.passes import workers_per_pass

WORLD_SIZES = [2, 4, 16, 64, 128]
BASE = ["model=cnn1d", "data=mnist1d", "trainer.epochs=1"]


def overrides(world_size: int, global_batch: int, steps: int, threads: int, fused: bool | str = True,
              procs: int = 1) -> list[str]:
    fuse = fused if isinstance(fused, str) else str(fused).lower()
    return [*BASE, f"dist.world_size={world_size}", f"dist.procs={procs}", f"trainer.global_batch={global_batch}",
            f"trainer.max_steps={steps}", f"dist.fuse_workers={fuse}"] + \
        ([f"trainer.threads={threads}"] if threads else [])


def fresh_process(args: list[str]):
    return lambda: run_lbt_subprocess(args).samples_per_sec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps per run, 2 repeats (under 2 minutes)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 5, quick 2)")
    parser.add_argument("--global-batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default: one epoch, quick 3)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the simulated runs (default 1: see bench/README.md, ## Speed)")
    parser.add_argument("--no-sequential", action="store_true", help="skip dist.fuse_workers=false")
    parser.add_argument("--no-procs", action="store_true", help="skip the real P=2 vs P=1 comparison")
    args = parser.parse_args(argv)
    B = args.global_batch
    repeats = args.repeats or (2 if args.quick else 9)
    steps = args.steps or (3 if args.quick else MNIST1D_TRAIN // B)
    print(describe_machine(), flush=True)
    watch = LoadWatch(own=args.threads)

    contenders = {"W=1": timed_run(overrides(1, B, steps, args.threads), steps)}
    for w in WORLD_SIZES:  # the default: passes of workers_per_pass workers
        group = workers_per_pass("auto", w, B // w, True, "cpu")
        contenders[f"W={w} auto ({w // group} passes of {group})"] = \
            timed_run(overrides(w, B, steps, args.threads, fused="auto"), steps)
    for w in WORLD_SIZES:
        contenders[f"W={w} fused"] = timed_run(overrides(w, B, steps, args.threads), steps)
    if not args.no_sequential:
        for w in WORLD_SIZES:
            contenders[f"W={w} sequential"] = timed_run(overrides(w, B, steps, args.threads, fused=False), steps)
    print("warm-up: one unmeasured step per configuration ...", flush=True)
    for w in [1, *WORLD_SIZES]:
        run_lbt(overrides(w, B, 1, args.threads))
        if w > 1:
            run_lbt(overrides(w, B, 1, args.threads, fused="auto"))
        if w > 1 and not args.no_sequential:
            run_lbt(overrides(w, B, 1, args.threads, fused=False))
    print(f"simulated workers: global batch {B}, {steps} steps per run, {args.threads} thread(s), "
          f"{repeats} interleaved repeats ...", flush=True)
    values = interleaved(contenders, repeats, watch)
    print()
    print("| configuration | per_worker_batch | samples/s | / W=1: median of per-repeat ratios (90% interval) |")
    print("| --- | --- | --- | --- |")
    ratios: dict[str, float] = {}
    for name, vals in values.items():
        w = int(name.split()[0][2:])
        per_pair = pair_ratios(vals, values["W=1"])
        ratios[name] = median(per_pair)
        low, high = median_interval(per_pair)
        print(f"| {name} | {B // w} | {spread(vals)} | {ratios[name]:.3f} ({low:.3f}-{high:.3f}) |")
    auto = {name: ratio for name, ratio in ratios.items() if "auto" in name}
    worst = min(auto, key=auto.get)

    if not args.no_procs:
        p_steps = steps if args.quick else 2 * steps
        p_repeats = 1 if args.quick else repeats
        cores = os.cpu_count() or 1
        procs = {
            "W=2 on P=2 (1 thread each)": fresh_process(overrides(2, B, p_steps, 0, procs=2)),
            f"W=2 on P=1 ({cores} threads)": fresh_process(overrides(2, B, p_steps, cores)),
            f"W=1 on P=1 ({cores} threads)": fresh_process(overrides(1, B, p_steps, cores)),
        }
        if not args.quick:
            procs["W=2 on P=1 (1 thread)"] = fresh_process(overrides(2, B, p_steps, 1))
        print(f"\nreal processes: global batch {B}, {p_steps} steps per run, fresh processes, "
              f"{p_repeats} interleaved repeat(s) ...", flush=True)
        pv = interleaved(procs, p_repeats, watch)
        reference = f"W=2 on P=1 ({cores} threads)"
        print(f"| configuration | samples/s | / {reference} |")
        print("| --- | --- | --- |")
        for name, vals in pv.items():
            print(f"| {name} | {spread(vals)} | {median(pair_ratios(vals, pv[reference])):.3f} |")
    print(watch.verdict())
    print(f"worst: {worst} ({auto[worst]:.3f}); target >= 0.95: {'met' if auto[worst] >= 0.95 else 'MISSED'}")
    headline("simulation_ratio", auto[worst])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
