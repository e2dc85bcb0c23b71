"""lbt/apps/tune/summary.py: the typed shapes of cells/<cell>.json and tune_summary.json, parsed once; the JSON
summarize writes keeps its format."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from lbt.apps.tune.report import markdown, summarize
from lbt.apps.tune.summary import StepsRow, parse_cell, parse_summary
from lbt.spec.objective import ACC


def cell_json(series: str, batch: int, val: float, test: float, curve: list[list[float]]) -> dict:
    """A finished cell as finals.py writes it, with one study of one trial."""
    finals = {"seeds": [1, 2], "val_acc": [val, val], "test_acc": [test, test], "val_mean_std": [val, 0.0],
              "test_mean_std": [test, 0.0], "diverged": 0, "base_lr": 0.1, "peak_lr": 0.1, "folders": []}
    return {"cell": f"recipe={series} dist.world_size={batch // 64}", "axes": [], "recipe": series, "series": series,
            "metric": "acc", "world_size": batch // 64, "global_batch": batch, "scaling": "linear", "base_batch": 64,
            "space": {}, "trials": {"counted": 3, "complete": 2, "pruned": 1, "diverged": 0, "failed": 0},
            "studies": [{"study": 1, "trial": 0, "val_acc": val, "fastest_trial": None, "steps_to_target": None,
                         "curves": {"0": curve}}],
            "best": {"trial": 0, "study": 1, "val_acc": val, "params": {"optim.lr": 0.1}, "diverged": False,
                     "base_lr": 0.1, "peak_lr": 0.1 * batch / 64},
            "tuned": finals, "default": {**finals, "seeds": [], "val_mean_std": None, "test_mean_std": None},
            "overrides": []}


CELLS = [cell_json("baseline", 64, 0.90, 0.89, [[10, 0.5], [20, 0.9]]),
         cell_json("baseline", 256, 0.88, 0.86, [[5, 0.6], [10, 0.88]])]


def test_a_cell_reads_as_attributes():
    cell = parse_cell(CELLS[1])
    assert (cell.series, cell.global_batch, cell.world_size, cell.scaling) == ("baseline", 256, 4, "linear")
    assert (cell.trials.counted, cell.trials.pruned) == (3, 1) and cell.curves == ({"0": [[5, 0.6], [10, 0.88]]},)
    assert cell.best is not None and (cell.best.value, cell.best.peak_lr) == (0.88, 0.4)
    assert cell.tuned is not None and cell.tuned.val_mean == 0.88 and cell.tuned.test_mean_std == (0.86, 0.0)
    assert cell.default.seeds == () and cell.default.val_mean is None
    older = {k: v for k, v in CELLS[1].items() if k not in ("tuned", "studies", "metric")} | {"best": None}
    assert parse_cell(older).tuned is None and parse_cell(older).curves == ()  # no trial finished


def test_the_summary_written_is_the_summary_read(tmp_path: Path):
    settings = SimpleNamespace(trials=3, seeds=2, seed=0, startup_trials=1, pruner="none", prune_startup_trials=1,
                               prune_after=0.5, metric=ACC, stop_at_target=False, sampler="tpe", studies=1,
                               objective="final", target=None, dir=tmp_path)
    written = summarize(SimpleNamespace(settings=settings, fixed=["model=mlp"]), CELLS, "sqlite:///x")
    summary = parse_summary(json.loads(json.dumps(written)))  # as tune_summary.json holds it
    assert summary.metric is ACC and summary.protocol.sampler == "multivariate TPE"
    assert summary.overrides == ("model=mlp",) and summary.tune_dir == str(tmp_path)
    assert summary.gaps.reference is not None and summary.gaps.reference.test == 0.89
    assert summary.gaps.batches[0].best_gap == pytest.approx(3.0)  # test points lost at 256
    assert summary.steps.target == pytest.approx(0.89)  # the tuned smallest batch's val mean less 1 point
    assert [r.json() for r in summary.steps.cells] == written["steps_to_target"]["cells"]
    assert StepsRow.from_json(written["steps_to_target"]["cells"][0]) == summary.steps.cells[0]
    assert [fit.batches for fit in summary.lr_fits] == [(64, 256)] and summary.lr_fits[0].exponent == pytest.approx(1)
    assert "| 256 | 4 | 3 (1, 0) | #0: 0.8800 |" in markdown(summary)
