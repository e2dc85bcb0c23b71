"""No answer without the data for it: the report of a study names its missing and failed jobs and states an
answer only from a complete study, over two or more batches, whose base batch learned; it warns when that
base is undertrained. And the report reads one way: accuracy in percent, losses in nats (bits per char beside
for a language model), one colour per recipe in every plot, splits named, TensorBoard runs named after what ran."""

from __future__ import annotations

import json
import re

import pytest
from test_cli_errors import run_main
from test_study import _job

from lbt.apps.report import write_report
from lbt.apps.study_folder import StudyJob, StudyRecord, write_study

GRID = [("baseline", 1), ("baseline", 4), ("lars", 1), ("lars", 4)]  # study.json's jobs 0..3, seed 0
ACCS = {("baseline", 1): [0.96, 0.98], ("baseline", 4): [0.95, 0.975], ("lars", 1): [0.96, 0.98],
        ("lars", 4): [0.955, 0.978]}  # every batch within 1 point: a complete study answers "up to 4 GPUs"
SYNTHETIC = {"data": {"_target_": "lbt.data.build_synthetic", "num_classes": 10}, "trainer": {"epochs": 2}}


def overrides(recipe: str, world_size: int, seed: int = 0) -> list[str]:
    return [f"recipe={recipe}", f"dist.world_size={world_size}", f"trainer.seed={seed}"]


def study(folder, finished=range(4), accs=ACCS, record: bool = True):
    """The four-job study of GRID with study.json (as `lbt study` writes it before any job), and the result.json
    of the jobs in `finished`."""
    if record:
        write_study(folder, StudyRecord(("recipe=baseline,lars", "dist.world_size=1,4"), tuple(
            StudyJob(str(n), tuple(overrides(recipe, w))) for n, (recipe, w) in enumerate(GRID))))
    for n, (recipe, world_size) in enumerate(GRID):
        if n in finished:
            history = accs[(recipe, world_size)]
            _job(folder / str(n), recipe, world_size, 0, history, b_simple=100.0, test=history[-1] - 0.005)
    return folder


def edit(result_json, **fields) -> None:
    result_json.write_text(json.dumps({**json.loads(result_json.read_text()), **fields}))


def answered(report: str) -> bool:
    """Whether report.md states an answer: the "Answer" line, or a critical batch figure."""
    return "**Answer" in report or re.search(r"\*\*Critical batch: [\d,]+\*\*", report) is not None


def test_a_complete_study_answers_and_says_it_is_complete(tmp_path):
    summary = write_report(study(tmp_path))
    assert (summary["complete"], summary["missing"], summary["failed"], summary["answer_withheld"]) == \
        (True, [], [], None)
    assert summary["gpu_answer"]["best"]["world_size"] == 4 and summary["critical_batch"]["value"] == 128
    assert answered((tmp_path / "report.md").read_text())


def test_an_incomplete_study_names_the_missing_cell_and_gives_no_answer(tmp_path):
    """study.json lists 4 jobs, 3 hold a result.json: the fourth is named (recipe, W, B, seed), no answer."""
    summary = write_report(study(tmp_path, finished=[0, 1, 2]))
    report = (tmp_path / "report.md").read_text()
    lines = report.splitlines()
    assert not answered(report) and "Answer: up to" not in report
    assert lines[2].startswith("**No answer: the study is incomplete: 1 missing of its 4 jobs.**")
    assert "Run the same `lbt study` command again: it continues the study" in lines[2]
    assert lines.index("## Missing jobs") < lines.index("## Diagnostics: other estimates of the critical batch")
    # W from its overrides, B from the per-worker batch every finished job shares (32 x 4), the seed from them
    # its overrides that differ between the study's jobs (trainer.seed=0 all share); summary.json has them all
    assert "| `3` | lars | 4 | 128 | 0 | `recipe=lars dist.world_size=4` |" in report
    assert summary["complete"] is False and summary["failed"] == []
    assert [(m["job_dir"], m["recipe"], m["world_size"], m["global_batch"], m["seed"]) for m in summary["missing"]] \
        == [("3", "lars", 4, 128, 0)]
    # nothing downstream can read an answer: lbt plan plan.from_study=DIR finds no critical batch
    assert "incomplete" in summary["answer_withheld"] and summary["gpu_answer"]["best"] is None
    assert summary["gpu_answer"]["recipes"] == [] and summary["gpu_answer"]["withheld"] == summary["answer_withheld"]
    crit = summary["critical_batch"]
    assert (crit["value"], crit["fit"], crit["gns"], crit["withheld"]) == (None, None, None, summary["answer_withheld"])
    from lbt.apps.plan.compute import critical_batch_from_study

    with pytest.raises(ValueError):
        critical_batch_from_study(tmp_path)
    assert summary["plot_lines"]["accuracy_vs_batch.png"] == []  # no critical batch drawn


def test_a_sweep_without_study_json_expects_the_folders_hydra_made(tmp_path):
    """`lbt train -m` leaves .hydra/ in every job folder as the job starts: one without result.json is missing."""
    study(tmp_path, finished=[0, 1, 3], record=False)
    for n, (recipe, world_size) in enumerate(GRID):
        (tmp_path / str(n) / ".hydra").mkdir(parents=True)
        (tmp_path / str(n) / ".hydra" / "overrides.yaml").write_text(
            "".join(f"- {o}\n" for o in overrides(recipe, world_size)))
    summary = write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert [m["job_dir"] for m in summary["missing"]] == ["2"] and not answered(report)
    assert summary["missing"][0]["overrides"] == overrides("lars", 1)
    assert "the same `lbt train -m` command with trainer.resume=auto" in report.splitlines()[2]  # no lbt study here


def test_a_failed_cell_is_listed_near_the_top_and_withholds_the_answer(tmp_path):
    study(tmp_path, finished=[0, 1, 2])
    (tmp_path / "3").mkdir()
    (tmp_path / "3" / "result.json").write_text(json.dumps({  # as lbt train writes a job that failed
        "version": 2, "error": "RuntimeError: CUDA out of memory", "recipe": "lars",
        "overrides": overrides("lars", 4), "world_size": 4, "per_worker_batch": 32, "global_batch": 128, "seed": 0}))
    summary = write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    lines = report.splitlines()
    assert not answered(report) and "1 failed of its 4 jobs" in lines[2]
    assert lines.index("## Failed jobs") < lines.index("## Diagnostics: other estimates of the critical batch")
    assert "| `3` | lars | 4 | 128 | 0 | RuntimeError: CUDA out of memory |" in report
    assert summary["missing"] == [] and [f["job_dir"] for f in summary["failed"]] == ["3"]
    assert summary["failed"][0]["error"] == "RuntimeError: CUDA out of memory"


def test_a_diverged_run_is_finished(tmp_path):
    """A diverged run is a measurement: the study is complete and the batch bounds the answer."""
    study(tmp_path)
    edit(tmp_path / "3" / "result.json", diverged=True)
    summary = write_report(tmp_path)
    assert summary["complete"] and summary["answer_withheld"] is None
    assert {r["recipe"]: r["global_batch"] for r in summary["gpu_answer"]["recipes"]} == {"baseline": 128, "lars": 32}


def test_lbt_report_on_a_damaged_result_names_it_and_goes_on(tmp_path, capsys):
    from lbt.apps.cli import main

    study(tmp_path)
    (tmp_path / "3" / "result.json").write_text('{"recipe": "lars", "global_ba')  # cut short: a full disk
    main(["report", str(tmp_path)])
    out = capsys.readouterr().out
    assert f"{tmp_path / '3' / 'result.json'}: not a readable lbt result.json" in out
    assert "No answer: the study is incomplete: 1 failed of its 4 jobs" in out and "Answer: up to" not in out
    # its cell from study.json, as the file says nothing
    assert "| `3` | lars | 4 | 128 | 0 |" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("runs", [[(1, 0), (1, 1)], [(1, 0)]])
def test_one_batch_measured_gives_no_answer(tmp_path, runs):
    """Two seeds, or one run at val_acc 0.10: one batch measured is no answer (not "up to 16 GPUs")."""
    for n, (world_size, seed) in enumerate(runs):
        _job(tmp_path / str(n), "baseline", world_size, seed, [0.08, 0.10], b_simple=10.0, test=0.10)
    summary = write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert not answered(report) and summary["gpu_answer"]["best"] is None
    assert "one global batch measured (32): the answer needs at least two" in report.splitlines()[2]
    assert summary["complete"]  # every job finished: the study is complete, but cannot answer


def test_a_base_batch_at_chance_gives_no_answer(tmp_path):
    accs = {key: [0.09, 0.105 if key[1] == 1 else 0.10] for key in ACCS}
    study(tmp_path, accs=accs)
    for n in range(4):
        edit(tmp_path / str(n) / "result.json", config=SYNTHETIC)
    summary = write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert not answered(report) and summary["critical_batch"]["value"] is None
    assert ("the base batch did not learn: baseline at the smallest global batch (32) reached 10.50% on val, within 2 "
            "points of chance (10.00%, 1 of 10 classes)") in report.splitlines()[2]


def test_an_undertrained_base_batch_is_warned_above_the_answer(tmp_path):
    """A 1-epoch study at 53%: still rising steeply at its end, below halfway from chance to 100%."""
    rising = {key: [0.30, 0.53] for key in ACCS}
    study(tmp_path, accs=rising)
    for n in range(4):
        edit(tmp_path / str(n) / "result.json", config=SYNTHETIC)
    summary = write_report(tmp_path)
    lines = (tmp_path / "report.md").read_text().splitlines()
    warning = next(i for i, line in enumerate(lines) if line.startswith("**Warning: the base batch is undertrained**"))
    assert warning < lines.index("## Diagnostics: other estimates of the critical batch")
    assert "gained 11.5 points over the last 25% of its training" in lines[warning]  # 0.415 at 3/4 -> 0.53
    assert "below halfway between chance (10.00%) and 100% (55.00%)" in lines[warning]
    assert "trainer.epochs=4, now 2" in lines[warning]
    answer = next(i for i, line in enumerate(lines) if line.startswith("**Answer: up to"))  # the answer stands
    assert "the base batch is undertrained" in lines[answer - 2]  # said again just above it
    assert summary["warnings"] and summary["answer_withheld"] is None


def test_a_trained_base_batch_gets_no_warning(tmp_path):
    study(tmp_path)  # 0.96 -> 0.98: 1 point over the last quarter, at 98%
    for n in range(4):
        edit(tmp_path / str(n) / "result.json", config=SYNTHETIC)
    summary = write_report(tmp_path)
    assert summary["warnings"] == [] and "Warning" not in (tmp_path / "report.md").read_text()


def test_the_rising_rule_for_a_loss():
    from lbt.apps.report.trust import late_gain
    from lbt.spec.objective import ACC, LOSS
    from lbt.spec.result import EvalPoint

    def history(*points):
        return [EvalPoint(step=s, samples_seen=s, global_batch=1, acc=a, loss=loss) for s, a, loss in points]

    rising = history((100, 0.5, 3.0), (200, 0.6, 2.0))
    assert late_gain(rising, LOSS) == pytest.approx(0.5)  # 2.5 nats at 150 samples, 2.0 at the end
    assert late_gain(rising, ACC) == pytest.approx(5.0)  # points
    assert late_gain(history((200, 0.6, 2.0)), LOSS) is None  # a loss has no known start
    assert late_gain(history((200, 0.6, 2.0)), ACC, chance=0.1) == pytest.approx(12.5)  # from chance at sample 0


def test_accuracy_reads_in_percent_everywhere(tmp_path):
    """Every accuracy of report.md is in percent: never `0.9850 ± 0.0056` beside `98.50 ± 0.56`."""
    for n, (world_size, seed, acc) in enumerate([(1, 0, 0.985), (1, 1, 0.9794), (4, 0, 0.981), (4, 1, 0.975)]):
        _job(tmp_path / str(n), "baseline", world_size, seed, [0.9, acc], b_simple=10.0, test=acc)
    write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert re.findall(r"\b0\.\d{4}\b", report) == []  # no fraction of 1 anywhere
    assert "| 32 | 1 | 2 | 98.22 ± 0.40 |" in report and "final val acc (%)" in report
    assert "97.80 ± 0.42 (2)" in report and "98.22%" in report.splitlines()[2]


def test_a_language_models_losses_read_in_nats_and_bits_per_char(tmp_path):
    from test_loss_targets import _job as text_job

    from lbt.spec.objective import bits

    for n, (world_size, losses) in enumerate([(1, [2.1, 2.0]), (4, [2.15, 2.04])]):
        text_job(tmp_path / str(n), world_size, losses, test_loss=losses[-1] + 0.01)
    write_report(tmp_path, metric="loss", tolerance=0.1)
    report = (tmp_path / "report.md").read_text()
    assert f"2.0000 nats = {bits(2.0):.4f} bits/char" in report.splitlines()[2]  # the lead figure's base
    assert "final val loss (nats)" in report and "val bits/char" in report
    assert "bits per char (nats / ln 2, as its runs print it" in report
    assert f"final val loss 2.0000 nats = {bits(2.0):.4f} bits/char" in report  # the answer's reference


def drawn_figures(monkeypatch) -> dict[str, object]:
    """The report's figures by file name, kept open instead of saved."""
    from lbt.apps.report import plots

    figures: dict[str, object] = {}
    monkeypatch.setattr(plots, "save_figure", lambda fig, path, title=None: figures.setdefault(path.name, fig))
    return figures


def legend_colours(fig) -> dict[str, str]:
    import numpy as np
    from matplotlib.colors import to_hex

    colours = {}
    for ax in fig.axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            line = handle[0] if isinstance(handle, tuple) else handle  # an errorbar's: its data line
            colour = line.get_color() if hasattr(line, "get_color") else np.atleast_2d(line.get_facecolor())[0]
            colours[label.split(":")[0]] = to_hex(colour)
    return colours


def test_one_colour_per_recipe_in_every_plot(tmp_path, monkeypatch):
    from lbt.apps.report.plots import PALETTE, series_colours

    colours = series_colours(["lars", "baseline", "lamb", "baseline (optim.lr=0.2)", "lars"])
    assert colours == series_colours(["baseline", "lamb", "lars", "baseline (optim.lr=0.2)"])  # any order
    assert colours["baseline"] == PALETTE[0] and len(set(colours.values())) == 4
    # lamb never reaches the target: the steps plot draws lars alone, still in lars's colour
    accs = {("baseline", 1): [0.9, 0.98], ("baseline", 4): [0.9, 0.975], ("lamb", 1): [0.2, 0.5],
            ("lamb", 4): [0.2, 0.4], ("lars", 1): [0.9, 0.98], ("lars", 4): [0.9, 0.979]}
    for n, ((recipe, world_size), history) in enumerate(accs.items()):
        _job(tmp_path / str(n), recipe, world_size, 0, history, b_simple=10.0, test=history[-1])
    figures = drawn_figures(monkeypatch)
    write_report(tmp_path, target=0.95, hybrid_cap=32)
    expected = series_colours(["baseline", "lamb", "lars"])
    assert {"accuracy_vs_batch.png", "steps_to_target.png", "accuracy_vs_gpus.png"} <= set(figures)
    for name in ("accuracy_vs_batch.png", "steps_to_target.png", "accuracy_vs_gpus.png"):
        drawn = {label: c for label, c in legend_colours(figures[name]).items() if label in expected}
        assert drawn and all(expected[label] == c for label, c in drawn.items()), (name, drawn)


def test_the_accuracy_plot_zooms_to_the_tolerance_band_and_names_its_splits(tmp_path, monkeypatch):
    from matplotlib.patches import Rectangle

    from lbt.apps.report.plots import zoom_limits

    low, high = zoom_limits(98.0, 97.0, [97.5, 50.0, 98.3])
    assert low < 97.0 and high > 98.3 and (98.0 - 97.0) / (high - low) >= 1 / 9  # the band is readable
    assert low > 50.0  # a far point does not stretch the axis: it is drawn clipped at the edge
    assert zoom_limits(99.9, 98.9, [], ceiling=100.0)[1] <= 100.25

    accs = {("baseline", 1): [0.9, 0.98], ("baseline", 4): [0.9, 0.975], ("baseline", 16): [0.4, 0.50]}
    for n, ((recipe, world_size), history) in enumerate(accs.items()):
        _job(tmp_path / str(n), recipe, world_size, 0, history, b_simple=10.0, test=history[-1])
    figures = drawn_figures(monkeypatch)
    write_report(tmp_path, hybrid_cap=32)
    zoomed, full = figures["accuracy_vs_batch.png"].axes
    bottom, top = zoomed.get_ylim()
    band = [(p.get_y(), p.get_y() + p.get_height()) for p in zoomed.patches if isinstance(p, Rectangle)]
    assert band == [(pytest.approx(97.0), pytest.approx(98.0))] and (98.0 - 97.0) / (top - bottom) >= 1 / 9
    assert bottom > 50.0  # the 50% run sits at the bottom edge, marked, its value written beside it
    assert any(text.get_text() == "50.00" for text in zoomed.texts)
    assert "val" in zoomed.get_ylabel() and "test" in full.get_ylabel()
    assert "val" in figures["accuracy_vs_gpus.png"].axes[0].get_ylabel()  # it says which split it plots
    assert "val" in figures["steps_to_target.png"].axes[0].get_ylabel()
    plt_close(figures)


def plt_close(figures) -> None:
    import matplotlib.pyplot as plt

    for fig in figures.values():
        plt.close(fig)


def test_tensorboard_runs_are_named_after_what_ran(tmp_path):
    study(tmp_path)
    write_report(tmp_path)
    runs = sorted(p.name for p in (tmp_path / "tb_summary").iterdir() if p.is_dir())
    assert runs == ["baseline_W1_B32_seed0", "baseline_W4_B128_seed0", "lars_W1_B32_seed0", "lars_W4_B128_seed0"]


def test_two_jobs_of_one_cell_keep_apart_in_tensorboard():
    from lbt.apps.report.jobs import Job
    from lbt.apps.report.tensorboard import run_names
    from lbt.spec.result import RunResult

    same = RunResult(recipe="lars", world_size=4, global_batch=128, seed=0)
    jobs = [Job("a/1", None, same, series="lars (optim.lr=0.2)"), Job("b/1", None, same, series="lars (optim.lr=0.2)"),
            Job("2", None, RunResult(recipe="lars", world_size=8, tensor_parallel=2, global_batch=128), series="lars")]
    assert run_names(jobs) == ["lars_optim.lr=0.2_W4_B128_seed0_a_1", "lars_optim.lr=0.2_W4_B128_seed0_b_1",
                               "lars_W8_T2_B128_seed0"]


def test_a_full_disk_while_reporting_leaves_the_old_report_whole(tmp_path, capfd):
    """`(ulimit -f 4; lbt report DIR)` over a complete report: written in place, report.md would be cut mid-table.
    Every file the report writes goes through the atomic writer: a failed write leaves the old one. The
    command ends with one line naming the file, not a traceback (an OSError from PIL or the writer)."""
    import json
    import resource
    import signal

    from test_study import _job

    from lbt.apps.report import write_report

    for n, (world_size, accs) in enumerate([(1, [0.8, 0.95]), (4, [0.7, 0.93]), (16, [0.5, 0.9])]):
        _job(tmp_path / str(n), "baseline", world_size, 0, accs, b_simple=200.0, test=accs[-1])
    write_report(tmp_path)
    before = {name: (tmp_path / name).read_bytes() for name in ("report.md", "summary.json")}
    assert len(before["report.md"]) > 4096 and json.loads(before["summary.json"])
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        code, err = run_main(["report", str(tmp_path), "--target", "0.9"], capfd)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"lbt: error: cannot write {tmp_path}/"), err
    assert "may not grow this large" in lines[0] and "run the same command again" in lines[0]


@pytest.mark.parametrize("key, value, says", [
    ("final_val_acc", float("nan"), "final_val_acc is nan, outside [0, 1]"),
    ("final_val_acc", 1e308, "final_val_acc is 1e+308, outside [0, 1]"),
    ("final_val_acc", "0.9", "final_val_acc is '0.9', not a number"),
    ("global_batch", -64, "global_batch is -64, not a positive whole number"),
    ("global_batch", 0, "global_batch is 0, not a positive whole number"),
    ("global_batch", "64", "global_batch is '64', not a positive whole number"),
    ("world_size", [1], "world_size is [1], not a positive whole number"),
])
def test_a_result_with_a_bad_field_is_a_failed_job_and_the_answer_is_withheld(tmp_path, key, value, says):
    """Unchecked, `final_val_acc: NaN` would give "Answer: up to 4 GPUs" from another recipe's base, `global_batch:
    -64` a critical batch of -64, and wrong types tracebacks (1e308 writing "inf%" first). The one result reader checks
    every field's type and range: such a job has failed, is named, and no answer comes from the study."""
    import json

    from test_study import _job

    from lbt.apps.report import write_report

    for n, (world_size, accs) in enumerate([(1, [0.8, 0.95]), (4, [0.7, 0.945]), (16, [0.5, 0.90])]):
        _job(tmp_path / str(n), "baseline", world_size, 0, accs, b_simple=200.0, test=accs[-1])
    bad = tmp_path / "0" / "result.json"
    bad.write_text(json.dumps({**json.loads(bad.read_text()), key: value}))
    summary = write_report(tmp_path)
    failed = [j for j in summary["jobs"] if j.get("error")]
    assert [j["job_dir"] for j in failed] == ["0"] and says in failed[0]["error"]
    assert summary["answer_withheld"] and summary["gpu_answer"]["best"] is None
    assert "## Failed jobs" in (tmp_path / "report.md").read_text()
