"""The critical batch through tune folders run at different epoch budgets (bench/README.md, "A longer budget
where 10 epochs miss the target").

    python bench/fit_budgets.py runs/tune/fair_transformer1d_small runs/tune/fair_transformer1d_long

`bench/fair.py` fits S = S_min (1 + B_crit / B) through one folder's cells, all at one epoch budget. Where the
budget ends before a large batch reaches the target, that batch is "missed": it only holds the fit at or above
the budget's steps, and a recipe whose steps fall as 1/batch up to there has no critical batch at all. A
longer budget at those batches (`bench/fair.py --epochs 30 --target T`, T the first folder's target) measures
them. Per recipe and global batch this script takes the steps of the first folder given (give the shortest
budget first) whose median over studies reaches the target, and fits through them: a batch gets a longer
budget only where a shorter one missed; a batch missed in every folder holds the fit at its longest budget
(from folders written since 2026-11-29, whose rows record it). The folders must share the target.

The last lines: `critical_batch_<recipe>=<samples>` per recipe (n/a: no fit).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from lbt.apps.tune.report import bound_words, steps_fit
from lbt.apps.tune.summary import StepsRow


def read(folder: Path) -> tuple[float, str, list[dict]]:
    """A folder's target, its epoch budget (as its overrides say it) and its steps-to-target rows."""
    if not (folder / "tune_summary.json").is_file():
        sys.exit(f"bench/fit_budgets.py: {folder} has no tune_summary.json: not a finished bench/fair.py folder")
    summary = json.loads((folder / "tune_summary.json").read_text())
    epochs = next((o.split("=", 1)[1] for o in summary["overrides"] if o.startswith("trainer.epochs=")), "default")
    steps = summary["steps_to_target"]
    return steps["target"], epochs, steps["cells"]


def chosen_points(folders: list[Path]) -> tuple[float, dict[str, dict[int, tuple[float, str]]], dict[str, dict]]:
    """Per recipe, per global batch: (median steps, epochs) from the first folder whose median reaches the
    target; and per recipe, per batch no folder's median reached, the longest budget it missed in (steps)."""
    targets, points, budgets = [], {}, {}
    for folder in folders:
        target, epochs, rows = read(folder)
        targets.append(target)
        for row in rows:
            if row["median"] is not None:
                points.setdefault(row["series"], {}).setdefault(row["global_batch"], (row["median"], epochs))
            elif row.get("budget"):
                longest = budgets.setdefault(row["series"], {})
                longest[row["global_batch"]] = max(row["budget"], longest.get(row["global_batch"], 0))
    missed = {series: {b: n for b, n in by_batch.items() if b not in points.get(series, {})}
              for series, by_batch in budgets.items()}
    if any(not math.isclose(t, targets[0], rel_tol=1e-9) for t in targets):
        sys.exit(f"bench/fit_budgets.py: the folders' targets differ ({', '.join(f'{t:.4f}' for t in targets)}); "
                 "run the longer budget with --target set to the first folder's")
    return targets[0], points, missed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="+", type=Path, help="tune folders, the shortest budget first")
    args = parser.parse_args(argv)
    target, points, missed = chosen_points(args.folders)
    print(f"Target val {100 * target:.2f}%; per batch the shortest budget whose median reaches it.\n")
    print("| recipe | steps to target (epochs) per global batch | critical batch | S_min | relative rms | "
          "held at a missed budget |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    found = {}
    for series, by_batch in sorted(points.items()):
        batches = sorted(by_batch)
        shown = ", ".join(f"{b:,}: {by_batch[b][0]:,.0f} ({by_batch[b][1]})" for b in batches)
        fit = steps_fit(series, [StepsRow(global_batch=b, median=by_batch[b][0]) for b in batches]  # fair.py's fit
                        + [StepsRow(global_batch=b, median=None, budget=n) for b, n in missed.get(series, {}).items()])
        found[series] = fit["b_crit"]
        if fit["b_crit"] is None:
            print(f"| {series} | {shown} | n/a: {fit['note']} | | | |")
        else:
            print(f"| {series} | {shown} | {fit['b_crit']:,.0f} | {fit['s_min']:.1f} | {fit['rel_rms']:.3f} | "
                  f"{bound_words(fit['bound_at'])} |")
    print()
    for series, b_crit in found.items():
        print(f"critical_batch_{series}={'n/a' if b_crit is None else f'{b_crit:.0f}'}")


if __name__ == "__main__":
    main()
