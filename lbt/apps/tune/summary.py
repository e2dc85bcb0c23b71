"""The tune's two files as typed shapes, each parsed from its JSON in one function: a cell's summary
(cells/<cell>.json, written by finals.py) by `parse_cell`, and the tune's (tune_summary.json, written by
report.py) by `parse_summary`. report.py computes from the cells and writes the report from the summary by
attribute; the files keep their JSON format, as bench/ and users read them.

Keys an older file may lack read as what they meant then (no tuned runs, no warnings, one study, acc).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from lbt.spec.objective import Metric, metric_named

Curve = Sequence[Sequence[float]]  # a trial's val curve: [step, value] per evaluation
MeanStd = tuple[float, float]  # mean and sample std over the seeds that did not diverge


@dataclass(frozen=True)
class Trials:
    counted: int  # finished or pruned
    pruned: int
    diverged: int


@dataclass(frozen=True)
class Best:
    """A cell's tuned values: the best trial of its median search."""

    trial: int
    value: float  # its final val value (val_acc, or val_loss)
    params: Mapping[str, Any]
    diverged: bool
    base_lr: float | None  # optim.lr
    peak_lr: float | None  # the LR the run reached: optim.lr x scaling


@dataclass(frozen=True)
class Finals:
    """A cell's final runs of one kind (tuned, or the recipe's untuned defaults), a seed each."""

    seeds: tuple[int, ...]
    val_mean_std: MeanStd | None  # None: no run finished without diverging
    test_mean_std: MeanStd | None
    diverged: int

    @property
    def val_mean(self) -> float | None:
        return None if self.val_mean_std is None else self.val_mean_std[0]

    @property
    def test_mean(self) -> float | None:
        return None if self.test_mean_std is None else self.test_mean_std[0]


@dataclass(frozen=True)
class TunedCell:
    """cells/<cell>.json: one (recipe, global batch) cell, its trials and its final runs."""

    cell: str
    series: str
    global_batch: int
    world_size: int
    scaling: str  # schedule.scaling
    trials: Trials
    curves: tuple[Mapping[str, Curve], ...]  # per independent search: its trials' val curves, by trial number
    best: Best | None  # None: no trial finished
    tuned: Finals | None  # None: no trial finished, so nothing was tuned
    default: Finals  # no seeds with tune.untuned=false


def parse_cell(data: Mapping[str, Any]) -> TunedCell:
    """A cell's summary (cells/<cell>.json, or an entry of tune_summary.json's cells)."""
    best, trials, tuned = data["best"], data["trials"], data.get("tuned")
    return TunedCell(
        cell=data["cell"], series=data["series"], global_batch=data["global_batch"], world_size=data["world_size"],
        scaling=data["scaling"], trials=Trials(trials["counted"], trials["pruned"], trials["diverged"]),
        curves=tuple(dict(study.get("curves") or {}) for study in data.get("studies") or []),
        best=None if best is None else Best(
            trial=best["trial"], value=best[f"val_{data.get('metric', 'acc')}"], params=best["params"],
            diverged=best["diverged"], base_lr=best["base_lr"], peak_lr=best["peak_lr"]),
        tuned=None if tuned is None else parse_finals(tuned), default=parse_finals(data["default"]))


def parse_finals(data: Mapping[str, Any]) -> Finals:
    return Finals(seeds=tuple(data["seeds"]), val_mean_std=pair(data["val_mean_std"]),
                  test_mean_std=pair(data["test_mean_std"]), diverged=data["diverged"])


def pair(values: Sequence[float] | None) -> MeanStd | None:
    return None if values is None else (values[0], values[1])


@dataclass(frozen=True)
class Protocol:
    """tune_summary.json's settings: what every cell got."""

    metric: Metric
    trials: int
    studies: int  # independent searches of each cell
    sampler: str  # in words: "multivariate TPE" or "quasi-random search (scrambled Halton)"
    seed: int
    startup_trials: int
    pruner: str
    prune_after: float
    prune_startup_trials: int
    target: float | None  # tune.target
    stop_at_target: bool


@dataclass(frozen=True)
class LrFit:
    """One curve's best peak LRs against its batches, and the exponent k of peak LR ∝ B^k they fit."""

    series: str
    scalings: tuple[str, ...]
    claimed: tuple[float, ...]  # the exponents the scalings claim
    batches: tuple[int, ...]
    peak_lrs: tuple[float, ...]
    exponent: float | None  # None: not fitted (`note` says why)
    coefficient: float | None
    base_exponent: float | None  # of optim.lr, before scaling
    note: str | None


@dataclass(frozen=True)
class GapRow:
    """Test units lost at one global batch against the tuned smallest batch (positive: lost)."""

    global_batch: int
    ratio: float  # global_batch / the smallest
    best_series: str  # the recipe with the best tuned val mean here
    best_gap: float
    per_series: Mapping[str, float]


@dataclass(frozen=True)
class GapReference:
    series: str
    global_batch: int
    test: float  # its tuned test mean


@dataclass(frozen=True)
class Gaps:
    reference: GapReference | None  # None: no cell's tuned runs were scored on val and test
    batches: tuple[GapRow, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Gaps:
        ref = data.get("reference")
        reference = None if ref is None else GapReference(ref["series"], ref["global_batch"],
                                                          ref[f"test_{data['metric']}"])
        return cls(reference, tuple(GapRow(row["global_batch"], row["ratio"], row["best_series"], row["best_gap"],
                                           row["per_series"]) for row in data["batches"]))


@dataclass(frozen=True, kw_only=True)
class StepsRow:
    """One cell's steps to the target: each study's fastest trial, their median and range (None: missed)."""

    cell: str = ""
    series: str = ""
    global_batch: int
    budget: float | None = None  # the steps of the cell's longest trial; None where no trial has a curve
    per_study: tuple[float | None, ...] = ()
    median: float | None
    low: float | None = None
    high: float | None = None
    missed: int = 0  # studies none of whose trials reached the target

    def json(self) -> dict[str, Any]:
        """The row as tune_summary.json holds it."""
        return asdict(self) | {"per_study": list(self.per_study)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepsRow:
        return cls(cell=data["cell"], series=data["series"], global_batch=data["global_batch"], budget=data["budget"],
                   per_study=tuple(data["per_study"]), median=data["median"], low=data["low"], high=data["high"],
                   missed=data["missed"])


@dataclass(frozen=True)
class StepsFit:
    """S = S_min (1 + B_crit / B) through one curve's median steps to target, and through each study alone."""

    series: str
    batches: tuple[int, ...]
    b_crit: float | None  # None: not fitted (`note` says why)
    s_min: float | None
    rel_rms: float | None
    bound_at: tuple[float, ...]  # the missed batches whose budget holds the fit
    per_study_b_crit: tuple[float | None, ...]
    note: str | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StepsFit:
        return cls(data["series"], tuple(data["batches"]), data["b_crit"], data["s_min"], data["rel_rms"],
                   tuple(data.get("bound_at") or ()), tuple(data.get("per_study_b_crit") or ()), data.get("note"))


@dataclass(frozen=True)
class Steps:
    target: float | None  # None: no target, so no steps
    target_from: str | None  # where the target came from
    cells: tuple[StepsRow, ...]
    fits: tuple[StepsFit, ...]


@dataclass(frozen=True)
class TuneSummary:
    """tune_summary.json: the protocol, every cell, the fitted LR exponents, the gaps, the steps to target."""

    tune_dir: str
    storage: str  # what optuna-dashboard opens the trials with
    protocol: Protocol
    overrides: tuple[str, ...]  # of every run
    warnings: tuple[str, ...]
    cells: tuple[TunedCell, ...]
    lr_fits: tuple[LrFit, ...]
    gaps: Gaps
    steps: Steps

    @property
    def metric(self) -> Metric:
        return self.protocol.metric


def parse_summary(data: Mapping[str, Any]) -> TuneSummary:
    """tune_summary.json's contents, as report.py's `summarize` returns them."""
    s, steps = data["settings"], data.get("steps_to_target") or {}
    protocol = Protocol(
        metric=metric_named(s.get("metric", "acc"), "tune.metric"), trials=s["trials"], studies=s.get("studies", 1),
        sampler=s["sampler"], seed=s["seed"], startup_trials=s["startup_trials"], pruner=s["pruner"],
        prune_after=s["prune_after"], prune_startup_trials=s["prune_startup_trials"], target=s.get("target"),
        stop_at_target=bool(s.get("stop_at_target")))
    fits = tuple(LrFit(fit["series"], tuple(fit["scalings"]), tuple(fit["claimed"]), tuple(fit["batches"]),
                       tuple(fit["peak_lrs"]), fit["exponent"], fit["coefficient"], fit["base_exponent"],
                       fit.get("note")) for fit in data["lr_fits"])
    return TuneSummary(
        tune_dir=data["tune_dir"], storage=data["storage"], protocol=protocol, overrides=tuple(data["overrides"]),
        warnings=tuple(data.get("warnings", ())), cells=tuple(parse_cell(c) for c in data["cells"]), lr_fits=fits,
        gaps=Gaps.from_json(data["gaps"]),
        steps=Steps(steps.get("target"), steps.get("target_from"),
                    tuple(StepsRow.from_json(row) for row in steps.get("cells", ())),
                    tuple(StepsFit.from_json(fit) for fit in steps.get("fits", ()))))
