"""`lbt report DIR`: a study (Hydra multirun folder) -> table, curves, TensorBoard summary.

Reads every job's result.json under DIR (jobs.py) and writes into DIR: report.md (markdown.py),
accuracy_vs_batch.png, steps_to_target.png (with the fitted critical-batch curve) and
gns_over_training.png (plots.py), summary.json, and tb_summary/ (tensorboard.py: scalars whose step
axis is the global batch, plus an HParams table). Jobs that share recipe and global batch (several
seeds) are averaged, with their standard deviation (rows.py).

Every number is named after the split it was measured on: `val` is held out of the training set and
is what runs select on (best, steps-to-target); `test` is scored once per run, at the end. A study
whose runs have no validation split evaluated test during training, and its columns say test.

The report judges runs by accuracy (`--metric acc`, the default) or by loss (`--metric loss`, lower is
better; a language model's also reads as bits per char): the target, steps to it (critical.py) and
"how many GPUs" (answer.py) all compare through lbt/spec/objective.py's Metric; accuracy_vs_batch.png
is then loss_vs_batch.png. Past a batch cap, hybrid.py scores data x tensor parallelism.

No answer without the data for it (trust.py): the report names the study's missing and failed jobs, and
states the critical batch and "how many GPUs" only when every job finished, more than one global batch
was measured and the base batch learned; otherwise it says why, and summary.json holds `complete`,
`missing`, `failed`, `answer_withheld` and no figure to read as an answer. It warns above the answer when
the base batch is undertrained.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lbt.apps.report.answer import answer_lines, gpu_answer, time_to_accuracy, withhold
from lbt.apps.report.critical import critical_batch, withhold_figures
from lbt.apps.report.hybrid import hybrid_caps, hybrid_points
from lbt.apps.report.jobs import SUMMARY_DIR, Job, load_jobs
from lbt.apps.report.markdown import markdown
from lbt.apps.report.plots import plot_gns, plot_gpus, plot_metric_vs_batch, plot_steps
from lbt.apps.report.probe import probe_beside, probe_lines
from lbt.apps.report.rows import Row, aggregate, default_target
from lbt.apps.report.tensorboard import write_tensorboard
from lbt.apps.report.trust import judge_study
from lbt.apps.study_folder import expected_jobs
from lbt.errors import ConfigError
from lbt.paths import atomic_write
from lbt.spec.objective import Metric, metric_named

__all__ = ["Job", "Row", "aggregate", "answer_lines", "default_target", "gpu_answer", "load_jobs", "write_report"]


def write_report(study_dir: str | Path, target: float | None = None, tolerance: float | None = None,
                 network: str | None = None, step_ms: float | None = None, metric: str = "acc",
                 hybrid_cap: int | None = None) -> dict[str, Any]:
    """The report of a study folder judged on `metric` (acc or loss): the target, steps to it, and "how many GPUs"
    within `tolerance` (the metric's units; default its own). Writes the report's files; returns summary.json."""
    study_dir, judge = Path(study_dir), metric_named(metric, "--metric")
    jobs = finished_jobs(study_dir)
    target = default_target(jobs, judge) if target is None else target
    tolerance = judge.default_tolerance if tolerance is None else tolerance
    rows = aggregate(jobs, target, judge)
    measured = gpu_answer(rows, tolerance, judge)
    trust = judge_study(study_dir, jobs, rows, measured, judge)
    answer = withhold(measured, trust.reasons) if trust.withheld else measured
    crit = critical_batch(jobs, rows, target, answer, judge)  # the sweep's figure first; fit and gns as diagnostics
    if network is not None and not trust.withheld:
        answer["time_to_accuracy"] = time_to_accuracy(rows, answer, jobs, network, step_ms)
    hybrid = hybrid_points(rows, jobs, hybrid_caps(answer, hybrid_cap), judge)
    beside = None if trust.withheld else probe_beside(study_dir, jobs, answer)
    text = markdown(rows, target, crit, answer, judge, hybrid, hybrid_cap is not None, trust, probe_lines(beside))
    atomic_write(study_dir / "report.md", lambda f: f.write(text.encode()))  # a full disk keeps the old one
    curves = f"{judge.label}_vs_batch.png"
    vertical_lines = plot_metric_vs_batch(rows, crit, study_dir / curves, judge, measured, trust.withheld)
    files = ["report.md", curves, *plot_hybrid(rows, hybrid, study_dir, judge), "steps_to_target.png",
             "gns_over_training.png", "summary.json", SUMMARY_DIR]
    plot_steps(rows, target, crit, study_dir / "steps_to_target.png", judge)
    plot_gns(jobs, crit, study_dir / "gns_over_training.png")
    write_tensorboard(rows, jobs, study_dir / SUMMARY_DIR)
    if trust.withheld:
        crit = withhold_figures(crit, trust.withheld)
    summary = {
        "metric": judge.name,
        f"target_{judge.name}": target,
        "files": files,
        # Whether every job of the study finished, which did not, and why there is no answer (None: there is one).
        "complete": trust.complete,
        "missing": trust.missing,
        "failed": trust.failed,
        "answer_withheld": trust.withheld,
        "warnings": [w.replace("**", "") for w in trust.warnings],
        "gpu_answer": answer, "probe": beside,  # an `lbt probe` of the same workload in the folder, or None
        "hybrid": hybrid,
        "critical_batch": crit,
        "plot_lines": {curves: vertical_lines},  # the x of every vertical line drawn on it
        "rows": [asdict(r) for r in rows],
        "jobs": [job_summary(job) for job in jobs],
    }
    atomic_write(study_dir / "summary.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))
    return summary


def finished_jobs(study_dir: Path) -> list[Job]:
    """The jobs that wrote a result.json; none is a ConfigError saying why."""
    jobs = load_jobs(study_dir)
    if not jobs:
        expected = len(expected_jobs(study_dir))
        raise ConfigError(f"none of the {expected} jobs of the study in {study_dir} has finished yet: no report (run "
                          "the same `lbt study` command to continue it)" if expected else
                          f"no result.json found under {study_dir}: is it a study (multirun) folder?")
    return jobs


def job_summary(job: Job) -> dict[str, Any]:
    """A job's entry in summary.json: its layout and numbers under result.json's own split-named keys."""
    result, split = job.result, job.result.eval_split
    if not job.readable:
        return {"job_dir": job.job_dir, "series": job.series, "error": result.error}
    entry: dict[str, Any] = {
        "job_dir": job.job_dir, "series": job.series, "recipe": result.recipe, "world_size": result.world_size,
        "global_batch": result.global_batch, "per_worker_batch": result.per_worker_batch, "seed": result.seed,
        "eval_split": split,
    }
    if not result.failed:  # a failed job's result.json holds what it was, not what it measured
        entry.update({
            f"final_{split}_acc": result.final_acc, f"best_{split}_acc": result.best_acc,
            "test_acc": result.test_acc, f"final_{split}_loss": result.final_loss, "test_loss": result.test_loss,
        })
        if result.token:
            entry[f"final_{split}_bits_per_{result.token}"] = result.bits_per_token(result.final_loss)
            if result.test_loss is not None:
                entry[f"test_bits_per_{result.token}"] = result.bits_per_token(result.test_loss)
        entry.update({"steps": result.steps, "samples_per_sec": result.samples_per_sec,
                      "diverged": result.diverged})
    else:
        entry["error"] = result.error
    return entry


def plot_hybrid(rows: list[Row], hybrid: list[dict], study_dir: Path, judge: Metric) -> list[str]:
    """<metric>_vs_gpus.png when the hybrid section has a point to draw (its name, to list), else none: an
    earlier report's, of another tolerance or cap, is removed, as it would contradict this one."""
    gpus = f"{judge.label}_vs_gpus.png"
    if any("impossible" not in p for p in hybrid):
        plot_gpus(rows, hybrid, study_dir / gpus, judge)
        return [gpus]
    (study_dir / gpus).unlink(missing_ok=True)
    return []
