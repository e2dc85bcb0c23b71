"""The report's figures, drawn with lbt/apps/plotting.py's axes and saver; a recipe (series) has one colour in
all of them (`series_colours`), and every axis that shows a number names the split it was measured on.

<metric>_vs_batch.png: two panels against the global batch, a line per recipe, with one vertical line at the
report's critical batch (the sweep's own, which its points agree with). Left, the final value on the split
the answer is judged on (val), zoomed to the tolerance band under the base batch's value (`zoom_limits`) so
the band the answer depends on is readable; points beyond the zoom sit at its edge as triangles with their
value, diverged or failed runs as crosses at the worse edge. Right, the test value (scored once per run) over
its full range. <metric>_vs_gpus.png: the final value against GPU count, data parallelism alone and the data x
tensor parallel hybrid past the cap. steps_to_target.png: steps to the target per batch with the fitted
S = S_min (1 + B_noise / B). gns_over_training.png: B_simple over training for each job of the
series the report reads B_simple from (SGD's only: for another optimizer it says it is not defined).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lbt.apps.judging import tolerance_floor
from lbt.apps.plotting import batch_axis, colormap, figure, save_figure
from lbt.apps.report.jobs import Job, is_baseline
from lbt.apps.report.rows import B_SIMPLE, GNS_WINDOW, Row, study_split
from lbt.metrics.critical import b_simple_undefined, run_optimizer
from lbt.spec.objective import ACC, Metric

# matplotlib's tab10 without its gray, which the reference lines use: a series' colour never reads as one of them
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
REFERENCE = "#7f7f7f"  # the base value, the critical batch
BAND = 2.0  # the zoomed panel shows this many band widths either side of the tolerance band ...
REACH = 4.0  # ... stretched to hold the values within this many widths of it (the band stays >= 1/9 of the height)


def series_colours(series: Iterable[str]) -> dict[str, str]:
    """The colour of each series (recipe) of a report, the same in every plot of it: the baseline's first,
    then the others by name, from PALETTE. Give it every series of the study, not one plot's."""
    names = sorted(set(series), key=lambda name: (not is_baseline(name), name))
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def axis_label(prefix: str, metric: Metric) -> str:
    """`test accuracy (%)`, `final val loss (nats)`: the metric's label with its unit."""
    return f"{prefix} {metric.label} ({metric.suffix or 'nats'})"


def zoom_limits(reference: float, floor: float, values: Iterable[float], ceiling: float | None = None
                ) -> tuple[float, float]:
    """The y range of the zoomed panel: the tolerance band between `reference` and `floor` with BAND band widths
    either side, stretched to hold every value within REACH widths of the band (so the band keeps at least
    1 / (1 + 2 REACH) of the height) and capped at `ceiling` (100% of accuracy); values beyond are drawn clipped."""
    low_band, high_band = sorted((reference, floor))
    width = (high_band - low_band) or abs(reference) / 100 or 1.0
    near = [v for v in values if math.isfinite(v) and low_band - REACH * width <= v <= high_band + REACH * width]
    low = min([low_band - BAND * width, *near]) - width / 4
    high = max([high_band + BAND * width, *near]) + width / 4
    if ceiling is not None:
        high = min(high, max(ceiling, high_band) + width / 4)
    return low, high


def plot_metric_vs_batch(rows: list[Row], crit: dict[str, Any], path: Path, metric: Metric = ACC,
                         answer: dict[str, Any] | None = None, withheld: str | None = None) -> list[float]:
    """The final value on the answer's split (zoomed to the tolerance band of `answer`, gpu_answer's measured
    reference and tolerance) and the test value, scored once per run (full range), vs global batch, one line
    per recipe; returns the x of the vertical lines drawn (summary.json keeps them, so a test can hold them to
    the points). The diagnostics (fit, B_simple) are not drawn here: a line where every recipe still holds its
    accuracy would contradict the points. `withheld`: why the report gives no answer (said in the title)."""
    fig, (zoomed, full) = figure(columns=2, width=12.5, height=4.8)
    colours = series_colours(r.recipe for r in rows)
    split = answer["split"] if answer else study_split(rows)
    draw_selection_panel(zoomed, rows, answer, split, metric, colours)
    draw_test_panel(full, rows, metric, colours)
    vertical: list[float] = []
    for ax in (zoomed, full):
        if crit.get("value"):
            ax.axvline(crit["value"], color=REFERENCE, linestyle="--",
                       label=f"critical batch {crit['value']:,} ({crit['recipe']}: the largest within "
                             f"{metric.units(crit['tolerance'])} on {crit['split']})")
        vertical += [float(line.get_xdata()[0]) for line in ax.get_lines()
                     if len(set(line.get_xdata())) == 1 and len(line.get_xdata()) == 2]
        batch_axis(ax)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    title = f"{metric.label.capitalize()} vs global batch (same epoch budget)"
    save_figure(fig, path, title + (f": no answer ({withheld})" if withheld else ""))
    return sorted(set(vertical))


def draw_selection_panel(ax: Any, rows: list[Row], answer: dict[str, Any] | None, split: str, metric: Metric,
                         colours: dict[str, str]) -> None:
    """The final value on `split` per recipe, the tolerance band under the base batch's value shaded, the y
    range zoomed to it; values beyond sit at the edge (triangles, with their value), lost runs at the worse edge."""
    mine = [r for r in rows if r.split == split]
    values = [metric.scale * r.final(metric) for r in mine if math.isfinite(r.final(metric))]
    reference, tolerance = (answer or {}).get("reference"), (answer or {}).get("tolerance", metric.default_tolerance)
    if reference is not None:
        base = metric.scale * reference[metric.name]
        floor = metric.scale * tolerance_floor(reference[metric.name], tolerance, metric)
        low, high = zoom_limits(base, floor, values, 100.0 if metric.name == "acc" else None)
        ax.axhspan(min(base, floor), max(base, floor), color=REFERENCE, alpha=0.2, lw=0,
                   label=f"within {metric.units(tolerance)} of {reference['recipe']} at "
                         f"{reference['global_batch']:,} (the answer's band)")
        ax.axhline(base, color=REFERENCE, linestyle=":", linewidth=1)
    else:
        low, high = (min(values, default=0.0), max(values, default=1.0))
    worse = low if metric.higher_is_better else high
    for i, recipe in enumerate(sorted({r.recipe for r in mine})):
        colour, points = colours[recipe], sorted((r for r in mine if r.recipe == recipe), key=lambda r: r.global_batch)
        drawn = [(r.global_batch, metric.scale * r.final(metric), metric.scale * (r.final_std(metric) or 0))
                 for r in points if math.isfinite(r.final(metric))]
        shown = [(x, min(max(v, low), high), std if low <= v <= high else 0.0) for x, v, std in drawn]
        ax.errorbar([x for x, _, _ in shown], [y for _, y, _ in shown], yerr=[e for _, _, e in shown], marker="o",
                    capsize=3, color=colour, label=recipe)
        for (x, v, _), (_, y, _) in zip(drawn, shown):
            if y != v:  # beyond the zoom: at the edge, pointing the way it lies, with its value
                ax.scatter([x], [y], marker="v" if y == low else "^", s=70, color=colour, zorder=3, clip_on=False)
                ax.annotate(f"{metric.show(v / metric.scale)}", (x, y), textcoords="offset points", fontsize=7,
                            xytext=(5, 3 + 8 * i if y == low else -9 - 8 * i), color=colour)  # one above another
        lost = [r.global_batch for r in points if r.diverged or r.errors]
        if lost:
            ax.scatter(lost, [worse] * len(lost), marker="x", s=80, color=colour, clip_on=False, zorder=3,
                       label=f"{recipe}: diverged/failed")
    if reference is not None:
        ax.set_ylim(low, high)
    ax.set_ylabel(axis_label(f"final {split}", metric))
    ax.set_title(f"final {split} {metric.label}: what the answer is judged on", fontsize=9)


def draw_test_panel(ax: Any, rows: list[Row], metric: Metric, colours: dict[str, str]) -> None:
    """Test value, scored once per run, per recipe over its full range; a lost run at the bottom of its curve."""
    for recipe in sorted({r.recipe for r in rows}):
        points = sorted((r for r in rows if r.recipe == recipe), key=lambda r: r.global_batch)
        scored = [(r.global_batch, metric.scale * value, metric.scale * (r.test_std(metric) or 0))
                  for r in points if (value := r.test(metric)) is not None]
        ax.errorbar([batch for batch, _, _ in scored], [value for _, value, _ in scored],
                    yerr=[std for _, _, std in scored], marker="o", capsize=3, label=recipe, color=colours[recipe])
        bad = [r for r in points if r.diverged or r.errors]
        if bad:  # drawn at the worst value shown, so a lost run reads as the bottom of its curve
            floor = min([value for _, value, _ in scored], key=metric.score, default=10.0)
            ax.scatter([r.global_batch for r in bad], [floor] * len(bad), marker="x", s=80,
                       color=colours[recipe], label=f"{recipe}: diverged/failed")
    ax.set_ylabel(axis_label("test", metric) + ", scored once per run")
    ax.set_title(f"test {metric.label}, full range", fontsize=9)


def plot_gpus(rows: list[Row], points: list[dict[str, Any]], path: Path, metric: Metric = ACC) -> None:
    """Final (selection-split) metric vs GPU count: data parallelism alone (solid) and the hybrid past
    the batch cap (dashed; filled markers were run as DP x T, hollow ones follow from exactness)."""
    fig, ax = figure()
    points = [p for p in points if "impossible" not in p]
    colours, split = series_colours(r.recipe for r in rows), study_split(rows)
    for recipe in sorted({p["recipe"] for p in points}):
        data_parallel = sorted((r for r in rows if r.recipe == recipe and math.isfinite(r.final(metric))),
                               key=lambda r: r.world_size)
        line = ax.plot([r.world_size for r in data_parallel], [metric.scale * r.final(metric) for r in data_parallel],
                       marker="o", color=colours[recipe], label=f"{recipe}: data parallel")[0]
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
    ax.set_ylabel(axis_label(f"final {split}", metric))
    ax.set_title(f"More GPUs: a bigger batch, or split layers at the same batch\n(final {split} {metric.label})",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_steps(rows: list[Row], target: float | None, crit: dict[str, Any], path: Path, metric: Metric = ACC) -> None:
    """Steps to target vs global batch per recipe, with the fitted S = S_min (1 + B_noise / B)."""
    fig, ax = figure()
    colours, split = series_colours(r.recipe for r in rows), study_split(rows)
    for recipe in sorted({r.recipe for r in rows}):
        points = sorted((r for r in rows if r.recipe == recipe and r.steps_to_target), key=lambda r: r.global_batch)
        if points:
            ax.errorbar([r.global_batch for r in points], [r.steps_to_target for r in points],
                        yerr=[r.steps_to_target_std or 0 for r in points], marker="o", capsize=3, label=recipe,
                        color=colours[recipe])
    batches = sorted({r.global_batch for r in rows})
    if crit["fit"] and batches:
        grid = [batches[0] * (batches[-1] / batches[0]) ** (i / 50) for i in range(51)]
        s_min, b_noise = crit["s_min"], crit["fit"]
        ax.plot(grid, [s_min * (1 + b_noise / b) for b in grid], "k--",
                label=f"fit ({crit['series']}): S_min={s_min:,.0f}, B_crit={b_noise:,.0f}")
    batch_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel(f"steps to {split} {metric.label} {metric.show(target)}{metric.suffix or ' nats'}"
                  if target is not None else f"steps to the {split} target")
    ax.set_title(f"Steps to the target on {split} vs global batch", fontsize=9)
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
    drawn = [job for job in sorted(jobs, key=lambda job: (job.result.global_batch, job.result.seed or 0))
             if job.series == crit["gns_series"] and job.result.technique_curves.get(B_SIMPLE)
             and not b_simple_undefined(run_optimizer(job.result.config))]
    batches = sorted({job.result.global_batch for job in drawn})
    for job in drawn:  # one series: its lines are batches, coloured small (dark) to large (light), not recipes
        curve = job.result.technique_curves[B_SIMPLE]
        ax.plot([p[0] for p in curve], [p[1] for p in curve], marker=".",
                color=colormap("viridis")(0.85 * batches.index(job.result.global_batch) / max(len(batches) - 1, 1)),
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
