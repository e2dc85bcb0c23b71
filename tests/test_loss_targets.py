"""Loss-based targets (lower is better) through the critical batch, the report and the tuner: hand-built
result.json files and cells, pure and fast."""

import json
import math

import pytest

from lbt.errors import ConfigError
from lbt.metrics.critical import crossing_step
from lbt.spec.objective import ACC, LOSS, bits, metric_named
from lbt.spec.result import EvalPoint


def history(*points):
    return [EvalPoint(step=s, samples_seen=64 * s, global_batch=64, acc=0.0, loss=loss) for s, loss in points]


def test_one_definition_of_better():
    assert LOSS.reached(2.0, 2.1) and not LOSS.reached(2.2, 2.1) and ACC.reached(0.9, 0.8)
    assert LOSS.best([2.5, math.nan, 2.0, 3.0]) == 2.0 and ACC.best([0.5, 0.9]) == 0.9
    assert LOSS.worse_by(2.0, 0.05) == pytest.approx(2.05) and ACC.worse_by(0.9, 1.0) == pytest.approx(0.89)
    assert LOSS.gap(2.1, 2.0) == pytest.approx(0.1) and ACC.gap(0.88, 0.9) == pytest.approx(2.0)
    assert bits(math.log(2) * 1.5) == pytest.approx(1.5)
    with pytest.raises(ConfigError, match="choose one of acc, loss"):
        metric_named("bpc", "tune.metric")


def test_steps_to_a_loss_target_are_interpolated():
    h = history((10, 3.0), (20, 2.5), (30, 1.5))
    assert crossing_step(h, 2.0, metric=LOSS) == pytest.approx(20 + 10 * (2.5 - 2.0) / (2.5 - 1.5))  # 25
    assert crossing_step(h, 2.5, metric=LOSS) == pytest.approx(20)
    assert crossing_step(h, 3.5, metric=LOSS) == pytest.approx(10)  # no known start: the first evaluation
    assert crossing_step(history((10, 3.0), (20, math.nan), (30, 1.0)), 2.0, metric=LOSS) == pytest.approx(20)
    assert crossing_step(h, 1.0, metric=LOSS) is None


def _job(folder, world_size: int, losses: list[float], test_loss: float):
    """A language model's job folder: val loss after each of its evaluations, bits per char beside."""
    folder.mkdir(parents=True)
    batch, steps = 32 * world_size, 1024 // (32 * world_size)
    points = [{"step": steps * (e + 1), "samples_seen": 1024 * (e + 1), "global_batch": batch, "acc": 0.5,
               "loss": loss} for e, loss in enumerate(losses)]
    (folder / "result.json").write_text(json.dumps({
        "recipe": "baseline", "overrides": ["recipe=baseline", f"dist.world_size={world_size}"],
        "world_size": world_size, "procs": 1, "per_worker_batch": 32, "global_batch": batch, "seed": 0,
        "eval_split": "val", "final_val_acc": 0.5, "best_val_acc": 0.5, "test_acc": 0.5,
        "final_val_loss": losses[-1], "best_val_loss": min(losses), "test_loss": test_loss,
        "final_val_bits_per_char": bits(losses[-1]), "test_bits_per_char": bits(test_loss),
        "steps": points[-1]["step"], "samples_per_sec": 1000.0, "diverged": False, "val_history": points,
    }))


@pytest.fixture
def study(tmp_path):
    for n, (world_size, losses) in enumerate([(1, [2.6, 2.0]), (4, [2.8, 2.04]), (16, [3.0, 2.3])]):
        _job(tmp_path / str(n), world_size, losses, test_loss=losses[-1] + 0.01)
    return tmp_path


def test_report_on_a_loss_target(study):
    from lbt.apps.report import write_report

    summary = write_report(study, metric="loss", tolerance=0.1)
    assert summary["metric"] == "loss" and summary["target_loss"] == pytest.approx(2.0 + 0.05)  # default margin
    rows = {r["global_batch"]: r for r in summary["rows"]}
    # Steps to loss <= 2.05: batch 32 between step 32 (2.6) and 64 (2.0); batch 128 between 8 (2.8) and 16 (2.04).
    assert rows[32]["steps_to_target"] == pytest.approx(32 + 32 * (2.6 - 2.05) / (2.6 - 2.0))
    assert rows[128]["steps_to_target"] == pytest.approx(8 + 8 * (2.8 - 2.05) / (2.8 - 2.04))
    assert rows[512]["steps_to_target"] is None
    assert rows[512]["gap"] == pytest.approx(0.3)  # test loss, nats above the smallest batch's
    answer = summary["gpu_answer"]
    assert answer["reference"] == {"recipe": "baseline", "global_batch": 32, "loss": 2.0}
    assert answer["best"]["global_batch"] == 128 and answer["recipes"][0]["next_loss"] == 2.3  # 2.3 > 2.0 + 0.1
    assert write_report(study, metric="loss", tolerance=0.5)["gpu_answer"]["best"]["global_batch"] == 512
    report = (study / "report.md").read_text()
    assert "val bits/char" in report and f"| {bits(2.0):.4f} | {bits(2.01):.4f} |" in report
    assert "Within **0.5 nats**" in report and (study / "loss_vs_batch.png").is_file()


def test_report_command_reads_a_loss_target(study, capsys):
    from lbt.apps.cli import main

    main(["report", str(study), "--metric", "loss", "--target", "2.5"])
    out = capsys.readouterr().out
    assert "first reached 2.5000" in out and "loss_vs_batch.png" in out
    summary = json.loads((study / "summary.json").read_text())
    assert summary["target_loss"] == 2.5 and summary["gpu_answer"]["tolerance"] == LOSS.default_tolerance


@pytest.mark.parametrize("args, expected", [(["--target", "-1"], "not a positive loss"),
                                            (["--tolerance", "x"], "not a loss in nats"),
                                            (["--metric", "bpc"], "invalid choice")])
def test_bad_loss_options_are_one_line(study, capsys, args, expected):
    from lbt.apps.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["report", str(study), "--metric", "loss", *args])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("lbt: error:") and expected in err


def test_tune_minimises_a_loss():
    """The pruner hears the loss, Optuna minimises it, the best trial is the lowest, gaps are in nats."""
    import optuna

    from lbt.apps.tune.grid import Settings, TuneGrid
    from lbt.apps.tune.report import gap_lines, gaps_to_base
    from lbt.apps.tune.summary import Gaps, parse_cell
    from lbt.apps.tune.trials import PruneOnVal, open_study

    class Trial:
        reports = []

        def report(self, value, step):
            self.reports.append((step, value))

    hook = PruneOnVal(Trial(), prune_after=None, metric=LOSS)
    hook.after_eval(EvalPoint(step=5, samples_seen=500, global_batch=100, acc=0.3, loss=2.4))
    assert hook.trial.reports == [(500, 2.4)]

    node = {"trials": 2, "seeds": 1, "seed": 0, "startup_trials": 1, "pruner": "none", "prune_startup_trials": 1,
            "prune_after": 0.5, "dir": "unused"}
    settings = Settings.from_config({**node, "metric": "loss"})
    assert settings.metric is LOSS

    class Cell:
        name, space = "recipe=baseline", {}

        def study_name(self, search):
            return self.name

    grid = TuneGrid(settings, head=[], fixed=[])
    storage = optuna.storages.InMemoryStorage()
    study = open_study(storage, grid, Cell())
    for value in (2.3, 2.1, math.inf):  # inf: a diverged trial, the worst loss
        study.tell(study.ask(), value)
    assert study.best_value == 2.1
    grid.settings = Settings.from_config(node)  # tune.metric=acc (the default) over the same trials: refused
    with pytest.raises(ConfigError, match="minimized their value, and tune.metric=acc tune.objective=final maximizes"):
        open_study(storage, grid, Cell())

    def finals(val: float | None, test: float | None) -> dict:
        return {"seeds": [1], "val_mean_std": val and [val, 0.0], "test_mean_std": test and [test, 0.0], "diverged": 0}

    cells = [parse_cell({"cell": f"b{b}", "series": series, "metric": "loss", "global_batch": b, "world_size": b // 64,
                         "scaling": "none", "trials": {"counted": 1, "pruned": 0, "diverged": 0}, "best": None,
                         "tuned": finals(val, test), "default": finals(None, None)})
             for series, b, val, test in [("baseline", 64, 2.0, 2.02), ("baseline", 1024, 2.2, 2.25),
                                          ("lamb", 1024, 2.1, 2.12)]]
    gaps = gaps_to_base(cells, LOSS)
    assert gaps["reference"]["test_loss"] == 2.02
    assert gaps["batches"][0]["best_series"] == "lamb" and gaps["batches"][0]["best_gap"] == pytest.approx(0.10)
    assert "| 1,024 | 16 | lamb | +0.1000 |" in "\n".join(gap_lines(Gaps.from_json(gaps), ["baseline", "lamb"], LOSS))
