"""Studies: a real Hydra multirun, then `lbt report`; launcher configs compose."""

import json
import math

import pytest
from conftest import names_val
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_cli_errors import run_main, run_main_io

TINY = ["data=synthetic", "model=mlp", "trainer.epochs=2", "trainer.progress=false", "trainer.per_worker_batch=32"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """2 recipes x 2 world sizes through `lbt train -m`, then `lbt report`, both in this process (Hydra's basic
    launcher runs the jobs here too; the command's own process is in test_lbt_study_runs_its_extra_grid...)."""
    from lbt.apps.cli import main

    root = tmp_path_factory.mktemp("study")
    sweep = root / "sweep"
    for args in (["train", "-m", "recipe=baseline,goyal2017", "dist.world_size=1,4", "measure=[gns]", *TINY,
                  "data.num_train=1024", "data.val_fraction=0.25", f"hydra.sweep.dir={sweep}"],
                 ["report", str(sweep), "--target", "0.15"]):
        try:
            main(args)
        except SystemExit as done:
            assert not done.code, (args, done.code)
    return sweep


@pytest.mark.slow
def test_multirun_makes_one_folder_per_job(study):
    jobs = sorted(p for p in study.iterdir() if p.is_dir() and (p / "result.json").exists())
    assert len(jobs) == 4
    combos = {(json.loads((p / "result.json").read_text())["recipe"],
               json.loads((p / "result.json").read_text())["world_size"]) for p in jobs}
    assert combos == {("baseline", 1), ("baseline", 4), ("goyal2017", 1), ("goyal2017", 4)}
    for job in jobs:  # each job has its own TensorBoard events and Hydra config
        assert list(job.glob("events.out.tfevents.*")) and (job / ".hydra" / "config.yaml").exists()


def _accuracy_on_each_split(job_dir) -> dict[str, float]:
    """The job's final model scored here, independently of lbt's bookkeeping, on its val and test splits."""
    import torch

    from lbt.engine.build import build_data, build_model
    from lbt.spec.targets import target_of

    config = json.loads((job_dir / "result.json").read_text())["config"]
    data = build_data(target_of(config["data"], "data"))
    model = build_model(target_of(config["model"], "model"), data.input_shape, data.num_classes)
    model.load_state_dict(torch.load(job_dir / "final_model.pt", weights_only=True))
    model.eval()
    with torch.no_grad():
        return {split: (model(d.x).argmax(1) == d.y).float().mean().item()
                for split, d in (("val", data.val), ("test", data.test))}


@pytest.mark.slow
def test_no_val_named_number_holds_test_data(study):
    """Acceptance: val-named fields, columns and tags hold val numbers; test numbers are there, named test."""
    summary = json.loads((study / "summary.json").read_text())
    report = (study / "report.md").read_text()
    events = EventAccumulator(str(study / "tb_summary"))
    events.Reload()
    assert len(summary["jobs"]) == 4
    for job in summary["jobs"]:
        result = json.loads((study / job["job_dir"] / "result.json").read_text())
        scored = _accuracy_on_each_split(study / job["job_dir"])
        assert result["eval_split"] == "val" and result["final_val_acc"] == pytest.approx(scored["val"], abs=1e-6)
        assert result["val_history"][-1]["acc"] == result["final_val_acc"]
        assert result["test_acc"] == pytest.approx(scored["test"], abs=1e-6) and "test/acc" not in result
        assert job["final_val_acc"] == result["final_val_acc"] and job["test_acc"] == result["test_acc"]
        row = next(r for r in summary["rows"]
                   if r["recipe"] == job["recipe"] and r["global_batch"] == job["global_batch"])
        assert row["split"] == "val" and row["final_acc"] == result["final_val_acc"]
        assert row["test_acc"] == result["test_acc"]
        # report.md: the final val column holds val, the test column test
        assert f"| {job['global_batch']:,} | {job['world_size']} | 1 | {100 * result['final_val_acc']:.2f} | " in report
        assert f"| {100 * result['test_acc']:.2f} |" in report  # accuracy in percent, as everywhere in the report
        # TensorBoard: study/<recipe>/val_acc and test_acc, and the job's own val/ and test/ tags
        val = {e.step: e.value for e in events.Scalars(f"study/{job['recipe']}/val_acc")}
        test = {e.step: e.value for e in events.Scalars(f"study/{job['recipe']}/test_acc")}
        assert val[job["global_batch"]] == pytest.approx(result["final_val_acc"])
        assert test[job["global_batch"]] == pytest.approx(result["test_acc"])
        own = EventAccumulator(str(study / job["job_dir"]))
        own.Reload()
        assert own.Scalars("val/acc")[-1].value == pytest.approx(scored["val"], abs=1e-6)
        assert [e.value for e in own.Scalars("test/acc")] == [pytest.approx(scored["test"], abs=1e-6)]
    assert "**val** is held out of the training set" in report


@pytest.mark.slow
def test_report_files_and_numbers_match_the_jobs(study):
    for name in ("report.md", "accuracy_vs_batch.png", "steps_to_target.png", "gns_over_training.png",
                 "summary.json"):
        assert (study / name).stat().st_size > 0
    summary = json.loads((study / "summary.json").read_text())
    rows = {(r["recipe"], r["global_batch"]): r for r in summary["rows"]}
    assert set(rows) == {("baseline", 32), ("baseline", 128), ("goyal2017", 32), ("goyal2017", 128)}
    assert rows[("baseline", 32)]["gap"] == 0.0
    # the gradient noise scale of the W=4 jobs over their last 20% gives the GNS critical batch;
    # two batches are too few for the steps-to-target fit, and the report says so
    crit = summary["critical_batch"]
    assert crit["series"] == "baseline" and crit["gns"] is not None and math.isfinite(crit["gns"])
    assert crit["fit"] is None and "at least 3 distinct batches" in crit["fit_error"]
    report = (study / "report.md").read_text()
    assert "## baseline" in report and "## goyal2017" in report and "**Critical batch: " in report.splitlines()[2]


@pytest.mark.slow
def test_a_diverged_or_failed_job_is_reported_not_fatal(tmp_path, capfd):
    sweep = tmp_path / "sweep"
    # lr=1e6 diverges; world_size 3 does not divide global batch 64: a config error
    code, err = run_main(["train", "-m", "optim.lr=0.1,1e6", "dist.world_size=2,3", "trainer.global_batch=64",
                          "schedule=constant", "trainer.log_every=1", *[a for a in TINY if "per_worker_batch" not in a],
                          f"hydra.sweep.dir={sweep}"], capfd)
    assert code == 0, err
    code, err = run_main(["report", str(sweep)], capfd)
    assert code == 0, err
    summary = json.loads((sweep / "summary.json").read_text())
    assert len(summary["jobs"]) == 4
    assert sum(bool(j.get("diverged")) for j in summary["jobs"]) == 1
    errors = [j for j in summary["jobs"] if j.get("error")]
    assert len(errors) == 2 and all("not divisible" in j["error"] for j in errors)
    report = (sweep / "report.md").read_text()
    assert "diverged 1/2" in report and "error 1/2" in report and "## Failed jobs" in report


@pytest.mark.parametrize("launcher,target", [("slurm", "SlurmLauncher"), ("local_parallel", "JoblibLauncher")])
def test_launcher_configs_compose_without_a_cluster(launcher, target, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_main_io(["train", f"hydra/launcher={launcher}", "recipe=goyal2017", "--cfg", "job"], capsys)
    assert code == 0 and "dist:" in out and "trainer:" in out, out
    code, out, _ = run_main_io(["train", f"hydra/launcher={launcher}", "--cfg", "hydra"], capsys)
    assert code == 0 and target in out, out


def test_study_configs_compose(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for study_name in ("default", "gpu_counts"):
        code, out, _ = run_main_io(["train", f"study={study_name}", "--cfg", "hydra"], capsys)
        assert code == 0 and "mode: MULTIRUN" in out and "dist.world_size" in out, out



def _job(folder, recipe: str, world_size: int, seed: int, accs: list[float], b_simple: float, test: float,
         split: str = "val") -> None:
    """A job folder as `lbt train -m` leaves it: its result.json (same fields the trainer writes)."""
    folder.mkdir(parents=True)
    global_batch, steps_per_epoch = 32 * world_size, 1024 // (32 * world_size)
    history = [{"step": steps_per_epoch * (e + 1), "samples_seen": 1024 * (e + 1), "global_batch": global_batch,
                "acc": acc, "loss": 1.0} for e, acc in enumerate(accs)]
    (folder / "result.json").write_text(json.dumps({
        "recipe": recipe, "overrides": [f"recipe={recipe}", f"dist.world_size={world_size}", f"trainer.seed={seed}"],
        "world_size": world_size, "procs": 1, "per_worker_batch": 32, "global_batch": global_batch, "seed": seed,
        "eval_split": split, f"final_{split}_acc": accs[-1], f"best_{split}_acc": max(accs), "test_acc": test,
        "steps": history[-1]["step"], "samples_per_sec": 1000.0 * (seed + 1), "diverged": False,
        f"{split}_history": history, "technique_curves": {"gns/b_simple": [[1024, b_simple / 2], [2048, b_simple]]},
    }))


def test_report_averages_seeds_with_their_spread(tmp_path):
    from lbt.apps.report import write_report

    accs = {  # (recipe, world_size) -> per seed, val acc after each of 2 epochs
        ("baseline", 1): [[0.86, 0.90], [0.70, 0.94]],
        ("baseline", 8): [[0.86, 0.70], [0.60, 0.74]],
        ("lars", 8): [[0.85, 0.88], [0.80, 0.90]],
    }
    n = 0
    for (recipe, world_size), per_seed in accs.items():
        for seed, history in enumerate(per_seed):
            _job(tmp_path / str(n), recipe, world_size, seed, history, b_simple=100.0 + n, test=history[-1] - 0.01)
            n += 1
    summary = write_report(tmp_path, target=0.85)
    rows = {(r["recipe"], r["global_batch"]): r for r in summary["rows"]}
    base, big, lars = rows[("baseline", 32)], rows[("baseline", 256)], rows[("lars", 256)]
    assert base["seeds"] == 2 and base["final_acc"] == pytest.approx(0.92)
    assert base["final_acc_std"] == pytest.approx(0.0282843, rel=1e-4)  # sample std of 0.90, 0.94
    assert base["test_acc"] == pytest.approx(0.91)
    assert big["gap"] == pytest.approx(-20.0) and lars["gap"] == pytest.approx(-3.0)  # on test
    # steps to 0.85, interpolated between evaluations (from step 0 at accuracy 0 before the first):
    # baseline@32 seed 0 crosses in its first 32 steps, seed 1 between step 32 (0.70) and 64 (0.94)
    crossings = [32 * 0.85 / 0.86, 32 + 32 * (0.85 - 0.70) / (0.94 - 0.70)]
    assert base["steps_to_target"] == pytest.approx(sum(crossings) / 2)
    assert big["steps_to_target"] is None  # one seed never reached the target
    assert lars["steps_to_target"] == pytest.approx((4 + 4 + 4 * 0.05 / 0.10) / 2)
    # B_simple: each run's median over its last 20% of training (its last point), median over the baseline rows
    assert summary["critical_batch"]["gns"] == pytest.approx(101.5)
    report = (tmp_path / "report.md").read_text()
    assert "| 32 | 1 | 2 | 92.00 ± 2.83 |" in report and "| 256 | 8 | 2 | 72.00 ± 2.83 |" in report
    events = EventAccumulator(str(tmp_path / "tb_summary"))
    events.Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("study/baseline/val_acc")] == [(32, 0.92), (256, 0.72)]
    # The report ends with the answer; reporting again replaces tb_summary/ rather than adding to it.
    assert report.rstrip().splitlines()[-1].startswith("**Answer: up to")
    files = sorted(p.name for p in (tmp_path / "tb_summary").rglob("*") if p.is_file())
    write_report(tmp_path, target=0.85)
    assert len(sorted(p.name for p in (tmp_path / "tb_summary").rglob("*") if p.is_file())) == len(files)


def test_a_study_without_a_validation_split_names_test(tmp_path):
    from lbt.apps.report import write_report

    for n, (world_size, accs) in enumerate([(1, [0.5, 0.8]), (2, [0.4, 0.7]), (4, [0.3, 0.6])]):
        _job(tmp_path / str(n), "baseline", world_size, 0, accs, b_simple=50.0, test=accs[-1], split="test")
    summary = write_report(tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "no validation split" in report and "final test acc" in report and "val acc" not in report
    assert not [k for job in summary["jobs"] for k in job if names_val(k)]
    events = EventAccumulator(str(tmp_path / "tb_summary"))
    events.Reload()
    assert not [t for t in events.Tags()["scalars"] if names_val(t)]
    assert summary["target_acc"] == pytest.approx(0.8 - 0.01)  # the base batch's final accuracy minus 1 point


@pytest.mark.slow
def test_lbt_study_runs_its_extra_grid_into_the_same_report(tmp_path, capfd, monkeypatch):
    out = tmp_path / "study"
    # The command line's sweep replaces the study's grid; the extra grid adds seeds 1 and 2. In this process, on
    # Hydra's basic launcher (the jobs in the command's process; the study's own, joblib, is in
    # test_study_stop_continue.py and test_tensor_parallel.py): no interpreter starts.
    monkeypatch.chdir(tmp_path)
    code, stdout, err = run_main_io(["study", *TINY, "recipe=baseline", "dist.world_size=1,2",
                                     'extra_sweeps.seeds=["trainer.seed=1,2"]', "hydra/launcher=basic",
                                     f"hydra.sweep.dir={out}"], capfd)
    assert code == 0, err
    assert f"report: {out}/report.md" in stdout
    rows = {r["global_batch"]: r for r in json.loads((out / "summary.json").read_text())["rows"]}
    assert set(rows) == {32, 64} and rows[32]["seeds"] == rows[64]["seeds"] == 3  # seed 0 here, 1 and 2 in seeds/
    assert len([p for p in (out / "seeds").iterdir() if (p / "result.json").exists()]) == 4
    assert "±" in (out / "report.md").read_text()


def test_extra_grid_is_skipped_when_the_command_line_sweeps_its_keys(capsys):
    from lbt.apps.study import extra_sweeps

    assert extra_sweeps(["study=default"]) == [("seeds", ["dist.world_size=64,128", "trainer.seed=1,2"])]
    assert extra_sweeps(["study=default", "dist.world_size=1,8"]) == []
    assert "skipped" in capsys.readouterr().err
    assert extra_sweeps(["study=gpu_counts"]) == []


def test_report_fits_the_critical_batch_to_steps_to_target(tmp_path):
    """Runs whose steps to 80% follow S = S_min (1 + B_noise / B): the report recovers S_min and B_noise."""
    from lbt.apps.report import write_report

    s_min, b_noise = 20.0, 200.0
    for n, world_size in enumerate([1, 2, 4, 8, 16]):
        batch = 32 * world_size
        for seed in range(2):
            crossing = s_min * (1 + b_noise / batch) * (1 + 0.02 * (seed - 0.5))  # +-1% between seeds
            folder = tmp_path / f"{n}_{seed}"
            folder.mkdir()
            history = [{"step": crossing / 2, "samples_seen": 0, "global_batch": batch, "acc": 0.4, "loss": 1.0},
                       {"step": crossing * 1.5, "samples_seen": 0, "global_batch": batch, "acc": 1.0, "loss": 0.5}]
            (folder / "result.json").write_text(json.dumps({
                "recipe": "baseline", "overrides": [f"dist.world_size={world_size}", f"trainer.seed={seed}"],
                "world_size": world_size, "per_worker_batch": 32, "global_batch": batch, "seed": seed,
                "eval_split": "val", "final_val_acc": 1.0, "best_val_acc": 1.0, "test_acc": 0.99, "steps": 10_000,
                "samples_per_sec": 1.0, "diverged": False, "val_history": history,
            }))
    summary = write_report(tmp_path, target=0.7)  # crossed halfway between the two evaluations
    crit = summary["critical_batch"]
    assert crit["series"] == "baseline" and crit["fit_points"] == 10
    assert crit["fit"] == pytest.approx(b_noise, rel=0.1) and crit["s_min"] == pytest.approx(s_min, rel=0.1)
    low, high = crit["fit_interval"]
    assert low <= b_noise <= high
    assert "From steps to target (baseline, 10 runs" in (tmp_path / "report.md").read_text()


def test_a_damaged_result_is_a_failed_job_not_a_traceback(tmp_path):
    """A result.json cut short (a full disk) or not lbt's is listed under "Failed jobs", named; the rest report."""
    from lbt.apps.report import write_report

    for n, world_size in enumerate([1, 2]):
        _job(tmp_path / str(n), "baseline", world_size, 0, [0.5, 0.8], b_simple=50.0, test=0.8)
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "result.json").write_text('{"recipe": "baseline", "global_ba')
    summary = write_report(tmp_path)
    assert {r["global_batch"] for r in summary["rows"]} == {32, 64}  # the damaged job joins no row
    failed = [j for j in summary["jobs"] if j.get("error")]
    assert [j["job_dir"] for j in failed] == ["2"] and "result.json" in failed[0]["error"]
    assert "## Failed jobs" in (tmp_path / "report.md").read_text()
