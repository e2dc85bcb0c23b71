"""From the probe's runs to its numbers (probe.json): each checkpoint's verdict, the answer, the batch schedule.

The decision rules are lbt/metrics/branches.py's; this module only reads the runs' result.json files.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lbt.apps.probe.plan import ProbePlan
from lbt.apps.probe.settings import ProbeSettings
from lbt.apps.words import count
from lbt.metrics import branches as rules
from lbt.metrics.critical import b_simple_undefined, run_optimizer
from lbt.spec.result import ResultError, RunResult, read_result
from lbt.techniques.gns import B_SIMPLE

PROBE_VERSION = 2
BRANCH_KINDS = ("hold", "cooldown")


def branch_dir(folder: Path, plan: ProbePlan, at: int, factor: int, seed: int, kind: str = "hold") -> Path:
    return folder / "branches" / f"{kind}_at{at}_w{factor * plan.world_size}_seed{seed}"


def branch_result(folder: Path, plan: ProbePlan, at: int, factor: int, seed: int,
                  kind: str = "hold") -> RunResult | None:
    """A finished branch's result; None while it has none, or when it failed (a failed branch is not a
    finished one: it is run again, and a diverged one is finished)."""
    try:
        result = read_result(branch_dir(folder, plan, at, factor, seed, kind))
    except (ResultError, FileNotFoundError, OSError):
        return None
    return None if result.stopped or result.failed else result


def branch_done(folder: Path, plan: ProbePlan, at: int, factor: int, seed: int, kind: str = "hold") -> bool:
    return branch_result(folder, plan, at, factor, seed, kind) is not None


def value_of(result: RunResult, settings: ProbeSettings) -> float:
    """The branch's held-out value at its end by the probe's metric; NaN for a diverged or failed one."""
    if result.failed or result.diverged:
        return math.nan
    return float(getattr(result, f"final_{settings.metric}"))


def verdicts(point: dict[str, Any], settings: ProbeSettings) -> dict[int, bool]:
    """Factor -> whether the checkpoint alone predicts a from-scratch run at k x B0 within tolerance (and no
    branch of it or a smaller factor diverged), from `checkpoint_numbers`; k=1 only has to have trained."""
    passed = {int(k): gap <= settings.within and int(k) not in point["diverged"]
              for k, gap in point["budget_shortfalls"].items()}
    reference = next((b for b in point["branches"] if b["factor"] == 1 and b["seed"] == point["base_seed"]), None)
    passed[1] = reference is not None and math.isfinite(reference["value"])
    return passed


def budget_points(folder: Path, plan: ProbePlan, settings: ProbeSettings, base: RunResult) -> list[list[float]]:
    """(samples, final value) of base-batch runs that ended there: each checkpoint's cooldown and the base
    run's end; without cooldowns, the base run's own evaluations (pessimistic: its LR had not decayed there)."""
    final = [float(plan.budget), float(getattr(base, f"final_{settings.metric}"))]
    if not plan.cooldowns:
        return [[float(p.samples_seen), float(getattr(p, settings.metric))] for p in base.history
                if p.samples_seen < plan.budget] + [final]
    points = []
    for at, cool in zip(plan.checkpoints, plan.cooldowns):
        result = branch_result(folder, plan, at, 1, plan.seeds[0], "cooldown")
        if result is not None and math.isfinite(value_of(result, settings)):
            points.append([float(at + cool), value_of(result, settings)])
    return [*points, final]


def analyse(folder: Path, plan: ProbePlan, settings: ProbeSettings, base_dir: Path) -> dict[str, Any]:
    base = read_result(base_dir)
    points = budget_points(folder, plan, settings, base)
    checkpoints = [checkpoint_numbers(folder, plan, settings, at, base, points) for at in plan.checkpoints]
    for previous, point in zip([0, *plan.checkpoints], checkpoints):
        point["b_simple"] = b_simple_between(base, previous, point["samples"])
    metric = settings.criterion
    final = float(getattr(base, f"final_{metric.name}"))
    found = rules.predict(plan.checkpoints, [c.pop("ratios") for c in checkpoints], points, plan.budget,
                          settings.within, metric)
    largest = found.factor * plan.base_batch
    low, high = rules.interval(found.factor, plan.factors[-1])
    alone = [k * plan.base_batch for k in found.alone]
    for point, factor in zip(checkpoints, alone):
        point["answer_alone"] = factor
    held = [c["local_critical"]["held"] for c in checkpoints]
    trained = plan.budget + sum(b["samples"] for c in checkpoints for b in c["branches"]) + \
        sum(b["samples"] for b in cooldown_records(folder, plan, settings))
    return {
        "version": PROBE_VERSION,
        "settings": {k: v for k, v in vars(settings).items() if k != "dir"} | {"tolerance": settings.within},
        "base": {"dir": str(base_dir), "global_batch": plan.base_batch, "world_size": plan.world_size,
                 "per_worker_batch": plan.per_worker_batch, "budget_samples": plan.budget,
                 f"final_{metric.name}": final,
                 "history": [[p.samples_seen, p.acc, p.loss] for p in base.history]},
        "budget_curve": points,
        "cooldowns": cooldown_records(folder, plan, settings),
        "checkpoints": checkpoints,
        "weights": rules.phase_weights(plan.checkpoints, plan.budget),
        "prediction": {str(plan.batch(k)): {"samples_ratio": r, "effective_samples": plan.budget / r,
                                            "shortfall": found.shortfalls[k], "diverged": k in found.failed}
                       for k, r in found.ratios.items()},
        "answer": answer(plan, settings, largest, low * plan.base_batch, high * plan.base_batch,
                         found.failed, max(found.ratios, default=1)),
        "batch_schedule": [{"from_samples": at, "global_batch": b}
                           for at, b in rules.batch_schedule(plan.checkpoints, held, plan.base_batch)],
        "cost": {"samples": trained, "sweep_samples": plan.sweep_samples, "share": trained / plan.sweep_samples,
                 "branches": sum(len(c["branches"]) for c in checkpoints) + len(plan.cooldowns),
                 "run_seconds": base.wall_seconds + sum(b["seconds"] for c in checkpoints for b in c["branches"])
                 + sum(b["seconds"] for b in cooldown_records(folder, plan, settings))},
    }


def cooldown_records(folder: Path, plan: ProbePlan, settings: ProbeSettings) -> list[dict[str, Any]]:
    records = []
    for at in plan.checkpoints[:len(plan.cooldowns)]:
        result = branch_result(folder, plan, at, 1, plan.seeds[0], "cooldown")
        if result is not None:
            records.append(branch_record(result, plan, settings, at, 1, plan.seeds[0]))
    return records


def checkpoint_numbers(folder: Path, plan: ProbePlan, settings: ProbeSettings, at: int, base: RunResult,
                       points: list[list[float]]) -> dict[str, Any]:
    """One checkpoint: its held-LR branches, their samples ratios (measured, and the fitted noise scale's
    where a factor was not run), what they predict alone for the budget, and the local verdict."""
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
    mine = [r for r in records if r["seed"] == plan.seeds[0] and reference is not None]
    gaps = {r["factor"]: rules.shortfall(r["value"], level, metric) for r in mine}
    verdict = rules.local_critical(gaps, plan.base_batch, settings.within, floor)
    diverged = [r["factor"] for r in mine if not math.isfinite(r["value"])]
    ratios = rules.checkpoint_ratios(start.loss if start else math.inf, {r["factor"]: r["curve"] for r in mine},
                                     diverged, plan.base_batch, plan.factors)
    return {"samples": at, "fraction": at / plan.budget, "base_seed": plan.seeds[0],
            "start": {"loss": start.loss, "acc": start.acc} if start else None,
            "noise_floor": floor, "reference": level, "branches": records,
            "shortfalls": {str(k): v for k, v in gaps.items()},
            "local_critical": {"held": verdict.held, "failed": verdict.failed, "resolved": verdict.resolved,
                               "batch": verdict.batch},
            "samples_ratios": {str(k): v for k, v in ratios.measured.items()},
            "ratios_filled": {str(k): v for k, v in ratios.filled.items()},
            "noise_scale": ratios.noise_scale, "diverged": list(ratios.diverged),
            "budget_shortfalls": {str(k): v for k, v in
                                  rules.budget_shortfalls(ratios.filled, points, plan.budget, metric).items()},
            "ratios": ratios}


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
    return {"at": at, "factor": factor, "global_batch": plan.batch(factor), "seed": seed,
            "value": value_of(result, settings),
            "loss": float(result.final_loss) if ok else math.inf, "acc": float(result.final_acc) if ok else math.nan,
            "diverged": result.diverged, "error": result.error, "seconds": result.wall_seconds,
            "samples": max(0, result.samples_seen - at) if not result.failed else 0,
            "curve": [(p.samples_seen - at, p.loss) for p in result.history if p.samples_seen > at],
            "curve_acc": [p.acc for p in result.history if p.samples_seen > at]}


def answer(plan: ProbePlan, settings: ProbeSettings, largest: int, low: int, high: int, failed: frozenset[int],
           probed: int) -> dict[str, Any]:
    """The prediction: the largest batch whose from-scratch run the branches predict within tolerance of the
    base batch at the end of this budget (the samples ratios over the checkpoints, time-weighted, read on the
    budget curve); the interval is one doubling either side, as far as the prediction has been from the
    sweep's answer on the workloads bench/critical.py validates."""
    metric, gpus = settings.criterion, largest // plan.per_worker_batch
    unit = "point" if metric.unit == "point" else "nat"
    within = f"{settings.within:g} {unit}{'s' if settings.within != 1 else ''}"
    sentence = (f"Predicted: up to {count(gpus, 'GPU')} (global batch {largest:,} at per-worker batch "
                f"{plan.per_worker_batch}) stay within {within} of the base batch {plan.base_batch:,} in this "
                f"budget ({plan.budget:,} samples); interval {low:,}..{high:,}")
    top = largest == probed * plan.base_batch
    if top:
        sentence += "; the largest batch probed held, so possibly more"
    return {"largest_batch": largest, "gpus": gpus, "per_worker_batch": plan.per_worker_batch,
            "metric": metric.name, "tolerance": settings.within, "sentence": sentence, "interval": [low, high],
            "diverged_factors": sorted(failed), "largest_probed_held": top}
