"""Recipe quality under the fair protocol (bench/README.md, "Recipe quality, fair protocol").

Every recipe (the baseline included) gets the same budget, chosen on val and scored on test,
through lbt's own `lbt tune`: MNIST-1D (54,000 train, 6,000 val held out, 10,000 test), cnn1d,
10 epochs, per-worker batch 64, world sizes 16, 64, 128 for every recipe; the baseline also at
1 (the base batch every gap is measured against) and at 4 and 32 (the batches the steps-to-target
fit needs). `--trials` Optuna trials per cell, then the best values and the untuned defaults
trained with `--seeds` fresh seeds each.

    python bench/fair.py                  # the protocol: about 2 hours on 2 cores (3 tune processes)
    python bench/fair.py --dir runs/tune/fair --procs 3 --trials 6 --seeds 3

Cells run in `--procs` `lbt tune` processes side by side (one thread each), all into one tune.dir
(one SQLite storage); interrupted, the same command continues. Then:
- the critical batch from steps to target: `lbt report <dir>/final/tuned` (the tuned runs);
- the critical batch from the gradient noise scale: the tuned baseline trained again at world
  sizes 16 and 64 with measure=[gns] (which does not change the run), `lbt report <dir>/gns`.
The last line is `best_gap_64x=<points> best_gap_128x=<points>`: test points the best recipe
(chosen on val) loses against the tuned base batch (positive = below).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

# The grid in groups of cells, one `lbt tune` process each; together every recipe at 16, 64, 128
# and the baseline at 1, 4 and 32 besides.
GROUPS = [["recipe=baseline", "dist.world_size=1,16,64,128,4,32"],
          ["recipe=goyal2017,lars", "dist.world_size=16,64,128"],
          ["recipe=lamb", "dist.world_size=16,64,128"]]
GNS_WORLD_SIZES = (16, 64)


def lbt(*args: str, log: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lbt", *args]
    if log is None:
        return subprocess.run(command, capture_output=True, text=True)
    with open(log, "a") as out:
        return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, text=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("runs/tune/fair"))
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--procs", type=int, default=len(GROUPS), help="tune processes at a time (at most 3)")
    args = parser.parse_args(argv)
    folder = args.dir.absolute()
    folder.mkdir(parents=True, exist_ok=True)
    common = [f"tune.trials={args.trials}", f"tune.startup_trials={max(1, args.trials // 2)}",
              f"tune.seeds={args.seeds}", "trainer.threads=1", f"tune.dir={folder}"]
    started = time.perf_counter()
    groups = [GROUPS[i::args.procs] for i in range(min(args.procs, len(GROUPS)))]
    running = []
    for n, chain in enumerate(groups):  # each process runs its groups one after another
        script = " && ".join(" ".join([sys.executable, "-m", "lbt", "tune", *g, *common]) for g in chain)
        running.append(subprocess.Popen(["bash", "-c", script], stdout=open(folder / f"tune_{n}.log", "a"),
                                        stderr=subprocess.STDOUT))
        time.sleep(20)  # staggered: the first process generates MNIST-1D's cache
    codes = [p.wait() for p in running]
    if any(codes):
        sys.exit(f"bench/fair.py: a tune process failed ({codes}); see {folder}/tune_*.log")
    # Every group once more, in order: no new trial or run; the last writes the report over all cells.
    for group in GROUPS:
        lbt("tune", *group, *common, log=folder / "report.log")
    summary = json.loads((folder / "tune_summary.json").read_text())
    lbt("report", str(folder / "final" / "tuned"))
    fit = json.loads((folder / "final" / "tuned" / "summary.json").read_text())["critical_batch"]

    base = {c["world_size"]: c for c in summary["cells"] if c["series"] == "baseline"}
    for world_size in GNS_WORLD_SIZES:
        run_dir = folder / "gns" / f"w{world_size}"
        if not (run_dir / "result.json").is_file():
            best = base[world_size]["best"]["params"]
            # As the tuned final run of seed 1 (one thread, as the tune ran it), plus the measurement.
            lbt("train", "recipe=baseline", f"dist.world_size={world_size}", "measure=[gns]", "trainer.seed=1",
                "trainer.threads=1", "trainer.progress=false", *[f"{k}={v!r}" for k, v in best.items()],
                f"hydra.run.dir={run_dir}", log=folder / "gns.log")
    lbt("report", str(folder / "gns"))
    gns = json.loads((folder / "gns" / "summary.json").read_text())["critical_batch"]

    print((folder / "tune_report.md").read_text())
    interval = fit.get("fit_interval") or [None, None]
    print(f"critical batch, steps to target ({fit.get('series')}): {fit.get('fit')} "
          f"(90% interval {interval[0]} - {interval[1]}); from the gradient noise scale: {gns.get('gns')}")
    print(f"fair protocol in {time.perf_counter() - started:.0f} s; tune report: {folder / 'tune_report.md'}")
    gaps = summary["gaps"]
    shown = {k: (f"{gaps[k]:.2f}" if gaps.get(k) is not None else "n/a") for k in ("best_gap_64x", "best_gap_128x")}
    print(f"best_gap_64x={shown['best_gap_64x']} best_gap_128x={shown['best_gap_128x']}")


if __name__ == "__main__":
    main()
