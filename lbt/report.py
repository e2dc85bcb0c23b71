"""`lbt report DIR`: a study (Hydra multirun folder) -> table, curves, TensorBoard summary.

Reads every job's result.json under DIR and writes into DIR: report.md,
accuracy_vs_batch.png, steps_to_target.png (with the fitted critical-batch
curve), gns_over_training.png, summary.json and tb_summary/ (scalars whose
step axis is the global batch, plus an HParams table). Jobs that share recipe
and global batch (several seeds) are averaged, with their standard deviation.

Every number is named after the split it was measured on: `val` is held out
of the training set and is what runs select on (best, steps-to-target);
`test` is scored once per run, at the end. A study whose runs have no
validation split evaluated test during training, and its columns say test.

The report judges runs by accuracy (`--metric acc`, the default) or by loss
(`--metric loss`, lower is better; a language model's also reads as bits per
char): the target, steps to it and "how many GPUs" all compare through
lbt/objective.py's Metric; accuracy_vs_batch.png is then loss_vs_batch.png.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from lbt.config import auto_tensor_parallel
from lbt.critical import bootstrap_fit, crossing_step, gns_summary
from lbt.errors import ConfigError
from lbt.objective import ACC, Metric, metric_named

SUMMARY_DIR = "tb_summary"
# The default target (the base batch's final value, on the selection split, made worse by the metric's
# target_margin) and the default tolerance of "how many GPUs" are the metric's: lbt/objective.py.
GNS_WINDOW = 0.2  # B_simple is summarised over this last fraction of training


@dataclass
class Row:
    """One (recipe, global batch) point of a study, averaged over seeds."""

    recipe: str
    global_batch: int
    world_size: int
    seeds: int
    split: str  # the split the runs evaluated during training: "val", or "test" without a validation split
    final_acc: float  # on `split`
    final_acc_std: float
    best_acc: float
    test_acc: float | None  # scored once per run, at the end
    test_acc_std: float | None
    gap: float | None  # the report metric on test minus the smallest-batch baseline's, in its units
    steps: float
    steps_to_target: float | None  # interpolated crossing on `split`, mean over seeds
    steps_to_target_std: float | None
    samples_per_sec: float
    diverged: int
    errors: int
    b_simple: float | None  # gradient noise scale over the last GNS_WINDOW of training, median over seeds
    jobs: list[str] = field(default_factory=list)
    final_loss: float = math.nan  # on `split`
    final_loss_std: float = math.nan
    best_loss: float = math.nan
    test_loss: float | None = None
    test_loss_std: float | None = None
    bits_per_char: float | None = None  # a language model's final loss on `split` in bits (data=text)
    test_bits_per_char: float | None = None
    # Model-sized allreduces per run and the bytes each worker sent (mean over seeds): accuracy against communication.
    allreduces: float | None = None
    bytes_sent: float | None = None

    def final(self, metric: Metric) -> float:
        """The final value of `metric` on `split` (mean over seeds): final_acc or final_loss."""
        return getattr(self, f"final_{metric.name}")

    def final_std(self, metric: Metric) -> float:
        return getattr(self, f"final_{metric.name}_std")

    def test(self, metric: Metric) -> float | None:
        return getattr(self, f"test_{metric.name}")


def load_jobs(study_dir: Path) -> list[dict]:
    jobs = []
    for path in sorted(study_dir.rglob("result.json")):
        if SUMMARY_DIR in path.parts:
            continue
        job = json.loads(path.read_text())
        job["job_dir"] = str(path.parent.relative_to(study_dir))
        job.setdefault("eval_split", "val")
        jobs.append(job)
    # Only overrides that differ between jobs make a variant; ones shared by all are the study's setting.
    shared = set.intersection(*(set(j.get("overrides", [])) for j in jobs)) if jobs else set()
    for job in jobs:
        job["swept"] = [o for o in job.get("overrides", []) if o not in shared]
        job["series"] = series_name(job)
    return jobs


def _on(job: dict, what: str):
    """A job's number on the split it evaluated during training: _on(job, "final_{}_acc")."""
    return job.get(what.format(job["eval_split"]))


def _mean_std(values: list[float]) -> tuple[float, float]:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return float("nan"), float("nan")
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


# Overrides that place a job on the curve (batch) or average it (seed), not a variant of the recipe.
# Tensor parallelism is exact (lbt/tensor_parallel.py): a DP x T run is a point of its recipe's curve at its
# global batch, beside the data-parallel runs at that batch.
_AXIS_KEYS = ("recipe", "study", "trainer.seed", "dist.world_size", "dist.procs", "trainer.per_worker_batch",
              "trainer.global_batch", "hydra.", "trainer.progress", "dist.tensor_parallel", "dist.max_global_batch")


def series_name(job: dict) -> str:
    """The recipe, plus any other swept setting (`lars (optim.lr=20)`): one curve each."""
    extra = [o for o in job.get("overrides", []) if o.split("=", 1)[0].lstrip("+~") not in _AXIS_KEYS
             and not o.startswith("hydra.")]
    swept = [o for o in extra if o in job.get("swept", extra)]
    recipe = job.get("recipe", "?")
    return f"{recipe} ({', '.join(swept)})" if swept else recipe


def _groups(jobs: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for job in jobs:
        groups.setdefault((job["series"], int(job.get("global_batch") or 0)), []).append(job)
    return dict(sorted(groups.items()))


def default_target(jobs: list[dict], metric: Metric = ACC) -> float | None:
    """The base batch's final value of `metric` (the baseline's, mean over seeds), made worse by the
    metric's target margin (accuracy: minus 1 point)."""
    trained = [j for j in jobs if "error" not in j and not j.get("diverged")]
    if not trained:
        return None
    smallest = min(int(j["global_batch"]) for j in trained)
    at_smallest = [j for j in trained if int(j["global_batch"]) == smallest]
    baseline = [j for j in at_smallest if j.get("recipe") == "baseline"] or at_smallest
    value, _ = _mean_std([_on(j, "final_{}_" + metric.name) for j in baseline])
    return metric.worse_by(value, metric.target_margin) if math.isfinite(value) else None


def _test_mean_std(jobs: list[dict], key: str) -> tuple[float | None, float | None]:
    values = [j[key] for j in jobs if j.get(key) is not None]
    return _mean_std(values) if values else (None, None)


def one_per_seed(jobs: list[dict]) -> list[dict]:
    """The jobs that are samples of a (recipe, batch) point: a DP x T run repeats the data-parallel run of
    its seed (tensor parallelism is exact), so where that run finished it is not another sample."""
    finished = {j.get("seed") for j in jobs if int(j.get("tensor_parallel") or 1) == 1 and "error" not in j}
    return [j for j in jobs if int(j.get("tensor_parallel") or 1) == 1 or j.get("seed") not in finished]


def aggregate(jobs: list[dict], target: float | None, metric: Metric = ACC) -> list[Row]:
    rows = []
    for (recipe, batch), every in _groups(jobs).items():
        members = one_per_seed(every)
        ok = [j for j in members if "error" not in j]
        trained = [j for j in ok if not j.get("diverged")]
        final, final_std = _mean_std([_on(j, "final_{}_acc") for j in trained])
        test, test_std = _test_mean_std(trained, "test_acc")
        final_loss, final_loss_std = _mean_std([_on(j, "final_{}_loss") for j in trained])
        test_loss, test_loss_std = _test_mean_std(trained, "test_loss")
        reached = [crossing_step(_on(j, "{}_history") or [], target, metric=metric)
                   for j in trained] if target is not None else []
        reached = [r for r in reached if r is not None]
        stt, stt_std = _mean_std(reached) if reached and len(reached) == len(trained) else (None, None)
        b_simple = [gns_summary(j.get("technique_curves", {}).get("gns/b_simple", []), GNS_WINDOW) for j in ok]
        b_simple = [b for b in b_simple if b is not None]
        rows.append(Row(
            recipe=recipe, global_batch=batch, world_size=data_parallel(members[0]),
            seeds=len(members), split=members[0]["eval_split"], final_acc=final, final_acc_std=final_std,
            best_acc=_mean_std([_on(j, "best_{}_acc") for j in trained])[0],
            test_acc=test, test_acc_std=test_std, gap=None,
            steps=_mean_std([j["steps"] for j in ok])[0] if ok else float("nan"),
            steps_to_target=stt, steps_to_target_std=stt_std,
            samples_per_sec=_mean_std([j["samples_per_sec"] for j in ok])[0] if ok else float("nan"),
            diverged=sum(bool(j.get("diverged")) for j in ok), errors=len(members) - len(ok),
            b_simple=statistics.median(b_simple) if b_simple else None,
            jobs=[j["job_dir"] for j in every],
            final_loss=final_loss, final_loss_std=final_loss_std,
            best_loss=_mean_std([_on(j, "best_{}_loss") for j in trained])[0],
            test_loss=test_loss, test_loss_std=test_loss_std,
            bits_per_char=_optional(_mean_std([_on(j, "final_{}_bits_per_char") for j in trained])[0]),
            test_bits_per_char=_test_mean_std(trained, "test_bits_per_char")[0],
            allreduces=_mean_std([j["allreduces"] for j in ok if "allreduces" in j])[0] if ok else None,
            bytes_sent=_mean_std([j["bytes_sent"] for j in ok if "bytes_sent" in j])[0] if ok else None,
        ))
    reference = _reference(rows, metric)
    for row in rows:
        if reference is not None and row.test(metric) is not None:
            row.gap = (row.test(metric) - reference) / metric.unit_size
    return rows


def data_parallel(job: dict) -> int:
    """A job's data-parallel workers: its GPUs, or its GPUs / T under tensor parallelism."""
    return int(job.get("data_parallel") or job.get("world_size") or 0)


def hybrid_points(rows: list[Row], jobs: list[dict], caps: dict[str, int], metric: Metric = ACC) -> list[dict]:
    """Data x tensor parallelism past the batch cap (issue: more GPUs without a bigger batch).

    For each recipe with a cap and each GPU count W of the study, T is the smallest power of two that keeps
    the global batch b x W / T at or below the cap (`dist.tensor_parallel=auto`). Tensor parallelism is exact,
    so the W-GPU hybrid scores what the W/T-worker data-parallel run at that batch scored: a point is "run"
    when a job ran it as DP x T, else it follows from exactness (the data-parallel run at W/T).
    Only points with T > 1 (below the cap the hybrid is data parallelism). A T that cannot split the
    recipe's model (a layer width or head count it does not divide) gives a point marked `impossible`,
    with no score: exactness says nothing about a run lbt cannot start."""
    by_dir = {j["job_dir"]: j for j in jobs}
    points = []
    for recipe, cap in sorted(caps.items()):
        mine = {r.global_batch: r for r in rows if r.recipe == recipe and math.isfinite(r.final(metric))}
        done = [j for j in jobs if j.get("series") == recipe and "error" not in j and j.get("per_worker_batch")]
        b = int(done[0]["per_worker_batch"]) if done else 0
        refusal = split_refusal(done[0].get("config")) if done else (lambda t: None)
        for gpus in sorted({int(j["world_size"]) for j in done}):
            try:
                t = auto_tensor_parallel(gpus, b, cap)
            except ConfigError:
                continue
            row = mine.get(b * gpus // t)
            if t == 1 or row is None:
                continue
            reason = refusal(t)
            if reason is not None:
                points.append({"recipe": recipe, "gpus": gpus, "tensor_parallel": t, "data_parallel": gpus // t,
                               "global_batch": row.global_batch, "cap": cap, "impossible": reason})
                continue
            ran = [by_dir[d] for d in row.jobs
                   if by_dir[d].get("tensor_parallel") == t and by_dir[d].get("world_size") == gpus]
            points.append({"recipe": recipe, "gpus": gpus, "tensor_parallel": t, "data_parallel": gpus // t,
                           "global_batch": row.global_batch, "cap": cap, metric.name: row.final(metric),
                           f"{metric.name}_std": row.final_std(metric), "seeds": row.seeds,
                           "data_parallel_only": (mine.get(b * gpus).final(metric) if b * gpus in mine else None),
                           "source": _ran(ran, [by_dir[d] for d in row.jobs], metric) if ran
                           else f"exactness: the {gpus // t}-worker data-parallel run"})
    return points


def split_refusal(config: dict | None):
    """A function T -> why T cannot split the model this job config trains (None: it can), as
    lbt/tensor_parallel.py would refuse it; without a config (older result.json) it refuses nothing."""
    if not config or "model" not in config or "data" not in config:
        return lambda t: None
    from lbt.plan import build_model, data_shape
    from lbt.tensor_parallel import split_plan, why_not

    splits = split_plan(build_model(config["model"], data_shape(config["data"])))
    return lambda t: why_not(splits, t)


def _ran(hybrids: list[dict], members: list[dict], metric: Metric) -> str:
    """'run', with each DP x T run's score beside its seed's data-parallel twin (float order may differ)."""
    key = f"final_{{}}_{metric.name}"
    parts = []
    for job in hybrids:
        twin = next((j for j in members if j.get("seed") == job.get("seed") and int(j.get("tensor_parallel") or 1) == 1
                     and "error" not in j), None)
        value = _on(job, key)
        text = f"seed {job.get('seed')}: {metric.show(value)}{metric.suffix}" if value is not None else "failed"
        if twin is not None and _on(twin, key) is not None:
            text += f", its data-parallel run {metric.show(_on(twin, key))}{metric.suffix}"
        parts.append(text)
    return f"run ({'; '.join(parts)})"


def hybrid_caps(answer: dict, cap: int | None) -> dict[str, int]:
    """Each recipe's batch cap: the one given, else its largest global batch within the tolerance."""
    return {r["recipe"]: cap or r["global_batch"] for r in answer["recipes"] if cap or r["global_batch"]}


def hybrid_lines(points: list[dict], split: str, metric: Metric, given_cap: bool) -> list[str]:
    if not points:
        return []
    m, show = metric.name, metric.show
    cap_from = ("the cap given (`--hybrid-cap`)" if given_cap else
                "each recipe's largest global batch within the tolerance (see \"How many GPUs?\" below; "
                "`--hybrid-cap B` to choose)")
    lines = ["", "## More GPUs without a bigger batch: data x tensor parallelism", "",
             f"Past the cap, {cap_from}, the GPUs split each worker's dense layers (`dist.tensor_parallel=auto "
             "dist.max_global_batch=CAP`, lbt/tensor_parallel.py) instead of growing the batch. Tensor parallelism "
             "does not change the math, so a W-GPU hybrid scores what the data-parallel run at W/T workers "
             "scored; the last column says which points were run as DP x T and which follow from exactness. "
             "Whether the extra GPUs pay in time: `lbt plan --tensor-parallel auto`.", "",
             f"| recipe | GPUs | DP x T | global batch (cap) | final {split} {m}, hybrid | final {split} {m}, "
             "data parallel only | hybrid point |", "|---|---:|---:|---:|---:|---:|---|"]
    for p in points:
        if "impossible" in p:
            lines.append(f"| {p['recipe']} | {p['gpus']} | {p['data_parallel']} x {p['tensor_parallel']} | "
                         f"{p['global_batch']:,} ({p['cap']:,}) | - | - | not possible: {p['impossible']} |")
            continue
        spread = f" ± {show(p[f'{m}_std'])}" if p["seeds"] > 1 else ""
        only = "not run" if p["data_parallel_only"] is None else f"{show(p['data_parallel_only'])}{metric.suffix}"
        lines.append(f"| {p['recipe']} | {p['gpus']} | {p['data_parallel']} x {p['tensor_parallel']} | "
                     f"{p['global_batch']:,} ({p['cap']:,}) | {show(p[m])}{metric.suffix}{spread} ({p['seeds']}) | "
                     f"{only} | {p['source']} |")
    return lines


def _optional(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _reference(rows: list[Row], metric: Metric) -> float | None:
    """The test value of the baseline at the smallest global batch (any recipe there if no baseline)."""
    candidates = [r for r in rows if r.test(metric) is not None]
    if not candidates:
        return None
    smallest = min(r.global_batch for r in candidates)
    at_smallest = [r for r in candidates if r.global_batch == smallest]
    baseline = [r for r in at_smallest if r.recipe.split(" (")[0] == "baseline"]
    return (baseline or at_smallest)[0].test(metric)


def gpu_answer(rows: list[Row], tolerance: float, metric: Metric = ACC) -> dict:
    """How many GPUs: per recipe, the largest global batch whose mean final `metric` (on the selection
    split) stays within `tolerance` (the metric's units: accuracy points, nats of loss) of the smallest
    batch's baseline, and the world size there.

    Judged on the split the runs select on (val when there is one), never on test; test is shown beside.
    Entries are named after the metric (`acc`, `acc_std`, `test_acc`, `next_acc`; `loss`, ...).
    """
    split, m = "val" if any(r.split == "val" for r in rows) else "test", metric.name
    scored = [r for r in rows if r.split == split and math.isfinite(r.final(metric))]
    if not scored:
        return {"metric": m, "tolerance": tolerance, "split": split, "reference": None, "recipes": [], "best": None}
    smallest = min(r.global_batch for r in scored)
    at_smallest = [r for r in scored if r.global_batch == smallest]
    ref = ([r for r in at_smallest if _is_baseline(r.recipe)] or at_smallest)[0]
    floor = metric.worse_by(ref.final(metric), tolerance)  # the worst value still within the tolerance
    recipes = []
    for recipe in sorted({r.recipe for r in scored}):
        mine = sorted((r for r in scored if r.recipe == recipe), key=lambda r: r.global_batch)
        within = [r for r in mine if metric.reached(r.final(metric), floor) and not r.diverged]
        top = within[-1] if within else None
        beyond = next((r for r in mine if top and r.global_batch > top.global_batch), None)
        recipes.append({
            "recipe": recipe, "global_batch": top and top.global_batch, "world_size": top and top.world_size,
            m: top and top.final(metric), f"{m}_std": top and top.final_std(metric), "seeds": top and top.seeds,
            f"test_{m}": top and top.test(metric), "largest_batch_run": mine[-1].global_batch,
            "next_batch": beyond and beyond.global_batch, f"next_{m}": beyond and beyond.final(metric),
        })
    ranked = [r for r in recipes if r["global_batch"]]
    best = max(ranked, key=lambda r: (r["global_batch"], metric.score(r[m]))) if ranked else None
    return {"metric": m, "tolerance": tolerance, "split": split, "floor": floor, "best": best, "recipes": recipes,
            "reference": {"recipe": ref.recipe, "global_batch": smallest, m: ref.final(metric)}}


def time_to_accuracy(rows: list[Row], answer: dict, jobs: list[dict], study_dir: Path, network: str,
                     step_ms: float | None = None) -> dict:
    """With a network (and lbt plan's model of a step), the GPU count that reaches the target soonest
    within the tolerance: steps to target (measured) x the step time plan predicts at that world size.

    A worker's compute comes from `step_ms` (measured elsewhere, e.g. on a GPU) or from the study's
    smallest-batch run (its samples/s on this machine).
    """
    from lbt import plan as lbt_plan

    if network not in lbt_plan.NETWORKS:
        raise ConfigError(f"--network {network}: choose one of {', '.join(sorted(lbt_plan.NETWORKS))}")
    done = sorted((j for j in jobs if "error" not in j and j.get("samples_per_sec") and j.get("config")),
                  key=lambda j: (j["world_size"], not _is_baseline(j.get("series", ""))))
    if not done:
        raise ConfigError("no finished run with timings to model a step from")
    source = done[0]
    if step_ms is not None:
        config = source["config"]
        shape = lbt_plan.data_shape(config["data"])
        compute = lbt_plan.compute_from_step_ms(step_ms, config["model"], shape, int(source["per_worker_batch"]),
                                                config["model"].get("_target_", "model"))
    else:
        compute, _ = lbt_plan.compute_from_result(study_dir / source["job_dir"] / "result.json")
    net = lbt_plan.NETWORKS[network]
    floor, metric = answer.get("floor"), metric_named(answer["metric"], "metric")
    options = []
    for r in rows:
        if r.split != answer["split"] or r.steps_to_target is None or r.diverged or floor is None \
                or not metric.reached(r.final(metric), floor):
            continue
        step_s = lbt_plan.plan_rows(compute, net, [r.world_size], 1)[0].step_s
        options.append({"recipe": r.recipe, "world_size": r.world_size, "global_batch": r.global_batch,
                        "steps_to_target": r.steps_to_target, "step_s": step_s,
                        "seconds": r.steps_to_target * step_s})
    best = min(options, key=lambda o: o["seconds"]) if options else None
    return {"network": network, "compute": compute.source, "options": options, "best": best}


def answer_lines(answer: dict) -> list[str]:
    """The report's last section: the answer to "how many GPUs can I use, with which recipe?"."""
    ref, split, tol = answer["reference"], answer["split"], answer["tolerance"]
    metric = metric_named(answer["metric"], "metric")
    m, show, within = metric.name, metric.show, metric.units(tol)
    lines = ["", "## How many GPUs?", ""]
    if ref is None:
        return lines + ["No run finished: no answer."]
    lines += [f"Within **{within}** of {ref['recipe']} at the smallest global batch "
              f"({ref['global_batch']:,}: final {split} {m} {show(ref[m])}{metric.suffix}), judged on {split} "
              f"(`lbt report DIR --tolerance {metric.unit.upper()}S` to change it):", "",
              f"| recipe | largest global batch within | GPUs (world size) | final {split} {m} (mean ± std, seeds) | "
              f"test {m} | next batch tried: {m} |", "|---|---:|---:|---:|---:|---|"]
    for r in answer["recipes"]:
        if r["global_batch"] is None:
            lines.append(f"| {r['recipe']} | none | - | - | - | every batch tried is more than {within} worse |")
            continue
        spread = f" ± {show(r[f'{m}_std'])}" if r["seeds"] and r["seeds"] > 1 else ""
        nxt = (f"{r['next_batch']:,}: {show(r[f'next_{m}'])}{metric.suffix}"
               if r["next_batch"] and r[f"next_{m}"] is not None
               else "none larger tried" if r["global_batch"] == r["largest_batch_run"] else "diverged")
        lines.append(f"| {r['recipe']} | {r['global_batch']:,} | {r['world_size']} | {show(r[m])}{spread} "
                     f"({r['seeds']}) | {show(r[f'test_{m}'])} | {nxt} |")
    best = answer["best"]
    if best:
        lines += ["", f"**Answer: up to {best['world_size']} GPUs (global batch {best['global_batch']:,}) with "
                      f"{best['recipe']}**, within {within} of the smallest batch on "
                      f"{split}; past that, {metric.label} is more than {within} worse (or the run is lost). "
                      "Whether those GPUs also pay in time is `lbt plan`'s question (time per epoch vs GPU count)."]
    tta = answer.get("time_to_accuracy")
    if tta:
        lines += ["", f"Time to accuracy on {tta['network']} (steps to the target, measured, x lbt plan's step time "
                      f"at that world size; compute {tta['compute']}):", "",
                  "| recipe | GPUs | global batch | steps to target | step (ms) | time to target (s) |",
                  "|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {o['recipe']} | {o['world_size']} | {o['global_batch']:,} | {o['steps_to_target']:,.0f} | "
                  f"{1e3 * o['step_s']:.2f} | {o['seconds']:,.2f} |"
                  for o in sorted(tta["options"], key=lambda o: o["seconds"])]
        b = tta["best"]
        lines += ["", f"**Fastest within the tolerance: {b['world_size']} GPUs with {b['recipe']}** "
                      f"({b['seconds']:,.2f} s to the target)." if b else
                  "No run within the tolerance reached the target: no time to compare."]
    return lines


def _is_baseline(recipe: str) -> bool:
    return recipe.split(" (")[0] == "baseline"


def _crossings(jobs: list[dict], series: str, target: float | None, metric: Metric) -> dict[int, list[float]]:
    """Each trained job's interpolated steps to `target`, by global batch, for one series."""
    points: dict[int, list[float]] = {}
    for job in jobs:
        if job.get("series") != series or "error" in job or job.get("diverged") or target is None:
            continue
        step = crossing_step(_on(job, "{}_history") or [], target, metric=metric)
        if step is not None and step > 0:
            points.setdefault(int(job["global_batch"]), []).append(step)
    return points


def critical_batch(jobs: list[dict], rows: list[Row], target: float | None, metric: Metric = ACC) -> dict:
    """The critical batch two ways, on one series: the baseline, unless fewer than 3 of its batches
    reach the target, then the series with the most batches that do (the report names it).

    fit: S = S_min (1 + B_noise / B) fitted to each job's interpolated steps to
    `target` across global batches (McCandlish et al. 2018, eq. 2.11), with a
    90% bootstrap interval over seeds; gns: the median over the series' jobs of
    B_simple summarised over the last GNS_WINDOW of training.
    """
    names = sorted({r.recipe for r in rows}, key=lambda name: (not _is_baseline(name), name))
    reached = {name: _crossings(jobs, name, target, metric) for name in names}
    series = names[0] if names else None
    if series is not None and len(reached[series]) < 3:
        series = max(names, key=lambda name: len(reached[name]))  # the first of equals: the baseline
    points = reached.get(series, {})
    b_simple = [r.b_simple for r in rows if r.recipe == series and r.b_simple is not None]
    result = {"series": series, "target": target, "fit": None, "fit_interval": None, "s_min": None, "e_min": None,
              "fit_points": sum(len(v) for v in points.values()), "fit_error": None,
              "gns": statistics.median(b_simple) if b_simple else None, "gns_window": GNS_WINDOW, "ratio": None}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # resamples that fail to fit only narrow the sample
            fit, interval = bootstrap_fit(points)
        result.update(fit=fit.b_crit, fit_interval=list(interval), s_min=fit.s_min, e_min=fit.e_min)
    except ValueError as error:
        batches = ", ".join(f"{b:,}" for b in sorted(points)) or "none"
        result["fit_error"] = f"{error} (batches reaching the target: {batches})"
    if result["fit"] and result["gns"]:
        result["ratio"] = result["fit"] / result["gns"]
    return result


def _fmt(value, spec: str = ".4f", std=None) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    text = format(value, spec)
    return text + (f" ± {format(std, spec)}" if std else "")


def markdown(rows: list[Row], target: float | None, crit: dict, jobs: list[dict], answer: dict | None = None,
             metric: Metric = ACC, hybrid: list[dict] = (), hybrid_cap_given: bool = False) -> str:
    split = "val" if any(r.split == "val" for r in rows) else "test"
    lines = ["# lbt study report", ""]
    if split == "val":
        lines.append("Splits: **val** is held out of the training set and is what the runs select on (best "
                     "accuracy, steps to target); **test** is scored once per run, at the end.")
    else:
        lines.append("Splits: **no validation split** (data.val_fraction=0): the runs evaluated the **test** split "
                     "during training, so every number below is a test number and says so. Hold out a validation "
                     "split to select on val.")
    target_text = f"{metric.show(target)}{metric.suffix}" if target is not None else "-"
    lines.append(f"Steps to target: interpolated step at which {split} {metric.label} first reached {target_text} (the "
                 f"base batch's final {split} {metric.label}, {metric.units(metric.target_margin)} worse, unless "
                 f"--target is given). Gap: test {metric.label} minus the baseline's at the smallest global batch, in "
                 f"{metric.unit}s.")
    # The loss columns for a loss-judged study or a language model, whose loss reads as bits per char.
    text = any(r.bits_per_char is not None for r in rows)
    losses = metric.name == "loss" or text
    lines += ["", "## Critical batch", ""]
    if crit["fit"]:
        low, high = crit["fit_interval"]
        lines.append(f"- From steps to target ({crit['series']}, {crit['fit_points']} runs, S = S_min (1 + B_noise/B), "
                     f"McCandlish et al. 2018): **{crit['fit']:,.0f}** (90% bootstrap interval {low:,.0f} - {high:,.0f}; "
                     f"S_min {crit['s_min']:,.1f} steps, E_min {crit['e_min']:,.0f} samples)")
    else:
        lines.append(f"- From steps to target ({crit['series']}): not measured: {crit['fit_error']}")
    if crit["gns"]:
        lines.append(f"- From the gradient noise scale B_simple ({crit['series']}, median over runs of its median over "
                     f"the last {100 * GNS_WINDOW:g}% of training): **{crit['gns']:,.0f}**")
    else:
        lines.append("- From the gradient noise scale: not measured (run the study with measure=[gns])")
    if crit["ratio"]:
        lines.append(f"- Ratio fit / gns: {crit['ratio']:.2f}")
    for recipe in sorted({r.recipe for r in rows}):
        header = ([f"final {split} acc", f"best {split} acc", "test acc"]
                  + [f"final {split} loss", f"best {split} loss", "test loss"] * losses
                  + [f"{split} bits/char", "test bits/char"] * text
                  + [f"gap ({metric.unit}s)", "steps", f"steps to target ({split} {metric.name})",
                     f"B_simple (last {100 * GNS_WINDOW:g}%)", "samples/s", "allreduces", "MB sent per worker"])
        lines += ["", f"## {recipe}", "",
                  "| global batch | world size | seeds | " + " | ".join(header) + " | diverged |",
                  "|---:|---:|---:|" + "---:|" * len(header) + "---|"]
        for r in sorted((r for r in rows if r.recipe == recipe), key=lambda r: r.global_batch):
            status = ", ".join(
                [f"diverged {r.diverged}/{r.seeds}"] * bool(r.diverged) + [f"error {r.errors}/{r.seeds}"] * bool(r.errors)
            ) or "no"
            mine = r.split == split  # a row evaluated on another split leaves the split-named columns empty
            cells = [f"{r.global_batch:,}", str(r.world_size), str(r.seeds),
                     _fmt(r.final_acc if mine else None, ".4f", r.final_acc_std), _fmt(r.best_acc if mine else None),
                     _fmt(r.test_acc, ".4f", r.test_acc_std)]
            if losses:
                cells += [_fmt(r.final_loss if mine else None, ".4f", r.final_loss_std),
                          _fmt(r.best_loss if mine else None), _fmt(r.test_loss, ".4f", r.test_loss_std)]
            if text:
                cells += [_fmt(r.bits_per_char if mine else None), _fmt(r.test_bits_per_char)]
            cells += [_fmt(r.gap, metric.gap_spec), _fmt(r.steps, ".0f"),
                      _fmt(r.steps_to_target if mine else None, ".0f", r.steps_to_target_std),
                      _fmt(r.b_simple, ",.0f"), _fmt(r.samples_per_sec, ",.0f"), _fmt(r.allreduces, ",.0f"),
                      _fmt(None if r.bytes_sent is None else r.bytes_sent / 1e6, ",.1f"), status]
            lines.append("| " + " | ".join(cells) + " |")
    failed = [j for j in jobs if "error" in j]
    if failed:
        lines += ["", "## Failed jobs", ""]
        lines += [f"- `{j['job_dir']}` ({j['series']}): {j['error']}" for j in failed]
    # The answer is the report's last section; the hybrid (past the answer's batches) comes just before it.
    lines += hybrid_lines(list(hybrid), split, metric, hybrid_cap_given)
    if answer is not None:
        lines += answer_lines(answer)
    return "\n".join(lines) + "\n"


def _batch_axis(ax) -> None:
    """Log2 axis of global batches, labelled with the batches themselves."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlabel("global batch")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_accuracy(rows: list[Row], crit: dict, path: Path, metric: Metric = ACC) -> None:
    """Test accuracy (or loss: `metric`), scored once per run, vs global batch, one line per recipe."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for recipe in sorted({r.recipe for r in rows}):
        points = sorted((r for r in rows if r.recipe == recipe), key=lambda r: r.global_batch)
        good = [r for r in points if r.test(metric) is not None]
        line = ax.errorbar([r.global_batch for r in good], [metric.scale * r.test(metric) for r in good],
                           yerr=[metric.scale * (getattr(r, f"test_{metric.name}_std") or 0) for r in good],
                           marker="o", capsize=3, label=recipe)
        bad = [r for r in points if r.diverged or r.errors]
        if bad:  # drawn at the worst value shown
            worst = [metric.scale * r.test(metric) for r in good]
            floor = min(worst, key=metric.score, default=10.0)
            ax.scatter([r.global_batch for r in bad], [floor] * len(bad), marker="x", s=80,
                       color=line[0].get_color(), label=f"{recipe}: diverged/failed")
    for value, style, name in ((crit["fit"], "--", "steps-to-target fit"), (crit["gns"], ":", "GNS")):
        if value:
            ax.axvline(value, color="gray", linestyle=style, label=f"critical batch ≈ {value:,.0f} ({name})")
    _batch_axis(ax)
    ax.set_ylabel(f"test {metric.label}{f' ({metric.suffix})' if metric.suffix else ''}, scored once per run")
    ax.set_title(f"{metric.label.capitalize()} vs global batch (same epoch budget)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gpus(rows: list[Row], points: list[dict], path: Path, metric: Metric = ACC) -> None:
    """Final (selection-split) metric vs GPU count: data parallelism alone (solid) and the hybrid past
    the batch cap (dashed; filled markers were run as DP x T, hollow ones follow from exactness)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [p for p in points if "impossible" not in p]
    for recipe in sorted({p["recipe"] for p in points}):
        dp = sorted((r for r in rows if r.recipe == recipe and math.isfinite(r.final(metric))),
                    key=lambda r: r.world_size)
        line = ax.plot([r.world_size for r in dp], [metric.scale * r.final(metric) for r in dp], marker="o",
                       label=f"{recipe}: data parallel")[0]
        mine = [p for p in points if p["recipe"] == recipe]
        below = [r for r in dp if r.global_batch <= mine[0]["cap"]]
        xs = [r.world_size for r in below] + [p["gpus"] for p in mine]
        ys = [metric.scale * r.final(metric) for r in below] + [metric.scale * p[metric.name] for p in mine]
        ax.plot(xs, ys, linestyle="--", color=line.get_color(),
                label=f"{recipe}: data x tensor parallel (batch <= {mine[0]['cap']:,})")
        for p in mine:
            ax.scatter([p["gpus"]], [metric.scale * p[metric.name]], s=50, color=line.get_color(),
                       facecolors=line.get_color() if p["source"].startswith("run") else "none")
    _batch_axis(ax)
    ax.set_xlabel("GPUs")
    ax.set_ylabel(f"final {metric.label}{f' ({metric.suffix})' if metric.suffix else ''}")
    ax.set_title("More GPUs: a bigger batch, or split layers at the same batch")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_steps(rows: list[Row], jobs: list[dict], target: float | None, crit: dict, path: Path,
               metric: Metric = ACC) -> None:
    """Steps to target vs global batch per recipe, with the fitted S = S_min (1 + B_noise / B)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
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
    _batch_axis(ax)
    ax.set_yscale("log")
    split = "val" if any(r.split == "val" for r in rows) else "test"
    ax.set_ylabel(f"steps to {split} {metric.label} {metric.show(target)}{metric.suffix}" if target is not None
                  else "steps to target")
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    else:  # an empty plot says why rather than showing bare axes
        ax.text(0.5, 0.5, "no run reached the target", transform=ax.transAxes, ha="center", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_gns(jobs: list[dict], crit: dict, path: Path) -> None:
    """B_simple over training (samples seen), one line per job of the critical-batch series."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for job in sorted(jobs, key=lambda j: (int(j.get("global_batch") or 0), j.get("seed", 0))):
        curve = job.get("technique_curves", {}).get("gns/b_simple", [])
        if job.get("series") == crit["series"] and curve:
            ax.plot([p[0] for p in curve], [p[1] for p in curve], marker=".",
                    label=f"B={int(job['global_batch']):,} seed {job.get('seed', 0)}")
    ax.set_xlabel("samples seen")
    ax.set_ylabel("gradient noise scale B_simple")
    ax.set_yscale("log")
    ax.set_title(f"{crit['series']}: B_simple over training (summarised over the last {100 * GNS_WINDOW:g}%)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_tensorboard(rows: list[Row], jobs: list[dict], path: Path) -> None:
    """Scalars with the global batch as step (`study/<recipe>/val_acc`, `.../test_acc`) and an HParams row per job."""
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(path, ignore_errors=True)  # a second report replaces the first, not adds to it
    writer = SummaryWriter(str(path))
    for row in sorted(rows, key=lambda r: r.global_batch):
        if math.isfinite(row.final_acc) and row.split == "val":
            writer.add_scalar(f"study/{row.recipe}/val_acc", row.final_acc, row.global_batch)
        if row.test_acc is not None:
            writer.add_scalar(f"study/{row.recipe}/test_acc", row.test_acc, row.global_batch)
        if math.isfinite(row.final_loss) and row.split == "val":
            writer.add_scalar(f"study/{row.recipe}/val_loss", row.final_loss, row.global_batch)
        if row.test_loss is not None:
            writer.add_scalar(f"study/{row.recipe}/test_loss", row.test_loss, row.global_batch)
        if row.steps_to_target:
            writer.add_scalar(f"study/{row.recipe}/steps_to_target_{row.split}", row.steps_to_target, row.global_batch)
    for i, job in enumerate(jobs):
        if "error" in job:
            continue
        hparams = {"recipe": job.get("recipe", "?"), "world_size": job["world_size"],
                   "global_batch": job["global_batch"], "per_worker_batch": job["per_worker_batch"],
                   "seed": job.get("seed", 0), "lr": job.get("base_lr", 0.0)}
        split = job["eval_split"]
        metrics = {f"hparam/final_{split}_acc": job[f"final_{split}_acc"],
                   f"hparam/best_{split}_acc": job[f"best_{split}_acc"],
                   "hparam/diverged": float(bool(job.get("diverged")))}
        if job.get("test_acc") is not None:
            metrics["hparam/test_acc"] = job["test_acc"]
        writer.add_hparams(hparams, metrics, run_name=f"job_{job['job_dir'].replace(os.sep, '_') or i}")
    writer.close()


def write_report(study_dir: str | Path, target: float | None = None, tolerance: float | None = None,
                 network: str | None = None, step_ms: float | None = None, metric: str = "acc",
                 hybrid_cap: int | None = None) -> dict:
    """The report of a study folder, judged on `metric` ("acc", higher is better, or "loss", lower is
    better): the target, steps to it, and "how many GPUs" within `tolerance` (the metric's units,
    default its default_tolerance)."""
    study_dir, judge = Path(study_dir), metric_named(metric, "--metric")
    jobs = load_jobs(study_dir)
    if not jobs:
        raise ConfigError(f"no result.json found under {study_dir}: is it a study (multirun) folder?")
    target = default_target(jobs, judge) if target is None else target
    tolerance = judge.default_tolerance if tolerance is None else tolerance
    rows = aggregate(jobs, target, judge)
    crit = critical_batch(jobs, rows, target, judge)
    answer = gpu_answer(rows, tolerance, judge)
    if network is not None:
        answer["time_to_accuracy"] = time_to_accuracy(rows, answer, jobs, study_dir, network, step_ms)
    curves = f"{judge.label}_vs_batch.png"
    hybrid = hybrid_points(rows, jobs, hybrid_caps(answer, hybrid_cap), judge)
    report = markdown(rows, target, crit, jobs, answer, judge, hybrid, hybrid_cap is not None)
    (study_dir / "report.md").write_text(report)
    plot_accuracy(rows, crit, study_dir / curves, judge)
    files = ["report.md", curves, "steps_to_target.png", "gns_over_training.png", "summary.json", SUMMARY_DIR]
    if any("impossible" not in p for p in hybrid):
        plot_gpus(rows, hybrid, study_dir / f"{judge.label}_vs_gpus.png", judge)
        files.insert(2, f"{judge.label}_vs_gpus.png")
    plot_steps(rows, jobs, target, crit, study_dir / "steps_to_target.png", judge)
    plot_gns(jobs, crit, study_dir / "gns_over_training.png")
    write_tensorboard(rows, jobs, study_dir / SUMMARY_DIR)
    named = ("job_dir", "series", "recipe", "world_size", "global_batch", "per_worker_batch", "seed", "eval_split",
             "final_val_acc", "best_val_acc", "final_test_acc", "best_test_acc", "test_acc", "final_val_loss",
             "final_test_loss", "test_loss", "final_val_bits_per_char", "test_bits_per_char", "steps",
             "samples_per_sec", "diverged", "error")
    summary = {
        "metric": judge.name,
        f"target_{judge.name}": target,
        "files": files,
        "gpu_answer": answer,
        "hybrid": hybrid,
        "critical_batch": crit,
        "rows": [asdict(r) for r in rows],
        "jobs": [{k: j[k] for k in named if k in j} for j in jobs],
    }
    (study_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
