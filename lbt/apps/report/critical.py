"""The critical batch of a study: one figure, and two diagnostics (lbt/metrics/critical.py does the math).

The figure (`lead_figure`) is the sweep's own measurement: the largest global batch whose mean final
value stays within the tolerance of the base batch's (answer.py's "how many GPUs"), bracketed by the
next batch tried. It answers the question the study is run for, and by construction no point of the
accuracy plot contradicts it. The diagnostics estimate a critical batch in other terms and often
disagree with it (FIT_CAVEAT, B_SIMPLE_CAVEAT say why):

From steps to target: S = S_min (1 + B_noise / B) fitted to each trained job's interpolated steps to
the target across global batches (McCandlish et al. 2018, eq. 2.11), with a 90% bootstrap interval
over seeds. From the gradient noise scale: the median over the series' rows of B_simple, summarised
over the last GNS_WINDOW of training, for a series stepped by plain SGD only. The series is the
baseline, unless fewer than 3 of its batches reach the target; then it is the series with the most
batches that do, and the report names it.
"""

from __future__ import annotations

import math
import statistics
import warnings
from typing import Any

from lbt.apps.report.jobs import Job, is_baseline
from lbt.apps.report.rows import GNS_WINDOW, Row
from lbt.metrics.critical import b_simple_undefined, bootstrap_fit, crossing_step
from lbt.spec.objective import ACC, Metric

MIN_FIT_BATCHES = 3  # the fit has two parameters: fewer batches cannot test it
SWEEP_METHOD = "sweep: largest global batch within tolerance of the base batch"
# Why each diagnostic can differ from the sweep's figure: report.md and summary.json say the same.
FIT_CAVEAT = ("It extrapolates McCandlish et al.'s trade-off curve between steps and samples, and measures steps "
              "to a target, not the final accuracy a fixed budget ends at.")
B_SIMPLE_CAVEAT = ("McCandlish et al.'s estimate for plain SGD with an isotropic Hessian, read late in training: "
                   "typically far below the batch where accuracy breaks (Merrill et al. 2025, arXiv:2505.23971).")
NOT_MEASURED = "not measured (run the study with measure=[gns] and dist.world_size >= 2)"


def critical_batch(jobs: list[Job], rows: list[Row], target: float | None, answer: dict[str, Any],
                   metric: Metric = ACC) -> dict[str, Any]:
    """summary.json's `critical_batch`: the figure the report leads with (`lead_figure`), the two estimates
    (`estimates`: fit..., gns..., flat, as lbt plan and bench/ read them) and both again as `diagnostics`,
    each with why it can differ from the figure."""
    crit = {**lead_figure(answer, rows, metric), **estimates(jobs, rows, target, metric)}
    crit["diagnostics"] = {
        "steps_to_target_fit": {"value": crit["fit"], "interval": crit["fit_interval"], "series": crit["series"],
                                "runs": crit["fit_points"], "reason": crit["fit_error"], "why_it_differs": FIT_CAVEAT},
        "b_simple": {"value": crit["gns"], "series": crit["gns_series"], "last_fraction": GNS_WINDOW,
                     "reason": crit["gns_note"], "why_it_differs": B_SIMPLE_CAVEAT},
    }
    return crit


def withhold_figures(crit: dict[str, Any], reason: str) -> dict[str, Any]:
    """summary.json's critical_batch of a study that gives no answer (trust.py): every figure lbt plan or a
    script could take for the critical batch (value, fit, gns, ratio) is None and `withheld` says why; the
    diagnostics keep what the finished jobs measured, as report.md shows them."""
    return {**crit, "withheld": reason, "value": None, "held": None, "fit": None, "fit_interval": None,
            "gns": None, "ratio": None}


def lead_figure(answer: dict[str, Any], rows: list[Row], metric: Metric = ACC) -> dict[str, Any]:
    """The one critical-batch figure: the best recipe's largest global batch within the tolerance of the
    base batch (`held`), the batch it tried next (`failed`, `failed_by` units worse than the base), the seeds
    and spread there, and how many runs the sweep measured it from."""
    best, base, m = answer.get("best"), answer.get("reference"), metric.name
    figure: dict[str, Any] = {
        "value": None, "method": SWEEP_METHOD, "metric": m, "tolerance": answer["tolerance"],
        "split": answer["split"], "base": base, "runs": sum(r.seeds for r in rows if r.split == answer["split"]),
        "recipe": None, "held": None, "failed": None,
    }
    if not best or not base:
        return figure
    failed_value = finite(best[f"next_{m}"])
    figure.update(
        value=best["global_batch"], recipe=best["recipe"], held=best["global_batch"], held_value=best[m],
        held_std=best[f"{m}_std"], seeds=best["seeds"], held_by=metric.gap(best[m], base[m]),
        failed=best["next_batch"], failed_value=failed_value,
        failed_by=None if failed_value is None else metric.gap(failed_value, base[m]),
        largest_run=best["largest_batch_run"])
    return figure


def finite(value: float | None) -> float | None:
    """A value summary.json can hold: None for NaN (a diverged batch has no final value)."""
    return value if value is not None and math.isfinite(value) else None


def crossings(jobs: list[Job], series: str, target: float | None, metric: Metric) -> dict[float, list[float]]:
    """Each trained job's interpolated steps to `target`, by global batch, for one series."""
    points: dict[float, list[float]] = {}
    if target is None:
        return points
    for job in jobs:
        if job.series != series or not job.result.trained:
            continue
        step = crossing_step(job.result.history, target, metric=metric)
        if step is not None and step > 0:
            points.setdefault(job.result.global_batch, []).append(step)
    return points


def estimates(jobs: list[Job], rows: list[Row], target: float | None, metric: Metric = ACC) -> dict[str, Any]:
    """The diagnostics: fit (with fit_interval, s_min, e_min, fit_points, or fit_error saying why there is
    none) and gns (B_simple, of gns_series, or gns_note saying why there is none), and their ratio."""
    names = sorted({r.recipe for r in rows}, key=lambda name: (not is_baseline(name), name))
    reached = {name: crossings(jobs, name, target, metric) for name in names}
    series = names[0] if names else None
    if series is not None and len(reached[series]) < MIN_FIT_BATCHES:
        series = max(names, key=lambda name: len(reached[name]))  # the first of equals: the baseline
    points = reached[series] if series is not None else {}
    # B_simple of the fit's series where it is measured (and defined: rows hold None where it is not), else
    # of the first series that has it (the baseline first).
    measured = [n for n in names if any(r.b_simple is not None for r in rows if r.recipe == n)]
    gns_series = series if series in measured or not measured else measured[0]
    b_simple = [r.b_simple for r in rows if r.recipe == gns_series and r.b_simple is not None]
    optimizer = next((r.optimizer for r in rows if r.recipe == gns_series), None)
    result: dict[str, Any] = {
        "series": series, "target": target, "fit": None, "fit_interval": None, "s_min": None, "e_min": None,
        "fit_points": sum(len(v) for v in points.values()), "fit_error": None,
        "gns": statistics.median(b_simple) if b_simple else None, "gns_series": gns_series,
        "gns_window": GNS_WINDOW, "gns_note": None, "ratio": None,
    }
    if result["gns"] is None:
        result["gns_note"] = b_simple_undefined(optimizer) or NOT_MEASURED
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # resamples that fail to fit only narrow the sample
            fit, interval = bootstrap_fit(points)
        result.update(fit=fit.b_crit, fit_interval=list(interval), s_min=fit.s_min, e_min=fit.e_min)
    except ValueError as error:
        batches = ", ".join(f"{b:,}" for b in sorted(points)) or "none"
        result["fit_error"] = f"{error} (batches reaching the target: {batches})"
    if result["fit"] and result["gns"] and gns_series == series:  # a ratio of one series' two estimates
        result["ratio"] = result["fit"] / result["gns"]
    return result
