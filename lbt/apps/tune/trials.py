"""A cell's trials: an Optuna study per cell, TPE draws from the recipe's space, each draw one `lbt train` run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy
import optuna

from lbt.apps.compose import compose
from lbt.apps.errors import Stopped, raise_if_stopped
from lbt.apps.tune.grid import Cell, Settings, TuneGrid
from lbt.apps.tune.storage import TuneStorage, claim_lock, fail_stale, heartbeat, mark_mine, redacted, storage_name
from lbt.engine import make_spec, run
from lbt.errors import ConfigError
from lbt.metrics.critical import crossing_step
from lbt.spec.objective import ACC, Metric
from lbt.spec.result import EvalPoint, RunResult
from lbt.stop import stopped_by
from lbt.techniques.base import Technique

SLOT = "slot"  # a trial's user attribute: which of the cell's tune.trials slots it fills

# Overrides that change how a run is shown, not what it measures: a tune continued with others is the same tune.
PRESENTATION_KEYS = ("trainer.threads", "trainer.progress")
TrialState = optuna.trial.TrialState


class PruneOnVal(Technique):
    """Hands each evaluation of the val split (its `metric`) to an Optuna trial and stops the run when its
    pruner says so.

    Pruning is asked only past `prune_after` of the run's samples (a long warmup trails early; None:
    never, the trial only reports) and never at the last evaluation (the run is done: its final
    value counts). Raising TrialPruned unwinds the run; `run_trial` catches it.
    """

    name = "tune_pruning"
    order = 99  # after every technique that changes the run's layouts (batch ramp: 5)

    def __init__(self, trial: optuna.Trial, prune_after: float | None, metric: Metric = ACC):
        self.trial, self.prune_after, self.metric = trial, prune_after, metric
        self.total_samples = 0

    def epoch_layouts(self, layouts: list, num_train: int, after_epoch: int | None = None,
                      samples_seen: int = 0) -> list:
        self.total_samples = sum((num_train // layout.global_batch) * layout.global_batch for layout in layouts)
        return layouts

    def after_eval(self, point: EvalPoint) -> None:
        value = getattr(point, self.metric.name)
        self.trial.report(value, point.samples_seen)
        if self.prune_after is None or not self.prune_after * self.total_samples <= point.samples_seen \
                < self.total_samples:
            return
        if self.trial.should_prune():
            raise optuna.TrialPruned(f"val {self.metric.name} {value:.4f} at {point.samples_seen:,} samples")


def open_study(storage: Any, grid: TuneGrid, cell: Cell, search: int = 0) -> optuna.Study:
    """The Optuna study of the cell's `search`-th independent search (created, or loaded to continue); refused
    if it was tuned under other settings."""
    s = grid.settings
    pruners: dict[str, Callable[[], optuna.pruners.BasePruner]] = {
        "median": lambda: optuna.pruners.MedianPruner(n_startup_trials=0),  # PruneOnVal waits instead
        "halving": optuna.pruners.SuccessiveHalvingPruner,
        "hyperband": optuna.pruners.HyperbandPruner,
        "none": optuna.pruners.NopPruner}
    # steps to target: fewer is better
    direction: Literal["minimize", "maximize"] = "minimize" if s.objective == "steps_to_target" else s.metric.direction
    study = optuna.create_study(storage=storage, study_name=cell.study_name(search), direction=direction,
                                pruner=pruners[s.pruner](), load_if_exists=True)
    if study.direction.name.lower() != direction:  # a loaded study keeps the direction it was created with
        raise ConfigError(f"{s.dir} holds trials of cell {cell.name!r} that {study.direction.name.lower()}d their "
                          f"value, and tune.metric={s.metric.name} tune.objective={s.objective} {direction}s it; pick "
                          "another tune.dir")
    identity = json.loads(json.dumps(tune_identity(grid, cell)))  # as the storage gives it back: lists, not tuples
    if not study.user_attrs:
        for key, value in identity.items():
            study.set_user_attr(key, value)
        return study
    stored = {k: study.user_attrs.get(k, LATER_IDENTITY.get(k)) for k in identity}
    if differ := [k for k in identity if stored[k] != identity[k]]:
        raise ConfigError(f"{s.dir} holds trials of cell {cell.name!r} run with "
                          f"{difference(differ, stored, identity)}; pick another tune.dir")
    return study


# Identity keys a study's attributes may lack (lbt stored them only from some version on), each with the value such
# a study was tuned under: absent means this value, so its folder continues under the defaults and only under them.
LATER_IDENTITY: dict[str, Any] = {"sampler": "tpe", "objective": "final", "target": None, "stop_at_target": False}


def tune_identity(grid: TuneGrid, cell: Cell) -> dict[str, Any]:
    """What makes a cell's trials comparable: continuing a folder with another value of any of these is another
    tune. The target counts only where it ranks the trials (tune.objective=steps_to_target)."""
    s = grid.settings
    return {"overrides": identity_overrides(grid), "space": cell.space, "sampler": s.sampler,
            "objective": s.objective, "target": s.target if s.objective == "steps_to_target" else None,
            "stop_at_target": s.stop_at_target}


def difference(keys: list[str], stored: dict[str, Any], identity: dict[str, Any]) -> str:
    """How a folder's identity differs from the command's, in the command line's words."""
    words = {"overrides": f"other overrides ({' '.join(stored['overrides'] or []) or 'none'})",
             "space": "another search space"}

    def value(v: Any) -> str:
        return v if isinstance(v, str) else json.dumps(v)  # null, true: as an override is written

    return ", ".join(words.get(k) or f"tune.{k}={value(stored[k])} (this command: tune.{k}={value(identity[k])})"
                     for k in keys)


def identity_overrides(grid: TuneGrid) -> list[str]:
    """The overrides that change what a cell measures (not how it is shown), sorted."""
    return sorted(o for o in grid.fixed if o.split("=", 1)[0].lstrip("+~") not in PRESENTATION_KEYS)


@dataclass
class Claim:
    """A trial this worker took: its slot in the cell (0 .. tune.trials - 1) and whether pruning is armed."""

    trial: optuna.Trial
    slot: int
    armed: bool  # the cell has prune_startup_trials finished trials, so the pruner has something to compare with
    search: int = 0  # which of the cell's independent searches (tune.studies) the trial belongs to


def claim_trial(grid: TuneGrid, cell: Cell, study: optuna.Study, storage: TuneStorage,
                search: int = 0) -> Claim | None:
    """Take the cell's next free trial slot, or None when every slot is done or running in some worker.

    Under tune.dir's lock, so two workers never both take the last slot: stale trials (their worker is gone)
    are failed, freeing their slots; finished, pruned, running and waiting trials hold theirs.
    """
    s = grid.settings
    with claim_lock(storage.folder):
        for number in fail_stale(storage, study):
            print(f"[{cell.name}] trial {number}: its worker is gone (no heartbeat for {storage.grace} s); "
                  "it is run again as a new trial", flush=True)
        held = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
        slot = free_slot(study.get_trials(deepcopy=False, states=held), s.trials)
        if slot is None:
            return None
        # Seeded per slot, so a trial redone after an interruption draws what it drew then (in the random
        # startup trials at least); the seed is hashed from (tune.seed, slot), since consecutive seeds give
        # NumPy's RandomState close first draws.
        finished = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        with warnings.catch_warnings():  # multivariate TPE is experimental; the heartbeat is ours (storage.py)
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            warnings.filterwarnings("ignore", "Heartbeat of storage")
            study.sampler = sampler(s, search, slot)
            trial = study.ask()
        trial.set_user_attr(SLOT, slot)
        mark_mine(storage, trial)
    return Claim(trial, slot, armed=finished >= s.prune_startup_trials, search=search)


def free_slot(held: list[optuna.trial.FrozenTrial], slots: int) -> int | None:
    """The lowest slot no held trial holds (each records its own; one without, from an older lbt, holds the
    lowest free one in trial order), or None when all are held. Counting the held trials instead would give a
    dead trial's retry the next trial's slot, so one point would run twice and another never."""
    taken: set[int] = {t.user_attrs[SLOT] for t in held if isinstance(t.user_attrs.get(SLOT), int)}
    for _ in (t for t in sorted(held, key=lambda t: t.number) if not isinstance(t.user_attrs.get(SLOT), int)):
        taken.add(min(k for k in range(len(held) + 1) if k not in taken))
    return next((k for k in range(slots) if k not in taken), None)


def sampler(s: Settings, search: int, slot: int) -> optuna.samplers.BaseSampler:
    """The sampler of one slot of one search, seeded from (tune.seed, slot[, search]): hashed, since consecutive
    seeds give NumPy's RandomState close first draws; the first search keeps the seeds of a tune of one.

    qmc: one scrambled Halton sequence per search (its seed), which Optuna walks along the study's trials;
    its first point is drawn at random (Optuna's QMCSampler infers the space from it), seeded per slot."""
    def hashed(*words: int) -> int:
        return int(numpy.random.SeedSequence(list(words)).generate_state(1)[0])

    seed = hashed(s.seed, slot) if search == 0 else hashed(s.seed, slot, search)
    if s.sampler == "qmc":
        return optuna.samplers.QMCSampler(qmc_type="halton", scramble=True, seed=hashed(s.seed, search, 1),
                                          independent_sampler=optuna.samplers.RandomSampler(seed=seed),
                                          warn_independent_sampling=False, warn_asynchronous_seeding=False)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.startup_trials, multivariate=True)


def run_trial(study: optuna.Study, grid: TuneGrid, cell: Cell, claim: Claim, storage: TuneStorage) -> None:
    """One trial: sample the space, train, tell Optuna the final val accuracy or loss (tune.metric; or pruned,
    or the metric's worst value if diverged). Its heartbeat runs while it trains.
    """
    trial = claim.trial
    params = {key: suggest(trial, key, values) for key, values in cell.space.items()}
    overrides = [f"{key}={hydra_value(value)}" for key, value in params.items()]
    metric = grid.settings.metric
    if grid.settings.stop_at_target:  # the trial only (the final runs train the whole budget)
        overrides.append(f"trainer.stop_at_val_{metric.name}={grid.settings.target!r}")
    pruning = PruneOnVal(trial, grid.settings.prune_after if claim.armed else None, metric)
    started, shown = time.perf_counter(), shown_values(params)
    search = f", study {claim.search + 1}/{grid.settings.studies}" if grid.settings.studies > 1 else ""
    head = f"[{cell.name}] trial {trial.number} ({claim.slot + 1}/{grid.settings.trials}{search})"
    run_dir = grid.settings.dir / "trials" / cell.trials_folder(claim.search) / str(trial.number)
    try:
        with heartbeat(storage, storage.trial_id(trial.study.study_name, trial.number)):
            result = train_run(grid, cell, overrides, run_dir, {"params": params}, [pruning])
    except optuna.TrialPruned as error:
        tell(study, trial, state=TrialState.PRUNED)
        print(f"{head}: pruned ({error}) {shown} ({time.perf_counter() - started:.0f} s)", flush=True)
        return
    except ConfigError as error:  # e.g. a sampled value the config refuses
        tell(study, trial, state=TrialState.FAIL)
        raise ConfigError(f"[{cell.name}] trial {trial.number} ({shown}): {error}") from None
    except BaseException:  # a crash or Ctrl-C: the trial is run again, as a new one, next time
        tell(study, trial, state=TrialState.FAIL)
        raise
    if result.stopped:
        tell(study, trial, state=TrialState.FAIL)
        raise Stopped(stopped_by())
    value, steps = record(trial, result, grid.settings)
    # A diverged trial spent the budget like any other: it counts, with the worst value (accuracy 0, loss inf;
    # steps to target inf, as a run that misses the target: AlgoPerf's rule).
    if grid.settings.objective == "steps_to_target":
        tell(study, trial, math.inf if steps is None else steps)
    else:
        tell(study, trial, metric.worst if value is None else value)
    state = f"diverged, counted as val_{metric.name}={metric.worst:g}" if value is None \
        else f"val_{metric.name}={value:.4f}"
    if grid.settings.target is not None and value is not None:
        state += f", target {metric.show(grid.settings.target)}{metric.suffix} " + \
            (f"at step {steps:,.0f}" if steps is not None else "missed")
    print(f"{head}: {state} {shown} ({time.perf_counter() - started:.0f} s)", flush=True)


def record(trial: optuna.Trial, result: RunResult, s: Settings) -> tuple[float | None, float | None]:
    """The trial's user attributes: its final val value (`final_val`, None if diverged), its val curve
    (`curve`: [step, value] per evaluation, from which the report reads steps to any target) and, with
    tune.target, the steps to it (`steps_to_target`, None if missed). Returns (final value, steps)."""
    value = final_value(result, s.metric)
    steps = None
    if s.target is not None and value is not None:
        steps = crossing_step(result.history, s.target, metric=s.metric)
    for key in ("global_batch", "base_lr", "peak_lr"):
        trial.set_user_attr(key, getattr(result, key))
    trial.set_user_attr("diverged", value is None)
    trial.set_user_attr("final_val", value)
    trial.set_user_attr("steps_to_target", steps)
    trial.set_user_attr("curve", curve(result, s.metric))
    return value, steps


def curve(result: RunResult, metric: Metric) -> list[list[float]]:
    """[step, val value] per finite evaluation of a run."""
    points = ((p.step, getattr(p, metric.name)) for p in result.history)
    return [[int(step), float(value)] for step, value in points if math.isfinite(value)]


def tell(study: optuna.Study, trial: optuna.Trial, value: float | None = None,
         state: TrialState | None = None) -> None:
    """study.tell, unless the trial was already finished: taken as stale by another worker (this one stalled
    longer than the grace period), whose retry counts instead; said in one line."""
    try:
        study.tell(trial, value, state=state)
    except (ValueError, RuntimeError, optuna.exceptions.UpdateFinishedTrialError) as error:
        if "Cannot tell" not in str(error) and not isinstance(error, optuna.exceptions.UpdateFinishedTrialError):
            raise
        print(f"trial {trial.number}: already failed by another worker (no heartbeat for too long): "
              "its result is not counted, its retry is", flush=True)


def final_value(result: RunResult, metric: Metric) -> float | None:
    """The run's final val value of `metric`; None if it diverged (or has none)."""
    value = getattr(result, f"final_{metric.name}")
    return None if result.diverged or not math.isfinite(value) else value


def train_run(grid: TuneGrid, cell: Cell, overrides: list[str], run_dir: Path, tune_record: dict,
              techniques: list[Technique] | tuple = (), resume: bool = False,
              shown_overrides: list[str] | None = None) -> RunResult:
    """One run of the cell with `overrides`, as `lbt train` composes it, in this process, quietly (its text log
    is run_dir/train.log).

    `shown_overrides` stand for `overrides` in the result (and so in `lbt report`'s series names): a final
    run is named by its kind and seed, not by the tuned values it trains.
    """
    raise_if_stopped()  # told to stop since the last run ended: this one does not start
    composed = compose(grid.head + grid.fixed + cell.axes + overrides, job_name="lbt_tune")
    config = composed.config
    config["tune"] = {**{k: v for k, v in (config.get("tune") or {}).items() if k not in ("grid", "space")},
                      "cell": cell.name, **tune_record}
    if config["tune"].get("storage") is not None:  # result.json never holds the storage's password
        config["tune"]["storage"] = redacted(storage_name(config["tune"]["storage"]))
    if resume:
        config["trainer"]["resume"] = "auto"
    shown = overrides if shown_overrides is None else shown_overrides
    spec = make_spec(config, composed.recipe, grid.fixed + cell.axes + shown)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return run(spec, run_dir, list(techniques))


def suggest(trial: optuna.Trial, key: str, values: dict) -> Any:
    """Draw one value of a search-space entry (grid.check_range accepted it)."""
    if "choices" in values:
        return trial.suggest_categorical(key, list(values["choices"]))
    log, step = bool(values.get("log")), values.get("step")
    if values.get("int"):
        return trial.suggest_int(key, int(values["low"]), int(values["high"]), step=int(step or 1), log=log)
    return trial.suggest_float(key, float(values["low"]), float(values["high"]), step=step, log=log)


def hydra_value(value: Any) -> str:
    """A sampled value as a Hydra override's value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def shown_values(params: dict) -> str:
    """`key=value` pairs for the terminal, floats to 4 significant digits."""
    return " ".join(f"{k}={short(v)}" for k, v in params.items())


def short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
