"""`lbt probe ... probe.confirm=true`: full runs around the prediction until they give the sweep's answer.

The runs are ordinary `lbt train` jobs in DIR/confirm/w<world size>_seed<seed> (the base run is the base
batch's first seed); which to train next is lbt/metrics/confirm.py's. A finished run is read, never trained
again; one cut off continues from its checkpoint (trainer.resume=auto).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lbt.apps.errors import fail, raise_if_stopped
from lbt.apps.judging import within
from lbt.apps.probe.plan import ProbePlan
from lbt.apps.probe.settings import ProbeSettings
from lbt.apps.train import train_command
from lbt.apps.words import gpus
from lbt.metrics.branches import shortfall
from lbt.metrics.confirm import SEEDS, confirm_step, mean_value
from lbt.spec.result import ResultError, RunResult, read_result

# Keys a confirm run sets itself (the user's values define the base run only).
RUN_KEYS = ("dist.world_size", "trainer.seed", "trainer.resume", "hydra.run.dir", "hydra.sweep.dir",
            "hydra.sweep.subdir", "trainer.progress")


def run_dir(folder: Path, plan: ProbePlan, factor: int, seed_index: int, base: Path) -> Path:
    if factor == 1 and seed_index == 0:
        return base
    return folder / "confirm" / f"w{factor * plan.world_size}_seed{plan.seeds[0] + seed_index}"


def finished(path: Path) -> RunResult | None:
    try:
        result = read_result(path)
    except (ResultError, FileNotFoundError, OSError):
        return None
    return None if result.stopped else result


def final_value(result: RunResult, settings: ProbeSettings) -> float:
    if result.failed or result.diverged:
        return float("nan")
    return float(getattr(result, f"final_{settings.metric}"))


def confirm(folder: Path, plan: ProbePlan, settings: ProbeSettings, overrides: list[str], base: Path,
            predicted_batch: int, again: str) -> dict[str, Any]:
    own = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in RUN_KEYS]
    predicted = predicted_batch // plan.base_batch
    while True:
        results = {(k, s): r for k in plan.factors for s in range(SEEDS)
                   if (r := finished(run_dir(folder, plan, k, s, base))) is not None}
        values = {key: final_value(r, settings) for key, r in results.items()}
        step = confirm_step(predicted, plan.factors, values, settings.within, settings.criterion)
        if step.answer is not None:
            return summary(plan, settings, step.answer, step.top, results, values, base)
        for seed_index in sorted({s for _, s in step.runs}):
            raise_if_stopped()
            sizes = [k * plan.world_size for k, s in step.runs if s == seed_index]
            print(f"probe: confirm: full run(s) at world size {', '.join(map(str, sizes))}, "
                  f"seed {plan.seeds[0] + seed_index}", flush=True)
            try:
                train_command(["-m", *own, f"dist.world_size={','.join(map(str, sizes))}",
                               f"trainer.seed={plan.seeds[0] + seed_index}", "trainer.resume=auto",
                               "trainer.progress=false", f"hydra.sweep.dir={folder.resolve()}/confirm",
                               "hydra.sweep.subdir=w${dist.world_size}_seed${trainer.seed}"], report_failures=False)
            except SystemExit as done:
                if done.code not in (0, None):
                    raise
            raise_if_stopped()
            if any(finished(run_dir(folder, plan, k, s, base)) is None for k, s in step.runs if s == seed_index):
                fail(f"confirm runs did not finish (stopped?); continue the probe with: {again}")


def summary(plan: ProbePlan, settings: ProbeSettings, factor: int, top: bool, results: dict[tuple[int, int], Any],
            values: dict[tuple[int, int], float], base: Path) -> dict[str, Any]:
    metric = settings.criterion
    reference = mean_value(values, 1, metric)
    rows = []
    for k in sorted({k for k, _ in values}):
        mean = mean_value(values, k, metric)
        seeds = [values[(k, s)] for s in range(SEEDS) if (k, s) in values]
        rows.append({"global_batch": plan.batch(k), "values": seeds, "mean": mean,
                     "holds": within(shortfall(mean, reference, metric), settings.within)})
    trained = [r for key, r in results.items() if key != (1, 0)]
    samples = sum(r.samples_seen for r in trained)
    batch = plan.batch(factor)
    sentence = (f"Measured: up to {gpus(batch // plan.per_worker_batch)} (global batch {batch:,}); took {len(trained)} "
                f"full run(s) besides the base run, {samples / plan.sweep_samples:.0%} of a sweep")
    if top:
        sentence += "; the largest batch of the grid held, so possibly more"
    return {"largest_batch": batch, "gpus": batch // plan.per_worker_batch, "top": top, "sentence": sentence,
            "runs": rows, "full_runs": len(trained), "samples": samples}
