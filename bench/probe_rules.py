"""A recipe's LR scaling rule, probed: `lbt probe` once per rule, paired branch by branch.

Where no batch rule is published for an optimizer (Muon: recipes/muon.yaml), the probe tests the candidates:
the base run is the same under every rule (at the base batch every rule scales the LR by 1), and a branch
at k x the base batch starts from the same snapshot with the LR the rule gives it. A better rule keeps the
larger-batch branches closer to k=1: a smaller shortfall (accuracy points below the k=1 branch) and a
larger held batch (the local critical batch) at each checkpoint. Branches are short (10% of the budget,
re-warmed): they judge how well the rule transfers the LR, not a full run at that batch.

    python bench/probe_rules.py                                   # muon: sqrt, linear
    python bench/probe_rules.py --recipe lamb --rules sqrt,linear,none model=mlp

Each probe lands in --dir/<recipe>_<rule> (its output in <recipe>_<rule>.log beside it); interrupted, the
same command continues it (`lbt probe` keeps what finished). Last lines: `held_<rule>=<batch per
checkpoint>` per rule, then `better_rule=<rule>` (larger held batches at more checkpoints; a tie goes to
the smaller mean shortfall over the branches every rule ran).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def probe(recipe: str, rule: str, folder: Path, overrides: list[str]) -> dict:
    """The probe's probe.json, running (or continuing) it first."""
    out = folder / f"{recipe}_{rule}"
    command = [sys.executable, "-m", "lbt", "probe", f"recipe={recipe}", f"schedule.scaling={rule}",
               f"probe.dir={out}", *overrides]
    with open(folder / f"{recipe}_{rule}.log", "a") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        sys.exit(f"bench/probe_rules.py: lbt probe under schedule.scaling={rule} failed (exit {code}); "
                 f"see {folder / f'{recipe}_{rule}.log'}")
    return json.loads((out / "probe.json").read_text())


def table(results: dict[str, dict]) -> list[str]:
    """Markdown: per checkpoint and factor, each rule's shortfall (points below k=1; "-": not run, the
    checkpoint stopped after two failed factors; "diverged": the branch's loss passed 3x its start), then
    each rule's held batch."""
    rules = list(results)
    first = next(iter(results.values()))
    factors = sorted({int(k) for r in results.values() for c in r["checkpoints"] for k in c["shortfalls"]} - {1})
    lines = [f"| samples seen | {' | '.join(f'{k}x {rule}' for k in factors for rule in rules)} | "
             f"{' | '.join(f'held {rule}' for rule in rules)} |",
             "| " + " | ".join(["---:"] * (1 + len(factors) * len(rules) + len(rules))) + " |"]
    for i, checkpoint in enumerate(first["checkpoints"]):
        cells = []
        for k in factors:
            for rule in rules:
                shortfalls = results[rule]["checkpoints"][i]["shortfalls"]
                shortfall = shortfalls.get(str(k))
                shown = "diverged" if shortfall is None else f"{shortfall:+.2f}"
                cells.append(shown if str(k) in shortfalls else "-")
        held = [f"{results[rule]['checkpoints'][i]['local_critical']['held']:,}" for rule in rules]
        lines.append(f"| {checkpoint['samples']:,} | {' | '.join(cells)} | {' | '.join(held)} |")
    return lines


def better_rule(results: dict[str, dict]) -> str:
    """The rule with larger held batches at more checkpoints; a tie: the smaller mean shortfall over the
    (checkpoint, factor) branches every rule ran to the end (a diverged branch already failed its factor)."""
    rules = list(results)
    count = len(next(iter(results.values()))["checkpoints"])
    held = {rule: [results[rule]["checkpoints"][i]["local_critical"]["held"] for i in range(count)] for rule in rules}
    wins = {rule: sum(held[rule][i] == max(held[r][i] for r in rules) for i in range(count)) for rule in rules}
    common = [(i, k) for i in range(count) for k in results[rules[0]]["checkpoints"][i]["shortfalls"]
              if k != "1" and all(results[r]["checkpoints"][i]["shortfalls"].get(k) is not None for r in rules)]
    mean = {rule: statistics.fmean(results[rule]["checkpoints"][i]["shortfalls"][k] for i, k in common)
            if common else 0.0 for rule in rules}
    return min(rules, key=lambda rule: (-wins[rule], mean[rule]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="muon")
    parser.add_argument("--rules", default="sqrt,linear", help="comma-separated schedule.scaling values")
    parser.add_argument("--dir", type=Path, default=Path("runs/probe"))
    parser.add_argument("overrides", nargs="*", help="any `lbt probe` override, given to every probe")
    args = parser.parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    results = {rule: probe(args.recipe, rule, args.dir, args.overrides) for rule in args.rules.split(",")}
    print(f"{args.recipe}: shortfall of each branch (points below k=1 at the same checkpoint) and the held batch")
    print("\n".join(table(results)))
    for rule, result in results.items():
        print(f"{rule}: {result['answer']['sentence']}")
    for rule, result in results.items():
        print(f"held_{rule}={','.join(str(c['local_critical']['held']) for c in result['checkpoints'])}")
    print(f"better_rule={better_rule(results)}")


if __name__ == "__main__":
    main()
