"""A tuned cell's final runs: its best values and its untuned defaults over fresh seeds, scored once on test."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import optuna

from lbt.apps.errors import Stopped
from lbt.apps.tune.grid import Cell, TuneGrid
from lbt.apps.tune.trials import (
    TrialState,
    final_value,
    hydra_value,
    identity_overrides,
    shown_values,
    train_run,
)
from lbt.errors import ConfigError
from lbt.metrics.spread import mean_std
from lbt.paths import atomic_write
from lbt.spec.objective import Metric
from lbt.spec.result import RunResult, read_result
from lbt.stop import stopped_by

KEY = "finals_key"  # in cells/<cell>.json: the finals_key its runs were trained for


def finish_cell(grid: TuneGrid, cell: Cell, searches: list[optuna.Study], new_runs: dict) -> dict:
    """The cell's trials in numbers, each independent search's best and fastest trial, then the best values of
    the median search and the recipe's defaults over tune.seeds fresh seeds."""
    trials = [t for study in searches for t in study.get_trials(deepcopy=False)]
    counted = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    complete = [t for t in counted if t.state == TrialState.COMPLETE]
    metric = grid.settings.metric
    summary: dict[str, Any] = {
        "cell": cell.name, "axes": cell.axes, "recipe": cell.recipe, "series": cell.series, "metric": metric.name,
        "world_size": cell.config["dist"]["world_size"], "global_batch": cell.global_batch,
        "scaling": cell.config["schedule"]["scaling"], "base_batch": cell.config["schedule"]["base_batch"],
        "space": cell.space,
        "trials": {"counted": len(counted), "complete": len(complete),
                   "pruned": sum(t.state == TrialState.PRUNED for t in counted),
                   "diverged": sum(bool(t.user_attrs.get("diverged")) for t in complete),
                   "failed": sum(t.state == TrialState.FAIL for t in trials)},
        "studies": [search_summary(study, k, metric, grid.settings.stop_at_target) for k, study in enumerate(searches)],
        "best": None,
    }
    first_seed = int(cell.config["trainer"]["seed"])
    seeds = [first_seed + k for k in range(1, grid.settings.seeds + 1)]
    median = median_search(summary["studies"], metric, grid.settings.stop_at_target)
    if median is not None:
        best = next(t for t in searches[median["study"] - 1].get_trials(deepcopy=False) if t.number == median["trial"])
        value = final_val(best, metric)
        summary["best"] = {"trial": best.number, "study": median["study"], f"val_{metric.name}": value,
                           "params": dict(best.params), "diverged": bool(best.user_attrs.get("diverged")),
                           "base_lr": best.user_attrs.get("base_lr"), "peak_lr": best.user_attrs.get("peak_lr")}
        t, which = summary["trials"], f" (the median of {len(searches)} studies: study {median['study']})" \
            if len(searches) > 1 else ""
        print(f"[{cell.name}] best of {len(counted)} trials ({t['pruned']} pruned, {t['diverged']} diverged){which}: "
              f"trial {best.number} val_{metric.name}={value:.4f} {shown_values(best.params)}", flush=True)
        summary["tuned"] = final_runs(grid, cell, "tuned", dict(best.params), seeds, new_runs)
    else:
        print(f"[{cell.name}] no trial finished (all {len(counted)} pruned): no tuned runs", flush=True)
    summary["default"] = final_runs(grid, cell, "default", {}, seeds if grid.settings.untuned else [], new_runs)
    summary["overrides"] = identity_overrides(grid)
    (grid.settings.dir / "cells").mkdir(exist_ok=True)
    written = {**summary, KEY: finals_key(grid, searches)}
    atomic_write(cell_path(grid, cell), lambda f: f.write(json.dumps(written, indent=2).encode()))
    return summary


def cell_path(grid: TuneGrid, cell: Cell) -> Path:
    return grid.settings.dir / "cells" / f"{cell.folder}.json"


def finals_key(grid: TuneGrid, searches: list[optuna.Study]) -> str:
    """What a cell's final runs and its part of the report follow from: its trials and the finals' settings."""
    s = grid.settings
    trials = [[t.number, t.state.name, t.value] for study in searches for t in study.get_trials(deepcopy=False)]
    return json.dumps({"trials": trials, "seeds": s.seeds, "untuned": s.untuned, "metric": s.metric.name,
                       "overrides": identity_overrides(grid)})


def read_cell(path: Path) -> tuple[dict, str | None]:
    """A finished cell's summary (cells/<cell>.json) and the finals_key it was written for."""
    cell = json.loads(path.read_text())
    return cell, cell.pop(KEY, None)


def finished(grid: TuneGrid, cell: Cell, searches: list[optuna.Study]) -> bool:
    """Whether the cell's final runs and summary are done for the trials it has now."""
    try:
        return read_cell(cell_path(grid, cell))[1] == finals_key(grid, searches)
    except (OSError, ValueError):
        return False


def earlier_cells(grid: TuneGrid, cells: list[dict]) -> list[dict]:
    """Finished cells in tune.dir that this command did not name, tuned with the same overrides and metric."""
    names, found = {c["cell"] for c in cells}, []
    for path in sorted((grid.settings.dir / "cells").glob("*.json")):
        try:
            cell = read_cell(path)[0]
        except (OSError, ValueError):
            continue  # being written by another process, or not ours
        same = cell.get("overrides") == identity_overrides(grid) \
            and cell.get("metric", "acc") == grid.settings.metric.name
        if cell.get("cell") not in names and same:
            found.append(cell)
    return found


def final_val(trial: optuna.trial.FrozenTrial, metric: Metric) -> float:
    """A finished trial's final val value (the metric's worst if it diverged), whatever its objective."""
    if "final_val" in trial.user_attrs:  # recorded by trials.record
        value = trial.user_attrs["final_val"]
        return metric.worst if value is None else float(value)
    assert trial.value is not None  # a finished trial
    return float(trial.value)  # a trial of a tune from before tune.objective: its value is the final val value


def search_summary(study: optuna.Study, search: int, metric: Metric, fastest_is_best: bool = False) -> dict[str, Any]:
    """One independent search of a cell: its best trial on final val, and its fastest to tune.target (AlgoPerf
    takes the fastest trial of each study; None: no trial reached it) with every trial's val curve, from which
    the report reads steps to a target decided later. `fastest_is_best` (tune.stop_at_target: trials that
    reached the target ended there, so their final val values rank nothing): the fastest is the best too, and
    the best on final val only where none reached it."""
    complete = [t for t in study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: (metric.score(final_val(t, metric)), -t.number), default=None)
    reached = [t for t in complete if t.user_attrs.get("steps_to_target") is not None]
    fastest = min(reached, key=lambda t: (t.user_attrs["steps_to_target"], t.number), default=None)
    best = fastest if fastest_is_best and fastest is not None else best
    return {"study": search + 1, "trial": best.number if best else None,
            f"val_{metric.name}": final_val(best, metric) if best else None,
            "fastest_trial": fastest.number if fastest else None,
            "steps_to_target": fastest.user_attrs["steps_to_target"] if fastest else None,
            "curves": {str(t.number): t.user_attrs.get("curve") for t in complete if t.user_attrs.get("curve")}}


def median_search(searches: list[dict], metric: Metric, by_steps: bool = False) -> dict | None:
    """The search whose best final val value (`by_steps`: whose steps to the target; missed: infinite) is the
    median of the searches' (the worse middle one of an even count): its best trial is the cell's tuned values,
    as AlgoPerf reports the median over studies."""
    def score(s: dict) -> float:
        if not by_steps:
            return metric.score(s[f"val_{metric.name}"])
        return -math.inf if s["steps_to_target"] is None else -s["steps_to_target"]

    ranked = sorted((s for s in searches if s["trial"] is not None), key=lambda s: (score(s), -s["study"]))
    return ranked[(len(ranked) - 1) // 2] if ranked else None


def final_runs(grid: TuneGrid, cell: Cell, kind: str, params: dict, seeds: list[int], new_runs: dict) -> dict:
    """Train `params` (the best trial's, or none: the defaults) once per seed; a run done before is read back.

    Each run's overrides are the tune's, the cell's, `+tune.final=KIND` and its seed, not the tuned values
    (those are in its config, and under `tune.params`): `lbt report` then draws one curve per recipe across
    the cells, in final/tuned, final/default, or both side by side in final/.
    """
    results = [final_run(grid, cell, kind, params, seed, new_runs) for seed in seeds]
    m = grid.settings.metric
    # A diverged run has no value to average (its last evaluation came before the blow-up).
    val = [final_value(r, m) for r in results]
    test = [None if r.diverged else getattr(r, f"test_{m.name}") for r in results]
    return {"seeds": seeds, f"val_{m.name}": val, f"test_{m.name}": test, "val_mean_std": spread(val),
            "test_mean_std": spread(test), "diverged": sum(r.diverged for r in results),
            "base_lr": results[0].base_lr if results else None,
            "peak_lr": results[0].peak_lr if results else None,
            "folders": [str(grid.settings.dir / "final" / kind / cell.folder / f"seed_{s}") for s in seeds]}


def final_run(grid: TuneGrid, cell: Cell, kind: str, params: dict, seed: int, new_runs: dict) -> RunResult:
    """One final run, read back if it finished before; a run stopped part-way continues from its checkpoint."""
    run_dir = grid.settings.dir / "final" / kind / cell.folder / f"seed_{seed}"
    if (run_dir / "result.json").is_file():
        done = read_result(run_dir)
        trained = (done.config.get("tune") or {}).get("params") or {}
        if trained != params:  # the cell's trials grew (tune.trials, tune.studies) and chose other values
            raise ConfigError(f"{run_dir} holds a final run of other values ({shown_values(trained) or 'the defaults'})"
                              f" than the cell's best now ({shown_values(params)}): its trials changed since, and a "
                              f"finished run is never overwritten; tune into another tune.dir, or move "
                              f"{run_dir.parent} away to train them again")
        if not done.failed:
            return done
    started = time.perf_counter()
    marks = [f"+tune.final={kind}", f"trainer.seed={seed}"]
    values = [f"{key}={hydra_value(value)}" for key, value in params.items()]
    result = train_run(grid, cell, values + marks, run_dir, {"params": params},
                       resume=(run_dir / "checkpoint").is_dir(), shown_overrides=marks)
    if result.stopped:
        raise Stopped(stopped_by())
    new_runs["finals"] += 1
    m = grid.settings.metric.name
    test = getattr(result, f"test_{m}")
    state = "diverged" if result.diverged else \
        f"val_{m}={getattr(result, f'final_{m}'):.4f} test_{m}={'n/a' if test is None else format(test, '.4f')}"
    print(f"[{cell.name}] {kind} seed {seed}: {state} ({time.perf_counter() - started:.0f} s)", flush=True)
    return result


def spread(values: list[float | None]) -> list[float] | None:
    """[mean, sample std] of the finite values (a diverged run has none), or None."""
    mean, std = mean_std(values)
    return None if math.isnan(mean) else [mean, std]
