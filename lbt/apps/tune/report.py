"""The tune's report: tune_summary.json (the protocol, every cell, the fitted LR exponents, the gaps to the
smallest batch, the steps to target and the fitted critical batches), tune_report.md, best_lr_vs_batch.png and
steps_to_target.png.

`summarize` computes the summary from the cells (cells/<cell>.json, parsed by summary.py) and returns it as
tune_summary.json holds it; `write_tune_report` parses it once (summary.py) and draws the markdown and the figures
from its attributes."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from lbt.apps.judging import target_from, within
from lbt.apps.plotting import batch_axis, figure, save_figure
from lbt.apps.tables import line, table
from lbt.apps.tune.grid import TuneGrid
from lbt.apps.tune.summary import (
    Curve,
    Finals,
    Gaps,
    LrFit,
    MeanStd,
    Protocol,
    Steps,
    StepsFit,
    StepsRow,
    TunedCell,
    TuneSummary,
    parse_cell,
    parse_summary,
)
from lbt.apps.tune.trials import short
from lbt.metrics.critical import CriticalFit, crossing_step, fit_steps_to_target
from lbt.paths import atomic_write
from lbt.spec.lr import scaling_factor
from lbt.spec.objective import ACC, Metric
from lbt.spec.result import EvalPoint


def fit_exponent(batches: Sequence[float], lrs: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of lr = c x B^k in log-log space; returns (k, c).

    Needs two distinct batches and positive LRs (ValueError otherwise).
    """
    points = [(math.log(b), math.log(lr)) for b, lr in zip(batches, lrs)]
    if len(points) != len(batches) or len({x for x, _ in points}) < 2:
        raise ValueError("fitting an exponent needs LRs at two or more distinct batches")
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    k = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return k, math.exp(mean_y - k * mean_x)


def claimed_exponent(scaling: str) -> float:
    """The exponent k of peak LR ∝ B^k that a scaling rule claims: none 0, sqrt 0.5, linear 1 (lbt.spec.lr)."""
    return round(math.log2(scaling_factor(2, 1, scaling)), 9)


def tuning_failed(cell: TunedCell, metric: Metric = ACC) -> str | None:
    """Why a cell's tuned result is no optimum, or None: its tuned runs end more than the metric's tolerance
    worse on val than the recipe's untuned defaults (unwarned, a chance-level "tuned" 9.6% beside 72.5%
    untuned would be reported as tuned, and its LR fitted)."""
    tuned, untuned = None if cell.tuned is None else cell.tuned.val_mean, cell.default.val_mean
    if tuned is None or untuned is None:
        return None
    worse = metric.gap(tuned, untuned)
    if within(worse, metric.default_tolerance):
        return None
    shown = {name: f"{metric.show(value)}{metric.suffix}" for name, value in (("tuned", tuned), ("untuned", untuned))}
    return (f"{cell.series} at global batch {cell.global_batch:,}: tuned val {shown['tuned']} is "
            f"{metric.units(round(worse, metric.decimals))} worse than the untuned defaults' {shown['untuned']}; "
            f"its best trial is no optimum (widen tune.space or give more tune.trials), and its LR is left out "
            f"of the fit")


def lr_fit(series: str, members: list[TunedCell], metric: Metric = ACC) -> dict[str, Any]:
    """One curve's best peak LRs against its batches, and the exponent they fit (None with a `note` if none);
    a cell whose tuning failed (`tuning_failed`) is left out."""
    usable = sorted(lr_points(members, metric), key=lambda point: point[0])
    batches, peaks, bases = [b for b, _, _ in usable], [peak for _, peak, _ in usable], [base for _, _, base in usable]
    fit: dict[str, Any] = {"series": series, "scalings": sorted({c.scaling for c in members}),
           "claimed": sorted({claimed_exponent(c.scaling) for c in members}), "batches": batches, "peak_lrs": peaks,
           "base_lrs": bases, "exponent": None, "coefficient": None, "base_exponent": None}
    try:
        fit["exponent"], fit["coefficient"] = fit_exponent(batches, peaks)
        fit["base_exponent"] = fit_exponent(batches, bases)[0]
    except ValueError as error:
        fit["note"] = str(error)
    return fit


def lr_points(members: list[TunedCell], metric: Metric) -> list[tuple[int, float, float]]:
    """(global batch, peak LR, base LR) of each cell whose best trial did not diverge and whose tuning did not
    fail (`tuning_failed`)."""
    points = []
    for c in members:
        best = c.best
        if best is None or best.diverged or best.peak_lr is None or not best.peak_lr > 0 or best.base_lr is None:
            continue
        if tuning_failed(c, metric) is None:
            points.append((c.global_batch, best.peak_lr, best.base_lr))
    return points


def summarize(grid: TuneGrid, cells: list[dict], storage: str) -> dict:
    """tune_summary.json: the protocol, every cell (`cells`: cells/<cell>.json's), and per curve the fitted
    exponent of the best peak LR.

    `storage`: what `optuna-dashboard` opens the trials with (a URL's password hidden).
    """
    s, tuned = grid.settings, [parse_cell(c) for c in cells]
    fits = [lr_fit(series, [c for c in tuned if c.series == series], s.metric)
            for series in dict.fromkeys(c.series for c in tuned)]
    return {
        "warnings": [w for w in (tuning_failed(c, s.metric) for c in tuned) if w],
        "gaps": gaps_to_base(tuned, s.metric),
        "steps_to_target": steps_to_target(tuned, s.metric, s.target, reference_cell(tuned, s.metric)),
        "tune_dir": str(s.dir), "storage": storage,
        "settings": {"trials": s.trials, "seeds": s.seeds, "seed": s.seed, "startup_trials": s.startup_trials,
                     "pruner": s.pruner, "prune_startup_trials": s.prune_startup_trials,
                     "prune_after": s.prune_after, "metric": s.metric.name,
                     "selected_on": "steps_to_target" if s.stop_at_target else f"final_val_{s.metric.name}",
                     "sampler": "multivariate TPE" if s.sampler == "tpe" else "quasi-random search (scrambled Halton)",
                     "studies": s.studies, "objective": s.objective, "target": s.target,
                     "stop_at_target": s.stop_at_target},
        "overrides": grid.fixed, "cells": cells, "lr_fits": fits,
    }


class Scored(NamedTuple):
    """A cell whose tuned runs were scored on val and on test: their means over the seeds."""

    cell: TunedCell
    val: float
    test: float


def scored_cells(cells: list[TunedCell]) -> list[Scored]:
    return [Scored(c, c.tuned.val_mean_std[0], c.tuned.test_mean_std[0]) for c in cells
            if c.tuned is not None and c.tuned.val_mean_std is not None and c.tuned.test_mean_std is not None]


def reference_cell(cells: list[TunedCell], metric: Metric = ACC) -> Scored | None:
    """The tuned smallest batch the gaps and the default target are counted from: the smallest global batch's
    scored cell with the best tuned val mean (of several recipes there); None when no cell was scored."""
    scored = scored_cells(cells)
    if not scored:
        return None
    smallest = min(s.cell.global_batch for s in scored)
    return max((s for s in scored if s.cell.global_batch == smallest), key=lambda s: metric.score(s.val))


def gaps_to_base(cells: list[TunedCell], metric: Metric = ACC) -> dict:
    """Test accuracy (or loss: `metric`) lost at each batch against the tuned smallest batch, per curve and
    for the best curve.

    The reference is the smallest global batch's tuned run (`reference_cell`); at each larger batch the best
    curve is chosen on val too, and only its test value is compared: test decides nothing. Gaps are in the
    metric's units (percentage points of test accuracy, nats of test loss); positive: lost.
    """
    reference, scored = reference_cell(cells, metric), scored_cells(cells)
    if reference is None:
        return {"reference": None, "batches": []}
    smallest, base = reference.cell.global_batch, reference.cell
    gaps: dict[str, Any] = {
        "metric": metric.name,
        "reference": {"cell": base.cell, "series": base.series, "global_batch": smallest,
                      f"test_{metric.name}": reference.test},
        "batches": []}
    for batch in sorted({s.cell.global_batch for s in scored if s.cell.global_batch > smallest}):
        here = [s for s in scored if s.cell.global_batch == batch]
        best = max(here, key=lambda s: metric.score(s.val))
        ratio, best_gap = batch / smallest, metric.gap(best.test, reference.test)
        gaps["batches"].append({"global_batch": batch, "ratio": ratio, "best_series": best.cell.series,
                                "best_gap": best_gap,
                                "per_series": {s.cell.series: metric.gap(s.test, reference.test) for s in here}})
        gaps[f"best_gap_{ratio:g}x"] = best_gap
    return gaps


def steps_to_target(cells: list[TunedCell], metric: Metric, target: float | None, reference: Scored | None) -> dict:
    """AlgoPerf's measure (Dahl et al. 2023, arXiv:2306.07179): per cell, each independent search's fastest
    trial to the target val value (infinite if none reached it), the median and range over the searches;
    per curve, S = S_min (1 + B_crit / B) fitted through the medians (McCandlish et al. 2018).

    The target is tune.target, or else the tuned smallest batch's val mean (`reference`, reference_cell's) made
    worse by the metric's target margin (1 point of accuracy), as `lbt report` sets its target. Steps are
    read from each trial's val curve, interpolated between evaluations (lbt.metrics.critical.crossing_step).
    """
    searched = [c for c in cells if any(c.curves)]
    if target is None and reference is not None:
        target, source = target_from(reference.val, metric), \
            f"the tuned val mean of {reference.cell.series} at {reference.cell.global_batch:,}, less " \
            f"{metric.units(metric.target_margin)}"
    else:
        source = "tune.target"
    if not searched or target is None:
        return {"target": None, "cells": [], "fits": []}
    rows = [steps_row(c, target, metric) for c in sorted(searched, key=lambda c: (c.series, c.global_batch))]
    fits = [steps_fit(series, [r for r in rows if r.series == series])
            for series in dict.fromkeys(r.series for r in rows)]
    return {"target": target, "target_from": source, "metric": metric.name, "cells": [r.json() for r in rows],
            "fits": fits}


def steps_row(c: TunedCell, target: float, metric: Metric) -> StepsRow:
    """A cell's steps to `target`: each search's fastest trial, their median and range."""
    fastest = [fewest_steps(curves, target, metric) for curves in c.curves]
    done, median = sorted(f for f in fastest if math.isfinite(f)), statistics.median(fastest)
    return StepsRow(cell=c.cell, series=c.series, global_batch=c.global_batch,
                    budget=budget_steps(c.curves),  # per_study, median: None where missed
                    per_study=tuple(f if math.isfinite(f) else None for f in fastest),
                    median=median if math.isfinite(median) else None, low=done[0] if done else None,
                    high=done[-1] if done else None, missed=len(fastest) - len(done))


def fewest_steps(curves: Mapping[str, Curve], target: float, metric: Metric) -> float:
    """The fewest steps any trial's val curve took to reach `target`; inf if none did (AlgoPerf's rule)."""
    crossings = [crossing_step([EvalPoint(int(step), 0, 0, value, value) for step, value in curve], target,
                               metric=metric) for curve in curves.values()]
    return min((c for c in crossings if c is not None), default=math.inf)


def budget_steps(searches: Sequence[Mapping[str, Curve]]) -> float | None:
    """The cell's budget in steps: the last evaluation's step of its longest trial (one that missed the target
    runs in full unless pruned or diverged, which only end it earlier and weaken the bound); None where no
    trial has a curve. Every trial of a cell runs the same epochs, so the longest is the budget."""
    return max((float(curve[-1][0]) for curves in searches for curve in curves.values() if curve), default=None)


def missed_bounds(rows: Sequence[StepsRow], missed: Callable[[StepsRow], bool]) -> list[tuple[float, float]]:
    """(batch, budget) of the rows whose measure `missed` the target: their steps to it exceed the budget."""
    return [(r.global_batch, r.budget) for r in rows if missed(r) and r.budget]


def steps_fit(series: str, rows: Sequence[StepsRow]) -> dict[str, Any]:
    """The critical batch of one curve: S = S_min (1 + B_crit / B) through its cells' median steps to target,
    held at or above the budget where the median missed it (fit_steps_to_target's `missed`); and its spread:
    each study's own curve (study k's fastest trial at every batch, the studies being independent repetitions
    of the whole protocol) fitted alone, None where that one cannot be."""
    reached = [(r.global_batch, r.median) for r in rows if r.median is not None]
    studies = max((len(r.per_study) for r in rows), default=0)
    fit: dict[str, Any] = {"series": series, "batches": [b for b, _ in reached], "b_crit": None,
                           "s_min": None, "rel_rms": None, "bound_at": [],
                           "per_study_b_crit": [study_b_crit(rows, k) for k in range(studies)]}
    try:
        found = fit_steps_to_target([b for b, _ in reached], [steps for _, steps in reached],
                                    missed_bounds(rows, lambda r: r.median is None))
        fit.update(b_crit=found.b_crit, s_min=found.s_min, rel_rms=found.rel_rms, bound_at=list(found.binding))
    except ValueError as error:
        fit["note"] = str(error)
    return fit


def fitted_steps(fit: StepsFit, batch: float) -> float | None:
    """A stored fit's steps to target at `batch` (CriticalFit.steps_at); None where nothing was fitted."""
    if not fit.b_crit or fit.s_min is None or fit.rel_rms is None:
        return None
    found = CriticalFit(s_min=fit.s_min, b_noise=fit.b_crit, rel_rms=fit.rel_rms, points=len(fit.batches))
    return found.steps_at(batch)


def study_b_crit(rows: Sequence[StepsRow], study: int) -> float | None:
    """The critical batch fitted through one study's steps to target alone, held above the budget where that
    study missed the target (None: it reached the target at fewer than 3 batches)."""
    mine = [r for r in rows if study < len(r.per_study)]
    points = [(r.global_batch, steps) for r in mine if (steps := r.per_study[study]) is not None]
    try:
        return fit_steps_to_target([b for b, _ in points], [steps for _, steps in points],
                                   missed_bounds(mine, lambda r: r.per_study[study] is None)).b_crit
    except ValueError:
        return None


def number(value: float | None, spec: str = ".4f") -> str:
    """A table cell: `n/a` for a number not measured."""
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def mean_and_std(pair: MeanStd | None) -> str:
    return "n/a" if pair is None else f"{pair[0]:.4f} ± {pair[1]:.4f}"


def markdown(summary: TuneSummary) -> str:
    """The whole tune_report.md."""
    metric, m = summary.metric, summary.metric.name
    warned = [f"**Warning: {w}.**" for w in summary.warnings]
    lines = protocol_lines(summary) + [line for w in warned for line in (w, "")] + lr_fit_lines(summary.lr_fits)
    lines += gap_lines(summary.gaps, [fit.series for fit in summary.lr_fits], metric)
    lines += steps_lines(summary.steps, metric)
    for series in dict.fromkeys(c.series for c in summary.cells):
        header = ["global batch", "world size", "trials (pruned, diverged)", f"best trial: val {m}", f"tuned val {m}",
                  f"tuned test {m}", f"untuned val {m}", f"untuned test {m}",
                  f"test gained by tuning ({metric.unit}s)", "best values", "best peak LR"]
        lines += [f"## {series}", "", *table(header, "rrlrrrrrrlr", [])]
        lines += [cell_row(c, metric) for c in sorted((c for c in summary.cells if c.series == series),
                                                       key=lambda c: c.global_batch)]
        lines.append("")
    return "\n".join(lines)


def protocol_lines(summary: TuneSummary) -> list[str]:
    """What every cell got: the budget, the sampler, the pruning, the seeds of the final runs."""
    s, cells, metric = summary.protocol, summary.cells, summary.metric
    pruning = ("no pruning" if s.pruner == "none" else
               f"{s.pruner} pruning past {100 * s.prune_after:g}% of a trial's samples, once "
               f"{s.prune_startup_trials} trials of the cell finished")
    seeds = next((runs.seeds for c in cells for runs in (c.tuned, c.default) if runs is not None and runs.seeds), ())
    untuned = any(c.default.seeds for c in cells)
    selected = (f"each an `lbt train` run ended at the first evaluation that reached val {metric.label} "
                f"{metric.show(s.target)}{metric.suffix} (tune.stop_at_target; a trial that missed ran in full), "
                "the fastest selected" if s.stop_at_target else
                f"each a full `lbt train` run selected on its final **val** {metric.label} ({metric.direction}d)")
    finals = (f" were then trained with seeds {', '.join(map(str, seeds))} (not the trials' seed) and scored on val "
              "and, once, on **test**: the gap between the two is how much of the "
              f"{metric.label} lost at a batch was mis-tuning." if seeds else
              " were not trained again (tune.seeds=0): no final runs, no test figures.")
    return [
        f"# Tuning report: {summary.tune_dir}", "",
        f"Every cell got the same budget: **{s.trials} trials** of {sampler_words(s)} over its recipe's "
        f"`tune.space`{studies_words(s)}, {selected}; {pruning}; a "
        f"diverged trial counts, as {metric.worst:g}. The best trial's values (**tuned**)"
        + (" and the recipe's **untuned** defaults" if untuned else " (tune.untuned=false: not the untuned defaults)")
        + finals, "",
        f"Overrides of every run: `{' '.join(summary.overrides) or '(none)'}`. "
        f"Trials: `optuna-dashboard {summary.storage}`. The final runs read with `lbt report` too: "
        "`final/` (tuned and untuned side by side), `final/tuned`, `final/default`.", "",
    ]


def sampler_words(s: Protocol) -> str:
    if s.sampler == "multivariate TPE":
        return f"multivariate TPE (seed {s.seed}, the first {s.startup_trials} random)"
    return f"{s.sampler} (seed {s.seed})"


def studies_words(s: Protocol) -> str:
    """How many independent searches each cell had (tune.studies), and which one gives the tuned values."""
    if s.studies == 1:
        return ""
    return (f", in each of **{s.studies} independent studies** (their own sampler seeds; AlgoPerf's protocol), "
            "the tuned values being the best trial of the study whose best is the median")


def lr_fit_lines(fits: Sequence[LrFit]) -> list[str]:
    """The table of fitted LR exponents against the ones the scaling rules claim, and its figure."""
    lines = [
        "## Best LR vs global batch", "",
        "Fitted is the exponent k of the best trial's **effective peak LR** ∝ B^k (result.json `peak_lr` = "
        "`optim.lr` x scaling(B / `schedule.base_batch`), the LR the run reaches), not of the tuned `optim.lr` "
        "(the base LR before scaling, whose exponent is shown beside it). A scaling rule claims k = 1 (linear), "
        "0.5 (sqrt) or 0 (none); a fitted k below the claim means the rule scales the LR too fast here.", "",
    ]
    rows = []
    for fit in fits:
        claim = ", ".join(f"{c:g}" for c in fit.claimed) + f" ({', '.join(fit.scalings)})"
        fitted = number(fit.exponent, ".2f") if fit.exponent is not None else f"n/a: {fit.note}"
        rows.append([fit.series, claim, fitted, number(fit.base_exponent, ".2f"),
                     ", ".join(f"{b:,}" for b in fit.batches), ", ".join(f"{v:.3g}" for v in fit.peak_lrs)])
    header = ["recipe", "claims (schedule.scaling)", "fitted k, peak LR", "fitted k, optim.lr", "batches",
              "best peak LRs"]
    return lines + table(header, "llrrll", rows) + ["", "![best peak LR vs global batch](best_lr_vs_batch.png)", ""]


def gap_lines(gaps: Gaps, series: list[str], metric: Metric = ACC) -> list[str]:
    """The table of test points (or nats of loss) lost against the tuned smallest batch."""
    ref = gaps.reference
    if ref is None:
        return []
    unit, spec = f"{metric.unit}s", metric.gap_spec
    lines = [f"## Test {metric.label} lost against the tuned smallest batch", "",
             f"Reference: {ref.series} at global batch {ref.global_batch:,}, tuned, test {metric.name} "
             f"{metric.show(ref.test)}{metric.suffix}. {unit.capitalize()} lost on test (mean over "
             "the seeds; negative: gained). The best recipe at a batch is the one with the best tuned **val** mean "
             "there; test only scores it.", ""]
    rows = ([f"{row.global_batch:,}", f"{row.ratio:g}", row.best_series, format(row.best_gap, spec),
             *(number(row.per_series.get(name), spec) for name in series)] for row in gaps.batches)
    header = ["global batch", "x", "best on val", f"best: {unit} lost", *series]
    return lines + table(header, "rrlr" + "r" * len(series), rows) + [""]


def steps_lines(steps: Steps, metric: Metric) -> list[str]:
    """Steps to target per cell (median over the studies, with their range) beside perfect linear scaling,
    and each curve's fitted critical batch."""
    if not steps.cells:
        return []
    lines = ["## Steps to target (AlgoPerf-style)", "",
             f"Target: val {metric.name} {metric.show(steps.target)}{metric.suffix} ({steps.target_from}). Per "
             "cell, each independent study's fastest trial to the target (interpolated between evaluations; a study "
             "none of whose trials reached it counts as infinite), then the **median over the studies**, with the "
             "range of those that reached it. Perfect scaling: the smallest batch's median x its batch / this batch. "
             "Fitted: S = S_min (1 + B_crit / B) through the curve's medians, held at or above the budget's steps "
             "where the median missed the target (it needs more steps than the budget had).", "",
             "![steps to target vs global batch](steps_to_target.png)", ""]
    lines += table(["recipe", "global batch", "steps to target (median)", "range over studies", "studies missed",
                    "perfect scaling", "fitted"], "lrrlrrr", steps_cells(steps))
    lines += ["", "The critical batch fitted through the medians; beside it, each study's own curve fitted alone (n/a: "
              "that study reached the target at fewer than 3 batches, or its steps show no critical batch): two "
              "recipes whose per-study fits overlap are not told apart by this budget.", ""]
    fitted_rows = ([fit.series, f"{fit.b_crit:,.0f}" if fit.b_crit else f"n/a: {fit.note}",
                    per_study_words(fit.per_study_b_crit), number(fit.s_min, ",.1f"), number(fit.rel_rms, ".3f"),
                    ", ".join(f"{b:,}" for b in fit.batches), bound_words(fit.bound_at)] for fit in steps.fits)
    lines += table(["recipe", "fitted critical batch", "per study", "S_min (steps)", "relative rms", "batches fitted",
                    "held at a missed budget"], "lrrrrll", fitted_rows)
    return lines + [""]


def steps_cells(steps: Steps) -> list[list[str]]:
    """The rows of the steps-to-target table: a cell each, beside perfect scaling and its curve's fit."""
    first, fits = min(steps.cells, key=lambda r: r.global_batch), {fit.series: fit for fit in steps.fits}
    cells = []
    for r in steps.cells:
        fitted = fitted_steps(fits[r.series], r.global_batch)
        perfect = first.median * first.global_batch / r.global_batch if first.median else None
        span = "n/a" if r.low is None else f"{r.low:,.0f} - {r.high:,.0f}"
        cells.append([r.series, f"{r.global_batch:,}", number(r.median, ",.0f"), span,
                      f"{r.missed}/{len(r.per_study)}", number(perfect, ",.0f"), number(fitted, ",.0f")])
    return cells


def bound_words(bound_at: Sequence[float]) -> str:
    """The missed batches whose budget a steps fit is held at ("2,048"), or "none"."""
    return ", ".join(f"{b:,.0f}" for b in bound_at) or "none"


def per_study_words(b_crits: Sequence[float | None]) -> str:
    """Each study's own critical batch (a steps fit's per_study_b_crit), ascending, n/a last: "2,310, 2,571,
    2,903"."""
    found = sorted(b for b in b_crits if b is not None)
    return ", ".join([f"{b:,.0f}" for b in found] + ["n/a"] * (len(b_crits) - len(found))) or "n/a"


def cell_row(c: TunedCell, metric: Metric = ACC) -> str:
    """One row of a recipe's table: the cell's trials, its best trial, tuned and untuned finals over seeds."""
    t, best, tuned, default = c.trials, c.best, c.tuned, c.default

    def finals(runs: Finals | None, split: str) -> str:
        text = mean_and_std(None if runs is None else runs.val_mean_std if split == "val" else runs.test_mean_std)
        return text + (f" ({runs.diverged} diverged)" if runs and runs.diverged and split == "val" else "")

    gain = None
    if tuned and tuned.test_mean_std and default.test_mean_std:
        gain = metric.gap(default.test_mean_std[0], tuned.test_mean_std[0])
    cells = [f"{c.global_batch:,}", str(c.world_size), f"{t.counted} ({t.pruned}, {t.diverged})",
             f"#{best.trial}: {best.value:.4f}" if best else "none finished",
             finals(tuned, "val"), finals(tuned, "test"), finals(default, "val"), finals(default, "test"),
             number(gain, metric.gap_spec),
             ", ".join(f"`{k}={short(v)}`" for k, v in best.params.items()) if best else "",
             number(best.peak_lr, ".4g") if best else "n/a"]
    return line(cells)


def plot_best_lr(fits: Sequence[LrFit], path: Path) -> None:
    """Best effective peak LR vs global batch, log-log, with each curve's fitted power law."""
    fig, ax = figure()
    for fit in fits:
        if not fit.batches:
            continue
        claim = "/".join(f"{c:g}" for c in fit.claimed)
        label = fit.series + (f": k={fit.exponent:.2f} (claims {claim})" if fit.exponent is not None else "")
        dots = ax.scatter(fit.batches, fit.peak_lrs, label=label)
        if fit.exponent is not None and fit.coefficient is not None:
            xs = sorted(fit.batches)
            ax.plot(xs, [fit.coefficient * x ** fit.exponent for x in xs], "--", color=dots.get_facecolor()[0])
    batch_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel("best peak LR (optim.lr x scaling)")
    ax.set_title("Best LR vs global batch (tuned on val; dashed: fitted power law)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.collections:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no cell has a best trial that did not diverge", ha="center", transform=ax.transAxes)
    save_figure(fig, path)


def plot_steps_to_target(steps: Steps, path: Path, metric: Metric = ACC) -> None:
    """Steps to the target vs global batch, log-log, per recipe: the medians over the studies (bars: the range
    of the studies that reached it), each recipe's fitted S(B) dashed, and perfect linear scaling dotted from
    the smallest batch's median."""
    fig, ax = figure()
    fits, batches = {fit.series: fit for fit in steps.fits}, sorted({r.global_batch for r in steps.cells})
    for series in dict.fromkeys(r.series for r in steps.cells):
        draw_steps_curve(ax, fits[series], [r for r in steps.cells if r.series == series], batches)
    first = min((r for r in steps.cells if r.median is not None), key=lambda r: r.global_batch, default=None)
    if first is not None and first.median is not None:
        ax.plot(batches, [first.median * first.global_batch / b for b in batches], ":", color="gray",
                label="perfect linear scaling")
    batch_axis(ax)
    ax.set_yscale("log")
    ax.set_ylabel(f"steps to val {metric.label} {metric.show(steps.target)}{metric.suffix}")
    ax.set_title("Steps to the target vs global batch (median over studies; bars: their range;\n"
                 "dashed: fitted S = S_min (1 + B_crit / B), at or above the budget of a batch whose median\n"
                 "missed; ^: such a budget the fit is held at)", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    if first is not None:
        ax.legend(fontsize=7)
    else:  # an empty plot says why rather than showing bare axes
        ax.text(0.5, 0.5, "no cell's median reached the target", ha="center", transform=ax.transAxes)
    save_figure(fig, path)


def draw_steps_curve(ax: Any, fit: StepsFit, rows: list[StepsRow], batches: list[int]) -> None:
    """One recipe's medians with their range, the fit held at the budgets it is bound by, and the fit."""
    reached = sorted((r for r in rows if r.median is not None), key=lambda r: r.global_batch)
    if not reached:
        return
    label = fit.series + (f": B_crit={fit.b_crit:,.0f}, S_min={fit.s_min:,.0f}" if fit.b_crit else "")
    medians = [r.median for r in reached if r.median is not None]
    bars = ax.errorbar([r.global_batch for r in reached], medians, marker="o", capsize=3, label=label,
                       yerr=[[m - (r.low or 0) for m, r in zip(medians, reached)],
                             [(r.high or 0) - m for m, r in zip(medians, reached)]])
    color = bars.lines[0].get_color()
    if fit.bound_at:  # the fit passes through these budgets: the target needs more steps than they had
        ax.plot(fit.bound_at, [fitted_steps(fit, b) for b in fit.bound_at], "^", color=color, fillstyle="none",
                markersize=8)
    if fit.b_crit:
        grid = [batches[0] * (batches[-1] / batches[0]) ** (i / 50) for i in range(51)]
        ax.plot(grid, [fitted_steps(fit, b) for b in grid], "--", color=color)


def write_tune_report(folder: Path, summary: dict) -> None:
    """The report's files from `summarize`'s summary: tune_summary.json as it is, the markdown and the figures
    from its typed shape."""
    typed = parse_summary(summary)
    plot_best_lr(typed.lr_fits, folder / "best_lr_vs_batch.png")
    if typed.steps.cells:
        plot_steps_to_target(typed.steps, folder / "steps_to_target.png", typed.metric)
    atomic_write(folder / "tune_summary.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))
    atomic_write(folder / "tune_report.md", lambda f: f.write(markdown(typed).encode()))
