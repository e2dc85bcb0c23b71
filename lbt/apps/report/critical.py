"""The critical batch of a study: one figure, and two diagnostics (lbt/metrics/critical.py does the math).

The figure (`lead_figure`) is the sweep's own measurement: the largest global batch whose mean final
value stays within the tolerance of the base batch's, with the next batch tried. It answers the
question the study is run for, and by construction no point of the accuracy plot contradicts it.
The diagnostics estimate a critical batch in other terms and often disagree with it:

From steps to target: S = S_min (1 + B_noise / B) fitted to each trained job's interpolated steps to
the target across global batches (McCandlish et al. 2018, eq. 2.11), with a 90% bootstrap interval
over seeds. From the gradient noise scale: the median over the series' rows of B_simple, summarised
over the last GNS_WINDOW of training. The series is the baseline, unless fewer than 3 of its batches
reach the target; then it is the series with the most batches that do, and the report names it.
"""

from __future__ import annotations

import statistics
import warnings
from typing import Any

from lbt.apps.report.jobs import Job, is_baseline
from lbt.apps.report.rows import GNS_WINDOW, Row
from lbt.metrics.critical import bootstrap_fit, crossing_step
from lbt.spec.objective import ACC, Metric

MIN_FIT_BATCHES = 3  # the fit has two parameters: fewer batches cannot test it


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


def critical_batch(jobs: list[Job], rows: list[Row], target: float | None, metric: Metric = ACC) -> dict[str, Any]:
    """Both estimates, as summary.json's `critical_batch`: fit (with fit_interval, s_min, e_min, fit_points,
    or fit_error saying why there is none), gns, and their ratio."""
    names = sorted({r.recipe for r in rows}, key=lambda name: (not is_baseline(name), name))
    reached = {name: crossings(jobs, name, target, metric) for name in names}
    series = names[0] if names else None
    if series is not None and len(reached[series]) < MIN_FIT_BATCHES:
        series = max(names, key=lambda name: len(reached[name]))  # the first of equals: the baseline
    points = reached[series] if series is not None else {}
    b_simple = [r.b_simple for r in rows if r.recipe == series and r.b_simple is not None]
    result: dict[str, Any] = {
        "series": series, "target": target, "fit": None, "fit_interval": None, "s_min": None, "e_min": None,
        "fit_points": sum(len(v) for v in points.values()), "fit_error": None,
        "gns": statistics.median(b_simple) if b_simple else None, "gns_window": GNS_WINDOW, "ratio": None,
    }
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # resamples that fail to fit only narrow the sample
            fit, interval = bootstrap_fit(points)
        result.update(fit=fit.b_crit, fit_interval=list(interval), s_min=fit.s_min, e_min=fit.e_min)
    except ValueError as error:
        batches = ", ".join(f"{b:,}" for b in sorted(points)) or "none"
        result["fit_error"] = f"{error} (batches reaching the target: {batches})"
    optimizer = optimizer_of(jobs, series)
    if result["gns"] is not None and optimizer not in ("SGD", "unknown"):
        result["gns"], result["gns_note"] = None, (
            f"not defined for {optimizer}: B_simple is the noise scale of plain SGD's step, and {optimizer}'s step "
            "is not the raw gradient")
    if result["fit"] and result["gns"]:
        result["ratio"] = result["fit"] / result["gns"]
    return result


def optimizer_of(jobs: list[Job], series: str | None) -> str:
    """The series' optimizer class name (`SGD`, `LARS`, `AdamW`), from its jobs' configs."""
    for job in jobs:
        if job.series == series:
            optim = (job.result.config or {}).get("optim") or {}
            name = str(optim.get("optimizer_class") or optim.get("_target_") or "")
            return name.rsplit(".", 1)[-1] or "unknown"
    return "unknown"


def lead_figure(answer: dict[str, Any]) -> dict[str, Any]:
    """The one critical-batch figure the report leads with: the sweep's largest global batch within the
    tolerance of the base batch (the best recipe's), the batch tried next, and how it was measured."""
    best, reference, m = answer.get("best"), answer.get("reference") or {}, answer["metric"]
    method = (f"sweep: the largest global batch whose mean final {answer['split']} {m} stays within "
              f"{answer['tolerance']:g} of the base batch's ({reference.get('global_batch')})")
    if not best:
        return {"value": None, "method": method, "recipe": None, "failed": None}
    return {"value": best["global_batch"], "method": method, "recipe": best["recipe"], "failed": best["next_batch"],
            "failed_value": best[f"next_{m}"], "largest_run": best["largest_batch_run"]}
