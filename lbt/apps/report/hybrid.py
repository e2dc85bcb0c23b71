"""More GPUs without a bigger batch: the study's points of data x tensor parallelism past a batch cap.

For each recipe with a cap and each GPU count W of the study, T is the smallest power of two that keeps
the global batch b x W / T at or below the cap (`dist.tensor_parallel=auto`). Tensor parallelism is exact,
so the W-GPU hybrid scores what the W/T-worker data-parallel run at that batch scored: a point is "run"
when a job ran it as DP x T, else it follows from exactness. Only points with T > 1 are listed (below the
cap the hybrid is data parallelism). A T that cannot split the recipe's model (a layer width or head count
it does not divide) gives a point marked `impossible`, with no score: exactness says nothing about a run
lbt cannot start.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from lbt.apps.report.jobs import Job
from lbt.apps.report.rows import Row
from lbt.apps.tables import table
from lbt.engine.build import build_model, data_shape
from lbt.errors import ConfigError
from lbt.parallel.tensor_parallel import dense_splits, why_not
from lbt.spec.batching import auto_tensor_parallel
from lbt.spec.objective import ACC, Metric
from lbt.spec.targets import target_of

Refusal = Callable[[int], str | None]  # T -> why T cannot split the model (None: it can)


def hybrid_caps(answer: dict[str, Any], cap: int | None) -> dict[str, int]:
    """Each recipe's batch cap: the one given, else its largest global batch within the tolerance."""
    return {r["recipe"]: cap or r["global_batch"] for r in answer["recipes"] if cap or r["global_batch"]}


def hybrid_points(rows: list[Row], jobs: list[Job], caps: dict[str, int], metric: Metric = ACC) -> list[dict[str, Any]]:
    """The hybrid points of every capped recipe, as summary.json's `hybrid`."""
    return [point for recipe, cap in sorted(caps.items()) for point in recipe_points(recipe, cap, rows, jobs, metric)]


def recipe_points(recipe: str, cap: int, rows: list[Row], jobs: list[Job], metric: Metric) -> list[dict[str, Any]]:
    """One recipe's hybrid point at each GPU count of the study whose batch b x W the cap holds back."""
    scored = {r.global_batch: r for r in rows if r.recipe == recipe and math.isfinite(r.final(metric))}
    done = [job for job in jobs if job.series == recipe and not job.result.failed and job.result.per_worker_batch]
    if not done:
        return []
    per_worker_batch = done[0].result.per_worker_batch
    refusal = split_refusal(done[0].result.config)
    points = []
    for gpus in sorted({job.result.world_size for job in done}):
        try:
            t = auto_tensor_parallel(gpus, per_worker_batch, cap)
        except ConfigError:  # the cap cannot be kept at this GPU count: no point
            continue
        row = scored.get(per_worker_batch * gpus // t)
        if t == 1 or row is None:
            continue
        layout = {"recipe": recipe, "gpus": gpus, "tensor_parallel": t, "data_parallel": gpus // t,
                  "global_batch": row.global_batch, "cap": cap}
        reason = refusal(t)
        if reason is not None:
            points.append({**layout, "impossible": reason})
            continue
        unsplit = scored.get(per_worker_batch * gpus)  # the same GPUs growing the batch instead
        points.append({**layout, metric.name: row.final(metric), f"{metric.name}_std": row.final_std(metric),
                       "seeds": row.seeds, "data_parallel_only": None if unsplit is None else unsplit.final(metric),
                       "source": point_source(row, jobs, gpus, t, metric)})
    return points


def split_refusal(config: dict[str, Any]) -> Refusal:
    """A function T -> why T cannot split the model this job config trains (None: it can), as
    lbt/parallel/tensor_parallel.py would refuse it; without a config (older result.json) it refuses nothing."""
    if not config or "model" not in config or "data" not in config:
        return lambda t: None
    shape = data_shape(target_of(config["data"], "data"))
    splits = dense_splits(build_model(target_of(config["model"], "model"), shape.input_shape, shape.num_classes))
    return lambda t: why_not(splits, t)


def point_source(row: Row, jobs: list[Job], gpus: int, t: int, metric: Metric) -> str:
    """Where a hybrid point's score comes from: 'run (...)', each DP x T run's score beside its seed's
    data-parallel twin (float order may differ), or exactness from the W/T-worker data-parallel run."""
    members = [job for job in jobs if job.job_dir in set(row.jobs)]
    hybrids = [job for job in members if job.result.tensor_parallel == t and job.result.world_size == gpus]
    if not hybrids:
        return f"exactness: the {gpus // t}-worker data-parallel run"
    parts = []
    for job in hybrids:
        twin = next((j for j in members if j.result.seed == job.result.seed and j.result.tensor_parallel == 1
                     and not j.result.failed), None)
        text = (f"seed {job.result.seed}: {metric.show(job.final(metric))}{metric.suffix}" if not job.result.failed
                else "failed")
        if twin is not None:
            text += f", its data-parallel run {metric.show(twin.final(metric))}{metric.suffix}"
        parts.append(text)
    return f"run ({'; '.join(parts)})"


def hybrid_lines(points: list[dict[str, Any]], split: str, metric: Metric, given_cap: bool) -> list[str]:
    """The report's section on the hybrid points (none without points)."""
    if not points:
        return []
    m, show = metric.name, metric.show
    cap_from = ("the cap given (`--hybrid-cap`)" if given_cap else
                "each recipe's largest global batch within the tolerance (see \"How many GPUs?\" below; "
                "`--hybrid-cap B` to choose)")
    lines = ["", "## More GPUs without a bigger batch: data x tensor parallelism", "",
             f"Past the cap, {cap_from}, the GPUs split each worker's dense layers (`dist.tensor_parallel=auto "
             "dist.max_global_batch=CAP`, lbt/parallel/tensor_parallel.py) instead of growing the batch. Tensor "
             "parallelism does not change the math, so a W-GPU hybrid scores what the data-parallel run at W/T "
             "workers scored; the last column says which points were run as DP x T and which follow from exactness. "
             "Whether the extra GPUs pay in time: `lbt plan plan.tensor_parallel=auto`.", ""]
    rows = []
    for p in points:
        where = [p["recipe"], p["gpus"], f"{p['data_parallel']} x {p['tensor_parallel']}",
                 f"{p['global_batch']:,} ({p['cap']:,})"]
        if "impossible" in p:
            rows.append([*where, "-", "-", f"not possible: {p['impossible']}"])
            continue
        spread = f" ± {show(p[f'{m}_std'])}" if p["seeds"] > 1 else ""
        only = "not run" if p["data_parallel_only"] is None else f"{show(p['data_parallel_only'])}{metric.suffix}"
        rows.append([*where, f"{show(p[m])}{metric.suffix}{spread} ({p['seeds']})", only, p["source"]])
    header = ["recipe", "GPUs", "DP x T", "global batch (cap)", f"final {split} {m}, hybrid",
              f"final {split} {m}, data parallel only", "hybrid point"]
    return lines + table(header, "lrrrrrl", rows)
