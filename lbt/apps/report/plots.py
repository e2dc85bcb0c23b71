"""The report's figures, drawn with lbt/apps/plotting.py's axes and saver.

<metric>_vs_batch.png: the test value (scored once per run) against the global batch, a line per recipe,
with one vertical line at the report's critical batch (the sweep's own, which its points agree with).
<metric>_vs_gpus.png: the final value against GPU count, data parallelism alone and the data x tensor
parallel hybrid past the cap. steps_to_target.png: steps to the target per batch with the fitted
S = S_min (1 + B_noise / B). gns_over_training.png: B_simple over training for each job of the
series the report reads B_simple from (SGD's only: for another optimizer it says it is not defined).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lbt.apps.plotting import batch_axis, figure, save_figure
from lbt.apps.report.jobs import Job
from lbt.apps.report.rows import B_SIMPLE, GNS_WINDOW, Row, study_split
from lbt.metrics.critical import b_simple_undefined, run_optimizer
from lbt.spec.objective import ACC, Metric


def axis_label(prefix: str, metric: Metric) -> str:
    """`test accuracy (%)`: the metric's label with its unit, if it has one."""
    return f"{prefix} {metric.label}{f' ({metric.suffix})' if metric.suffix else ''}"


def plot_metric_vs_batch(rows: list[Row], crit: dict[str, Any], path: Path, metric: Metric = ACC) -> list[float]:
    """Test accuracy (or loss: `metric`), scored once per run, vs global batch, one line per recipe; returns
    the x of the vertical lines drawn (summary.json keeps them, so a test can hold them to the points).
    The diagnostics (fit, B_simple) are not drawn here: a line where every recipe still holds its accuracy
    would contradict the points."""
    fig, ax = figure()
    for recipe in sorted({r.recipe for r in rows}):
        points = sorted((r for r in rows if r.recipe == recipe), key=lambda r: r.global_batch)
        scored = [(r.global_batch, metric.scale * value, metric.scale * (r.test_std(metric) or 0))
                  for r in points if (value := r.test(metric)) is not None]
        line = ax.errorbar([batch for batch, _, _ in scored], [value for _, value, _ in scored],
                           yerr=[std for _, _, std in scored], marker="o", capsize=3, label=recipe)
        bad = [r for r in points if r.diverged or r.errors]
        if bad:  # drawn at the worst value shown, so a lost run reads as the bottom of its curve
            floor = min([value for _, value, _ in scored], key=metric.score, default=10.0)
            ax.scatter([r.global_batch for r in bad], [floor] * len(bad), marker="x", s=80,
                       color=line[0].get_color(), label=f"{recipe}: diverged/failed")
    if crit.get("value"):
        ax.axvline(crit["value"], color="gray", linestyle="--",
                   label=f"critical batch {crit['value']:,} ({crit['recipe']}: the largest within "
                         f"{metric.units(crit['tolerance'])} on {crit['split']})")
    vertical = [float(line.get_xdata()[0]) for line in ax.get_lines()
                if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2]
    batch_axis(ax)
    ax.set_ylabel(axis_label("test", metric) + ", scored once per run")
    ax.set_title(f"{metric.label.capitalize()} vs global batch (same epoch budget)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path)
    return vertical


def plot_gpus(rows: list[Row], points: list[dict[str, Any]], path: Path, metric: Metric = ACC) -> None:
    """Final (selection-split) metric vs GPU count: data parallelism alone (solid) and the hybrid past
    the batch cap (dashed; filled markers were run as DP x T, hollow ones follow from exactness)."""
    fig, ax = figure()
    points = [p for p in points if "impossible" not in p]
    for recipe in sorted({p["recipe"] for p in points}):
        data_parallel = sorted((r for r in rows if r.recipe == recipe and math.isfinite(r.final(metric))),
                               key=lambda r: r.world_size)
        line = ax.plot([r.world_size for r in data_parallel], [metric.scale * r.final(metric) for r in data_parallel],
                       marker="o", label=f"{recipe}: data parallel")[0]
        mine = [p for p in points if p["recipe"] == recipe]
        cap = mine[0]["cap"]
        below = [r for r in data_parallel if r.global_batch <= cap]
        xs = [r.world_size for r in below] + [p["gpus"] for p in mine]
        ys = [metric.scale * r.final(metric) for r in below] + [metric.scale * p[metric.name] for p in mine]
        ax.plot(xs, ys, linestyle="--", color=line.get_color(),
                label=f"{recipe}: data x tensor parallel (batch <= {cap:,})")
        for p in mine:
            ax.scatter([p["gpus"]], [metric.scale * p[metric.name]], s=50, color=line.get_color(),
                       facecolors=line.get_color() if p["source"].startswith("run") else "none")
    batch_axis(ax, "GPUs")
    ax.set_ylabel(axis_label("final", metric))
    ax.set_title("More GPUs: a bigger batch, or split layers at the same batch")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_steps(rows: list[Row], target: float | None, crit: dict[str, Any], path: Path, metric: Metric = ACC) -> None:
    """Steps to target vs global batch per recipe, with the fitted S = S_min (1 + B_noise / B)."""
    fig, ax = figure()
    for recipe in sorted({r.recipe for r in rows}):
        points = sorted((r for r in rows if r.recipe == recipe and r.steps_to_target), key=lambda r: r.global_batch)
        if points:
            ax.errorbar([r.global_batch for r in points], [r.steps_to_target for r in points],
                        yerr=[r.steps_to_target_std or 0 for r in points], marker="o", capsize=3, label=recipe)
    batches = sorted({r.global_batch for r in rows})
    if crit["fit"] and batches:
        grid = [batches[0] * (batches[-1] / batches[0]) ** (i / 50) for i in range(51)]
        s_min, b_noise = crit["s_min"], crit["fit"]
        ax.plot(grid, [s_min * (1 + b_noise / b) for b in grid], "k--",
                label=f"fit ({crit['series']}): S_min={s_min:,.0f}, B_crit={b_noise:,.0f}")
    batch_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel(f"steps to {study_split(rows)} {metric.label} {metric.show(target)}{metric.suffix}"
                  if target is not None else "steps to target")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:  # an empty plot says why rather than showing bare axes
        ax.text(0.5, 0.5, "no run reached the target", transform=ax.transAxes, ha="center", va="center")
    save_figure(fig, path)


def plot_gns(jobs: list[Job], crit: dict[str, Any], path: Path) -> None:
    """B_simple over training (samples seen), one line per job of the series the report takes B_simple from;
    none where it is not defined (another optimizer than SGD) or not measured: the plot says why."""
    fig, ax = figure()
    for job in sorted(jobs, key=lambda job: (job.result.global_batch, job.result.seed or 0)):
        curve = job.result.technique_curves.get(B_SIMPLE, [])
        if job.series == crit["gns_series"] and curve and not b_simple_undefined(run_optimizer(job.result.config)):
            ax.plot([p[0] for p in curve], [p[1] for p in curve], marker=".",
                    label=f"B={job.result.global_batch:,} seed {job.result.seed or 0}")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("gradient noise scale B_simple")
    ax.set_title(f"{crit['gns_series']}: B_simple over training (summarised over the last {100 * GNS_WINDOW:g}%)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    else:
        note = crit["gns_note"].replace(" (", "\n(", 1)  # the reason on a line of its own, inside the axes
        ax.text(0.5, 0.5, f"B_simple {note}", transform=ax.transAxes, ha="center", va="center")
    save_figure(fig, path)
