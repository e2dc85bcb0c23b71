"""The answer a study is run for: how many GPUs can I use, and with which recipe?

`gpu_answer` finds, per recipe, the largest global batch whose final value (on the split the runs
select on, never test) stays within a tolerance of the smallest batch's baseline, and the world size
there. With a network, `time_to_accuracy` adds which of those GPU counts reaches the target soonest:
steps to target (measured) x the step time lbt plan's cost model predicts at that world size.
`answer_lines` writes both as the report's last section. A study whose data cannot carry an answer
(trust.py: jobs missing or failed, one batch measured, a base batch that did not learn) gets none:
`withhold` keeps what the runs measured and drops what would answer.
"""

from __future__ import annotations

import math
from typing import Any

from lbt.apps.judging import critical_bracket, holds, tolerance_floor
from lbt.apps.plan.compute import compute_from_result, compute_from_step_ms
from lbt.apps.report.jobs import Job, is_baseline
from lbt.apps.report.rows import Row, char_level, shown, study_split
from lbt.apps.tables import table
from lbt.apps.words import gpus
from lbt.cost.data_parallel import NETWORKS, Compute, scaling_rows
from lbt.engine.build import data_shape
from lbt.errors import ConfigError
from lbt.spec.objective import ACC, Metric, metric_named
from lbt.spec.targets import target_of


def gpu_answer(rows: list[Row], tolerance: float, metric: Metric = ACC) -> dict[str, Any]:
    """How many GPUs: per recipe, the largest global batch whose mean final `metric` (on the selection
    split) stays within `tolerance` (the metric's units: accuracy points, nats of loss) of the smallest
    batch's baseline, and the world size there.

    Judged on the split the runs select on (val when there is one), never on test; test is shown beside.
    Entries are named after the metric (`acc`, `acc_std`, `test_acc`, `next_acc`; `loss`, ...).
    """
    split, m, char = study_split(rows), metric.name, char_level(rows)
    # A batch every seed of which diverged or failed has no final value, but was tried and lost: it bounds the answer.
    tried = [r for r in rows if r.split == split and (math.isfinite(r.final(metric)) or r.diverged or r.errors)]
    scored = [r for r in tried if math.isfinite(r.final(metric))]
    if not scored:
        return {"metric": m, "tolerance": tolerance, "split": split, "reference": None, "recipes": [], "best": None,
                "bits_per_char": char}
    smallest = min(r.global_batch for r in scored)
    at_smallest = [r for r in scored if r.global_batch == smallest]
    reference = ([r for r in at_smallest if is_baseline(r.recipe)] or at_smallest)[0]
    floor = tolerance_floor(reference.final(metric), tolerance, metric)
    recipes = [recipe_answer([r for r in tried if r.recipe == recipe], floor, metric)
               for recipe in sorted({r.recipe for r in scored})]
    ranked = [r for r in recipes if r["global_batch"]]
    best = max(ranked, key=lambda r: (r["global_batch"], metric.score(r[m]))) if ranked else None
    return {"metric": m, "tolerance": tolerance, "split": split, "floor": floor, "best": best, "recipes": recipes,
            "bits_per_char": char,
            "reference": {"recipe": reference.recipe, "global_batch": smallest, m: reference.final(metric)}}


def withhold(answer: dict[str, Any], reasons: list[str]) -> dict[str, Any]:
    """summary.json's gpu_answer of a study that gives no answer: the base it was measured from, why it is
    withheld, and no recipe's largest batch, best recipe or floor for anything downstream to read."""
    return {**answer, "withheld": "; ".join(reasons), "floor": None, "best": None, "recipes": []}


def recipe_answer(rows: list[Row], floor: float, metric: Metric) -> dict[str, Any]:
    """One recipe's entry: its largest batch at or beyond `floor` that did not diverge, and the next batch tried
    (its value None where every seed there diverged or failed)."""
    m = metric.name
    mine = sorted(rows, key=lambda r: r.global_batch)
    at = {r.global_batch: r for r in mine}
    bracket = critical_bracket({r.global_batch: holds(r.final(metric), floor, metric) and not r.diverged
                                for r in mine})
    top = None if bracket.held is None else at[bracket.held]
    beyond = None if bracket.failed is None else at[bracket.failed]
    return {
        "recipe": mine[0].recipe, "global_batch": top and top.global_batch, "world_size": top and top.world_size,
        m: top and top.final(metric), f"{m}_std": top and top.final_std(metric), "seeds": top and top.seeds,
        f"test_{m}": top and top.test(metric), "largest_batch_run": mine[-1].global_batch,
        "next_batch": beyond and beyond.global_batch,
        f"next_{m}": beyond.final(metric) if beyond and math.isfinite(beyond.final(metric)) else None,
    }


def time_to_accuracy(rows: list[Row], answer: dict[str, Any], jobs: list[Job], network: str,
                     step_ms: float | None = None) -> dict[str, Any]:
    """With a network (and lbt plan's model of a step), the GPU count that reaches the target soonest
    within the tolerance: steps to target (measured) x the step time plan predicts at that world size."""
    if network not in NETWORKS:
        raise ConfigError(f"--network {network}: choose one of {', '.join(sorted(NETWORKS))}")
    compute = worker_compute(jobs, step_ms)
    floor, metric = answer.get("floor"), metric_named(answer["metric"], "metric")
    options: list[dict[str, Any]] = []
    for r in rows:
        if r.split != answer["split"] or r.steps_to_target is None or r.diverged or floor is None \
                or not holds(r.final(metric), floor, metric):
            continue
        step_s = scaling_rows(compute, NETWORKS[network], [r.world_size], 1)[0].step_s
        options.append({"recipe": r.recipe, "world_size": r.world_size, "global_batch": r.global_batch,
                        "steps_to_target": r.steps_to_target, "step_s": step_s,
                        "seconds": r.steps_to_target * step_s})
    best = min(options, key=lambda o: o["seconds"]) if options else None
    return {"network": network, "compute": compute.source, "options": options, "best": best}


def worker_compute(jobs: list[Job], step_ms: float | None) -> Compute:
    """A worker's compute per step: `step_ms` (measured elsewhere, e.g. on a GPU) for the study's model,
    else the samples/s of its smallest-world-size run (the baseline's first) on this machine."""
    done = sorted((job for job in jobs if not job.result.failed and job.result.samples_per_sec and job.result.config),
                  key=lambda job: (job.result.world_size, not is_baseline(job.series)))
    if not done:
        raise ConfigError("no finished run with timings to model a step from")
    source = done[0]
    try:
        if step_ms is None:
            compute, _, _ = compute_from_result(source.path)
            return compute
        model = target_of(source.result.config.get("model"), "model")
        shape = data_shape(target_of(source.result.config.get("data"), "data"))
        return compute_from_step_ms(step_ms, model, shape, source.result.per_worker_batch, model.target)
    except ValueError as error:  # plan's reader names the file it could not use: one line, not a traceback
        raise ConfigError(str(error)) from None


def answer_lines(answer: dict[str, Any], warnings: list[str] | tuple = ()) -> list[str]:
    """The report's last section: the answer to "how many GPUs can I use, with which recipe?", or why there is
    none; `warnings` (trust.py's headlines: "the base batch is undertrained") stand just above the answer."""
    lines = ["", "## How many GPUs?", ""]
    if answer.get("withheld"):
        return lines + [f"No answer: {answer['withheld']} (the top of this report says what it needs)."]
    if answer["reference"] is None:
        return lines + ["No run finished: no answer."]
    lines += recipe_table_lines(answer)
    if answer["best"] and warnings:
        lines += ["", f"Warning, see the top of this report: {'; '.join(warnings)}. Trust the answer below only "
                      "after that is fixed."]
    metric, best, split = metric_named(answer["metric"], "metric"), answer["best"], answer["split"]
    within = metric.units(answer["tolerance"])
    if best:
        lines += ["", f"**Answer: up to {gpus(best['world_size'])} (global batch {best['global_batch']:,}) with "
                      f"{best['recipe']}**, within {within} of the smallest batch on "
                      f"{split}; past that, {metric.label} is more than {within} worse (or the run is lost). "
                      "Whether those GPUs also pay in time is `lbt plan`'s question (time per epoch vs GPU count)."]
    if answer.get("time_to_accuracy"):
        lines += time_to_accuracy_lines(answer["time_to_accuracy"])
    return lines


def recipe_table_lines(answer: dict[str, Any]) -> list[str]:
    """The reference the tolerance is counted from, and per recipe its largest batch within it."""
    ref, split = answer["reference"], answer["split"]
    metric = metric_named(answer["metric"], "metric")
    m, show, within = metric.name, metric.show, metric.units(answer["tolerance"])
    unit, base = "%" if metric.suffix else "nats", shown(metric, ref[m], answer.get("bits_per_char"))
    lines = [f"Within **{within}** of {ref['recipe']} at the smallest global batch "
             f"({ref['global_batch']:,}: final {split} {m} {base}), "
             f"judged on {split} (`lbt report DIR --tolerance {metric.unit.upper()}S` to change it):", ""]
    header = ["recipe", "largest global batch within", "GPUs (world size)",
              f"final {split} {m}, {unit} (mean ± std, seeds)", f"test {m}, {unit}", f"next batch tried: {m}"]
    rows: list[list[str]] = []
    for r in answer["recipes"]:
        if r["global_batch"] is None:
            rows.append([r["recipe"], "none", "-", "-", "-", f"every batch tried is more than {within} worse"])
            continue
        spread = f" ± {show(r[f'{m}_std'])}" if r["seeds"] and r["seeds"] > 1 else ""
        following = (f"{r['next_batch']:,}: {shown(metric, r[f'next_{m}'])}"
                     if r["next_batch"] and r[f"next_{m}"] is not None
                     else "none larger tried" if r["global_batch"] == r["largest_batch_run"]
                     else f"{r['next_batch']:,}: diverged or failed")
        rows.append([r["recipe"], f"{r['global_batch']:,}", str(r["world_size"]),
                     f"{show(r[m])}{spread} ({r['seeds']})", show(r[f"test_{m}"]), following])
    return lines + table(header, "lrrrrl", rows)


def time_to_accuracy_lines(tta: dict[str, Any]) -> list[str]:
    """Each GPU count within the tolerance, fastest first, and the fastest named."""
    lines = ["", f"Time to accuracy on {tta['network']} (steps to the target, measured, x lbt plan's step time "
                 f"at that world size; compute {tta['compute']}):", "",
             *table(["recipe", "GPUs", "global batch", "steps to target", "step (ms)", "time to target (s)"],
                    "lrrrrr", ([o["recipe"], o["world_size"], f"{o['global_batch']:,}", f"{o['steps_to_target']:,.0f}",
                                f"{1e3 * o['step_s']:.2f}", f"{o['seconds']:,.2f}"]
                               for o in sorted(tta["options"], key=lambda o: o["seconds"])))]
    best = tta["best"]
    lines += ["", f"**Fastest within the tolerance: {gpus(best['world_size'])} with {best['recipe']}** "
                  f"({best['seconds']:,.2f} s to the target)." if best else
              "No run within the tolerance reached the target: no time to compare."]
    return lines
