"""Studies: a real Hydra multirun, then `lbt report`; launcher configs compose."""

import json
import math

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import lbt_cli

TINY = ["data=synthetic", "model=mlp", "trainer.epochs=2", "trainer.progress=false", "trainer.per_worker_batch=32"]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """2 recipes x 2 world sizes through `lbt train -m`, then `lbt report`."""
    root = tmp_path_factory.mktemp("study")
    sweep = root / "sweep"
    run = lbt_cli(["train", "-m", "recipe=baseline,goyal2017", "dist.world_size=1,4", "measure=[gns]", *TINY,
                   f"hydra.sweep.dir={sweep}"], root, timeout=600)
    assert run.returncode == 0, run.stderr
    report = lbt_cli(["report", str(sweep), "--target", "0.15"], root, timeout=120)
    assert report.returncode == 0, report.stderr
    return sweep


def test_multirun_makes_one_folder_per_job(study):
    jobs = sorted(p for p in study.iterdir() if p.is_dir() and (p / "result.json").exists())
    assert len(jobs) == 4
    combos = {(json.loads((p / "result.json").read_text())["recipe"],
               json.loads((p / "result.json").read_text())["world_size"]) for p in jobs}
    assert combos == {("baseline", 1), ("baseline", 4), ("goyal2017", 1), ("goyal2017", 4)}
    for job in jobs:  # each job has its own TensorBoard events and Hydra config
        assert list(job.glob("events.out.tfevents.*")) and (job / ".hydra" / "config.yaml").exists()


def test_report_files_and_numbers_match_the_jobs(study):
    for name in ("report.md", "accuracy_vs_batch.png", "steps_to_target.png", "summary.json"):
        assert (study / name).stat().st_size > 0
    summary = json.loads((study / "summary.json").read_text())
    assert len(summary["jobs"]) == 4
    for job in summary["jobs"]:
        result = json.loads((study / job["job_dir"] / "result.json").read_text())
        for key in ("final_val_acc", "best_val_acc", "steps", "global_batch", "world_size", "samples_per_sec"):
            assert job[key] == result[key]
    rows = {(r["recipe"], r["global_batch"]): r for r in summary["rows"]}
    assert set(rows) == {("baseline", 32), ("baseline", 128), ("goyal2017", 32), ("goyal2017", 128)}
    for (recipe, batch), row in rows.items():
        job = next(j for j in summary["jobs"] if j["recipe"] == recipe and j["global_batch"] == batch)
        assert row["final_acc"] == job["final_val_acc"] and job["series"] == recipe
    assert rows[("baseline", 32)]["gap"] == 0.0
    # the gradient noise scale of the W=4 jobs gives the critical-batch estimate
    assert summary["critical_batch"] is not None and math.isfinite(summary["critical_batch"])
    report = (study / "report.md").read_text()
    assert "## baseline" in report and "## goyal2017" in report and "Critical batch" in report


def test_tensorboard_summary_uses_the_global_batch_as_step(study):
    events = EventAccumulator(str(study / "tb_summary"))
    events.Reload()
    for recipe in ("baseline", "goyal2017"):
        assert [e.step for e in events.Scalars(f"study/{recipe}/val_acc")] == [32, 128]
    hparam_runs = [p for p in (study / "tb_summary").iterdir() if p.is_dir()]
    assert len(hparam_runs) == 4


def test_a_diverged_or_failed_job_is_reported_not_fatal(tmp_path):
    sweep = tmp_path / "sweep"
    # lr=1e6 diverges; world_size 3 does not divide global batch 64: a config error
    run = lbt_cli(["train", "-m", "optim.lr=0.1,1e6", "dist.world_size=2,3", "trainer.global_batch=64",
                   "schedule=constant", "trainer.log_every=1", *[a for a in TINY if "per_worker_batch" not in a],
                   f"hydra.sweep.dir={sweep}"], tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr
    report = lbt_cli(["report", str(sweep)], tmp_path, timeout=120)
    assert report.returncode == 0, report.stderr
    summary = json.loads((sweep / "summary.json").read_text())
    assert len(summary["jobs"]) == 4
    assert sum(bool(j["diverged"]) for j in summary["jobs"]) == 1
    errors = [j for j in summary["jobs"] if j["error"]]
    assert len(errors) == 2 and all("not divisible" in j["error"] for j in errors)
    report = (sweep / "report.md").read_text()
    assert "diverged 1/2" in report and "error 1/2" in report and "## Failed jobs" in report


@pytest.mark.parametrize("launcher,target", [("slurm", "SlurmLauncher"), ("local_parallel", "JoblibLauncher")])
def test_launcher_configs_compose_without_a_cluster(launcher, target, tmp_path):
    job = lbt_cli(["train", f"hydra/launcher={launcher}", "recipe=goyal2017", "--cfg", "job"],
                  tmp_path, timeout=60)
    assert job.returncode == 0, job.stderr
    assert "dist:" in job.stdout and "trainer:" in job.stdout
    hydra_cfg = lbt_cli(["train", f"hydra/launcher={launcher}", "--cfg", "hydra"], tmp_path, timeout=60)
    assert hydra_cfg.returncode == 0 and target in hydra_cfg.stdout


def test_study_configs_compose(tmp_path):
    for study_name in ("default", "gpu_counts"):
        out = lbt_cli(["train", f"study={study_name}", "--cfg", "hydra"], tmp_path, timeout=60)
        assert out.returncode == 0, out.stderr
        assert "mode: MULTIRUN" in out.stdout and "dist.world_size" in out.stdout
