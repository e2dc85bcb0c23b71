"""A study is one thing you can stop and continue; a run folder belongs to one run.

Ctrl-C stops every job with a checkpoint and gives no answer; the same command continues the study to
the parameters of an uninterrupted one, never rerunning or rewriting a finished job; another grid
in the same folder is refused. A diverged run is caught before its loss is NaN and stops early.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import train
from test_cli_errors import run_main, run_main_io

from lbt.apps.study_folder import StudyJob, StudyRecord, claim, expected_jobs, grid_jobs
from lbt.errors import ConfigError

# Long enough (a few seconds a job on 2 cores) for Ctrl-C, sent at a job's first checkpoint (end of epoch 1),
# to land mid-run; BN-free, so resumes are bitwise.
STUDY = ["study", "model=mlp", "data=synthetic", "recipe=baseline,lars", "dist.world_size=1,4", "trainer.epochs=20",
         "trainer.device=cpu"]  # one device for the study and the straight runs it is compared with


def test_grid_jobs_number_the_jobs_as_hydras_basic_sweeper_does():
    jobs = grid_jobs({"recipe": "baseline,lars", "dist.world_size": "1,16"}, ["dist.world_size=1,4", "model=mlp"])
    assert [j.dir for j in jobs] == ["0", "1", "2", "3"]
    # The command line's sweep replaces the config's values in the config's place; the rest follow.
    assert jobs[1].overrides == ("recipe=baseline", "dist.world_size=4", "model=mlp")
    assert grid_jobs({}, ["trainer.seed=1,2"], prefix="seeds/")[1] == StudyJob("seeds/1", ("trainer.seed=2",))


def test_a_folder_holds_one_study(tmp_path):
    mine = StudyRecord(("recipe=baseline",), (StudyJob("0", ("recipe=baseline",)),))
    assert claim(tmp_path / "s", mine) is False
    assert claim(tmp_path / "s", mine) is True  # the same command: a continued study
    assert expected_jobs(tmp_path / "s") == list(mine.jobs)
    other = StudyRecord(("recipe=lars",), (StudyJob("0", ("recipe=lars",)),))
    with pytest.raises(ConfigError, match="holds another study .*recipe=baseline.*recipe=lars"):
        claim(tmp_path / "s", other)
    # Reordered overrides, trainer.threads=1 or another launcher are the same jobs, not another study.
    two = StudyRecord(("recipe=baseline", "trainer.epochs=2"),
                      (StudyJob("0", ("recipe=baseline", "trainer.epochs=2")),))
    assert claim(tmp_path / "t", two) is False
    same = StudyRecord(("trainer.epochs=2", "recipe=baseline", "trainer.threads=1", "hydra/launcher=local_parallel"),
                       (StudyJob("0", ("trainer.epochs=2", "recipe=baseline", "trainer.threads=1",
                                       "hydra/launcher=local_parallel")),))
    assert claim(tmp_path / "t", same) is True
    longer = StudyRecord(("recipe=baseline", "trainer.epochs=3"),
                         (StudyJob("0", ("recipe=baseline", "trainer.epochs=3")),))
    with pytest.raises(ConfigError, match="it has trainer.epochs=2; this command has trainer.epochs=3"):
        claim(tmp_path / "t", longer)
    (tmp_path / "sweep" / "0").mkdir(parents=True)
    (tmp_path / "sweep" / "0" / "result.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds results of another sweep"):
        claim(tmp_path / "sweep", mine)


def test_a_run_folder_belongs_to_one_run(tmp_path, capfd):
    run_dir = tmp_path / "run"
    tiny = ["model=mlp", "trainer.epochs=1"]
    first = train(run_dir, tiny)
    before = (run_dir / "result.json").read_bytes()
    with pytest.raises(ConfigError, match="holds another run's result .*dist.world_size"):
        train(run_dir, [*tiny, "dist.world_size=4"])
    with pytest.raises(ConfigError, match="holds this run, finished"):
        train(run_dir, tiny)
    # Resuming a finished run trains nothing and says so.
    assert train(run_dir, [*tiny, "trainer.resume=auto"])["steps"] == first["steps"]
    assert (run_dir / "result.json").read_bytes() == before
    code, err = run_main(["train", "data=synthetic", *tiny, "dist.world_size=4", f"hydra.run.dir={run_dir}"], capfd)
    assert code == 2 and err.count("lbt: error:") == 1, err
    assert "another run's result" in err and (run_dir / "result.json").read_bytes() == before


def test_a_loss_far_above_its_start_is_divergence_and_stops_the_run(tmp_path):
    # lr=30 sends the loss to 1e24 within the epoch, finite: only a NaN check calls that run trained.
    tiny = ["model=mlp", "optim.lr=30", "schedule=constant", "trainer.epochs=1", "trainer.log_every=1"]
    assert train(tmp_path / "nan_only", [*tiny, "trainer.diverge_factor=null"])["diverged"] is False
    result = train(tmp_path / "run", tiny)  # the default rule: 10x the first step's loss, 3 log steps in a row
    assert result["diverged"] is True
    assert result["steps"] < 8  # stopped early: the epoch is 8 steps


def test_divergence_rule_counts_log_steps_in_a_row():
    from lbt.metrics.window import diverging

    high = 0
    for loss in (2.0, 30.0, 30.0, 2.0, 30.0):
        high = diverging(loss, 2.3, high, 10.0)
    assert high == 1  # a dip resets the count
    assert diverging(float("inf"), 2.3, 0, None) == 1 and diverging(1e30, 2.3, 0, None) == 0


def _start_study(folder: Path, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "lbt", *STUDY, f"hydra.sweep.dir={folder}"], cwd=cwd, env=env,
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_ctrl_c_stops_a_study_and_the_same_command_continues_it_exactly(tmp_path, capfd):
    folder = tmp_path / "study"
    study = _start_study(folder, tmp_path)
    deadline = time.time() + 120
    while time.time() < deadline and not list(folder.glob("*/checkpoint/latest.json")):
        time.sleep(0.05)
    os.killpg(study.pid, signal.SIGINT)  # what Ctrl-C sends: the whole process group
    out, err = study.communicate(timeout=120)
    assert study.returncode == 130, err
    assert "Answer" not in out and not (folder / "report.md").exists()
    assert err.count("lbt: study stopped (SIGINT)") == 1 and f"hydra.sweep.dir={folder}" in err
    assert len(out.splitlines()) <= 8 and "stopped, checkpoint saved" in out  # a header, one line per job
    finished = {p.parent.name: p.read_bytes() for p in folder.glob("*/result.json")}
    assert len(finished) < 4
    stopped = [job for job in expected_jobs(folder)
               if job.dir not in finished and (folder / job.dir / "checkpoint" / "latest.json").is_file()]
    assert stopped, "Ctrl-C landed between jobs: no job was stopped mid-run"

    code, out, err = run_main_io([*STUDY, f"hydra.sweep.dir={folder}"], capfd)  # in this process: one start less
    assert code == 0, err
    assert "continuing" in out and "Answer: up to" in out
    assert {name: (folder / name / "result.json").read_bytes() for name in finished} == finished
    # One line per job this command ran, each counter once (a kept job prints no `[k/4]` of its own).
    counters = re.findall(r"^\[(\d)/4\]", out, re.M)
    assert len(counters) == 4 - len(finished) and len(set(counters)) == len(counters), out

    # Each job stopped mid-run ends as the same job trained straight (one process, as the study runs it).
    for job in stopped:
        train(tmp_path / "whole" / job.dir, list(job.overrides))
        straight = torch.load(tmp_path / "whole" / job.dir / "final_model.pt", weights_only=True)
        resumed = torch.load(folder / job.dir / "final_model.pt", weights_only=True)
        assert straight.keys() == resumed.keys() and all(torch.equal(straight[k], resumed[k]) for k in straight), job
    assert len(list(folder.glob("*/final_model.pt"))) == 4

    # Run once more: every job finished earlier, so no sweep starts (no job's line), nothing is rewritten,
    # and the answer is the same.
    results = {p: p.read_bytes() for p in folder.glob("*/result.json")}
    answer = (folder / "report.md").read_text()
    code, out, _ = run_main_io([*STUDY, f"hydra.sweep.dir={folder}"], capfd)  # in this process: nothing trains
    assert code == 0 and "all 4 jobs finished earlier" in out and "[4/4]" not in out and "Answer: up to" in out, out
    assert (folder / "report.md").read_text() == answer
    assert {p: p.read_bytes() for p in results} == results
    # Another grid into the same folder is refused, naming what differs.
    code, err = run_main([*STUDY[:3], "recipe=baseline", *STUDY[4:], f"hydra.sweep.dir={folder}"], capfd)
    assert code == 2 and "holds another study (it has recipe=lars)" in err
    summary = json.loads((folder / "summary.json").read_text())
    assert len(summary["jobs"]) == 4


@pytest.mark.slow
def test_two_commands_on_one_run_folder_one_runs_the_other_is_refused_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "lbt", "train", "model=mlp", "data=synthetic", "trainer.epochs=300",
               "trainer.progress=false", f"hydra.run.dir={run_dir}"]
    first = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not ((run_dir / ".lock").is_file() and (run_dir / ".lock").read_text()):
        time.sleep(0.1)
    second = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert first.poll() is None, "the first run ended before the second was refused: give it more epochs"
    first.send_signal(signal.SIGTERM)  # the first ran undisturbed until now: it stops as told, with its checkpoint
    out, err = first.communicate(timeout=120)
    assert first.returncode == 143 and "stopped at step" in out, err
    assert second.returncode == 2 and second.stderr.count("lbt: error:") == 1, second.stderr
    assert f"is in use by pid {first.pid}" in second.stderr
    assert not (run_dir / "result.json").exists() and (run_dir / "checkpoint" / "latest.json").is_file()


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_the_workers_of_a_killed_study_end_with_it(tmp_path):
    """`kill -9` of an `lbt study` under hydra/launcher=local_parallel ends its 2 loky workers (which ignore
    SIGTERM: the study tells its jobs to stop) and their resource tracker too: none is left orphaned."""
    study = subprocess.Popen(
        [sys.executable, "-m", "lbt", "study", "data=synthetic", "model=mlp", "trainer.device=cpu",
         "trainer.epochs=200", "data.num_train=4096", "recipe=baseline", "dist.world_size=1,2,4,8",
         "hydra/launcher=local_parallel", f"hydra.sweep.dir={tmp_path / 'study'}"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, workers = time.monotonic() + 60, []
        while time.monotonic() < deadline and len(workers) < 2:
            time.sleep(0.5)
            workers = [p for p in _children(study.pid)
                       if b"loky" in (Path("/proc") / str(p) / "cmdline").read_bytes()]
        assert len(workers) >= 2, "the study's launcher started no workers"
        while time.monotonic() < deadline and len(list((tmp_path / "study").glob("*/train.log"))) < 2:
            time.sleep(0.25)  # until both train a job
        helpers = _children(study.pid)
        study.kill()
        study.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in helpers):
            time.sleep(0.25)
        assert not [p for p in helpers if _alive(p)], "processes of the killed study still run"
    finally:
        study.kill()
        for p in _children(study.pid):
            os.kill(p, signal.SIGKILL)


def test_a_studys_estimate_counts_jobs_side_by_side_sharing_the_cores(monkeypatch):
    """Two jobs at once on a CPU share its cores: a time measured on both cores alone is not divided by 2 (that
    would say "about 38 min", then "1.5 h left" at the first job)."""
    from conftest import compose_config

    from lbt.apps.study import parallel_speedup
    from lbt.engine import make_spec

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    every_core = make_spec(*compose_config(["model=mlp", "trainer.device=cpu"]))
    one_thread = make_spec(*compose_config(["model=mlp", "trainer.device=cpu", "trainer.threads=1"]))
    assert parallel_speedup(every_core, 2) == 1
    assert parallel_speedup(one_thread, 2) == 2 and parallel_speedup(one_thread, 4) == 2
