"""Exact resume after the `lbt` command is stopped: a run of two real processes stopped part-way (SIGKILL after
a checkpoint, SIGTERM mid-epoch, Ctrl-C, each to the command's own process) and continued with
trainer.resume=auto (`lbt train` in this process) ends bitwise equal to the run trained straight.

Simulated workers resume the same way in process (tests/test_resume_matrix.py: every recipe and technique);
a killed worker is named (tests/test_launchers.py) and its run resumed exactly (tests/test_restarts.py)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_cli_errors import run_main_io

from lbt.engine import make_spec, run

EPOCHS = 4
STEPS_PER_EPOCH = 16  # 2048 samples / global batch 128
RUN = FAST + ["model=cnn1d", "data.num_train=2048", f"trainer.epochs={EPOCHS}", "trainer.log_every=2",
              "trainer.global_batch=128", "measure=[gns]", "trainer.evals=0"]
REAL = ["dist.world_size=2", "dist.procs=2"]


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lbt", "train", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_line(job: subprocess.Popen, text: str) -> None:
    for line in job.stdout:
        if text in line:
            return
    raise AssertionError(f"the run ended before printing {text!r}: {job.stderr.read()}")


def assert_same_run(straight: Path, resumed: Path) -> None:
    a = torch.load(straight / "final_model.pt", weights_only=True)
    b = torch.load(resumed / "final_model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = (json.loads((d / "result.json").read_text()) for d in (straight, resumed))
    for key in ("final_train_loss", "final_test_loss", "final_test_acc", "steps", "samples_seen", "test_history",
                "technique_metrics"):
        assert ra[key] == rb[key], key
    events = EventAccumulator(str(resumed))
    events.Reload()
    assert [e.step for e in events.Scalars("test/acc")] == [STEPS_PER_EPOCH * (e + 1) for e in range(EPOCHS)]
    train_steps = [e.step for e in events.Scalars("train/loss")]
    assert train_steps == sorted(set(train_steps))  # no step logged twice


def resume(args: list[str], capfd) -> str:
    """`lbt train ARGS trainer.resume=auto` in this process (the stops are the command's own processes): stdout."""
    code, out, err = run_main_io(["train", *args, "trainer.resume=auto"], capfd)
    assert code == 0, err
    return out


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The run trained without interruption (in this process; its workers are real processes)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    run(make_spec(*compose_config(RUN + REAL)), run_dir)
    return run_dir


@pytest.mark.slow
def test_resume_after_sigkill_following_a_checkpoint(straight, tmp_path, capfd):
    args = [*RUN, *REAL, f"hydra.run.dir={tmp_path / 'run'}"]
    job = start(args, tmp_path)
    latest = tmp_path / "run" / "checkpoint" / "latest.json"
    deadline = time.monotonic() + 240
    while not latest.exists():
        assert job.poll() is None and time.monotonic() < deadline, job.stderr.read()
        time.sleep(0.05)
    os.killpg(job.pid, signal.SIGKILL)  # the launcher and all its workers, at once
    job.wait(timeout=30)
    assert not (tmp_path / "run" / "result.json").exists()
    assert "resumed from step" in resume(args, capfd)
    assert_same_run(straight, tmp_path / "run")


@pytest.mark.slow
def test_resume_after_sigterm_in_the_middle_of_an_epoch(straight, tmp_path, capfd):
    args = [*RUN, *REAL, "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path / 'run'}"]
    job = start(args, tmp_path)
    wait_for_line(job, "epoch 1/")
    os.kill(job.pid, signal.SIGTERM)  # what SLURM sends on preemption
    out, err = job.communicate(timeout=60)
    assert job.returncode == 143, err  # told to stop: 128 + SIGTERM, so a scheduler requeues it
    assert "stopped at step" in out and "trainer.resume=auto" in out
    meta = json.loads((tmp_path / "run" / "checkpoint" / "latest.json").read_text())
    assert meta["step"] % STEPS_PER_EPOCH != 0  # really mid-epoch
    assert f"resumed from step {meta['step']}" in resume(args, capfd)
    assert_same_run(straight, tmp_path / "run")


@pytest.mark.slow
def test_ctrl_c_checkpoints_and_stops_cleanly(straight, tmp_path, capfd):
    """Ctrl-C in a terminal sends SIGINT to the whole process group: launcher and workers."""
    args = [*RUN, *REAL, "trainer.checkpoint_every=0", f"hydra.run.dir={tmp_path / 'run'}"]
    job = start(args, tmp_path)
    wait_for_line(job, "epoch 1/")
    os.killpg(job.pid, signal.SIGINT)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 130, err  # 128 + SIGINT
    assert "stopped at step" in out and "Traceback" not in err and "KeyboardInterrupt" not in err
    assert not (tmp_path / "run" / "result.json").exists()
    meta = json.loads((tmp_path / "run" / "checkpoint" / "latest.json").read_text())
    assert EPOCHS * STEPS_PER_EPOCH > meta["step"] > STEPS_PER_EPOCH
    assert f"resumed from step {meta['step']}" in resume(args, capfd)
    assert_same_run(straight, tmp_path / "run")
