"""`lbt tune`: the same tuning budget for every (recipe, global batch) cell, chosen on val.

Comparing a hand-tuned recipe with an untuned baseline measures tuning effort, not the
batch size (Shallue et al. 2019; Nado et al. 2021, "A Large Batch Optimizer Reality
Check"). `lbt tune` runs one protocol for every cell of a grid:

    for cell in the grid (tune.grid in conf/tune/default.yaml, or the command line's sweeps):
        until tune.trials trials of the cell finished or were pruned:
            values = TPE(seeded).sample(the recipe's tune.space)     # recipes/*.yaml
            result = lbt.train.run(config + values)                 # in this process, as `lbt train`
                after each evaluation: val acc (or loss) -> the trial; the pruner may stop it (PruneOnVal)
            value  = final_val_acc, or 0 if the run diverged (it spent the budget all the same);
                     with tune.metric=loss final_val_loss, minimised, or inf if it diverged
    for cell: the best trial's values, and the recipe's untuned defaults, each trained with
        tune.seeds fresh seeds and scored on val and, once, on test
    tune_report.md, tune_summary.json, best_lr_vs_batch.png

The trials live in an Optuna SQLite storage, one Optuna study per cell, so the same
command again runs only what is missing and `optuna-dashboard sqlite:///<dir>/optuna.db`
shows them. Folder layout:

    <tune.dir>/optuna.db
    <tune.dir>/trials/<cell>/<number>/           a trial's run folder (no result.json if pruned)
    <tune.dir>/final/tuned/<cell>/seed_<s>/      the best values, seed s
    <tune.dir>/final/default/<cell>/seed_<s>/    the recipe's defaults, seed s
                                                 (`lbt report <tune.dir>/final`: tuned vs untuned, per recipe)
    <tune.dir>/tune_report.md, tune_summary.json, best_lr_vs_batch.png

Like lbt/cli.py, an entry module: it composes configs with Hydra (as `lbt train` does) and
drives `lbt.train.run`; the library never imports it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import statistics
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy

from lbt.compose import one_line, register_schemas
from lbt.config import plan_batches
from lbt.errors import ConfigError
from lbt.lr import scaling_factor
from lbt.metrics.tensorboard import RunLogger
from lbt.objective import ACC, Metric, metric_named
from lbt.paths import atomic_write, conf_dir
from lbt.techniques.base import Technique
from lbt.train import check_layout, run
from lbt.validate import integer, number, one_of

PRUNERS = ("median", "halving", "hyperband", "none")
# Cell keys that place a cell on the batch axis; the others (recipe, ...) name its curve.
BATCH_KEYS = ("dist.world_size", "trainer.global_batch", "trainer.per_worker_batch")
SPEC_KEYS = {"low", "high", "log", "step", "int"}
# Overrides that change how a run is shown, not what it measures: a tune continued with others is the same tune.
PRESENTATION_KEYS = ("trainer.threads", "trainer.progress")

HELP = """usage: lbt tune [overrides]

The same tuning budget for every (recipe, world size) cell: tune.trials Optuna trials per cell
(TPE, seeded; a pruner fed the val accuracy), each an `lbt train` run selected on val; then the best
values and the recipe's untuned defaults with tune.seeds fresh seeds, scored once on test.
Writes tune_report.md, tune_summary.json, best_lr_vs_batch.png and optuna.db into tune.dir;
the same command again continues an interrupted tune.

  lbt tune                                             the default grid (conf/tune/default.yaml)
  lbt tune recipe=baseline,lamb dist.world_size=16,64  a grid of your own (Hydra sweep syntax)
  lbt tune tune.trials=16 tune.seeds=5 tune.dir=runs/tune/mine model=mlp trainer.epochs=5

tune.* keys: trials, seeds, seed, startup_trials, pruner (median|halving|hyperband|none),
prune_startup_trials, prune_after, dir, grid, metric (acc: maximise val accuracy; loss: minimise
val loss). A recipe's search space is its `tune.space` (recipes/*.yaml).
"""


class Stopped(Exception):
    """A run was stopped by SIGTERM/SIGINT: the tune stops, to be continued by the same command."""


# -- the command line ---------------------------------------------------------------------------
@dataclass
class Settings:
    """The `tune` node (conf/tune/default.yaml), checked."""

    trials: int
    seeds: int
    seed: int
    startup_trials: int
    pruner: str
    prune_startup_trials: int
    prune_after: float
    dir: Path
    metric: Metric  # what trials are selected on: final val accuracy (maximised) or loss (minimised)
    untuned: bool = True  # also train the recipe's untuned defaults with the seeds (the "default" runs)

    @classmethod
    def from_config(cls, node: dict) -> Settings:
        return cls(
            trials=integer("tune.trials", node.get("trials")),
            seeds=integer("tune.seeds", node.get("seeds")),
            seed=integer("tune.seed", node.get("seed"), 0),
            startup_trials=integer("tune.startup_trials", node.get("startup_trials"), 0),
            pruner=str(one_of("tune.pruner", node.get("pruner"), PRUNERS)),
            prune_startup_trials=integer("tune.prune_startup_trials", node.get("prune_startup_trials"), 0),
            prune_after=number("tune.prune_after", node.get("prune_after"), 0.0, 1.0),
            dir=Path(str(node.get("dir") or "runs/tune/default")).expanduser().absolute(),
            metric=metric_named(str(node.get("metric", "acc")), "tune.metric"),
            untuned=bool(one_of("tune.untuned", node.get("untuned", True), (True, False))),
        )


@dataclass
class Cell:
    """One (recipe, world size, ...) point of the grid: its overrides and its composed default config."""

    axes: list[str]  # e.g. ["recipe=lars", "dist.world_size=16"]
    recipe: str
    config: dict  # composed with the recipe's defaults, resolved
    space: dict[str, dict]
    global_batch: int

    @property
    def name(self) -> str:
        """The cell's Optuna study name: its axes, led by the recipe's name when the grid does not sweep it."""
        named = any(a.split("=", 1)[0].lstrip("+~") == "recipe" for a in self.axes)
        return " ".join(self.axes if named else [f"recipe={self.recipe}", *self.axes])

    @property
    def folder(self) -> str:
        return self.name.replace(" ", ",").replace("/", "_")

    @property
    def series(self) -> str:
        """The curve the cell belongs to: its axes but the batch ones (`lars`, `lars optim=sgd`)."""
        others = [a for a in self.axes if a.split("=", 1)[0].lstrip("+~") not in BATCH_KEYS + ("recipe",)]
        return " ".join([self.recipe, *others])


@dataclass
class Plan:
    settings: Settings
    head: list[str]  # composed into every run, not a run's override: the tune config and tune.* keys
    fixed: list[str]  # the command line's other overrides: every run's
    cells: list[Cell] = field(default_factory=list)


def tune(args: list[str]) -> dict | None:
    """`lbt tune [overrides]`: tune every cell, train the finals, write the report; return its summary."""
    if any(arg in ("-h", "--help") for arg in args):
        print(HELP)
        return None
    optuna = _optuna()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial is printed here instead
    plan = plan_tune(args)
    folder = plan.settings.dir
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"tune.dir={folder}: cannot create the tune folder: {error.strerror or error}") from None
    storage = optuna.storages.RDBStorage(f"sqlite:///{folder / 'optuna.db'}")
    s = plan.settings
    print(f"tune: {_count(len(plan.cells), 'cell')} x {_count(s.trials, 'trial')} (TPE, seed {s.seed}; pruner "
          f"{s.pruner}), then the best{' and the defaults' if s.untuned else ''} x {_count(s.seeds, 'seed')}; "
          f"folder {folder}", flush=True)
    started, new_runs = time.perf_counter(), {"trials": 0, "finals": 0}
    # Every cell's study is opened (and checked against this command) before any trial runs.
    studies = [open_study(optuna, storage, plan, cell) for cell in plan.cells]
    try:
        cells = []
        for cell, study in zip(plan.cells, studies):
            tune_cell(optuna, plan, cell, study, new_runs)
            cells.append(finish_cell(optuna, plan, cell, study, new_runs))
    except (Stopped, KeyboardInterrupt):
        print(f"tune: stopped; run the same command again to continue ({folder})", flush=True)
        return None
    summary = summarize(plan, cells + earlier_cells(plan, cells))
    write_tune_report(folder, summary)
    print(f"tune finished in {time.perf_counter() - started:.0f} s: {_count(new_runs['trials'], 'new trial')}, "
          f"{_count(new_runs['finals'], 'new final run')}", flush=True)
    print(f"report: {folder / 'tune_report.md'}; trials: optuna-dashboard sqlite:///{folder / 'optuna.db'}; "
          f"final runs, tuned vs untuned: lbt report {folder / 'final'}", flush=True)
    return summary


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _optuna():
    try:
        import optuna
    except ImportError:
        raise ConfigError("lbt tune needs Optuna: pip install 'lbt[tune]'") from None
    return optuna


def compose(overrides: list[str]) -> tuple[dict, str]:
    """The resolved config `lbt train OVERRIDES` would run, and its recipe's name."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf, open_dict

    register_schemas()
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name="lbt_tune"):
            cfg = hydra_compose("config", overrides=list(overrides), return_hydra_config=True)
    except Exception as error:  # Hydra / OmegaConf composition errors, as one line
        raise ConfigError(one_line(error)) from None
    recipe = cfg.hydra.runtime.choices.get("recipe") or "custom"
    with open_dict(cfg):
        del cfg["hydra"]
    return OmegaConf.to_container(cfg, resolve=True), recipe


def plan_tune(args: list[str]) -> Plan:
    """Split the command line into the tune's settings, every run's overrides and the grid's cells.

    The grid is `tune.grid` with the command line's sweeps (`recipe=a,b`) and set grid keys
    (`dist.world_size=16`) in place of their lines, in a multirun's order (the last key fastest).
    Every cell's default config is composed and checked here, before any trial runs.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(list(args))
    except Exception as error:
        raise ConfigError(one_line(error)) from None
    group = next((o for o in parsed if o.key_or_group == "tune"), None)
    head = [f"+tune={group.value() if group else 'default'}"]
    if any(o.key_or_group.startswith("hydra") for o in parsed):
        raise ConfigError("lbt tune writes into tune.dir: hydra.* overrides do not apply to it")
    for o in parsed:
        if o.key_or_group.startswith("tune.") and o.is_sweep_override():
            raise ConfigError(f"{o.input_line}: tune.* settings take one value")
    head += [o.input_line for o in parsed if o.key_or_group.startswith("tune.")]
    rest = [o for o in parsed if o.key_or_group != "tune" and not o.key_or_group.startswith("tune.")]
    config, _ = compose(head + [o.input_line for o in rest if not o.is_sweep_override()])
    tune_node = config.get("tune") or {}
    settings = Settings.from_config(tune_node)

    axes: dict[str, list[str]] = {}
    for line in tune_node.get("grid") or []:
        key, values = _sweep(parser, str(line), "tune.grid")
        axes[key] = values
    fixed = []
    for o in rest:
        key = o.get_key_element()
        if o.is_sweep_override() or key in axes:
            axes[key] = _sweep(parser, o.input_line, "the command line")[1]
        else:
            fixed.append(o.input_line)
    plan = Plan(settings, head, fixed)
    for values in itertools.product(*axes.values()):
        plan.cells.append(check_cell(plan, [f"{k}={v}" for k, v in zip(axes, values)]))
    return plan


def _sweep(parser, line: str, where: str) -> tuple[str, list[str]]:
    """`key=a,b` (or range(...), or one value) as (key, [values])."""
    try:
        override = parser.parse_override(line)
        if override.is_sweep_override():
            values = list(override.sweep_string_iterator())
        else:
            values = [override.get_value_element_as_str()]
    except Exception as error:
        raise ConfigError(f"{where}: {line}: {one_line(error)}") from None
    return override.get_key_element(), values


def check_cell(plan: Plan, axes: list[str]) -> Cell:
    """Compose a cell's default config and refuse, with one line, what a tune cannot do with it."""
    config, recipe = compose(plan.head + plan.fixed + axes)
    where = f"cell {' '.join(axes)}"
    data = config.get("data") or {}
    if not (data.get("val_fraction") or 0) > 0:
        raise ConfigError(f"{where}: lbt tune selects on a validation split and data.val_fraction="
                          f"{data.get('val_fraction')} holds none out: set data.val_fraction > 0 (e.g. 0.1)")
    procs = check_layout(config, None)
    if procs != 1:
        raise ConfigError(f"{where}: lbt tune runs every trial in this process: dist.procs must be 1, got {procs}")
    dist_cfg, trainer = config["dist"], config["trainer"]
    batch = plan_batches(dist_cfg["world_size"], procs, trainer["per_worker_batch"], trainer["global_batch"])
    space = check_space((config.get("tune") or {}).get("space") or {}, config, recipe)
    return Cell(axes, recipe, config, space, batch.global_batch)


def check_space(space: dict, config: dict, recipe: str) -> dict[str, dict]:
    """The recipe's `tune.space`: config key -> {low, high[, log, step, int]} or {choices: [...]}."""
    if not space:
        raise ConfigError(f"recipe {recipe} declares no tune.space, so a tune has nothing to search: add "
                          f"e.g. `tune: {{space: {{optim.lr: {{low: 0.01, high: 1.0, log: true}}}}}}` to its YAML")
    for key, spec in space.items():
        try:
            check_range(key, spec, config)
        except ConfigError as error:
            raise ConfigError(f"recipe {recipe}: {error}") from None
    return space


def check_range(key: str, spec, config: dict) -> None:
    """One entry of a search space: a key of the config, and a range or choices Optuna can sample."""
    where = f"tune.space.{key}"
    if _lookup(config, key) is _MISSING:
        raise ConfigError(f"{where}: {key} is not a key of the composed config")
    if key in ("data.val_fraction", "data.val_seed", "trainer.seed"):
        raise ConfigError(f"{where}: trials are compared on one validation split and seed; {key} is not tuned")
    if not isinstance(spec, dict):
        raise ConfigError(f"{where} must be {{low: .., high: ..}} or {{choices: [..]}}, got {spec!r}")
    if "choices" in spec:
        if set(spec) != {"choices"} or not isinstance(spec["choices"], list) or not spec["choices"]:
            raise ConfigError(f"{where}: give a non-empty list `choices` and nothing else, got {spec!r}")
        return
    if set(spec) - SPEC_KEYS or not {"low", "high"} <= set(spec):
        raise ConfigError(f"{where}: give low and high (and optionally log, step, int), got {spec!r}")
    low = number(f"{where}.low", spec["low"])
    high = number(f"{where}.high", spec["high"], low, low_open=True)
    if spec.get("log") and low <= 0:
        raise ConfigError(f"{where}: a log-uniform range needs low > 0, got {spec['low']!r}")
    if spec.get("log") and spec.get("step") is not None:
        raise ConfigError(f"{where}: step and log exclude each other")
    if spec.get("step") is not None:
        number(f"{where}.step", spec["step"], 0, high - low, low_open=True)


_MISSING = object()


def _lookup(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


# -- trials -------------------------------------------------------------------------------------
class PruneOnVal(Technique):
    """Hands each evaluation of the val split (its `metric`) to an Optuna trial and stops the run when its
    pruner says so.

    Pruning is asked only past `prune_after` of the run's samples (a long warmup trails early; None:
    never, the trial only reports) and never at the last evaluation (the run is done: its final
    value counts). Raising TrialPruned unwinds the run; lbt.tune's runner catches it.
    """

    name = "tune_pruning"
    order = 99  # after every technique that changes the run's plans (batch ramp: 5)

    def __init__(self, trial, prune_after: float | None, metric: Metric = ACC):
        self.trial, self.prune_after, self.metric = trial, prune_after, metric
        self.total_samples, self.pruned_at = 0, None

    def plan_epochs(self, plans, num_train):
        self.total_samples = sum((num_train // p.global_batch) * p.global_batch for p in plans)
        return plans

    def after_eval(self, step: int, samples_seen: int, acc: float, loss: float = math.nan) -> None:
        import optuna

        value = {"acc": acc, "loss": loss}[self.metric.name]
        self.trial.report(value, samples_seen)
        if self.prune_after is None or not self.prune_after * self.total_samples <= samples_seen < self.total_samples:
            return
        if self.trial.should_prune():
            self.pruned_at = samples_seen
            raise optuna.TrialPruned(f"val {self.metric.name} {value:.4f} at {samples_seen:,} samples")


def open_study(optuna, storage, plan: Plan, cell: Cell):
    """The cell's Optuna study (created, or loaded to continue); refused if it was tuned under other settings."""
    s = plan.settings
    pruners = {"median": lambda: optuna.pruners.MedianPruner(n_startup_trials=0),  # PruneOnVal waits instead
               "halving": lambda: optuna.pruners.SuccessiveHalvingPruner(),
               "hyperband": lambda: optuna.pruners.HyperbandPruner(),
               "none": lambda: optuna.pruners.NopPruner()}
    direction = s.metric.direction
    study = optuna.create_study(storage=storage, study_name=cell.name, direction=direction,
                                pruner=pruners[s.pruner](), load_if_exists=True)
    if study.direction.name.lower() != direction:  # a loaded study keeps the direction it was created with
        raise ConfigError(f"{s.dir} holds trials of cell {cell.name!r} that {study.direction.name.lower()}d their "
                          f"value, and tune.metric={s.metric.name} {direction}s it; pick another tune.dir")
    identity = {"overrides": sorted(identity_overrides(plan)), "space": cell.space}
    if not study.user_attrs:
        for key, value in identity.items():
            study.set_user_attr(key, value)
    elif {k: study.user_attrs.get(k) for k in identity} != json.loads(json.dumps(identity)):
        raise ConfigError(f"{s.dir} holds trials of cell {cell.name!r} run with other overrides or another "
                          f"search space ({' '.join(study.user_attrs.get('overrides') or [])}); pick another tune.dir")
    return study


def identity_overrides(plan: Plan) -> list[str]:
    """The overrides that change what a cell measures (not how it is shown)."""
    return [o for o in plan.fixed if o.split("=", 1)[0].lstrip("+~") not in PRESENTATION_KEYS]


def tune_cell(optuna, plan: Plan, cell: Cell, study, new_runs: dict) -> None:
    """Run the cell's trials until it has tune.trials finished or pruned ones."""
    s = plan.settings
    done_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        # A trial left running by a process that was killed: it is run again, as a new trial.
        study.tell(stale.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
    done = len(study.get_trials(deepcopy=False, states=done_states))
    if done >= s.trials:
        print(f"[{cell.name}] {done} of {s.trials} trials done before", flush=True)
    while done < s.trials:
        # Seeded per trial, so a trial redone after an interruption draws what it drew then; the seed is
        # hashed from (tune.seed, trial), since consecutive seeds give NumPy's RandomState close first draws.
        seed = int(numpy.random.SeedSequence([s.seed, done]).generate_state(1)[0])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=s.startup_trials,
                                                       multivariate=True)
        finished = len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)))
        run_trial(optuna, study, plan, cell, done, armed=finished >= s.prune_startup_trials)
        new_runs["trials"] += 1
        done = len(study.get_trials(deepcopy=False, states=done_states))


def run_trial(optuna, study, plan: Plan, cell: Cell, done: int, armed: bool) -> None:
    """One trial: sample the space, train, tell Optuna the final val accuracy or loss (tune.metric; or pruned,
    or the metric's worst value if diverged).

    `armed`: the cell has prune_startup_trials finished trials, so the pruner has something to compare with.
    """
    trial = study.ask()
    params = {key: _suggest(trial, key, spec) for key, spec in cell.space.items()}
    values = [f"{key}={_hydra_value(value)}" for key, value in params.items()]
    run_dir = plan.settings.dir / "trials" / cell.folder / str(trial.number)
    metric = plan.settings.metric
    hook = PruneOnVal(trial, plan.settings.prune_after if armed else None, metric)
    started = time.perf_counter()
    shown = " ".join(f"{k}={_short(v)}" for k, v in params.items())
    head = f"[{cell.name}] trial {trial.number} ({done + 1}/{plan.settings.trials})"
    try:
        result = train_run(plan, cell, values, run_dir, plan.fixed + cell.axes + values, {"params": params}, [hook])
    except optuna.TrialPruned as error:
        _close_run_logs(error)
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        print(f"{head}: pruned ({error}) {shown} ({time.perf_counter() - started:.0f} s)", flush=True)
        return
    except ConfigError as error:  # e.g. a sampled value the config refuses
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise ConfigError(f"[{cell.name}] trial {trial.number} ({shown}): {error}") from None
    except BaseException:  # a crash or Ctrl-C: the trial is run again, as a new one, next time
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise
    if result.get("stopped"):
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        raise Stopped
    value = result.get(f"final_val_{metric.name}")
    diverged = bool(result.get("diverged")) or value is None or not math.isfinite(value)
    for key in ("global_batch", "base_lr", "peak_lr"):
        trial.set_user_attr(key, result.get(key))
    trial.set_user_attr("diverged", diverged)
    # A diverged trial spent the budget like any other: it counts, with the worst value (accuracy 0, loss inf).
    study.tell(trial, metric.worst if diverged else value)
    state = f"diverged, counted as val_{metric.name}={metric.worst:g}" if diverged else f"val_{metric.name}={value:.4f}"
    print(f"{head}: {state} {shown} ({time.perf_counter() - started:.0f} s)", flush=True)


def train_run(plan: Plan, cell: Cell, compose_overrides: list[str], run_dir: Path, overrides: list[str],
              tune_record: dict, techniques: list[Technique] = (), resume: bool = False) -> dict:
    """One run of the cell, as `lbt train` composes it, in this process, quietly: its text log is run_dir/train.log."""
    config, recipe = compose(plan.head + plan.fixed + cell.axes + compose_overrides)
    config["tune"] = {**{k: v for k, v in (config.get("tune") or {}).items() if k not in ("grid", "space")},
                      "cell": cell.name, **tune_record}
    if resume:
        config["trainer"]["resume"] = "auto"
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
        return run(config, run_dir, recipe=recipe, overrides=overrides, techniques=list(techniques))


def _close_run_logs(error: BaseException) -> None:
    """TrialPruned unwinds a run before it closes its TensorBoard writers: close the ones its frames held,
    so the pruned trial's curves reach the disk and no writer thread is left behind."""
    tb = error.__traceback__
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, RunLogger):
                value.close()
        tb = tb.tb_next


def _suggest(trial, key: str, spec: dict):
    if "choices" in spec:
        return trial.suggest_categorical(key, list(spec["choices"]))
    log, step = bool(spec.get("log")), spec.get("step")
    if spec.get("int"):
        return trial.suggest_int(key, int(spec["low"]), int(spec["high"]), step=int(step or 1), log=log)
    return trial.suggest_float(key, float(spec["low"]), float(spec["high"]), step=step, log=log)


def _hydra_value(value) -> str:
    """A sampled value as a Hydra override's value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# -- final runs ---------------------------------------------------------------------------------
def finish_cell(optuna, plan: Plan, cell: Cell, study, new_runs: dict) -> dict:
    """The cell's trials in numbers, then its best values and its defaults over tune.seeds fresh seeds."""
    states = optuna.trial.TrialState
    trials = study.get_trials(deepcopy=False)
    counted = [t for t in trials if t.state in (states.COMPLETE, states.PRUNED)]
    complete = [t for t in counted if t.state == states.COMPLETE]
    metric = plan.settings.metric
    summary = {
        "cell": cell.name, "axes": cell.axes, "recipe": cell.recipe, "series": cell.series, "metric": metric.name,
        "world_size": cell.config["dist"]["world_size"], "global_batch": cell.global_batch,
        "scaling": cell.config["schedule"]["scaling"], "base_batch": cell.config["schedule"]["base_batch"],
        "space": cell.space,
        "trials": {"counted": len(counted), "complete": len(complete),
                   "pruned": sum(t.state == states.PRUNED for t in counted),
                   "diverged": sum(bool(t.user_attrs.get("diverged")) for t in complete),
                   "failed": sum(t.state == states.FAIL for t in trials)},
        "best": None,
    }
    first_seed = int(cell.config["trainer"]["seed"])
    seeds = [first_seed + k for k in range(1, plan.settings.seeds + 1)]
    if complete:
        best = max(complete, key=lambda t: (metric.score(t.value), -t.number))
        summary["best"] = {"trial": best.number, f"val_{metric.name}": best.value, "params": dict(best.params),
                           "diverged": bool(best.user_attrs.get("diverged")),
                           "base_lr": best.user_attrs.get("base_lr"), "peak_lr": best.user_attrs.get("peak_lr")}
        shown = " ".join(f"{k}={_short(v)}" for k, v in best.params.items())
        print(f"[{cell.name}] best of {len(counted)} trials ({summary['trials']['pruned']} pruned, "
              f"{summary['trials']['diverged']} diverged): trial {best.number} val_{metric.name}={best.value:.4f} "
              f"{shown}",
              flush=True)
        summary["tuned"] = final_runs(plan, cell, "tuned", dict(best.params), seeds, new_runs)
    else:
        print(f"[{cell.name}] no trial finished (all {len(counted)} pruned): no tuned runs", flush=True)
    summary["default"] = final_runs(plan, cell, "default", {}, seeds if plan.settings.untuned else [], new_runs)
    summary["overrides"] = sorted(identity_overrides(plan))
    (plan.settings.dir / "cells").mkdir(exist_ok=True)
    atomic_write(plan.settings.dir / "cells" / f"{cell.folder}.json",
                 lambda f: f.write(json.dumps(summary, indent=2).encode()))
    return summary


def earlier_cells(plan: Plan, cells: list[dict]) -> list[dict]:
    """Finished cells in tune.dir that this command did not name, tuned with the same overrides and metric."""
    names, found = {c["cell"] for c in cells}, []
    for path in sorted((plan.settings.dir / "cells").glob("*.json")):
        try:
            cell = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being written by another process, or not ours
        same = cell.get("overrides") == sorted(identity_overrides(plan)) \
            and cell.get("metric", "acc") == plan.settings.metric.name
        if cell.get("cell") not in names and same:
            found.append(cell)
    return found


def final_runs(plan: Plan, cell: Cell, kind: str, params: dict, seeds: list[int], new_runs: dict) -> dict:
    """Train `params` (the best trial's, or none: the defaults) once per seed; a run done before is read back.

    Each run's overrides are the tune's, the cell's, `+tune.final=KIND` and its seed, not the tuned values
    (those are in its config, and under `tune.params`): `lbt report` then draws one curve per recipe across
    the cells, in final/tuned, final/default, or both side by side in final/.
    """
    values = [f"{key}={_hydra_value(value)}" for key, value in params.items()]
    marks = [f"+tune.final={kind}"]
    results = []
    for seed in seeds:
        run_dir = plan.settings.dir / "final" / kind / cell.folder / f"seed_{seed}"
        done = run_dir / "result.json"
        result = json.loads(done.read_text()) if done.is_file() else None
        if result is None or "error" in result:
            started = time.perf_counter()
            seed_override = [f"trainer.seed={seed}"]
            # A final run stopped part-way (Ctrl-C, preemption) continues from its checkpoint.
            result = train_run(plan, cell, values + marks + seed_override, run_dir,
                               plan.fixed + cell.axes + marks + seed_override, {"params": params},
                               resume=(run_dir / "checkpoint").is_dir())
            if result.get("stopped"):
                raise Stopped
            new_runs["finals"] += 1
            m = plan.settings.metric.name
            state = "diverged" if result.get("diverged") else (
                f"val_{m}={result.get(f'final_val_{m}', float('nan')):.4f} test_{m}={_fmt(result.get(f'test_{m}'))}")
            print(f"[{cell.name}] {kind} seed {seed}: {state} ({time.perf_counter() - started:.0f} s)", flush=True)
        results.append(result)
    # A diverged run has no value to average (its last evaluation came before the blow-up).
    m = plan.settings.metric.name
    val = [None if r.get("diverged") else r.get(f"final_val_{m}") for r in results]
    test = [None if r.get("diverged") else r.get(f"test_{m}") for r in results]
    return {"seeds": seeds, f"val_{m}": val, f"test_{m}": test, "val_mean_std": mean_std(val),
            "test_mean_std": mean_std(test), "diverged": sum(bool(r.get("diverged")) for r in results),
            "base_lr": results[0].get("base_lr") if results else None,
            "peak_lr": results[0].get("peak_lr") if results else None,
            "folders": [str(plan.settings.dir / "final" / kind / cell.folder / f"seed_{s}") for s in seeds]}


def mean_std(values: list) -> list[float] | None:
    """[mean, sample std] of the finite values (a diverged run has none), or None."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    if not finite:
        return None
    return [statistics.fmean(finite), statistics.stdev(finite) if len(finite) > 1 else 0.0]


# -- the report ---------------------------------------------------------------------------------
def fit_exponent(batches: list[float], lrs: list[float]) -> tuple[float, float]:
    """Least-squares fit of lr = c x B^k in log-log space; returns (k, c).

    Needs two distinct batches and positive LRs (ValueError otherwise).
    """
    points = [(math.log(b), math.log(lr)) for b, lr in zip(batches, lrs)]
    if len(points) != len(batches) or len({x for x, _ in points}) < 2:
        raise ValueError("fitting an exponent needs LRs at two or more distinct batches")
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    k = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)
    return k, math.exp(mean_y - k * mean_x)


def claimed_exponent(scaling: str) -> float:
    """The exponent k of peak LR ∝ B^k that a scaling rule claims: none 0, sqrt 0.5, linear 1 (lbt.lr)."""
    return round(math.log2(scaling_factor(2, 1, scaling)), 9)


def summarize(plan: Plan, cells: list[dict]) -> dict:
    """tune_summary.json: the protocol, every cell, and per curve the fitted exponent of the best peak LR."""
    fits = []
    for series in dict.fromkeys(c["series"] for c in cells):
        members = [c for c in cells if c["series"] == series]
        usable = sorted((c for c in members if c["best"] and not c["best"]["diverged"] and (c["best"]["peak_lr"] or 0) > 0),
                        key=lambda c: c["global_batch"])
        fit = {"series": series, "scalings": sorted({c["scaling"] for c in members}),
               "claimed": sorted({claimed_exponent(c["scaling"]) for c in members}),
               "batches": [c["global_batch"] for c in usable], "peak_lrs": [c["best"]["peak_lr"] for c in usable],
               "base_lrs": [c["best"]["base_lr"] for c in usable], "exponent": None, "coefficient": None,
               "base_exponent": None}
        try:
            fit["exponent"], fit["coefficient"] = fit_exponent(fit["batches"], fit["peak_lrs"])
            fit["base_exponent"] = fit_exponent(fit["batches"], fit["base_lrs"])[0]
        except ValueError as error:
            fit["note"] = str(error)
        fits.append(fit)
    s = plan.settings
    return {
        "gaps": gaps_to_base(cells, s.metric),
        "tune_dir": str(s.dir), "storage": f"sqlite:///{s.dir / 'optuna.db'}",
        "settings": {"trials": s.trials, "seeds": s.seeds, "seed": s.seed, "startup_trials": s.startup_trials,
                     "pruner": s.pruner, "prune_startup_trials": s.prune_startup_trials,
                     "prune_after": s.prune_after, "sampler": "multivariate TPE", "metric": s.metric.name,
                     "selected_on": f"final_val_{s.metric.name}"},
        "overrides": plan.fixed, "cells": cells, "lr_fits": fits,
    }


def gaps_to_base(cells: list[dict], metric: Metric = ACC) -> dict:
    """Test accuracy (or loss: `metric`) lost at each batch against the tuned smallest batch, per curve and
    for the best curve.

    The reference is the smallest global batch's tuned run (the curve with the best tuned val mean, if
    several reach that batch); at each larger batch the best curve is chosen on val too, and only its
    test value is compared: test decides nothing. Gaps are in the metric's units (percentage points of
    test accuracy, nats of test loss); positive: lost.
    """
    def mean(c: dict, split: str) -> float | None:
        pair = (c.get("tuned") or {}).get(f"{split}_mean_std")
        return pair[0] if pair else None

    scored = [c for c in cells if mean(c, "val") is not None and mean(c, "test") is not None]
    if not scored:
        return {"reference": None, "batches": []}
    smallest = min(c["global_batch"] for c in scored)
    def on_val(c: dict) -> float:
        return metric.score(mean(c, "val"))

    reference = max((c for c in scored if c["global_batch"] == smallest), key=on_val)
    ref_test = mean(reference, "test")
    gaps = {"metric": metric.name, "reference": {"cell": reference["cell"], "series": reference["series"],
                                                 "global_batch": smallest, f"test_{metric.name}": ref_test},
            "batches": []}
    for batch in sorted({c["global_batch"] for c in scored if c["global_batch"] > smallest}):
        here = [c for c in scored if c["global_batch"] == batch]
        best = max(here, key=on_val)
        ratio = batch / smallest
        row = {"global_batch": batch, "ratio": ratio, "best_series": best["series"],
               "best_gap": metric.gap(mean(best, "test"), ref_test),
               "per_series": {c["series"]: metric.gap(mean(c, "test"), ref_test) for c in here}}
        gaps["batches"].append(row)
        gaps[f"best_gap_{ratio:g}x"] = row["best_gap"]
    return gaps


def _fmt(value, spec: str = ".4f") -> str:
    return "n/a" if value is None or not math.isfinite(value) else format(value, spec)


def _fmt_ms(pair: list[float] | None) -> str:
    return "n/a" if pair is None else f"{pair[0]:.4f} ± {pair[1]:.4f}"


def markdown(summary: dict) -> str:
    s, cells = summary["settings"], summary["cells"]
    metric = metric_named(s.get("metric", "acc"), "tune.metric")
    m, label = metric.name, metric.label
    pruning = ("no pruning" if s["pruner"] == "none" else
               f"{s['pruner']} pruning past {100 * s['prune_after']:g}% of a trial's samples, once "
               f"{s['prune_startup_trials']} trials of the cell finished")
    seeds = next((c[kind]["seeds"] for c in cells for kind in ("tuned", "default") if c.get(kind, {}).get("seeds")), [])
    untuned = any(c["default"]["seeds"] for c in cells)
    lines = [
        f"# Tuning report: {summary['tune_dir']}", "",
        f"Every cell got the same budget: **{s['trials']} trials** of {s['sampler']} (seed {s['seed']}, the first "
        f"{s['startup_trials']} random) over its recipe's `tune.space`, each a full `lbt train` run selected on its "
        f"final **val** {label} ({metric.direction}d); {pruning}; a "
        f"diverged trial counts, as {metric.worst:g}. The best trial's values (**tuned**)"
        + (" and the recipe's **untuned** defaults" if untuned else " (tune.untuned=false: not the untuned defaults)")
        + f" were then trained with seeds {', '.join(map(str, seeds))} (not the "
        "trials' seed) and scored on val and, once, on **test**: the gap between the two is how much of the "
        f"{label} lost at a batch was mis-tuning.", "",
        f"Overrides of every run: `{' '.join(summary['overrides']) or '(none)'}`. "
        f"Trials: `optuna-dashboard {summary['storage']}`. The final runs read with `lbt report` too: "
        "`final/` (tuned and untuned side by side), `final/tuned`, `final/default`.", "",
        "## Best LR vs global batch", "",
        "Fitted is the exponent k of the best trial's **effective peak LR** ∝ B^k (result.json `peak_lr` = "
        "`optim.lr` x scaling(B / `schedule.base_batch`), the LR the run reaches), not of the tuned `optim.lr` "
        "(the base LR before scaling, whose exponent is shown beside it). A scaling rule claims k = 1 (linear), "
        "0.5 (sqrt) or 0 (none); a fitted k below the claim means the rule scales the LR too fast here.", "",
        "| recipe | claims (schedule.scaling) | fitted k, peak LR | fitted k, optim.lr | batches | best peak LRs |",
        "| --- | --- | ---: | ---: | --- | --- |",
    ]
    for fit in summary["lr_fits"]:
        claim = ", ".join(f"{c:g}" for c in fit["claimed"]) + f" ({', '.join(fit['scalings'])})"
        fitted = _fmt(fit["exponent"], ".2f") if fit["exponent"] is not None else f"n/a: {fit.get('note')}"
        row = [fit["series"], claim, fitted, _fmt(fit["base_exponent"], ".2f"),
               ", ".join(f"{b:,}" for b in fit["batches"]), ", ".join(f"{v:.3g}" for v in fit["peak_lrs"])]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "![best peak LR vs global batch](best_lr_vs_batch.png)", ""]
    lines += gap_lines(summary["gaps"], [fit["series"] for fit in summary["lr_fits"]], metric)
    for series in dict.fromkeys(c["series"] for c in cells):
        lines += [f"## {series}", "",
                  f"| global batch | world size | trials (pruned, diverged) | best trial: val {m} | tuned val {m} | "
                  f"tuned test {m} | untuned val {m} | untuned test {m} | test gained by tuning ({metric.unit}s) | "
                  "best values | best peak LR |",
                  "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
        lines += [_cell_row(c, metric) for c in sorted((c for c in cells if c["series"] == series),
                                                        key=lambda c: c["global_batch"])]
        lines.append("")
    return "\n".join(lines)


def gap_lines(gaps: dict, series: list[str], metric: Metric = ACC) -> list[str]:
    """The table of test points (or nats of loss) lost against the tuned smallest batch."""
    ref = gaps.get("reference")
    if not ref:
        return []
    unit, spec = f"{metric.unit}s", metric.gap_spec
    lines = [f"## Test {metric.label} lost against the tuned smallest batch", "",
             f"Reference: {ref['series']} at global batch {ref['global_batch']:,}, tuned, test {metric.name} "
             f"{metric.show(ref[f'test_{metric.name}'])}{metric.suffix}. {unit.capitalize()} lost on test (mean over "
             "the seeds; negative: gained). The best recipe at a batch is the one with the best tuned **val** mean "
             "there; test only scores it.", "",
             f"| global batch | x | best on val | best: {unit} lost | " + " | ".join(series) + " |",
             "| ---: | ---: | --- | ---: |" + " ---: |" * len(series)]
    for row in gaps["batches"]:
        per = [_fmt(row["per_series"].get(name), spec) for name in series]
        lines.append(f"| {row['global_batch']:,} | {row['ratio']:g} | {row['best_series']} | "
                     f"{format(row['best_gap'], spec)} | " + " | ".join(per) + " |")
    return lines + [""]


def _cell_row(c: dict, metric: Metric = ACC) -> str:
    """One row of a recipe's table: the cell's trials, its best trial, tuned and untuned finals over seeds."""
    t, best, tuned, default = c["trials"], c["best"], c.get("tuned"), c["default"]

    def finals(runs: dict | None, split: str) -> str:
        text = _fmt_ms(runs and runs[f"{split}_mean_std"])
        return text + (f" ({runs['diverged']} diverged)" if runs and runs["diverged"] and split == "val" else "")

    gain = None
    if tuned and tuned["test_mean_std"] and default["test_mean_std"]:
        gain = metric.gap(default["test_mean_std"][0], tuned["test_mean_std"][0])
    cells = [f"{c['global_batch']:,}", str(c["world_size"]), f"{t['counted']} ({t['pruned']}, {t['diverged']})",
             f"#{best['trial']}: {best[f'val_{metric.name}']:.4f}" if best else "none finished",
             finals(tuned, "val"), finals(tuned, "test"), finals(default, "val"), finals(default, "test"),
             _fmt(gain, metric.gap_spec),
             ", ".join(f"`{k}={_short(v)}`" for k, v in best["params"].items()) if best else "",
             _fmt(best["peak_lr"], ".4g") if best else "n/a"]
    return "| " + " | ".join(cells) + " |"


def plot_best_lr(summary: dict, path: Path) -> None:
    """Best effective peak LR vs global batch, log-log, with each curve's fitted power law."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fit in summary["lr_fits"]:
        if not fit["batches"]:
            continue
        claim = "/".join(f"{c:g}" for c in fit["claimed"])
        label = fit["series"] + (f": k={fit['exponent']:.2f} (claims {claim})" if fit["exponent"] is not None else "")
        dots = ax.scatter(fit["batches"], fit["peak_lrs"], label=label)
        if fit["exponent"] is not None:
            xs = sorted(fit["batches"])
            ax.plot(xs, [fit["coefficient"] * x ** fit["exponent"] for x in xs], "--", color=dots.get_facecolor()[0])
    batches = sorted({b for fit in summary["lr_fits"] for b in fit["batches"]})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    if batches:
        ax.set_xticks(batches, [f"{b:,}" for b in batches])
        ax.minorticks_off()
    ax.set_xlabel("global batch")
    ax.set_ylabel("best peak LR (optim.lr x scaling)")
    ax.set_title("Best LR vs global batch (tuned on val; dashed: fitted power law)")
    ax.grid(True, which="both", alpha=0.3)
    if ax.collections:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no cell has a best trial that did not diverge", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_tune_report(folder: Path, summary: dict) -> None:
    plot_best_lr(summary, folder / "best_lr_vs_batch.png")
    atomic_write(folder / "tune_summary.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))
    atomic_write(folder / "tune_report.md", lambda f: f.write(markdown(summary).encode()))
