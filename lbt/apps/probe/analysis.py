"""From the probe's runs to its numbers (probe.json): each checkpoint's verdict, the answer, the batch schedule.

The decision rules are lbt/metrics/branches.py's; this module only reads the runs' result.json files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lbt.apps.probe.plan import ProbePlan
from lbt.apps.probe.settings import ProbeSettings
from lbt.metrics import branches as rules
from lbt.metrics.critical import b_simple_undefined, crossing_step, run_optimizer
from lbt.spec.result import ResultError, RunResult, read_result
from lbt.techniques.gns import B_SIMPLE

PROBE_VERSION = 1


def branch_dir(folder: Path, plan: ProbePlan, at: int, factor: int, seed: int) -> Path:
    return folder / "branches" / f"at{at}_w{factor * plan.world_size}_seed{seed}"


def branch_result(folder: Path, plan: ProbePlan, at: int, factor: int, seed: int) -> RunResult | None:
    """A finished branch's result (a failed job's too: it says why); None while it has none."""
    try:
        result = read_result(branch_dir(folder, plan, at, factor, seed))
    except (ResultError, FileNotFoundError, OSError):
        return None
    return None if result.stopped else result


def branch_done(folder: Path, plan: ProbePlan, at: int, factor: int, seed: int) -> bool:
    return branch_result(folder, plan, at, factor, seed) is not None


def value_of(result: RunResult, settings: ProbeSettings) -> float:
    """The branch's held-out value at its end by the probe's metric; NaN for a diverged or failed one."""
    if result.failed or result.diverged:
        return math.nan
    return float(getattr(result, f"final_{settings.metric}"))


def verdicts(point: dict[str, Any], settings: ProbeSettings) -> dict[int, bool]:
    """Factor -> whether its branch (base seed) stayed within tolerance of the k=1 branches, from
    `checkpoint_numbers`; k=1 is the reference and only has to have trained (a diverged one closes the
    checkpoint)."""
    passed = {int(k): gap <= settings.within for k, gap in point["shortfalls"].items()}
    reference = next((b for b in point["branches"] if b["factor"] == 1 and b["seed"] == point["base_seed"]), None)
    if reference is not None:
        passed[1] = math.isfinite(reference["value"])
    return passed


def analyse(folder: Path, plan: ProbePlan, settings: ProbeSettings, base_dir: Path) -> dict[str, Any]:
    base = read_result(base_dir)
    checkpoints = [checkpoint_numbers(folder, plan, settings, at, base) for at in plan.checkpoints]
    for previous, point in zip([0, *plan.checkpoints], checkpoints):
        point["b_simple"] = b_simple_between(base, previous, point["samples"])
    metric = settings.criterion
    final = float(getattr(base, f"final_{metric.name}"))
    target = metric.worse_by(final, settings.within)
    step = crossing_step(base.history, target, metric=metric)
    reach = (step or base.steps) * plan.base_batch
    noise = [c["noise_scale"] for c in checkpoints]
    needs = {plan.batch(k): rules.predicted_need(plan.checkpoints, noise, reach, plan.batch(k), plan.base_batch)
             for k in plan.factors}
    additive = rules.largest_batch(plan.checkpoints, noise, reach, plan.budget, plan.base_batch, plan.factors)
    held = [c["local_critical"]["held"] for c in checkpoints]
    last = checkpoints[-1]["local_critical"]
    trained = plan.budget + sum(b["samples"] for c in checkpoints for b in c["branches"])
    return {
        "version": PROBE_VERSION,
        "settings": {k: v for k, v in vars(settings).items() if k != "dir"} | {"tolerance": settings.within},
        "base": {"dir": str(base_dir), "global_batch": plan.base_batch, "world_size": plan.world_size,
                 "per_worker_batch": plan.per_worker_batch, "budget_samples": plan.budget,
                 f"final_{metric.name}": final, "target": target, "reach_samples": reach,
                 "history": [[p.samples_seen, p.acc, p.loss] for p in base.history]},
        "checkpoints": checkpoints,
        "answer": answer(plan, settings, last, additive, needs),
        "batch_schedule": [{"from_samples": at, "global_batch": b}
                           for at, b in rules.batch_schedule(plan.checkpoints, held, plan.base_batch)],
        "cost": {"samples": trained, "sweep_samples": plan.sweep_samples, "share": trained / plan.sweep_samples,
                 "branches": sum(len(c["branches"]) for c in checkpoints),
                 "run_seconds": base.wall_seconds + sum(b["seconds"] for c in checkpoints for b in c["branches"])},
    }


def checkpoint_numbers(folder: Path, plan: ProbePlan, settings: ProbeSettings, at: int,
                       base: RunResult) -> dict[str, Any]:
    """One checkpoint: its branches, noise floor, local critical batch and fitted noise scale."""
    metric, records = settings.criterion, []
    for factor in plan.factors:
        for seed in plan.seeds if factor == 1 else plan.seeds[:1]:
            result = branch_result(folder, plan, at, factor, seed)
            if result is not None:
                records.append(branch_record(result, plan, settings, at, factor, seed))
    start = next((p for p in base.history if p.samples_seen == at), None)
    ones = [r["value"] for r in records if r["factor"] == 1]
    floor = rules.noise_floor(ones, metric)
    reference = next((r for r in records if r["factor"] == 1 and r["seed"] == plan.seeds[0]), None)
    level = rules.reference_value(ones)
    gaps = {r["factor"]: rules.shortfall(r["value"], level, metric)
            for r in records if reference is not None and r["seed"] == plan.seeds[0]}
    verdict = rules.local_critical(gaps, plan.base_batch, settings.within, floor)
    curve = [(0.0, start.loss if start else math.inf)] + (reference["curve"] if reference else [])
    ratios = {r["factor"]: rules.samples_ratio(curve, r["loss"], r["samples"], r["factor"])
              for r in records if r["seed"] == plan.seeds[0] and reference is not None}
    return {"samples": at, "fraction": at / plan.budget, "base_seed": plan.seeds[0],
            "start": {"loss": start.loss, "acc": start.acc} if start else None,
            "noise_floor": floor, "reference": level, "branches": records,
            "shortfalls": {str(k): v for k, v in gaps.items()},
            "local_critical": {"held": verdict.held, "failed": verdict.failed, "resolved": verdict.resolved,
                               "batch": verdict.batch},
            "samples_ratios": {str(k): v for k, v in ratios.items()},
            "noise_scale": rules.fit_noise_scale(ratios, plan.base_batch) if ratios else float(plan.base_batch)}


def b_simple_between(base: RunResult, start: int, end: int) -> float | str:
    """The base run's gradient noise scale B_simple over (start, end] samples (median), beside the branched
    critical batch, so a user with only a long run's B_simple curve learns how far to trust it here; or
    why there is none."""
    undefined = b_simple_undefined(run_optimizer(base.config))
    if undefined:
        return undefined
    curve = (base.technique_curves or {}).get(B_SIMPLE) or []
    values = [b for samples, b in curve if start < samples <= end and math.isfinite(b)]
    if not values:
        return "not measured (add measure=[gns] with dist.world_size >= 2)" if not curve else "no point here"
    return float(sorted(values)[len(values) // 2])


def branch_record(result: RunResult, plan: ProbePlan, settings: ProbeSettings, at: int, factor: int,
                  seed: int) -> dict[str, Any]:
    ok = not (result.failed or result.diverged)
    return {"factor": factor, "global_batch": plan.batch(factor), "seed": seed, "value": value_of(result, settings),
            "loss": float(result.final_loss) if ok else math.inf, "acc": float(result.final_acc) if ok else math.nan,
            "diverged": result.diverged, "error": result.error, "seconds": result.wall_seconds,
            "samples": max(0, result.samples_seen - at) if not result.failed else 0,
            "curve": [(p.samples_seen - at, p.loss) for p in result.history if p.samples_seen > at]}


def answer(plan: ProbePlan, settings: ProbeSettings, last: dict[str, Any], additive: int,
           needs: dict[int, float]) -> dict[str, Any]:
    """The prediction: the local critical batch at the last checkpoint. A study judges the value a run ends
    at, and a larger batch's lag early in training is mostly made up later (on MNIST-1D's mlp the early
    checkpoints held 64 where the sweep held 512), so the latest phase decides; the additive lag model
    (`need_samples`, McCandlish's ratio summed over the phases as if no lag were ever made up) is kept as
    the pessimistic bound."""
    largest = last["held"]
    metric, gpus = settings.criterion, largest // plan.per_worker_batch
    unit = "point" if metric.unit == "point" else "nat"
    within = f"{settings.within:g} {unit}{'s' if settings.within != 1 else ''}"
    sentence = (f"Predicted: up to {gpus} GPUs (global batch {largest:,} at per-worker batch "
                f"{plan.per_worker_batch}) stay within {within} of the base batch {plan.base_batch:,} in this "
                f"budget ({plan.budget:,} samples)")
    low = min(additive, largest)
    if low < largest:
        sentence += f"; at least {low:,} if no early lag is made up (the pessimistic bound)"
    if last["failed"] is None:
        sentence += "; the largest batch probed held, so possibly more"
    elif not last["resolved"]:
        sentence += "; not resolved past it (the next batch's shortfall lies within the noise floor): a lower bound"
    return {"largest_batch": largest, "gpus": gpus, "per_worker_batch": plan.per_worker_batch,
            "metric": metric.name, "tolerance": settings.within, "sentence": sentence, "resolved": last["resolved"],
            "additive_lag_bound": additive, "range": [low, largest],
            "need_samples": {str(b): n for b, n in needs.items()}}
