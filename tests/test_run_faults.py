"""Faults underneath a run: each ends in a resume, a stop or one line, never a
traceback or a mislabelled result.

- a resume never trains less than was trained; result.json's `epochs` is what ran;
- more processes than cores or than the memory left are refused before any starts, unless insisted on;
- a worker's exception reaches the parent as one line naming its type, message and line, its traceback in
  train.log; a full disk or an out-of-memory in the first step is not retried;
- a stop at any moment, the start included, is a stop: 143/130, never a restart;
- a resume refuses another dist.fuse_workers.

Tiny runs: an MLP on synthetic data, 4 steps an epoch. Damaged checkpoints and a full disk: tests/test_checkpoints.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist
from conftest import CHECKPOINTED_RUN, FAST, compose_config, interrupted, signal_after_line, train
from test_cli_errors import run_main_io

from lbt.engine import make_spec
from lbt.errors import ConfigError
from lbt.parallel import launcher
from lbt.parallel.launcher import WorkerDied
from lbt.techniques import Technique

RUN = CHECKPOINTED_RUN  # 4 epochs of 4 steps; the run trained straight through is `finished_run`


# -- a result says what was trained -----------------------------------------------------------------
def test_the_result_counts_the_epochs_that_ran(finished_run, tmp_path):
    assert json.loads((finished_run / "result.json").read_text())["epochs"] == 4
    cut = train(tmp_path / "cut", RUN + ["trainer.max_steps=3"])
    assert (cut["steps"], cut["samples_seen"], cut["epochs"]) == (3, 192, 0.75)


@pytest.mark.parametrize("finished_first", [False, True], ids=["checkpoint", "finished"])
def test_a_resume_with_a_smaller_budget_than_trained_is_refused(finished_run, tmp_path, finished_first):
    run_dir = tmp_path / "run"
    if finished_first:  # finished at step 16; its newest checkpoint is at 12; a budget of 4 or 6 would cut it
        shutil.copytree(finished_run, run_dir)
    else:
        run_dir = interrupted(finished_run, tmp_path)
    for budget in (["trainer.epochs=1"], ["trainer.max_steps=6"]):
        with pytest.raises(ConfigError, match=r"has trained (12|16) steps and this run's budget is (4|6) "):
            train(run_dir, RUN[:-3] + budget + ["trainer.log_every=2", "trainer.evals=0", "trainer.resume=auto"])
    if finished_first:
        assert json.loads((run_dir / "result.json").read_text())["steps"] == 16  # kept as it was


# -- resources checked before spawning --------------------------------------------------------------
def test_more_processes_than_cores_or_memory_are_refused_unless_insisted(monkeypatch):
    monkeypatch.delenv(launcher.OVERSUBSCRIBE, raising=False)
    cores = len(os.sched_getaffinity(0))
    many = ["model=mlp", f"dist.procs={cores + 1}", f"dist.world_size={cores + 1}"]
    with pytest.raises(ConfigError, match=rf"dist.procs={cores + 1} but this machine gives lbt {cores} cores"):
        make_spec(*compose_config(FAST + many))
    assert make_spec(*compose_config(FAST + many + ["dist.allow_oversubscribe=true"])).procs == cores + 1
    monkeypatch.setattr(launcher, "memory_left", lambda: 3 * launcher.worker_memory() // 2)
    with pytest.raises(ConfigError, match=r"dist.procs=2 needs about .* GiB \(.* MiB per worker, measured .* room "
                                          r"for 1 workers"):
        make_spec(*compose_config(FAST + ["model=mlp", "dist.procs=2"]))


def test_the_command_refuses_too_many_processes_in_one_line(tmp_path, capfd, monkeypatch):
    """`lbt train` in this process: refused before any process starts."""
    from test_cli_errors import run_main

    monkeypatch.setenv(launcher.OVERSUBSCRIBE, "0")
    monkeypatch.chdir(tmp_path)
    cores = len(os.sched_getaffinity(0))
    code, err = run_main(["train", *FAST, "model=mlp", f"dist.procs={cores * 4}", f"hydra.run.dir={tmp_path / 'run'}"],
                         capfd)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"lbt: error: dist.procs={cores * 4} but this machine gives lbt {cores} cores")
    assert not (tmp_path / "run").exists()


# -- every worker failure says why ------------------------------------------------------------------
class RaiseAt(Technique):
    """Test-only: rank `rank` raises `error` during step `step` (counted from 0)."""

    name = "raise_at"

    def __init__(self, step: int, rank: int, error: str):
        self.step, self.rank, self.error = step, rank, error

    def after_backward(self, model, progress) -> None:
        if progress.step == self.step and (not dist.is_initialized() or dist.get_rank() == self.rank):
            raise {"memory": MemoryError, "value": ValueError}[self.error](f"injected at step {self.step}")


def raise_at(step: int, rank: int, error: str) -> list[str]:
    return [f"+technique.raise_at._target_={__name__}.RaiseAt", f"+technique.raise_at.step={step}",
            f"+technique.raise_at.rank={rank}", f"+technique.raise_at.error={error}"]


@pytest.mark.slow
def test_a_worker_exception_is_one_line_with_its_place_and_out_of_memory_at_the_start_is_not_retried(
        tmp_path, capfd):
    run_dir = tmp_path / "run"
    with pytest.raises(WorkerDied) as died:
        train(run_dir, RUN + ["dist.world_size=2", "dist.procs=2", "dist.max_restarts=2", *raise_at(0, 1, "memory")])
    line = str(died.value)
    assert re.search(r"worker rank 1 failed: MemoryError: injected at step 0 \(tests/test_run_faults.py:\d+\)",
                     line), line
    assert "\n" not in line and not died.value.restartable
    err = capfd.readouterr().err
    assert "restarting" not in err and "Traceback" not in err, err
    log = (run_dir / "train.log").read_text()
    assert "rank 1 failed:\nTraceback" in log and "MemoryError: injected at step 0" in log


class RefuseInEveryRank(Technique):
    """Test-only: every rank refuses the run (a ConfigError) in its first step, rank 0 a second after the others,
    as when each rank checks its own device (comm_compression's PowerSGD check)."""

    name = "refuse"

    def after_backward(self, model, progress) -> None:
        if dist.get_rank() == 0:
            time.sleep(1.0)
        raise ConfigError("refused by every rank")


@pytest.mark.slow
def test_a_config_error_in_every_worker_is_rank_0s_one_line_when_another_rank_reports_first(tmp_path, capfd):
    with pytest.raises(WorkerDied) as died:
        train(tmp_path / "run", RUN + ["dist.world_size=2", "dist.procs=2",
                                       f"+technique.refuse._target_={__name__}.RefuseInEveryRank"])
    assert str(died.value) == "" and not died.value.restartable  # `lbt train` adds no line and exits 2
    err = capfd.readouterr().err
    assert [line for line in err.splitlines() if line.strip()] == ["lbt: error: refused by every rank"], err


# -- checkpoint fallback is total -------------------------------------------------------------------
# -- a stop at any moment ---------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_in_the_first_second_is_a_stop_and_a_rerun_finishes(tmp_path, capfd, monkeypatch):
    """While numpy, torch and Hydra import: a SIGTERM there once left a half-imported numpy and a traceback.

    Each signal is timed from the moment lbt's first module has imported (`-X importtime` says when on
    stderr): a signal before the interpreter reaches lbt's first line kills it by the default action, which
    no program can change, and on a loaded machine interpreter start-up alone took longer than 0.15 s."""
    args = [sys.executable, "-X", "importtime", "-m", "lbt", "train", *FAST, *RUN,
            f"hydra.run.dir={tmp_path / 'run'}"]
    for delay in (0.05, 0.2, 0.4, 0.7):
        job = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert job.stderr is not None
        for line in job.stderr:  # lbt.apps.errors imported: the stop handler is installed next
            if line.split("|")[-1].strip() == "lbt.apps.errors":
                break
        time.sleep(delay)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
        err = "\n".join(line for line in err.splitlines() if not line.startswith("import time:"))
        said = re.fullmatch(r"lbt: stopped \(SIGTERM\); rerun the same command( with trainer.resume=auto)? to continue",
                            err.strip())
        assert job.returncode == 143 and said, (delay, err)
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main_io(args[5:], capfd)  # `lbt train ...` again, in this process
    assert code == 0 and "done:" in out, err


@pytest.mark.slow
def test_sigterm_while_the_workers_start_is_a_stop_never_a_restart(tmp_path, capfd, monkeypatch):
    args = ["train", *FAST, *RUN, "trainer.epochs=8", "dist.world_size=2", "dist.procs=2", "dist.max_restarts=2",
            "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}"]
    # the workers' start line: the first step has not run
    code, _, err = signal_after_line(args, tmp_path, re.escape("world_size=2 (procs=2"), signal.SIGTERM, timeout=60)
    assert code == 143 and "restarting" not in err and "failed" not in err, err
    said = re.search(r"lbt: stopped \(SIGTERM\); rerun the same command( with trainer.resume=auto)? to continue",
                     err)
    assert said and "Traceback" not in err, err
    again = args + (["trainer.resume=auto"] if said.group(1) else [])
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main_io(again, capfd)  # in this process
    assert code == 0 and "done:" in out, err


# -- dist.fuse_workers is part of the run -----------------------------------------------------------
def test_a_resume_refuses_another_fuse_workers(finished_run, tmp_path):
    run_dir = interrupted(finished_run, tmp_path)
    with pytest.raises(ConfigError, match=r"belongs to another run: dist.fuse_workers \(\"auto\" -> false\)"):
        train(run_dir, RUN + ["trainer.resume=auto", "dist.fuse_workers=false"])


def test_threads_follow_omp_num_threads_where_set(monkeypatch):
    """trainer.threads=null: OMP_NUM_THREADS (torchrun sets 1 per process), else the cores shared by the processes."""
    from lbt.engine.worker import default_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads(2) == 3
    for unusable in ("0", "two", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert default_threads(2) == max(1, (os.cpu_count() or 1) // 2)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads(64) == 1


# -- a full disk, no memory ---------------------------------------------------------------------------
TINY_SWEEP = [*FAST, "model=mlp", "trainer.epochs=1", "trainer.per_worker_batch=32", "data.num_train=256",
              "dist.world_size=1,2"]


def test_a_sweep_whose_disk_is_full_ends_with_one_line_naming_the_file(tmp_path, capfd, monkeypatch):
    """A full disk during a study's jobs (the failed job's own result.json cannot be written either) is one line
    naming the file, not an `OSError: [Errno 28]` traceback; the same command continues later."""
    import errno
    import tempfile

    made = tempfile.mkstemp

    def full_for_results(*args, **kwargs):
        if kwargs.get("prefix") == "result.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return made(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", full_for_results)
    sweep = tmp_path / "sweep"
    code, _, err = run_main_io(["train", "-m", *TINY_SWEEP, f"hydra.sweep.dir={sweep}"], capfd)
    lines = err.strip().splitlines()
    assert code == 1 and "Traceback" not in err, err
    assert lines[-1] == (f"lbt: error: cannot write {sweep}/0/result.json: its disk is full (No space left on "
                         "device); free space there, then run the same command again to continue")


def test_hydras_own_write_to_a_full_disk_is_one_line_naming_the_sweep(tmp_path, capfd, monkeypatch):
    """Hydra's sweeper writing multirun.yaml to a full disk is lbt's one line, not Hydra's traceback and exit 1."""
    import errno

    from omegaconf import OmegaConf

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(OmegaConf, "save", full)
    sweep = tmp_path / "sweep"
    code, _, err = run_main_io(["train", "-m", *TINY_SWEEP, f"hydra.sweep.dir={sweep}"], capfd)
    assert code == 1 and err.strip().splitlines() == [
        f"lbt: error: cannot write {sweep}: its disk is full (No space left on device); free space there, then run "
        "the same command again to continue"], err


def test_cpu_out_of_memory_is_one_line(tmp_path, capfd):
    """The CPU allocator's failure is a plain RuntimeError, neither CUDA's OutOfMemoryError nor a MemoryError, and
    it is one line too. 160 TB of weights exceeds any address space, overcommit or not."""
    code, _, err = run_main_io(["train", *FAST, "model=mlp", "model.hidden=1000000000000", "trainer.epochs=1",
                                f"hydra.run.dir={tmp_path / 'run'}"], capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lbt: error: out of memory: RuntimeError"), err
    assert "the traceback is in train.log" in lines[0]
