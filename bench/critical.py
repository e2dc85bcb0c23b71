"""Critical batch: `lbt probe` against the full sweep it replaces, on six workloads.

For each workload:
  (a) the sweep: `lbt train -m` at every power-of-two world size 1..128 (per-worker batch 64, so global
      batch 64..8,192; 64x for the language models, whose budgets are shorter) x seeds 0,1, full-length
      runs, and its measured answer: the largest global batch whose mean final val metric over the seeds,
      and every smaller batch's, stays within the tolerance (1 accuracy point, or 0.05 nats) of the base
      batch's; a diverged or failed run counts as failing;
  (b) the evidence probe: `lbt probe` with more snapshots, longer branches and more seeds than lbt's
      defaults (EVIDENCE_PROBE), every factor at every snapshot (probe.prune=false);
  (c) diagnostics on the sweep: the steps-to-target fit S = S_min (1 + B_noise / B) and B_simple (cnn1d);
  (d) with --schedule, the probe's batch schedule trained from scratch against the probe's own base run.

Each workload's sweep (final val metric and curve per batch x seed) and probe (every branch's end and
curve) are written to bench/results/critical/<workload>/ (kilobytes), and `--rescore` scores the probe
from them alone, training nothing: any cheaper probe read out of the evidence (fewer snapshots, branches
cut at an earlier evaluation, with or without cooldowns, either samples-ratio estimator), the one chosen on
all workloads (the smallest worst factor within 10% of the sweep's compute), each workload scored again by
the variant chosen without it (leave one out), and the confirm step run on the sweep's own runs (the runs
it would train: the same commands; lbt runs are deterministic).

    python bench/critical.py                       # all six workloads (sweeps about 75 min on 2 cores)
    python bench/critical.py --sweeps-only         # the sweeps and their evidence
    python bench/critical.py --rescore             # the table from bench/results/critical/, in seconds

Runs land in --out (git-ignored runs/) and are read back when there: a sweep whose folder holds every
result.json is not run again, a probe continues itself (same probe.dir). Last line: `probe_worst_factor=F
probe_compute_share=C interval_holds=H/N confirm_exact=E/N confirm_share=S`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from lbt.apps.compose import compose
from lbt.engine import make_spec
from lbt.engine.build import build_data
from lbt.metrics import branches as rules
from lbt.metrics.confirm import confirm_step
from lbt.metrics.critical import crossing_step, fit_steps_to_target, gns_summary
from lbt.spec.objective import LOSS, Metric, metric_named
from lbt.spec.result import RunResult, read_result

REPO = Path(__file__).resolve().parent.parent
QUIET = ["trainer.progress=false", "trainer.threads=1", "trainer.device=cpu"]
PARALLEL = ["hydra/launcher=local_parallel"]  # two jobs side by side, one thread each
PER_WORKER_BATCH = 64  # lbt's default: world size W trains at global batch 64 W
MAX_FACTOR = 128
SEEDS = (0, 1)
TEXT_BYTES = 1_200_000  # the character LM's corpus: at least this much of the stdlib's source
GNS_WINDOW = 0.2  # B_simple: the last 20% of training, as `lbt report` summarises it
# The committed evidence (kilobytes): each workload's sweep and each probe's branch summaries, which
# `--rescore` reads to score a prediction rule without training.
EVIDENCE = REPO / "bench" / "results" / "critical"
# What the evidence probe measures; --rescore reads any subset of it (fewer snapshots, shorter branches as
# their first evaluations, without cooldowns): 4 snapshots log-uniform from 10% to 50% of the budget, held-LR
# branches of 5% with 8 evaluations each, 2 seeds at k=1, a cooldown of 20% of each snapshot's samples.
EVIDENCE_PROBE = ["probe.checkpoints=4", "probe.first=0.1", "probe.last=0.5", "probe.delta=0.05",
                  "probe.cooldown=0.2", "probe.seeds=2", "probe.evals=8", "probe.prune=false"]


def stdlib_text(out: Path) -> Path:
    """>= 1.2 MB of text: the Python installation's own top-level stdlib .py files, sorted by name and
    concatenated until the size is reached (the same file every time on one Python version)."""
    path = out / "stdlib.txt"
    if not path.exists():
        chunks, size = [], 0
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            chunks.append(source.read_text(encoding="utf-8", errors="replace"))
            size += len(chunks[-1])
            if size >= TEXT_BYTES:
                break
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(chunks), encoding="utf-8")
    return path


def byte_tokens(out: Path) -> Path:
    """A byte-level corpus (`lbt tokens`) of other stdlib text than the character LM's: the top-level .py files
    after the ones stdlib_text took, until 1.2 MB."""
    folder = out / "bytes"
    if not (folder / "meta.json").exists():
        taken = stdlib_text(out).stat().st_size
        chunks, size, skipped = [], 0, 0
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            text = source.read_text(encoding="utf-8", errors="replace")
            if skipped < taken:
                skipped += len(text)
                continue
            chunks.append(text)
            size += len(text)
            if size >= TEXT_BYTES:
                break
        text_file = out / "bytes.txt"
        text_file.write_text("".join(chunks), encoding="utf-8")
        if lbt(["tokens", str(text_file), str(folder)], out / "tokens.log"):
            raise SystemExit(f"lbt tokens failed; see {out / 'tokens.log'}")
    return folder


def workloads(out: Path) -> dict[str, tuple[list[str], str, list[str]]]:
    """name -> (overrides for every run, probe metric, extra overrides for the sweep runs only)."""
    return {
        "mlp": (["model=mlp", "recipe=goyal2017"], "acc", []),
        "cnn1d": (["recipe=goyal2017"], "acc", ["measure=[gns]"]),
        # 4 epochs of 15,744 windows, and 64x (4,096) at most: lbt probe's branches (10% of the budget) must
        # hold one step of the largest batch, so 128x (8,192) needs 6 epochs, whose sweep would take ~40 min
        # on 2 shared cores; the sweep stops at 64x too (the same probe.max_factor).
        "char_lm": (["data=text", f"data.path={stdlib_text(out)}", "recipe=adamw_sqrt", "trainer.epochs=4"],
                    "loss", []),
        # 5 epochs, not the default 10: its 5-epoch sweep took 19 min on 2 shared cores, 10 would take ~35.
        "transformer1d": (["model=transformer1d", "recipe=adamw_sqrt", "trainer.epochs=5"], "acc", []),
        # A matrix optimizer, whose batch rule is unsettled (bench/probe_rules.py).
        "transformer1d_muon": (["model=transformer1d", "recipe=muon", "trainer.epochs=5"], "acc", []),
        # A GPT on byte tokens, judged by val loss; 4 epochs and 64x at most, as the character LM.
        "gpt_bytes": (["data=tokens", f"data.path={byte_tokens(out)}", "data.context=64", "model.n_layer=2",
                       "model.n_embd=64", "recipe=adamw_sqrt", "trainer.epochs=4"], "loss", []),
    }


WORKLOADS = ("mlp", "cnn1d", "char_lm", "transformer1d", "transformer1d_muon", "gpt_bytes")
# Workloads whose sweep and probe stop below MAX_FACTOR for their budget (see workloads()).
FACTOR_CAP = {"char_lm": 64, "gpt_bytes": 64}


def largest_factor(name: str, overrides: list[str]) -> int:
    """128 (or the workload's cap), or the largest power of two whose global batch fits in the training set."""
    composed = compose(overrides)
    train = len(build_data(make_spec(composed.config, composed.recipe, overrides).data).train)
    factor = FACTOR_CAP.get(name, MAX_FACTOR)
    while factor * PER_WORKER_BATCH > train:
        factor //= 2
    return factor


def lbt(args: list[str], log: Path) -> int:
    with log.open("a") as f:
        f.write(f"\n$ lbt {' '.join(args)}\n")
        f.flush()
        done = subprocess.run([sys.executable, "-m", "lbt", *args], cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
    return done.returncode


class Timing:
    """Wall seconds of each phase, kept in the workload's folder so a cached phase still reports its time."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds = json.loads(path.read_text()) if path.exists() else {}

    def record(self, phase: str, seconds: float) -> None:
        self.seconds[phase] = round(seconds)
        self.path.write_text(json.dumps(self.seconds, indent=1))


def logged_seconds(folder: Path, log: Path) -> float | None:
    """A sweep's wall time when no timing.json kept it: from its log's first Hydra line to its last result."""
    try:
        first = log.read_text().split("[HYDRA]", 1)[0].rsplit("[", 1)[1].rstrip("] \n")
        start = dt.datetime.strptime(first.split(",")[0], "%Y-%m-%d %H:%M:%S").timestamp()
        return max(p.stat().st_mtime for p in folder.glob("*/result.json")) - start
    except (OSError, IndexError, ValueError):
        return None


def sweep(folder: Path, overrides: list[str], factor: int, timing: Timing) -> list[RunResult]:
    sizes = [2**i for i in range(int(math.log2(factor)) + 1)]
    jobs = len(sizes) * len(SEEDS)
    if len(list(folder.glob("*/result.json"))) < jobs:
        shutil.rmtree(folder, ignore_errors=True)
        started = time.perf_counter()
        code = lbt(["train", "-m", *overrides, *QUIET, *PARALLEL, f"dist.world_size={','.join(map(str, sizes))}",
                    f"trainer.seed={','.join(map(str, SEEDS))}", f"hydra.sweep.dir={folder}"],
                   folder.parent / "sweep.log")
        if len(list(folder.glob("*/result.json"))) < jobs:  # a failed job writes a result.json saying why
            raise SystemExit(f"the sweep in {folder} left runs without a result (exit {code}); see its sweep.log")
        timing.record("sweep", time.perf_counter() - started)
    elif "sweep" not in timing.seconds and (seconds := logged_seconds(folder, folder.parent / "sweep.log")):
        timing.record("sweep", seconds)
    return [read_result(p.parent) for p in sorted(folder.glob("*/result.json"))]


def run_record(result: RunResult) -> dict:
    """One run of a sweep or a probe, as the evidence keeps it: what it was, how it ended, its val curve."""
    return {"world_size": result.world_size, "global_batch": result.global_batch, "seed": result.seed,
            "trained": result.trained, "diverged": result.diverged, "error": result.error, "steps": result.steps,
            "samples": result.samples_seen, "final_val_acc": result.final_acc, "final_val_loss": result.final_loss,
            "history": [[p.samples_seen, round(p.acc, 6), round(p.loss, 6)] for p in result.history]}


def write_sweep_evidence(name: str, overrides: list[str], metric: str, results: list[RunResult]) -> None:
    folder = EVIDENCE / name
    folder.mkdir(parents=True, exist_ok=True)
    runs = sorted((run_record(r) for r in results), key=lambda r: (r["global_batch"], r["seed"]))
    evidence = {"workload": name, "overrides": [o for o in overrides if not o.startswith("data.path=")],
                "metric": metric, "tolerance": metric_named(metric, "metric").default_tolerance,
                "base_batch": min(r["global_batch"] for r in runs), "runs": runs}
    (folder / "sweep.json").write_text(json.dumps(evidence, indent=None, separators=(",", ":")) + "\n")


def record_value(run: dict, metric: Metric) -> float:
    """A run's final val value; a diverged or failed run's is NaN (it fails any tolerance)."""
    number = run[f"final_val_{metric.name}"]
    return number if run["trained"] and not run["diverged"] and number is not None and math.isfinite(number) \
        else math.nan


def sweep_answer(runs: list[dict], metric: Metric) -> tuple[int, int | None, dict[int, float]]:
    """(largest batch within tolerance of the base batch, the next batch (None: all held), mean by batch):
    the mean over the seeds, and every smaller batch's, within the tolerance; a NaN run fails."""
    by_batch: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        v = record_value(run, metric)
        by_batch[run["global_batch"]].append(v if math.isfinite(v) else metric.worst)
    means = {b: statistics.fmean(v) for b, v in sorted(by_batch.items())}
    base = min(means)
    floor = metric.worse_by(means[base], metric.default_tolerance)
    answer = base
    for batch, mean in means.items():
        if not metric.reached(mean, floor):
            return answer, batch, means
        answer = batch
    return answer, None, means


def steps_fit(results: list[RunResult], metric: Metric, target: float) -> str:
    """B_noise of S = S_min (1 + B_noise / B) on the runs' steps to `target`, or why there is none."""
    points = [(r.global_batch, crossing_step(r.history, target, metric=metric)) for r in results if r.trained]
    points = [(b, s) for b, s in points if s]
    try:
        fit = fit_steps_to_target([b for b, _ in points], [s for _, s in points])
    except ValueError as error:
        return f"no fit ({error})"
    return f"{fit.b_crit:,.0f} (rms {fit.rel_rms:.0%})"


def b_simple(results: list[RunResult]) -> str:
    late = [gns_summary([(s, b) for s, b in r.technique_curves.get("gns/b_simple", [])], GNS_WINDOW)
            for r in results if r.trained and r.world_size >= 2]
    late = [b for b in late if b is not None]
    return f"{statistics.median(late):,.0f}" if late else "not measured"


def probe(folder: Path, overrides: list[str], metric: str, factor: int, timing: Timing) -> dict:
    """The evidence probe (EVIDENCE_PROBE: more snapshots, longer branches and more seeds than lbt's defaults,
    which --rescore reads in subsets)."""
    fresh = not (folder / "probe.json").exists()
    if not fresh and "probe" not in timing.seconds:  # run before by another invocation: its own wall time
        cost = json.loads((folder / "probe.json").read_text())["cost"]
        timing.record("probe", cost.get("command_seconds", cost.get("wall_seconds", 0)))
    started = time.perf_counter()
    code = lbt(["probe", *overrides, *QUIET, *PARALLEL, f"probe.metric={metric}", *EVIDENCE_PROBE,
                *([f"probe.max_factor={factor}"] if factor != MAX_FACTOR else []), f"probe.dir={folder}"],
               folder.parent / "probe.log")
    if code or not (folder / "probe.json").exists():
        raise SystemExit(f"lbt probe failed (exit {code}); see {folder.parent / 'probe.log'}")
    if fresh:
        timing.record("probe", time.perf_counter() - started)
    return json.loads((folder / "probe.json").read_text())


def schedule_check(run_dir: Path, overrides: list[str], probe_dir: Path, probe_json: dict, timing: Timing) -> dict:
    """The probe's batch schedule from scratch vs the probe's base run (same overrides, same seed)."""
    schedule = probe_json["batch_schedule"]
    trained = run_dir / "schedule.json"  # the schedule the run in run_dir was trained with
    if not (run_dir / "result.json").exists() or not trained.exists() or json.loads(trained.read_text()) != schedule:
        shutil.rmtree(run_dir, ignore_errors=True)
        started = time.perf_counter()
        code = lbt(["train", *overrides, *QUIET, "+technique=batch_ramp", "technique.batch_ramp.mode=probe",
                    f"technique.batch_ramp.probe={probe_dir / 'probe.json'}", "technique.batch_ramp.grow=world_size",
                    f"hydra.run.dir={run_dir}"], run_dir.parent / "schedule.log")
        if code or not (run_dir / "result.json").exists():
            raise SystemExit(f"the batch-schedule run failed (exit {code}); see {run_dir.parent / 'schedule.log'}")
        trained.write_text(json.dumps(schedule))
        timing.record("schedule", time.perf_counter() - started)
    base, ramp = read_result(Path(probe_json["base"]["dir"])), read_result(run_dir)

    def steps_to(loss: float) -> tuple[float | None, float | None, float | None]:
        base_steps = crossing_step(base.history, loss, metric=LOSS)
        ramp_steps = crossing_step(ramp.history, loss, metric=LOSS) if ramp.trained else None
        saving = 1 - ramp_steps / base_steps if base_steps and ramp_steps is not None else None
        return base_steps, ramp_steps, saving

    exact, target = base.final_loss, LOSS.worse_by(base.final_loss, LOSS.target_margin)
    return {"base_final_loss": exact, "target_loss": target,
            "to_final": steps_to(exact), "to_target": steps_to(target),
            "base_total_steps": base.steps, "schedule_total_steps": ramp.steps,
            "acc_diff_points": (ramp.final_acc - base.final_acc) * 100, "loss_diff": ramp.final_loss - base.final_loss,
            "batches_by_epoch": next((t for t in ramp.techniques if "batch schedule" in t), "")}


# --- scoring a probe rule on the evidence, without training -----------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A probe cheaper than the evidence probe, read from it: some of its snapshots, its branches cut at
    their first `evals` evaluations (of 8), with or without the cooldowns."""

    checkpoints: tuple[int, ...]
    evals: int
    cooldown: bool
    estimator: str = "progress"

    def name(self) -> str:
        at = ",".join(f"{SNAPSHOTS[i]:.2f}" for i in self.checkpoints)
        return (f"snapshots {at}, branches {self.evals}/8 of 5%, {'cooldowns' if self.cooldown else 'no cooldowns'}, "
                f"{self.estimator}")


# The constant a probe rule is chosen by: which snapshots. Its branches are the evidence's whole ones, so the
# probe lbt ships is exactly the one scored; the cooldowns and the progress estimator are the design
# (docs/probe.md), and --rescore also scores the chosen rule without them.
SUBSETS = [tuple(c) for n in (1, 2, 3, 4) for c in itertools.combinations(range(4), n)]
VARIANTS = [Variant(c, 8, True) for c in SUBSETS]
# Shorter branches, read as the first 2 or 4 of the 8 evaluations: the answer-vs-cost curve. Approximate: a
# branch cut so re-warmed its LR over more of itself (20% of the whole one) than a short branch would.
SHORTER = [Variant(c, e, True) for c in SUBSETS for e in (2, 4)]
SHARE_TARGET = 0.10


SNAPSHOTS = tuple(0.1 * 5 ** (i / 3) for i in range(4))  # where EVIDENCE_PROBE asks for snapshots: 0.1 .. 0.5


def nearest(checkpoints: list[dict], wanted: tuple[int, ...]) -> list[dict]:
    """The workload's snapshots nearest to SNAPSHOTS[i] for each wanted i, once each: a short epoch moves
    snapshots to the step boundaries of the largest batch, and two may fall on one."""
    picked = {min(range(len(checkpoints)), key=lambda j: abs(checkpoints[j]["fraction"] - SNAPSHOTS[i]))
              for i in wanted}
    return [checkpoints[j] for j in sorted(picked)]


def score(probe_json: dict, runs: list[dict], variant: Variant) -> dict:
    """The variant's prediction, interval and compute for one workload, and the confirm step run on the
    sweep's own runs (the runs it would train: the same commands, and lbt runs are deterministic)."""
    settings, base = probe_json["settings"], probe_json["base"]
    metric, tolerance = metric_named(settings["metric"], "metric"), settings["tolerance"]
    budget, b0 = base["budget_samples"], base["global_batch"]
    factors = [2**i for i in range(int(math.log2(settings["max_factor"])) + 1)]
    chosen = nearest(probe_json["checkpoints"], variant.checkpoints)
    final = [float(budget), base[f"final_{metric.name}"]]
    index = 1 if metric.name == "acc" else 2
    if variant.cooldown:
        ends = {c["samples"] for c in chosen}
        points = [[c["at"] + c["samples"], c["value"]] for c in probe_json["cooldowns"] if c["at"] in ends
                  and c["value"] is not None] + [final]
    else:
        points = [[h[0], h[index]] for h in base["history"] if h[0] < budget] + [final]
    per_checkpoint, cost = [], float(budget)
    for c in chosen:
        mine = [b for b in c["branches"] if b["seed"] == c["base_seed"]]
        # A branch cut at its j-th of 8 evaluations: its points up to j/8 of its samples (an epoch's end adds one);
        # cut before its divergence it had not diverged, and one that diverged before the cut had.
        delta_b = max(b["samples"] for b in mine if b["factor"] == 1)
        cut = delta_b * variant.evals / 8 + 0.5 * b0 * factors[-1]
        curves = {b["factor"]: [(s, math.inf if v is None else v) for s, v in b["curve"] if s <= cut] for b in mine}
        diverged = [b["factor"] for b in mine if b["diverged"] and (variant.evals == 8 or b["samples"] <= cut)]
        per_checkpoint.append(rules.checkpoint_ratios(c["start"]["loss"], curves, diverged, b0, factors,
                                                      variant.estimator))
    found = rules.predict([c["samples"] for c in chosen], per_checkpoint, points, budget, tolerance, metric)
    delta = max(b["samples"] for c in chosen for b in c["branches"] if b["factor"] == 1) * variant.evals / 8
    for alone in found.alone:  # a checkpoint closes at the first factor it predicts to fail
        cost += delta * len([k for k in factors if k <= min(2 * alone, factors[-1])])
    if variant.cooldown:
        cost += sum(c["samples"] for c in probe_json["cooldowns"] if c["at"] in {p["samples"] for p in chosen})
    sweep_samples = probe_json["cost"]["sweep_samples"]
    values = {(r["global_batch"] // b0, r["seed"]): record_value(r, metric) for r in runs}
    trained: dict[tuple[int, int], dict] = {(r["global_batch"] // b0, r["seed"]): r for r in runs}
    known = {(1, 0): values[(1, 0)]}
    while (step := confirm_step(found.factor, factors, known, tolerance, metric)).answer is None:
        known.update({run: values[run] for run in step.runs})
    confirm_samples = sum(trained[run]["samples"] for run in known if run != (1, 0))
    low, high = rules.interval(found.factor, factors[-1])
    return {"predicted": found.factor * b0, "low": low * b0, "high": high * b0, "share": cost / sweep_samples,
            "confirmed": step.answer * b0, "confirm_runs": len(known) - 1,
            "confirm_share": (cost + confirm_samples) / sweep_samples}


def evidence(names: list[str]) -> dict[str, tuple[dict, dict]]:
    found = {}
    for name in names:
        sweep_file, probe_file = EVIDENCE / name / "sweep.json", EVIDENCE / name / "probe.json"
        if sweep_file.exists() and probe_file.exists():
            found[name] = (json.loads(sweep_file.read_text()), json.loads(probe_file.read_text()))
    return found


def factors_off(rows: dict[str, dict], swept: dict[str, int]) -> list[float]:
    return [max(r["predicted"] / swept[n], swept[n] / r["predicted"]) for n, r in rows.items()]


def worst(rows: dict[str, dict], swept: dict[str, int]) -> float:
    return max(factors_off(rows, swept))


def choose(found: dict[str, tuple[dict, dict]], swept: dict[str, int], names: list[str]) -> Variant:
    """The variant with the smallest worst factor over `names` among those within SHARE_TARGET there, then
    the smallest mean factor (in doublings), then the cheapest; every variant when none is within."""
    scored = []
    for variant in VARIANTS:
        rows = {n: score(found[n][1], found[n][0]["runs"], variant) for n in names}
        share = max(r["share"] for r in rows.values())
        off = factors_off(rows, swept)
        scored.append((share > SHARE_TARGET, max(off), statistics.fmean(math.log2(f) for f in off), share,
                       variant.checkpoints, variant.evals, variant))
    return min(scored, key=lambda t: t[:6])[-1]


def cost_curve(found: dict[str, tuple[dict, dict]], swept: dict[str, int]) -> list[str]:
    """For each branch length (whole, and the approximate shorter ones), the best worst factor reached within
    each share of the sweep's compute."""
    lines = []
    for evals in (8, 4, 2):
        points = []
        for subset in SUBSETS:
            rows = {n: score(p, s["runs"], Variant(subset, evals, True)) for n, (s, p) in found.items()}
            points.append((max(r["share"] for r in rows.values()), worst(rows, swept), Variant(subset, evals, True)))
        frontier, best = [], math.inf
        for share, factor, variant in sorted(points, key=lambda t: (t[0], t[1])):
            if factor < best:
                best = factor
                frontier.append(f"{share:.1%}: x{factor:.2f} ({variant.name()})")
        lines.append(f"- branches {evals}/8 of the evidence's{'' if evals == 8 else ' (approximate)'}: "
                     + "; ".join(frontier))
    return lines


def rescore(names: list[str]) -> list[str]:
    """Every workload's sweep answer and the probe's, from bench/results/critical/ alone; the variant is the
    one chosen on all workloads, and each workload is also scored by the variant chosen without it."""
    found = evidence(names)
    if not found:
        raise SystemExit(f"no evidence in {EVIDENCE} for {', '.join(names)}; run the benchmark first")
    swept = {n: sweep_answer(sweep["runs"], metric_named(sweep["metric"], "metric"))[0] for n, (sweep, _) in
             found.items()}
    everywhere = choose(found, swept, list(found))
    lines = [f"rule: {everywhere.name()} (chosen on all {len(found)} workloads)", "",
             "| workload | sweep answer | probe answer | factor | interval | probe share | left out: variant | "
             "left out: answer (factor) | confirmed | confirm runs | probe + confirm share |",
             "|---|---:|---:|---:|---|---:|---|---:|---:|---:|---:|"]
    rows, left = {}, {}
    for name, (sweep, probe_json) in found.items():
        rows[name] = score(probe_json, sweep["runs"], everywhere)
        without = choose(found, swept, [n for n in found if n != name]) if len(found) > 1 else everywhere
        left[name] = score(probe_json, sweep["runs"], without)
        r, lo = rows[name], left[name]
        factor = max(r["predicted"] / swept[name], swept[name] / r["predicted"])
        lo_factor = max(lo["predicted"] / swept[name], swept[name] / lo["predicted"])
        lines.append(f"| {name} | {swept[name]:,} | {r['predicted']:,} | {factor:.2f} | {r['low']:,}..{r['high']:,} | "
                     f"{r['share']:.1%} | {without.name()} | {lo['predicted']:,} ({lo_factor:.2f}) | "
                     f"{r['confirmed']:,} | {r['confirm_runs']} | {r['confirm_share']:.1%} |")
    for label, variant in (("without cooldowns (F from the base run's own curve)", replace(everywhere, cooldown=False)),
                           ("with the first-crossing estimator", replace(everywhere, estimator="crossing"))):
        other = {n: score(p, s["runs"], variant) for n, (s, p) in found.items()}
        lines += ["", f"the same rule {label}: " + ", ".join(f"{n} {r['predicted']:,}" for n, r in other.items())
                  + f"; worst factor {worst(other, swept):.2f}"]
    lines += ["", "answer vs cost, every snapshot subset (worst factor over the workloads, largest share):",
              *cost_curve(found, swept)]
    holds = sum(r["low"] <= swept[n] <= r["high"] and r["high"] <= 4 * r["low"] for n, r in rows.items())
    exact = sum(r["confirmed"] == swept[n] for n, r in rows.items())
    lines += ["", f"left-one-out worst factor: {worst(left, swept):.2f}",
              f"probe_worst_factor={worst(rows, swept):.2f} "
              f"probe_compute_share={max(r['share'] for r in rows.values()):.3f} "
              f"interval_holds={holds}/{len(rows)} confirm_exact={exact}/{len(rows)} "
              f"confirm_share={max(r['confirm_share'] for r in rows.values()):.3f}"]
    return lines


def write_probe_evidence(name: str, probe_json: dict) -> None:
    """probe.json as committed evidence: without the machine's paths."""
    kept = {**probe_json, "base": {k: v for k, v in probe_json["base"].items() if k != "dir"}}
    (EVIDENCE / name / "probe.json").write_text(json.dumps(kept, separators=(",", ":")) + "\n")


def one(name: str, overrides: list[str], metric_name: str, sweep_only: list[str], out: Path,
        schedule: bool) -> dict:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    timing = Timing(folder / "timing.json")
    metric = metric_named(metric_name, "metric")
    factor = largest_factor(name, overrides)
    results = sweep(folder / "sweep", [*overrides, *sweep_only], factor, timing)
    write_sweep_evidence(name, overrides, metric_name, results)
    runs = [run_record(r) for r in results]
    swept, next_batch, means = sweep_answer(runs, metric)
    base_mean = means[min(means)]
    found = probe(folder / "probe", overrides, metric_name, factor, timing)
    write_probe_evidence(name, found)
    row = {"workload": name, "overrides": overrides, "metric": metric_name, "max_factor": factor, "swept": swept,
           "swept_next": next_batch, "fit": steps_fit(results, metric, metric.worse_by(base_mean,
                                                                                       metric.default_tolerance)),
           "b_simple": b_simple(results), "means": {str(b): v for b, v in means.items()}}
    if schedule:
        row["schedule"] = schedule_check(folder / "schedule", overrides, folder / "probe", found, timing)
    row["seconds"] = timing.seconds
    (folder / "row.json").write_text(json.dumps(row, indent=1))
    return row


def pct(saving: float | None) -> str:
    return "never" if saving is None else f"{saving:.0%}"


def steps(pair: tuple) -> str:
    base_steps, ramp_steps, saving = pair
    shown = ["never" if s is None else f"{s:,.0f}" for s in (base_steps, ramp_steps)]
    return f"{shown[1]} vs {shown[0]} ({pct(saving)})"


def line(row: dict) -> str:
    m = metric_named(row["metric"], "metric")
    means = " ".join(f"{int(b):,}:{m.show(v)}" for b, v in row["means"].items())
    t, said = row["seconds"], ""
    if "schedule" in row:
        s = row["schedule"]
        said = (f"; schedule steps to the base's final val loss {steps(s['to_final'])}, to +0.05 nats "
                f"{steps(s['to_target'])}, val acc {s['acc_diff_points']:+.2f} points")
    return (f"{row['workload']}: sweep {row['swept']:,} (next {row['swept_next'] or '-'}); fit {row['fit']}; "
            f"B_simple {row['b_simple']}{said}; sweep means {means}; wall: sweep {t.get('sweep', '?')} s, "
            f"probe {t.get('probe', '?')} s, schedule {t.get('schedule', '-')} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of: {', '.join(WORKLOADS)}")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench" / "critical")
    parser.add_argument("--sweeps-only", action="store_true", help="run (or read) the sweeps, write their evidence")
    parser.add_argument("--schedule", action="store_true", help="also train the probe's batch schedule")
    parser.add_argument("--rescore", action="store_true",
                        help="score the probe from bench/results/critical/ alone, training nothing")
    args = parser.parse_args()
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(WORKLOADS)}")
    if args.rescore:
        print("\n".join(rescore(names)))
        return
    out = args.out.resolve()
    known = workloads(out)
    started = time.perf_counter()
    for name in names:
        overrides, metric, sweep_only = known[name]
        if args.sweeps_only:
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            results = sweep(folder / "sweep", [*overrides, *sweep_only], largest_factor(name, overrides),
                            Timing(folder / "timing.json"))
            write_sweep_evidence(name, overrides, metric, results)
            answer = sweep_answer([run_record(r) for r in results], metric_named(metric, "metric"))[0]
            print(f"{name}: sweep answer {answer:,}", flush=True)
            continue
        print(line(one(name, overrides, metric, sweep_only, out, args.schedule)), flush=True)
    print(f"total wall time {time.perf_counter() - started:.0f} s (cached phases take none)")
    if not args.sweeps_only:
        print("\n".join(rescore(names)))


if __name__ == "__main__":
    main()
