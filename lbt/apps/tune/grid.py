"""The tune's grid: its settings (the `tune` node), its cells, and each cell's checked search space."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser

from lbt.apps.compose import compose, one_line, sweep_grid
from lbt.engine import make_spec
from lbt.errors import ConfigError
from lbt.spec.objective import Metric, metric_named
from lbt.spec.validate import integer, number, one_of

PRUNERS = ("median", "halving", "hyperband", "none")
# tpe: Optuna's multivariate TPE (adaptive); qmc: a scrambled Halton sequence, the quasi-random search of
# AlgoPerf's external tuning (Kasimbeg et al. 2024), which draws the same points whatever the trials score.
SAMPLERS = ("tpe", "qmc")
# What a trial's Optuna value is: its final val value (tune.metric), or the steps it took to reach tune.target.
OBJECTIVES = ("final", "steps_to_target")
# Cell keys that place a cell on the batch axis; the others (recipe, ...) name its curve.
BATCH_KEYS = ("dist.world_size", "trainer.global_batch", "trainer.per_worker_batch")
RANGE_KEYS = {"low", "high", "log", "step", "int"}
# Keys every trial must share, so trials are compared on one validation split and one seed.
UNTUNABLE = ("data.val_fraction", "data.val_seed", "trainer.seed")


@dataclass(frozen=True)
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
    storage: str | None = None  # sqlite | journal | journal:PATH | a database URL (None: $LBT_TUNE_STORAGE or sqlite)
    workers: int = 1  # processes this command runs trials in (each a worker of tune/storage.py)
    heartbeat: int = 10  # seconds between a running trial's heartbeats (a worker gone 3 heartbeats: retried)
    studies: int = 1  # independent searches of each cell (their own sampler seeds): AlgoPerf's studies
    sampler: str = "tpe"  # tpe | qmc
    objective: str = "final"  # final | steps_to_target
    target: float | None = None  # the val value (tune.metric) whose steps to reach every trial records
    stop_at_target: bool = False  # a trial ends at the evaluation that reaches tune.target (AlgoPerf's rule)

    @classmethod
    def from_config(cls, node: dict) -> Settings:
        return cls(
            trials=integer("tune.trials", node.get("trials")),
            seeds=integer("tune.seeds", node.get("seeds"), 0),
            seed=integer("tune.seed", node.get("seed"), 0),
            startup_trials=integer("tune.startup_trials", node.get("startup_trials"), 0),
            pruner=str(one_of("tune.pruner", node.get("pruner"), PRUNERS)),
            prune_startup_trials=integer("tune.prune_startup_trials", node.get("prune_startup_trials"), 0),
            prune_after=number("tune.prune_after", node.get("prune_after"), 0.0, 1.0),
            dir=Path(str(node.get("dir") or "runs/tune/default")).expanduser().absolute(),
            metric=metric_named(str(node.get("metric", "acc")), "tune.metric"),
            untuned=bool(one_of("tune.untuned", node.get("untuned", True), (True, False))),
            storage=None if node.get("storage") is None else str(node["storage"]),
            workers=integer("tune.workers", node.get("workers", 1), 1, 256),
            heartbeat=integer("tune.heartbeat", node.get("heartbeat", 10), 1),
            studies=integer("tune.studies", node.get("studies", 1), 1, 100),
            sampler=str(one_of("tune.sampler", node.get("sampler", "tpe"), SAMPLERS)),
            objective=str(one_of("tune.objective", node.get("objective", "final"), OBJECTIVES)),
            target=None if node.get("target") is None else number("tune.target", node["target"]),
            stop_at_target=bool(one_of("tune.stop_at_target", node.get("stop_at_target", False), (True, False))),
        ).checked()

    def checked(self) -> Settings:
        """One line for settings that contradict each other."""
        if self.objective == "steps_to_target":
            if self.target is None:
                raise ConfigError("tune.objective=steps_to_target needs tune.target, the val "
                                  f"{self.metric.label} to reach (e.g. tune.target=0.8)")
            if self.pruner != "none":
                raise ConfigError(f"tune.objective=steps_to_target with tune.pruner={self.pruner}: the pruner "
                                  f"compares val {self.metric.label}, which a steps objective does not rank; set "
                                  "tune.pruner=none")
        if self.stop_at_target and self.objective != "steps_to_target":
            raise ConfigError(f"tune.stop_at_target=true with tune.objective={self.objective}: a trial that ends at "
                              "tune.target has no final val value to rank; set tune.objective=steps_to_target")
        if self.metric.start is not None and self.target is not None and not 0 < self.target <= 1:
            raise ConfigError(f"tune.target={self.target:g} is a val {self.metric.label} and lies in (0, 1]")
        return self


@dataclass(frozen=True)
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
        named = any(_key(a) == "recipe" for a in self.axes)
        return " ".join(self.axes if named else [f"recipe={self.recipe}", *self.axes])

    @property
    def folder(self) -> str:
        return self.name.replace(" ", ",").replace("/", "_")

    def study_name(self, study: int) -> str:
        """The Optuna study of the cell's `study`-th independent search (0: the cell's name, as one search)."""
        return self.name if study == 0 else f"{self.name} study={study + 1}"

    def trials_folder(self, study: int) -> str:
        return self.folder if study == 0 else f"{self.folder}/study_{study + 1}"

    @property
    def series(self) -> str:
        """The curve the cell belongs to: its axes but the batch ones (`lars`, `lars optim=sgd`)."""
        others = [a for a in self.axes if _key(a) not in (*BATCH_KEYS, "recipe")]
        return " ".join([self.recipe, *others])


@dataclass
class TuneGrid:
    """What one `lbt tune` command tunes: its settings, the overrides of every run, and the cells."""

    settings: Settings
    head: list[str]  # composed into every run, not a run's override: the tune config and tune.* keys
    fixed: list[str]  # the command line's other overrides: every run's
    cells: list[Cell] = field(default_factory=list)


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def tune_grid(args: list[str]) -> TuneGrid:
    """Split the command line into the tune's settings, every run's overrides and the grid's cells.

    The grid is `tune.grid` with the command line's sweeps (`recipe=a,b`) and set grid keys
    (`dist.world_size=16`) in place of their lines, in a multirun's order (the last key fastest).
    Every cell's default config is composed and checked here, before any trial runs.
    """
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
    head += [str(o.input_line) for o in parsed if o.key_or_group.startswith("tune.")]
    rest = [o for o in parsed if o.key_or_group != "tune" and not o.key_or_group.startswith("tune.")]
    config = compose(head + [str(o.input_line) for o in rest if not o.is_sweep_override()], job_name="lbt_tune").config
    tune_node = config.get("tune") or {}
    # The grid's lines, by key; a key the command line sets (swept or not) takes its line's place.
    axes = {_key_of(parser, str(line), "tune.grid"): str(line) for line in tune_node.get("grid") or []}
    fixed = []
    for o in rest:
        key = o.get_key_element()
        if o.is_sweep_override() or key in axes:
            axes[key] = str(o.input_line)
        else:
            fixed.append(str(o.input_line))
    grid = TuneGrid(Settings.from_config(tune_node), head, fixed)
    for cell in sweep_grid(list(axes.values()), "the tune's grid: "):
        grid.cells.append(check_cell(grid, cell))
    return grid


def _key_of(parser: OverridesParser, line: str, where: str) -> str:
    """A grid line's key (`dist.world_size` of `dist.world_size=1,16`); a line Hydra cannot read is one line."""
    try:
        return parser.parse_override(line).get_key_element()
    except Exception as error:
        raise ConfigError(f"{where}: {line}: {one_line(error)}") from None


def check_cell(grid: TuneGrid, axes: list[str]) -> Cell:
    """Compose a cell's default config and refuse, with one line, what a tune cannot do with it."""
    composed = compose(grid.head + grid.fixed + axes, job_name="lbt_tune")
    config, where = composed.config, f"cell {' '.join(axes)}"
    val_fraction = (config.get("data") or {}).get("val_fraction")
    if not (val_fraction or 0) > 0:
        raise ConfigError(f"{where}: lbt tune selects on a validation split and data.val_fraction="
                          f"{val_fraction} holds none out: set data.val_fraction > 0 (e.g. 0.1)")
    spec = make_spec(config, composed.recipe)
    if spec.procs != 1:
        raise ConfigError(f"{where}: lbt tune runs every trial in this process: dist.procs must be 1, "
                          f"got {spec.procs}")
    space = check_space((config.get("tune") or {}).get("space") or {}, config, composed.recipe)
    return Cell(axes, composed.recipe, config, space, spec.layout.global_batch)


def check_space(space: dict, config: dict, recipe: str) -> dict[str, dict]:
    """The recipe's `tune.space`: config key -> {low, high[, log, step, int]} or {choices: [...]}."""
    if not space:
        raise ConfigError(f"recipe {recipe} declares no tune.space, so a tune has nothing to search: add "
                          f"e.g. `tune: {{space: {{optim.lr: {{low: 0.01, high: 1.0, log: true}}}}}}` to its YAML")
    for key, values in space.items():
        try:
            check_range(key, values, config)
        except ConfigError as error:
            raise ConfigError(f"recipe {recipe}: {error}") from None
    return space


def check_range(key: str, values: Any, config: dict) -> None:
    """One entry of a search space: a key of the config, and a range or choices Optuna can sample."""
    where = f"tune.space.{key}"
    if not _has_key(config, key):
        raise ConfigError(f"{where}: {key} is not a key of the composed config")
    if key in UNTUNABLE:
        raise ConfigError(f"{where}: trials are compared on one validation split and seed; {key} is not tuned")
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be {{low: .., high: ..}} or {{choices: [..]}}, got {values!r}")
    if "choices" in values:
        if set(values) != {"choices"} or not isinstance(values["choices"], list) or not values["choices"]:
            raise ConfigError(f"{where}: give a non-empty list `choices` and nothing else, got {values!r}")
        return
    if set(values) - RANGE_KEYS or not {"low", "high"} <= set(values):
        raise ConfigError(f"{where}: give low and high (and optionally log, step, int), got {values!r}")
    low = number(f"{where}.low", values["low"])
    high = number(f"{where}.high", values["high"], low, low_open=True)
    if values.get("log") and low <= 0:
        raise ConfigError(f"{where}: a log-uniform range needs low > 0, got {values['low']!r}")
    if values.get("log") and values.get("step") is not None:
        raise ConfigError(f"{where}: step and log exclude each other")
    if values.get("step") is not None:
        number(f"{where}.step", values["step"], 0, high - low, low_open=True)


def _has_key(config: dict, dotted: str) -> bool:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
