"""`lbt tune` under AlgoPerf's protocol: independent studies per cell (tune.studies), quasi-random search
(tune.sampler=qmc), steps to a target val value (tune.objective=steps_to_target, and the report's table) and
the fitted critical batch per recipe (lbt/apps/tune/report.py)."""

import math

import optuna
import pytest
from test_tune import TINY, trials_in

from lbt.apps import cli
from lbt.apps.tune.command import tune
from lbt.apps.tune.finals import median_search
from lbt.apps.tune.report import fewest_steps, per_study_words, steps_fit
from lbt.apps.tune.summary import StepsRow
from lbt.errors import ConfigError
from lbt.metrics.critical import crossing_step
from lbt.spec.objective import ACC, LOSS
from lbt.spec.result import EvalPoint

ALGOPERF = ["tune.sampler=qmc", "tune.pruner=none", "tune.seeds=1", "tune.untuned=false"]


@pytest.mark.slow
def test_independent_studies_per_cell_then_steps_to_target_and_the_fitted_critical_batch(tmp_path, capsys):
    args = [*TINY, "recipe=baseline", "dist.world_size=1,2,4", "tune.trials=2", "tune.studies=2", *ALGOPERF,
            f"tune.dir={tmp_path}"]
    summary = tune(args)
    out = capsys.readouterr().out
    assert "x 2 trials x 2 independent studies (quasi-random (Halton)" in out
    assert "(2/2, study 2/2)" in out

    # Each cell has two Optuna studies of exactly tune.trials trials; the second search's runs have their folder.
    trials = trials_in(tmp_path)
    names = [f"recipe=baseline dist.world_size={w}" for w in (1, 2, 4)]
    assert sorted(trials) == sorted(names + [f"{n} study=2" for n in names])
    assert all([state for _, state in states] == ["COMPLETE"] * 2 for states in trials.values())
    assert (tmp_path / "trials" / "recipe=baseline,dist.world_size=1" / "study_2" / "1" / "result.json").is_file()
    # The searches are independent: their quasi-random points differ.
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    points = [[t.params["optim.lr"] for t in optuna.load_study(study_name=name, storage=storage).trials]
              for name in (names[0], f"{names[0]} study=2")]
    assert points[0] != points[1]

    for cell in summary["cells"]:
        # The tuned values are the best trial of the median study (of 2: the lower one).
        studies = cell["studies"]
        assert [s["study"] for s in studies] == [1, 2] and all(len(s["curves"]) == 2 for s in studies)
        median = min(studies, key=lambda s: (s["val_acc"], -s["study"]))
        assert (cell["best"]["study"], cell["best"]["trial"]) == (median["study"], median["trial"])
        study = optuna.load_study(study_name=cell["cell"] + ("" if median["study"] == 1 else " study=2"),
                                  storage=storage)
        assert cell["best"]["params"] == study.trials[median["trial"]].params

    # Steps to target: the tuned base batch's val accuracy less a point, read from every trial's curve.
    steps = summary["steps_to_target"]
    base = next(c for c in summary["cells"] if c["global_batch"] == 16)
    assert steps["target"] == pytest.approx(base["tuned"]["val_mean_std"][0] - 0.01)
    for row, cell in zip(steps["cells"], sorted(summary["cells"], key=lambda c: c["global_batch"])):
        expected = []
        for study in cell["studies"]:
            crossings = [crossing_step([EvalPoint(s, 0, 0, v, v) for s, v in curve], steps["target"])
                         for curve in study["curves"].values()]
            expected.append(min((c for c in crossings if c is not None), default=math.inf))
        assert row["per_study"] == pytest.approx([None if e == math.inf else e for e in expected])
    fit = steps["fits"][0]
    assert fit["series"] == "baseline" and (fit["b_crit"] is not None or fit["note"])
    report = (tmp_path / "tune_report.md").read_text()
    assert "## Steps to target (AlgoPerf-style)" in report and "fitted critical batch" in report
    assert "![steps to target vs global batch](steps_to_target.png)" in report
    assert (tmp_path / "steps_to_target.png").stat().st_size > 0
    assert "in each of **2 independent studies**" in report

    # The same command again: nothing new.
    tune(args)
    assert "0 new trials, 0 new final runs" in capsys.readouterr().out


@pytest.mark.slow
def test_the_steps_objective_minimises_steps_and_counts_a_missed_target_as_infinite(tmp_path):
    args = [*TINY, "recipe=baseline", "dist.world_size=1", "tune.trials=2", *ALGOPERF,
            "tune.objective=steps_to_target", f"tune.dir={tmp_path}"]
    tune(args + ["tune.target=0.999"])  # not reached by a tiny run
    study = optuna.load_study(study_name="recipe=baseline dist.world_size=1",
                              storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert study.direction == optuna.study.StudyDirection.MINIMIZE
    assert [t.value for t in study.trials] == [math.inf, math.inf]
    assert all(t.user_attrs["steps_to_target"] is None and t.user_attrs["final_val"] > 0 for t in study.trials)
    # The same folder with another target is another tune: refused rather than mixed in.
    with pytest.raises(Exception, match=r"tune.target=0.999 \(this command: tune.target=0.5\)"):
        tune(args + ["tune.target=0.5"])
    reached = tmp_path / "reached"
    tune([*args[:-1], f"tune.dir={reached}", "tune.target=0.05"])  # reached at the first evaluation
    trials = optuna.load_study(study_name="recipe=baseline dist.world_size=1",
                               storage=f"sqlite:///{reached / 'optuna.db'}").trials
    assert all(0 < t.value < math.inf and t.value == t.user_attrs["steps_to_target"] for t in trials)


@pytest.mark.slow
def test_trials_stopped_at_the_target_end_there_and_the_fastest_is_the_best(tmp_path):
    """tune.stop_at_target: a trial ends at the evaluation that reaches tune.target (AlgoPerf's rule), one that
    misses trains its budget (48 steps), the final run trains its budget whatever it reaches."""
    from lbt.spec.result import read_result

    args = [*TINY, "recipe=baseline", "dist.world_size=1", "tune.trials=3", *ALGOPERF,
            "tune.objective=steps_to_target", "tune.target=0.4", "tune.stop_at_target=true", f"tune.dir={tmp_path}"]
    cell = tune(args)["cells"][0]
    trials = optuna.load_study(study_name=cell["cell"], storage=f"sqlite:///{tmp_path / 'optuna.db'}").trials
    results = {t.number: read_result(tmp_path / "trials" / "recipe=baseline,dist.world_size=1" / str(t.number))
               for t in trials}
    reached = [t for t in trials if t.user_attrs["steps_to_target"] is not None]
    assert reached and len(reached) < len(trials), [t.user_attrs["final_val"] for t in trials]  # the tiny run's
    for t in trials:
        result = results[t.number]
        assert result.ended_at_target == (t in reached)
        assert result.steps == (result.history[-1].step if t in reached else 48)
        if t in reached:  # it ended at the first evaluation at or above the target
            assert result.final_acc >= 0.4 > max(p.acc for p in result.history[:-1])
            assert t.user_attrs["steps_to_target"] <= result.steps
    fastest = min(reached, key=lambda t: (t.value, t.number))
    assert (cell["best"]["trial"], cell["studies"][0]["trial"]) == (fastest.number, fastest.number)
    final = read_result(tmp_path / "final" / "tuned" / "recipe=baseline,dist.world_size=1" / "seed_1")
    assert final.steps == 48 and not final.ended_at_target
    with pytest.raises(ConfigError, match=r"tune.stop_at_target=true \(this command: tune.stop_at_target=false\)"):
        tune([a for a in args if a != "tune.stop_at_target=true"])  # trials that ran whole are another tune


@pytest.mark.slow
def test_a_tune_without_final_runs(tmp_path):
    """tune.seeds=0: the trials alone (steps to a target need no finals), no final run, no test figure."""
    args = [*TINY, "recipe=baseline", "dist.world_size=1", "tune.trials=1", *ALGOPERF[:2], "tune.seeds=0",
            "tune.untuned=false", f"tune.dir={tmp_path}"]
    summary = tune(args)
    assert summary["cells"][0]["tuned"]["seeds"] == [] and summary["gaps"]["reference"] is None
    assert not (tmp_path / "final").exists()
    assert "were not trained again (tune.seeds=0): no final runs" in (tmp_path / "tune_report.md").read_text()


@pytest.mark.slow
def test_a_final_run_of_other_values_is_refused_not_reused(tmp_path):
    """Trials added to a finished cell (more tune.trials or tune.studies) can choose other values: the finals
    trained for the old ones are neither read back as the new ones' nor overwritten."""
    from lbt.apps.tune.finals import final_run
    from lbt.apps.tune.grid import tune_grid

    args = [*TINY, "recipe=baseline", "dist.world_size=1", "tune.trials=1", *ALGOPERF, f"tune.dir={tmp_path}"]
    best = tune(args)["cells"][0]["best"]["params"]
    grid = tune_grid(args)
    again = final_run(grid, grid.cells[0], "tuned", dict(best), 1, {"finals": 0})  # the same values: read back
    assert again.config["tune"]["params"] == best
    with pytest.raises(ConfigError, match="holds a final run of other values .* never overwritten"):
        final_run(grid, grid.cells[0], "tuned", {"optim.lr": 0.5}, 1, {"finals": 0})


@pytest.mark.parametrize("overrides, message", [
    (["tune.objective=steps_to_target", "tune.pruner=none"], "tune.objective=steps_to_target needs tune.target"),
    (["tune.objective=steps_to_target", "tune.target=0.8"], "with tune.pruner=median"),
    (["tune.target=80"], "tune.target=80 is a val accuracy and lies in (0, 1]"),
    (["tune.studies=0"], "tune.studies must be"),
    (["tune.sampler=grid"], "tune.sampler must be one of tpe, qmc"),
    (["tune.objective=fastest"], "tune.objective must be one of final, steps_to_target"),
    (["tune.target=0.8", "tune.stop_at_target=true"], "tune.stop_at_target=true with tune.objective=final: a trial"),
    (["tune.stop_at_target=maybe"], "tune.stop_at_target must be one of"),
    (["tune.seeds=-1"], "tune.seeds must be a non-negative integer, got -1"),
])
def test_protocol_mistakes_are_one_line(overrides, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["tune", *TINY, "recipe=baseline", *overrides, f"tune.dir={tmp_path / 't'}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("lbt: error: ") and message in err, err
    assert not (tmp_path / "t").exists()


def test_the_median_study_and_fewest_steps():
    searches = [{"study": k + 1, "trial": k, "val_acc": acc} for k, acc in enumerate([0.7, 0.9, 0.8])]
    assert median_search(searches, ACC)["study"] == 3
    assert median_search(searches[:2], ACC)["study"] == 1  # of two, the lower
    losses = [{"study": k + 1, "trial": k, "val_loss": v} for k, v in enumerate([0.3, 0.1, 0.2, 0.4])]
    assert median_search(losses, LOSS)["study"] == 1  # 0.4 0.3 | 0.2 0.1: the lower middle is 0.3
    assert median_search([{"study": 1, "trial": None, "val_acc": None}], ACC) is None
    # tune.stop_at_target: the median study by its fastest trial's steps, a study that missed counted infinite.
    fastest = [{"study": k + 1, "trial": k, "val_acc": 0.5, "steps_to_target": s} for k, s in enumerate([30, None, 20])]
    assert median_search(fastest, ACC, by_steps=True)["study"] == 1
    assert median_search(fastest[1:], ACC, by_steps=True)["study"] == 2  # of two, the slower (here: missed)
    curves = {"0": [[10, 0.5], [20, 0.7]], "1": [[10, 0.6], [20, 0.9]]}
    assert fewest_steps(curves, 0.7, ACC) == pytest.approx(10 + 10 * (0.1 / 0.3))  # trial 1, interpolated
    assert fewest_steps(curves, 0.95, ACC) == math.inf


def test_steps_fit_recovers_the_critical_batch_and_says_why_not():
    rows = [StepsRow(global_batch=b, median=100 * (1 + 512 / b)) for b in (64, 256, 1024, 4096)]
    fit = steps_fit("muon", rows + [StepsRow(global_batch=8192, median=None)])  # a missed cell is left out
    assert fit["b_crit"] == pytest.approx(512) and fit["s_min"] == pytest.approx(100)
    assert fit["batches"] == [64, 256, 1024, 4096]
    assert "at least 3 distinct batches" in steps_fit("lars", rows[:2])["note"]


def test_steps_fit_is_held_above_the_budget_of_a_batch_that_missed():
    """A cell whose median missed the target in its budget bounds the curve there: a budget below the curve's
    steps (106 at 8,192) is consistent and changes nothing; one above it (a budget of 150 did not suffice)
    holds the fit at 150, which lowers the critical batch. Each study is held at the cells it missed."""
    rows = [StepsRow(global_batch=b, median=100 * (1 + 512 / b), per_study=(100 * (1 + 512 / b),))
            for b in (64, 256, 1024, 4096)]
    free = steps_fit("muon", [*rows, StepsRow(global_batch=8192, median=None, per_study=(None,), budget=90.0)])
    assert free["b_crit"] == pytest.approx(512) and free["bound_at"] == []
    held = steps_fit("muon", [*rows, StepsRow(global_batch=8192, median=None, per_study=(None,), budget=150.0)])
    assert held["bound_at"] == [8192] and held["s_min"] * (1 + held["b_crit"] / 8192) == pytest.approx(150)
    assert held["b_crit"] < 400 and held["per_study_b_crit"] == pytest.approx([held["b_crit"]])


def test_steps_fit_fits_each_study_alone_for_its_spread():
    # Study 1 scales with B_crit 512, study 2 with 2,048; study 3 reached the target at two batches only.
    batches = (64, 256, 1024, 4096)
    curves = [[100 * (1 + 512 / b) for b in batches], [80 * (1 + 2048 / b) for b in batches],
              [120 * (1 + 512 / 64), 90 * (1 + 512 / 256), None, None]]
    rows = [StepsRow(global_batch=b, per_study=tuple(curve[i] for curve in curves),
                     median=sorted((curve[i] for curve in curves), key=lambda s: s or math.inf)[1])
            for i, b in enumerate(batches)]
    fit = steps_fit("muon", rows)
    assert fit["per_study_b_crit"][:2] == pytest.approx([512, 2048]) and fit["per_study_b_crit"][2] is None
    assert per_study_words(fit["per_study_b_crit"]) == "512, 2,048, n/a"
    assert fit["b_crit"] is not None  # the medians' fit stands beside them


IDENTITY_CHANGES = [  # (one tune's settings, another's that differs only in the named identity key)
    ({"sampler": "qmc"}, {}),
    ({"metric": "loss", "objective": "steps_to_target", "target": 0.5}, {"metric": "loss"}),  # both minimise
    ({"objective": "steps_to_target", "target": 0.5}, {"objective": "steps_to_target", "target": 0.6}),
    ({"objective": "steps_to_target", "target": 0.5, "stop_at_target": True},
     {"objective": "steps_to_target", "target": 0.5}),
]


@pytest.mark.parametrize("key, changed, default", [(k, *c) for k, c in zip(
    ["sampler", "objective", "target", "stop_at_target"], IDENTITY_CHANGES)])
def test_a_folder_continues_only_under_the_settings_it_was_tuned_with_either_way(key, changed, default):
    """Each optional identity key is compared both ways: a folder tuned with a non-default value is refused to a
    command without it, and the other way round; a folder whose study lacks the key counts as its default."""
    from lbt.apps.tune.grid import Settings, TuneGrid
    from lbt.apps.tune.trials import open_study

    class Cell:
        name, space = "recipe=baseline", {"optim.lr": {"low": 0.01, "high": 1.0, "log": True}}

        def study_name(self, search):
            return self.name

    node = {"trials": 2, "seeds": 1, "seed": 0, "startup_trials": 1, "pruner": "none", "prune_startup_trials": 1,
            "prune_after": 0.5, "dir": "the_folder"}
    grid = {which: TuneGrid(Settings.from_config({**node, **settings}), head=[], fixed=["model=mlp"])
            for which, settings in (("changed", changed), ("default", default))}
    for first, then in (("changed", "default"), ("default", "changed")):
        storage = optuna.storages.InMemoryStorage()
        open_study(storage, grid[first], Cell())
        open_study(storage, grid[first], Cell())  # the same settings continue
        with pytest.raises(ConfigError, match=rf"run with tune\.{key}=\S+ \(this command: tune\.{key}=\S+\)"):
            open_study(storage, grid[then], Cell())  # the one key that differs, with both values

    # A folder whose study stores only the optional keys that are not the default.
    from lbt.apps.tune.trials import LATER_IDENTITY, tune_identity

    old = optuna.storages.InMemoryStorage()
    before = open_study(optuna.storages.InMemoryStorage(), grid["default"], Cell())
    study = optuna.create_study(storage=old, study_name=Cell.name, direction=before.direction)
    for k, v in tune_identity(grid["default"], Cell()).items():
        if LATER_IDENTITY.get(k, "stored") != v:
            study.set_user_attr(k, v)
    assert set(study.user_attrs) < set(before.user_attrs)
    open_study(old, grid["default"], Cell())
    with pytest.raises(ConfigError, match=rf"run with tune\.{key}=\S+ \(this command"):
        open_study(old, grid["changed"], Cell())
