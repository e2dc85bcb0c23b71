"""`lbt tune`: the same tuning budget for every (recipe, global batch) cell, chosen on val (lbt/apps/tune/)."""

import json
import re
import signal
import sys
from pathlib import Path

import optuna
import pytest
from conftest import compose_config, signal_after_line
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_cli_errors import run_main_io

from lbt.apps import cli
from lbt.apps.tune.command import tune
from lbt.apps.tune.grid import check_space
from lbt.apps.tune.report import claimed_exponent, fit_exponent, steps_fit
from lbt.apps.tune.summary import StepsRow
from lbt.apps.tune.trials import PruneOnVal
from lbt.errors import ConfigError
from lbt.spec.batching import BatchLayout
from lbt.spec.result import EvalPoint, read_result

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
# Synthetic data with a validation split, 2 epochs: a run takes well under a second.
TINY = ["data=synthetic", "data.val_fraction=0.25", "data.num_train=512", "model=mlp", "trainer.epochs=2",
        "trainer.per_worker_batch=16", "trainer.threads=1", "trainer.device=cpu"]


def trials_in(folder: Path) -> dict[str, list[tuple[int, str]]]:
    """Every cell's trials in the tune's storage: study name -> [(number, state)]."""
    storage = f"sqlite:///{folder / 'optuna.db'}"
    return {name: [(t.number, t.state.name) for t in optuna.load_study(study_name=name, storage=storage).trials]
            for name in optuna.get_all_study_names(storage)}


@pytest.mark.slow
def test_tune_a_tiny_grid_then_the_same_command_runs_nothing_new(tmp_path, capfd, monkeypatch):
    """A tune end to end: 2 recipes x 2 batches x 3 trials, finals with 2 seeds; then the same command."""
    folder = tmp_path / "tune"
    args = ["tune", *TINY, "recipe=baseline,goyal2017", "dist.world_size=1,4", "tune.trials=3", "tune.seeds=2",
            f"tune.dir={folder}"]
    monkeypatch.chdir(tmp_path)
    code, first, err = run_main_io(args, capfd)  # in this process, as `lbt tune` runs it
    assert code == 0, err
    assert (folder / "optuna.db").is_file()
    # One line per finished trial, one per cell.
    assert len(re.findall(r"\] trial \d+ \([123]/3\): (val_acc|pruned|diverged)", first)) == 12
    assert first.count("] best of 3 trials") == 4
    # After each trial and each cell's final runs: the runs done of 4 x (3 trials + 2 seeds x tuned, untuned).
    done = [int(n) for n in re.findall(r"^tune: (\d+) of 28 runs done \(\d+%\)", first, re.M)]
    assert len(done) == 12 + 4 and done == sorted(done) and done[-1] == 28
    assert re.search(r"^tune: \d+ of 28 runs done \(\d+%\); about \d+ s left$", first, re.M)

    # Equal budget: every cell has exactly tune.trials finished or pruned trials in the storage.
    trials = trials_in(folder)
    assert sorted(trials) == [f"recipe={r} dist.world_size={w}" for r in ("baseline", "goyal2017") for w in (1, 4)]
    for states in trials.values():
        assert sum(state in ("COMPLETE", "PRUNED") for _, state in states) == 3

    summary = json.loads((folder / "tune_summary.json").read_text())
    for cell in summary["cells"]:
        assert cell["trials"]["counted"] == 3 and len(cell["tuned"]["val_acc"]) == 2
        # The tuned finals train the best trial's values, with fresh seeds, scored once on test.
        tuned = read_result(cell["tuned"]["folders"][0])
        assert tuned.config["optim"]["lr"] == pytest.approx(cell["best"]["params"]["optim.lr"])
        assert tuned.eval_split == "val" and tuned.test_acc is not None and tuned.seed == 1
        assert cell["tuned"]["val_acc"][0] == pytest.approx(tuned.final_acc)
        assert "+tune.final=tuned" in tuned.overrides and not any("optim.lr" in o for o in tuned.overrides)
        default = read_result(cell["default"]["folders"][1])
        recipe_lr = compose_config([f"recipe={cell['recipe']}"])[0]["optim"]["lr"]  # the recipe's own default
        assert default.config["optim"]["lr"] == pytest.approx(recipe_lr) and default.seed == 2
    fits = {fit["series"]: fit for fit in summary["lr_fits"]}
    assert fits["baseline"]["claimed"] == [0.0] and fits["goyal2017"]["claimed"] == [1.0]
    assert all(fit["exponent"] is not None for fit in fits.values())
    report = (folder / "tune_report.md").read_text()
    assert "untuned test acc" in report and "tuned test acc" in report and "fitted k, peak LR" in report
    assert f"| goyal2017 | 1 (linear) | {fits['goyal2017']['exponent']:.2f} |" in report
    assert (folder / "best_lr_vs_batch.png").stat().st_size > 0

    # `lbt report` reads the final runs: per recipe a tuned and an untuned curve, the seeds averaged.
    from lbt.apps.report import write_report

    assert len(write_report(folder / "final", None)["jobs"]) == 16
    finals = (folder / "final" / "report.md").read_text()
    assert "## baseline (+tune.final=tuned)" in finals and "## goyal2017 (+tune.final=default)" in finals

    code, out, err = run_main_io(args, capfd)
    assert code == 0, err
    assert trials_in(folder) == trials
    assert "0 new trials, 0 new final runs" in out and "): val_acc" not in out and "runs done" not in out

    # Test points lost against the tuned smallest batch; the best recipe at a batch is chosen on val.
    gaps = summary["gaps"]
    cells = {(c["series"], c["global_batch"]): c for c in summary["cells"]}
    ref = gaps["reference"]
    assert ref["global_batch"] == min(b for _, b in cells)
    row = gaps["batches"][0]
    at = {s: c for (s, b), c in cells.items() if b == row["global_batch"]}
    best = max(at, key=lambda s: at[s]["tuned"]["val_mean_std"][0])
    assert row["best_series"] == best
    assert gaps[f"best_gap_{row['ratio']:g}x"] == pytest.approx(
        100 * (ref["test_acc"] - at[best]["tuned"]["test_mean_std"][0]))
    assert "Test accuracy lost against the tuned smallest batch" in report

    # One cell of the grid again: nothing new, and the report still covers every cell tuned in the folder.
    code, out, err = run_main_io([a for a in args if not a.startswith(("recipe=", "dist.world_size="))]
                                 + ["recipe=baseline", "dist.world_size=4"], capfd)
    assert code == 0, err
    assert "0 new trials, 0 new final runs" in out
    assert len(json.loads((folder / "tune_summary.json").read_text())["cells"]) == 4


@pytest.mark.slow
def test_a_stopped_tune_exits_with_the_signals_code_and_the_same_command_continues_it(tmp_path, capfd, monkeypatch):
    """Told to stop after its first trial (mid-run or between runs), with a helper worker: the signal's exit
    code, its helper stopped with it, no finished trial lost; the same command finishes the grid. Ctrl-C
    (SIGINT) here; SIGTERM reaches the same handler (lbt/stop.py), and a SIGTERM between a tune's safe points
    is the test below."""
    sig = signal.SIGINT
    folder = tmp_path / "tune"
    args = ["tune", *TINY, "trainer.epochs=3", "recipe=baseline", "dist.world_size=1,4", "tune.trials=3",
            "tune.seeds=1", "tune.workers=2", f"tune.dir={folder}"]
    code, out, err = signal_after_line(args, tmp_path, r"\] trial \d+ \(", sig)
    assert code == 128 + sig and "Traceback" not in err, (code, err)
    assert out.count("tune: stopped; run the same command again to continue") == 1  # the helper stays quiet
    stopped = trials_in(folder)
    assert not [t for states in stopped.values() for t in states if t[1] == "RUNNING"], stopped  # the helper too
    complete = {(name, n) for name, states in stopped.items() for n, state in states if state == "COMPLETE"}
    assert complete and not (folder / "tune_summary.json").exists()

    monkeypatch.chdir(tmp_path)
    code, _, err = run_main_io(args, capfd)  # continued in this process
    assert code == 0, err
    after = trials_in(folder)
    assert complete <= {(name, n) for name, states in after.items() for n, state in states if state == "COMPLETE"}
    assert all(sum(state == "COMPLETE" for _, state in states) == 3 for states in after.values())
    assert len(json.loads((folder / "tune_summary.json").read_text())["cells"]) == 2


@pytest.mark.parametrize("where, state", [("make_spec", "FAIL"),
                                          pytest.param("record", "COMPLETE", marks=pytest.mark.slow)])
def test_a_stop_between_the_tunes_last_look_and_the_next_is_not_lost(tmp_path, capsys, monkeypatch, where, state):
    """SIGTERM (its handler called as the signal would) in the gaps a tune's safe points leave: after
    train_run's look, as the run starts (make_spec), the run stops before its first step (its start must
    not forget the stop and train in full); after a run returned, before its trial is told (record), the trial
    is counted and the tune stops before the next (a stop raised from the handler would leave the trial
    RUNNING)."""
    from lbt.apps.tune import trials

    original, before = getattr(trials, where), signal.getsignal(signal.SIGTERM)

    def signalled(*args, **kwargs):
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler), handler  # the tune's, between runs
        handler(signal.SIGTERM, None)
        return original(*args, **kwargs)

    monkeypatch.setattr(trials, where, signalled)
    folder = tmp_path / "tune"
    with pytest.raises(SystemExit) as stop:
        tune([*TINY, "recipe=baseline", "dist.world_size=1", "tune.trials=3", f"tune.dir={folder}"])
    assert stop.value.code == 128 + signal.SIGTERM
    assert "tune: stopped; run the same command again to continue" in capsys.readouterr().out
    assert trials_in(folder) == {"recipe=baseline dist.world_size=1": [(0, state)]}
    assert signal.getsignal(signal.SIGTERM) == before  # the handlers are restored, and no stop is left over
    from lbt.stop import stop_asked

    assert stop_asked() is None


@pytest.mark.slow
def test_a_second_stop_kills_the_helpers_that_do_not_stop(monkeypatch, capsys):
    """A helper that ignores SIGTERM (hung): the tune says it waits, and a second Ctrl-C kills it, so a hung
    helper cannot keep the tune waiting for ever."""
    import subprocess
    import threading
    import time

    from lbt.apps.tune import workers
    from lbt.stop import ask_stop, forget_stop

    hung = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                             "signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"], stdout=subprocess.PIPE)
    assert hung.stdout is not None and hung.stdout.readline() == b"ready\n"  # SIGTERM is ignored from here
    monkeypatch.setattr(workers, "HELPER_PATIENCE_S", 0.2)
    forget_stop()
    ask_stop(signal.SIGINT)  # the first Ctrl-C
    second = threading.Timer(1.0, ask_stop, args=(signal.SIGINT,))
    second.start()
    started = time.monotonic()
    try:
        workers.stop_helpers([hung], stopping=True)
    finally:
        second.cancel()
        forget_stop()
        if hung.poll() is None:
            hung.kill()
            hung.wait()
    assert hung.returncode == -signal.SIGKILL and time.monotonic() - started < 30
    err = capsys.readouterr().err
    assert "tune: waiting for the other workers to stop; Ctrl-C again kills them" in err
    assert "tune: killed 1 worker(s) that had not stopped; their trials run again next time" in err


def test_runs_done_counts_every_search_pruned_trials_and_finished_cells():
    """2 cells x 2 searches x 3 trials, finals of 2 seeds without the untuned ones: one cell finished (its
    failed trial, run again, not counted twice), the other with a pruned, a complete, a running and a failed
    trial in one search and four complete in the other (capped at 3)."""
    from datetime import datetime, timedelta

    from lbt.apps.tune.workers import runs_done

    state = optuna.trial.TrialState

    def trial(kind, seconds=0.0):
        start = datetime(2026, 1, 1)
        values = {"value": 0.9} if kind == state.COMPLETE else {}
        made = optuna.trial.create_trial(state=kind, **values)
        made.datetime_start = start
        made.datetime_complete = start + timedelta(seconds=seconds) if kind.is_finished() else None
        return made

    done_cell = (True, [[trial(state.COMPLETE, 10)] * 3 + [trial(state.FAIL)], [trial(state.COMPLETE, 10)] * 3])
    open_cell = (False, [[trial(state.PRUNED), trial(state.COMPLETE, 40), trial(state.RUNNING), trial(state.FAIL)],
                         [trial(state.COMPLETE, 20)] * 4])
    done, total, seconds = runs_done(3, 2, [done_cell, open_cell])
    assert (done, total) == (6 + 2 + 2 + 3, 2 * (2 * 3 + 2))
    assert sorted(seconds) == [10.0] * 6 + [20.0] * 4 + [40.0]


def test_fit_exponent_recovers_a_power_law():
    batches = [64, 256, 1024, 8192]
    assert fit_exponent(batches, [0.1 * b ** 0.5 for b in batches]) == pytest.approx((0.5, 0.1))
    assert fit_exponent(batches, [0.1 * b for b in batches]) == pytest.approx((1.0, 0.1))
    assert fit_exponent(batches, [3.0] * 4) == pytest.approx((0.0, 3.0))
    with pytest.raises(ValueError, match="two or more distinct batches"):
        fit_exponent([64, 64], [0.1, 0.2])
    assert [claimed_exponent(rule) for rule in ("none", "sqrt", "linear")] == [0.0, 0.5, 1.0]


@pytest.mark.slow
def test_a_diverged_trial_counts_with_the_worst_value(tmp_path, capsys):
    space = "tune.space={optim.lr: {low: 1000.0, high: 10000.0, log: true}}"  # SGD blows up at any of these
    args = [*TINY, "recipe=baseline", "dist.world_size=1", "tune.trials=2", "tune.seeds=1", space,
            f"tune.dir={tmp_path}"]
    cell = tune(args)["cells"][0]
    assert cell["trials"] == {"counted": 2, "complete": 2, "pruned": 0, "diverged": 2, "failed": 0}
    assert [state for _, state in trials_in(tmp_path)["recipe=baseline dist.world_size=1"]] == ["COMPLETE"] * 2
    assert cell["best"]["val_acc"] == 0.0 and cell["default"]["diverged"] == 0
    assert "diverged, counted as val_acc=0" in capsys.readouterr().out
    # The same folder with other overrides is another tune: refused rather than mixed in.
    with pytest.raises(SystemExit) as stop:
        cli.main(["tune", *args, "trainer.epochs=1"])
    assert stop.value.code == 2 and "other overrides" in capsys.readouterr().err


@pytest.mark.slow
def test_a_pruned_trial_counts_and_leaves_its_curve(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", lambda self: True)
    args = [*TINY, "recipe=baseline", "dist.world_size=1", "tune.trials=2", "tune.seeds=1",
            "tune.prune_startup_trials=0", f"tune.dir={tmp_path}"]
    cell = tune(args)["cells"][0]
    assert cell["trials"]["counted"] == 2 and cell["trials"]["pruned"] == 2
    assert cell["best"] is None and "tuned" not in cell and len(cell["default"]["val_acc"]) == 1
    pruned = tmp_path / "trials" / "recipe=baseline,dist.world_size=1" / "0"
    assert not (pruned / "result.json").exists()  # nothing a report would read as a finished run
    events = EventAccumulator(str(pruned))
    events.Reload()
    assert [e.step for e in events.Scalars("val/acc")]  # its writers were closed, its curve is on disk
    assert "none finished" in (tmp_path / "tune_report.md").read_text()
    assert "pruned (val acc" in capsys.readouterr().out


def test_pruning_waits_for_its_share_of_the_run_and_spares_the_last_evaluation():
    class Trial:
        def __init__(self):
            self.reports = []

        def report(self, value, step):
            self.reports.append((step, value))

        def should_prune(self):
            return True

    def point(samples: int, acc: float) -> EvalPoint:
        return EvalPoint(step=samples // 100, samples_seen=samples, global_batch=100, acc=acc, loss=1 - acc)

    hook = PruneOnVal(Trial(), prune_after=0.5)
    layouts = [BatchLayout(1, 1, 100, 100)] * 2
    assert hook.epoch_layouts(layouts, 1050) == layouts
    hook.after_eval(point(500, 0.3))  # 500 of 2,000 samples: too early to judge
    hook.after_eval(point(2000, 0.6))  # the end: the run is done, its value counts
    with pytest.raises(optuna.TrialPruned, match="val acc 0.4000 at 1,000 samples"):
        hook.after_eval(point(1000, 0.4))
    assert hook.trial.reports == [(500, 0.3), (2000, 0.6), (1000, 0.4)]
    unarmed = PruneOnVal(Trial(), prune_after=None)  # the cell has too few finished trials to compare with
    unarmed.epoch_layouts(layouts, 1000)
    unarmed.after_eval(point(1000, 0.4))  # would raise if it asked the pruner
    assert unarmed.trial.reports == [(1000, 0.4)]


def test_refuses_data_without_a_validation_split(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["tune", "data=synthetic", "model=mlp", "recipe=baseline", f"tune.dir={tmp_path / 't'}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("lbt: error: ") and "validation split" in err and "data.val_fraction" in err
    assert not (tmp_path / "t").exists()


def test_optuna_missing_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "optuna", None)  # `import optuna` raises ImportError
    with pytest.raises(SystemExit) as stop:
        cli.main(["tune"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "lbt: error: lbt tune needs Optuna: pip install 'lbt[tune]'\n"


def test_a_search_space_mistake_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["tune", *TINY, "recipe=baseline", "tune.space={optim.lr: {low: 1.0, high: 0.1}}",
                  f"tune.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith("lbt: error: recipe baseline: tune.space.optim.lr.high must be a number > 1")
    config = {"optim": {"lr": 0.1}}
    with pytest.raises(ConfigError, match="recipe r: tune.space.optim.lrr: optim.lrr is not a key"):
        check_space({"optim.lrr": {"low": 0.1, "high": 1.0}}, config, "r")
    with pytest.raises(ConfigError, match="log-uniform range needs low > 0"):
        check_space({"optim.lr": {"low": 0.0, "high": 1.0, "log": True}}, config, "r")
    with pytest.raises(ConfigError, match="declares no tune.space"):
        check_space({}, config, "r")


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_declares_a_space_around_its_defaults(recipe):
    config, _ = compose_config([f"recipe={recipe}"])
    space = check_space(config["tune"]["space"], config, recipe)
    assert "optim.lr" in space  # every recipe tunes its LR, the baseline included (Shallue et al. 2019)
    for key, spec in space.items():
        node = config
        for part in key.split("."):
            node = node[part]
        assert spec["low"] <= node <= spec["high"], f"{recipe}: {key}={node} outside its tune range"


# -- bench/fair.py's pure parts --------------------------------------------------------------------------
def _steps_cell(series: str, batch: int, per_study: list[float | None]) -> dict:
    reached = sorted(s for s in per_study if s is not None)
    median = sorted(per_study, key=lambda s: float("inf") if s is None else s)[len(per_study) // 2]
    return {"series": series, "global_batch": batch, "per_study": per_study, "median": median,
            "missed": len(per_study) - len(reached), "low": reached[0] if reached else None,
            "high": reached[-1] if reached else None}


def test_fit_budgets_holds_a_batch_missed_in_every_budget_at_its_longest(monkeypatch, tmp_path, capsys):
    """Two budgets of one recipe on S = 100 (1 + 512 / B): 10 epochs reach the target at 64-256 and miss at
    1,024 and 4,096; 30 epochs reach it at 1,024 and miss at 4,096 in 300 steps, above the curve's 112 there.
    1,024 is taken from 30 epochs; 4,096 holds the fit at 300, the longer of its two budgets."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import fit_budgets

    def folder(name: str, epochs: int, rows: list[tuple[int, float | None, float]]) -> Path:
        cells = [{"series": "adamw", "global_batch": b, "median": m, "budget": n} for b, m, n in rows]
        (tmp_path / name).mkdir()
        (tmp_path / name / "tune_summary.json").write_text(json.dumps(
            {"overrides": [f"trainer.epochs={epochs}"], "steps_to_target": {"target": 0.98, "cells": cells}}))
        return tmp_path / name

    short = folder("short", 10, [(64, 900.0, 8000), (128, 500.0, 4000), (256, 300.0, 2000), (1024, None, 100),
                                 (4096, None, 50)])
    long = folder("long", 30, [(1024, 150.0, 300), (4096, None, 300)])
    target, points, missed = fit_budgets.chosen_points([short, long])
    assert points["adamw"][1024] == (150.0, "30") and points["adamw"][64] == (900.0, "10")
    assert missed == {"adamw": {4096: 300}}
    fit_budgets.main([str(short), str(long)])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| adamw"))
    assert row.endswith("| 4,096 |")  # held there: without the bound the fit would be exact, B_crit 512
    assert float(row.split(" | ")[2].replace(",", "")) < 512


def test_fair_tables_put_one_recipe_per_column(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import fair

    # Three studies of "base" scale as S = 100 (1 + B_crit / B) with B_crit 500, 1,000 and 2,000 (the median's);
    # at 4,096 two of them miss: the medians' fit leaves that batch out, the one study that reached it keeps it.
    # "lars" ran at one batch, one study missing.
    cells = [_steps_cell("base", b, [100 * (1 + crit / b) for crit in (500, 1000, 2000)]) for b in (64, 256, 1024)]
    cells += [_steps_cell("base", 4096, [None, 100 * (1 + 1000 / 4096), None]),
              _steps_cell("lars", 1024, [259.3, 245.0, None])]
    fits = [steps_fit(recipe, [StepsRow(**cell) for cell in cells if cell["series"] == recipe])
            for recipe in ("base", "lars")]
    summary = {"steps_to_target": {"target": 0.98383, "target_from": "base at 64 less 1 point", "cells": cells,
                                   "fits": fits},
               "gaps": {"reference": {"series": "base", "global_batch": 64, "test_acc": 0.99257},
                        "batches": [{"global_batch": 4096, "ratio": 64.0, "best_series": "lars", "best_gap": 0.72,
                                     "per_series": {"base": 1.823, "lars": 0.72}}]}}
    steps = fair.steps_table(summary).splitlines()
    assert steps[0] == "Steps to val 98.38% (base at 64 less 1 point):"
    assert steps[2:4] == ["| global batch (x) | base | lars |", "| --- | ---: | ---: |"]
    # A study that missed is named; the median is infinite once half or more missed; a recipe not run is blank.
    assert steps[4:] == ["| 64 (1) | 1,662 (881 - 3,225) |  |", "| 256 (4) | 491 (295 - 881) |  |",
                         "| 1,024 (16) | 198 (149 - 295) | 259 (245 - 259), missed in 1 |",
                         "| 4,096 (64) | missed in 2 (124 - 124) |  |"]
    fits = fair.fits_table(summary).splitlines()
    assert fits[2:] == ["| base | 1,000 | 500, 1,000, 2,000 | 100.0 | 0.000 | 64, 256, 1,024 | none | 1,024 |",
                        "| lars | n/a: need at least 3 distinct batches to fit a critical batch, got 1 | n/a, n/a, n/a "
                        "| n/a | n/a | 1,024 | none | 1,024 |"]
    gaps = fair.gaps_table(summary).splitlines()
    assert gaps[0] == "Test points lost against base at 64 (99.26% test; negative: gained):"
    assert gaps[-1] == "| 4,096 (64) | +1.82 | +0.72 | lars +0.72 |"


def test_fair_runs_transformer1ds_longer_budget_with_the_first_budgets_target(monkeypatch, tmp_path):
    """One command: the 10-epoch protocol (base recipe also at 64 and 256), then 30 epochs at 256-4,096 into
    <dir>/long, every recipe, with the first budget's target and each trial ended where it reaches it."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import fair

    calls = []
    monkeypatch.setattr(fair, "tune", lambda args, log: calls.append((args, log)) or 0)
    monkeypatch.setattr(fair, "print_results", lambda *args, **kwargs: None)
    monkeypatch.setattr(fair, "folder_summary", lambda folder, target: {"steps_to_target": {"target": 0.955}})
    (tmp_path / "tune_report.md").write_text("report")
    fair.main(["--workload", "transformer1d", "--recipes", "adamw_sqrt,muon", "--dir", str(tmp_path)])
    assert [log for _, log in calls] == [tmp_path / "tune.log"] * 2 + [tmp_path / "long" / "tune.log"] * 2
    first, long = [args for args, _ in calls[:2]], [args for args, _ in calls[2:]]
    assert first[0][:2] == ["recipe=adamw_sqrt", "dist.world_size=1,4,16,32,64"]
    assert first[1][:2] == ["recipe=muon", "dist.world_size=1,4,16,32,64"]
    assert all("trainer.epochs=10" in a and "tune.seeds=3" in a for a in first)
    assert not any(a.startswith(("tune.target", "tune.stop_at_target")) for args in first for a in args)
    assert [args[:2] for args in long] == [["recipe=adamw_sqrt", "dist.world_size=4,8,16,32,64"],
                                           ["recipe=muon", "dist.world_size=4,8,16,32,64"]]
    for args in long:
        assert {"trainer.epochs=30", "tune.seeds=0", "tune.target=0.955", "tune.objective=steps_to_target",
                "tune.stop_at_target=true", f"tune.dir={tmp_path / 'long'}"} <= set(args)
    calls.clear()
    fair.main(["--workload", "cnn1d", "--recipes", "baseline", "--dir", str(tmp_path)])  # cnn1d has no 30-epoch budget
    assert [log for _, log in calls] == [tmp_path / "tune.log"]


def test_a_chance_level_tuned_cell_is_warned_of_and_left_out_of_the_lr_fit():
    """`lbt tune` reported a chance-level "tuned" result (9.6% beside 72.5% untuned) and fitted an LR exponent
    from it, without a warning."""
    from lbt.apps.tune.report import lr_fit, tuning_failed
    from lbt.apps.tune.summary import TunedCell, parse_cell

    def cell(batch: int, lr: float, tuned: float, untuned: float) -> TunedCell:
        def finals(val: float) -> dict:
            return {"seeds": [1], "val_mean_std": [val, 0.0], "test_mean_std": None, "diverged": 0}

        return parse_cell({"cell": f"b{batch}", "series": "baseline", "global_batch": batch, "world_size": batch // 64,
                           "scaling": "none", "trials": {"counted": 1, "pruned": 0, "diverged": 0},
                           "best": {"trial": 0, "val_acc": tuned, "params": {}, "diverged": False, "peak_lr": lr,
                                    "base_lr": lr},
                           "tuned": finals(tuned), "default": finals(untuned)})

    good = [cell(64, 0.1, 0.90, 0.88), cell(256, 0.2, 0.89, 0.87), cell(1024, 0.4, 0.85, 0.85)]
    failed = cell(4096, 30.0, 0.096, 0.725)
    assert [tuning_failed(c) for c in good] == [None, None, None]
    assert tuning_failed(failed) == (
        "baseline at global batch 4,096: tuned val 9.60% is 62.9 points worse than the untuned defaults' 72.50%; its "
        "best trial is no optimum (widen tune.space or give more tune.trials), and its LR is left out of the fit")
    fit = lr_fit("baseline", [*good, failed])
    assert fit["batches"] == [64, 256, 1024] and fit["exponent"] == pytest.approx(0.5)
