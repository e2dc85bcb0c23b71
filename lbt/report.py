"""`lbt report DIR`: a study (Hydra multirun folder) -> table, curves, TensorBoard summary.

Reads every job's result.json under DIR and writes into DIR:
report.md, accuracy_vs_batch.png, steps_to_target.png, summary.json and
tb_summary/ (scalars whose step axis is the global batch, plus an HParams table).
Jobs that share recipe and global batch (several seeds) are averaged, with
their standard deviation.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path

SUMMARY_DIR = "tb_summary"


@dataclass
class Row:
    """One (recipe, global batch) point of a study, averaged over seeds."""

    recipe: str
    global_batch: int
    world_size: int
    seeds: int
    final_acc: float
    final_acc_std: float
    best_acc: float
    test_acc: float | None
    gap: float | None  # final_acc minus the smallest-batch baseline's, in points
    steps: float
    steps_to_target: float | None
    steps_to_target_std: float | None
    samples_per_sec: float
    diverged: int
    errors: int
    b_simple: float | None
    jobs: list[str] = field(default_factory=list)


def load_jobs(study_dir: Path) -> list[dict]:
    jobs = []
    for path in sorted(study_dir.rglob("result.json")):
        if SUMMARY_DIR in path.parts:
            continue
        job = json.loads(path.read_text())
        job["job_dir"] = str(path.parent.relative_to(study_dir))
        jobs.append(job)
    # Only overrides that differ between jobs make a variant; ones shared by all are the study's setting.
    shared = set.intersection(*(set(j.get("overrides", [])) for j in jobs)) if jobs else set()
    for job in jobs:
        job["swept"] = [o for o in job.get("overrides", []) if o not in shared]
        job["series"] = series_name(job)
    return jobs


def steps_to_target(val_history: list[dict], target: float) -> int | None:
    """First optimizer step whose evaluation reached `target` accuracy (Shallue et al. 2018)."""
    for point in val_history:
        if point["val_acc"] >= target:
            return int(point["step"])
    return None


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


# Overrides that place a job on the curve (batch) or average it (seed), not a variant of the recipe.
_AXIS_KEYS = ("recipe", "study", "trainer.seed", "dist.world_size", "dist.procs", "trainer.per_worker_batch",
              "trainer.global_batch", "hydra.", "trainer.progress")


def series_name(job: dict) -> str:
    """The recipe, plus any other swept setting (`lars (optim.lr=20)`): one curve each."""
    extra = [o for o in job.get("overrides", []) if o.split("=", 1)[0].lstrip("+~") not in _AXIS_KEYS
             and not o.startswith("hydra.")]
    swept = [o for o in extra if o in job.get("swept", extra)]
    recipe = job.get("recipe", "?")
    return f"{recipe} ({', '.join(swept)})" if swept else recipe


def aggregate(jobs: list[dict], target: float) -> list[Row]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for job in jobs:
        key = (job["series"], int(job.get("global_batch") or 0))
        groups.setdefault(key, []).append(job)
    rows = []
    for (recipe, batch), members in sorted(groups.items()):
        ok = [j for j in members if "error" not in j]
        trained = [j for j in ok if not j.get("diverged")]
        final, final_std = _mean_std([j["final_val_acc"] for j in trained])
        best, _ = _mean_std([j["best_val_acc"] for j in trained])
        tests = [j["test_acc"] for j in trained if j.get("test_acc") is not None]
        reached = [steps_to_target(j.get("val_history", []), target) for j in trained]
        reached = [r for r in reached if r is not None]
        stt, stt_std = _mean_std(reached) if reached and len(reached) == len(trained) else (None, None)
        b_simple = [j.get("technique_metrics", {}).get("gns/b_simple") for j in ok]
        b_simple = [b for b in b_simple if b is not None and math.isfinite(b)]
        rows.append(Row(
            recipe=recipe, global_batch=batch, world_size=int(members[0].get("world_size") or 0),
            seeds=len(members), final_acc=final, final_acc_std=final_std, best_acc=best,
            test_acc=statistics.fmean(tests) if tests else None, gap=None,
            steps=_mean_std([j["steps"] for j in ok])[0] if ok else float("nan"),
            steps_to_target=stt, steps_to_target_std=stt_std,
            samples_per_sec=_mean_std([j["samples_per_sec"] for j in ok])[0] if ok else float("nan"),
            diverged=sum(bool(j.get("diverged")) for j in ok), errors=len(members) - len(ok),
            b_simple=statistics.median(b_simple) if b_simple else None,
            jobs=[j["job_dir"] for j in members],
        ))
    reference = _reference(rows)
    for row in rows:
        if reference is not None and math.isfinite(row.final_acc):
            row.gap = 100 * (row.final_acc - reference)
    return rows


def _reference(rows: list[Row]) -> float | None:
    """Accuracy of the baseline at the smallest global batch (any recipe there if no baseline)."""
    candidates = [r for r in rows if math.isfinite(r.final_acc)]
    if not candidates:
        return None
    smallest = min(r.global_batch for r in candidates)
    at_smallest = [r for r in candidates if r.global_batch == smallest]
    baseline = [r for r in at_smallest if r.recipe.split(" (")[0] == "baseline"]
    return (baseline or at_smallest)[0].final_acc


def critical_batch(rows: list[Row]) -> float | None:
    """Median gradient-noise-scale B_simple over the study (the baseline's jobs if it has any)."""
    values = [r.b_simple for r in rows if r.b_simple is not None and r.recipe.split(" (")[0] == "baseline"]
    values = values or [r.b_simple for r in rows if r.b_simple is not None]
    return statistics.median(values) if values else None


def _fmt(value, spec: str = ".4f", std=None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    text = format(value, spec)
    return text + (f" ± {format(std, spec)}" if std else "")


def markdown(rows: list[Row], target: float, b_crit: float | None, jobs: list[dict]) -> str:
    lines = ["# lbt study report", ""]
    lines.append(f"Steps to target: first evaluated step with val accuracy >= {target:g}. "
                 "Gap: final val accuracy minus the baseline's at the smallest global batch, in points.")
    if b_crit is not None:
        lines.append(f"Critical batch estimate (gradient noise scale B_simple, median): **{b_crit:,.0f}**")
    for recipe in sorted({r.recipe for r in rows}):
        lines += ["", f"## {recipe}", "",
                  "| global batch | world size | seeds | final val acc | best val acc | test acc | gap (pts) | steps | "
                  "steps to target | samples/s | diverged |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in sorted((r for r in rows if r.recipe == recipe), key=lambda r: r.global_batch):
            status = ", ".join(
                [f"diverged {r.diverged}/{r.seeds}"] * bool(r.diverged) + [f"error {r.errors}/{r.seeds}"] * bool(r.errors)
            ) or "no"
            lines.append(
                f"| {r.global_batch:,} | {r.world_size} | {r.seeds} | {_fmt(r.final_acc, '.4f', r.final_acc_std)} | "
                f"{_fmt(r.best_acc)} | {_fmt(r.test_acc)} | {_fmt(r.gap, '+.2f')} | {_fmt(r.steps, '.0f')} | "
                f"{_fmt(r.steps_to_target, '.0f', r.steps_to_target_std)} | {_fmt(r.samples_per_sec, ',.0f')} | {status} |"
            )
    failed = [j for j in jobs if "error" in j]
    if failed:
        lines += ["", "## Failed jobs", ""]
        lines += [f"- `{j['job_dir']}` ({j['series']}): {j['error']}" for j in failed]
    return "\n".join(lines) + "\n"


def _batch_axis(ax) -> None:
    """Log2 axis of global batches, labelled with the batches themselves."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlabel("global batch")


def plot_accuracy(rows: list[Row], b_crit: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for recipe in sorted({r.recipe for r in rows}):
        points = sorted((r for r in rows if r.recipe == recipe), key=lambda r: r.global_batch)
        good = [r for r in points if math.isfinite(r.final_acc)]
        line = ax.errorbar([r.global_batch for r in good], [100 * r.final_acc for r in good],
                           yerr=[100 * r.final_acc_std for r in good], marker="o", capsize=3, label=recipe)
        bad = [r for r in points if r.diverged or r.errors]
        if bad:
            floor = min([100 * r.final_acc for r in good], default=10.0)
            ax.scatter([r.global_batch for r in bad], [floor] * len(bad), marker="x", s=80,
                       color=line[0].get_color(), label=f"{recipe}: diverged/failed")
    if b_crit is not None:
        ax.axvline(b_crit, color="gray", linestyle="--", label=f"critical batch ≈ {b_crit:,.0f} (GNS)")
    _batch_axis(ax)
    ax.set_ylabel("final val accuracy (%)")
    ax.set_title("Accuracy vs global batch (same epoch budget)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_steps(rows: list[Row], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for recipe in sorted({r.recipe for r in rows}):
        points = sorted((r for r in rows if r.recipe == recipe and r.steps_to_target), key=lambda r: r.global_batch)
        if points:
            ax.errorbar([r.global_batch for r in points], [r.steps_to_target for r in points],
                        yerr=[r.steps_to_target_std or 0 for r in points], marker="o", capsize=3, label=recipe)
    reached = [r for r in rows if r.steps_to_target]
    if reached:
        first = min(reached, key=lambda r: (r.global_batch, r.steps_to_target))
        batches = sorted({r.global_batch for r in rows})
        ax.plot(batches, [first.steps_to_target * first.global_batch / b for b in batches], "k:",
                label="perfect scaling")
    _batch_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel(f"steps to {100 * target:g}% val accuracy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_tensorboard(rows: list[Row], jobs: list[dict], path: Path) -> None:
    """Scalars with the global batch as step (`study/<recipe>/val_acc`) and an HParams row per job."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(path))
    for row in sorted(rows, key=lambda r: r.global_batch):
        if math.isfinite(row.final_acc):
            writer.add_scalar(f"study/{row.recipe}/val_acc", row.final_acc, row.global_batch)
        if row.steps_to_target:
            writer.add_scalar(f"study/{row.recipe}/steps_to_target", row.steps_to_target, row.global_batch)
    for i, job in enumerate(jobs):
        if "error" in job:
            continue
        hparams = {"recipe": job.get("recipe", "?"), "world_size": job["world_size"],
                   "global_batch": job["global_batch"], "per_worker_batch": job["per_worker_batch"],
                   "seed": job.get("seed", 0), "lr": job.get("base_lr", 0.0)}
        metrics = {"hparam/final_val_acc": job["final_val_acc"], "hparam/best_val_acc": job["best_val_acc"],
                   "hparam/diverged": float(bool(job.get("diverged")))}
        writer.add_hparams(hparams, metrics, run_name=f"job_{job['job_dir'].replace(os.sep, '_') or i}")
    writer.close()


def write_report(study_dir: str | Path, target: float = 0.95) -> dict:
    study_dir = Path(study_dir)
    jobs = load_jobs(study_dir)
    if not jobs:
        from lbt.errors import ConfigError

        raise ConfigError(f"no result.json found under {study_dir}: is it a study (multirun) folder?")
    rows = aggregate(jobs, target)
    b_crit = critical_batch(rows)
    (study_dir / "report.md").write_text(markdown(rows, target, b_crit, jobs))
    plot_accuracy(rows, b_crit, study_dir / "accuracy_vs_batch.png")
    plot_steps(rows, target, study_dir / "steps_to_target.png")
    write_tensorboard(rows, jobs, study_dir / SUMMARY_DIR)
    summary = {
        "target_acc": target,
        "critical_batch": b_crit,
        "rows": [asdict(r) for r in rows],
        "jobs": [{k: j.get(k) for k in ("job_dir", "series", "recipe", "world_size", "global_batch", "per_worker_batch", "seed",
                                       "final_val_acc", "best_val_acc", "test_acc", "steps", "samples_per_sec",
                                       "diverged", "error")} for j in jobs],
    }
    (study_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
