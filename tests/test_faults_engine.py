"""Faults underneath a run (issue 32, items 3-7 and 9): each ends in a resume, a stop or one line, never a
traceback or a mislabelled result.

- a resume never trains less than was trained (3); result.json's `epochs` is what ran;
- more processes than cores or than the memory left are refused before any starts, unless insisted on (4);
- a worker's exception reaches the parent as one line naming its type, message and line, its traceback in
  train.log; a full disk or an out-of-memory in the first step is not retried (5);
- every damaged newest checkpoint or latest.json ends in a resume from the newest good one, or one line (6);
- a stop at any moment, the start included, is a stop: 143/130, never a restart (7);
- a resume refuses another dist.fuse_workers (9).

Tiny runs: an MLP on synthetic data, 4 steps an epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import FAST, compose_config, interrupted, lbt_cli, signal_after_line, train

import lbt.engine.checkpoint
from lbt.engine import make_spec
from lbt.errors import ConfigError
from lbt.parallel import launcher
from lbt.parallel.launcher import WorkerDied
from lbt.techniques import Technique

STEPS_PER_EPOCH = 4  # 256 samples / global batch 64
RUN = ["model=mlp", "model.hidden=16", "data.num_train=256", "data.num_test=64", "trainer.global_batch=64",
       "trainer.epochs=3", "trainer.log_every=2", "trainer.evals=0"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run of 3 epochs, finished: checkpoints at steps 4 and 8, result.json at 12."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(run_dir, RUN)
    return run_dir



def same_params(a: Path, b: Path) -> bool:
    sa, sb = (torch.load(d / "final_model.pt", weights_only=True) for d in (a, b))
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


# -- 3: a result says what was trained -----------------------------------------------------------------
def test_the_result_counts_the_epochs_that_ran(finished, tmp_path):
    assert json.loads((finished / "result.json").read_text())["epochs"] == 3
    cut = train(tmp_path / "cut", RUN + ["trainer.max_steps=3"])
    assert (cut["steps"], cut["samples_seen"], cut["epochs"]) == (3, 192, 0.75)


@pytest.mark.parametrize("finished_first", [False, True], ids=["checkpoint", "finished"])
def test_a_resume_with_a_smaller_budget_than_trained_is_refused(finished, tmp_path, finished_first):
    run_dir = tmp_path / "run"
    if finished_first:  # finished at step 12; its newest checkpoint is at 8; a budget of 4 or 8 would cut it
        shutil.copytree(finished, run_dir)
    else:
        run_dir = interrupted(finished, tmp_path)
    for budget in (["trainer.epochs=1"], ["trainer.max_steps=6"]):
        with pytest.raises(ConfigError, match=r"has trained (8|12) steps and this run's budget is (4|6) "):
            train(run_dir, RUN[:-3] + budget + ["trainer.log_every=2", "trainer.evals=0", "trainer.resume=auto"])
    if finished_first:
        assert json.loads((run_dir / "result.json").read_text())["steps"] == 12  # kept as it was


# -- 4: resources checked before spawning --------------------------------------------------------------
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


@pytest.mark.slow
def test_the_command_refuses_too_many_processes_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(launcher.OVERSUBSCRIBE, "0")
    cores = len(os.sched_getaffinity(0))
    done = lbt_cli(["train", *FAST, "model=mlp", f"dist.procs={cores * 4}", f"hydra.run.dir={tmp_path / 'run'}"],
                   tmp_path, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"lbt: error: dist.procs={cores * 4} but this machine gives lbt {cores} cores")
    assert not (tmp_path / "run").exists()


# -- 5: every worker failure says why ------------------------------------------------------------------
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
    assert re.search(r"worker rank 1 failed: MemoryError: injected at step 0 \(tests/test_faults_engine.py:\d+\)",
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


def checkpointed(finished: Path, tmp_path: Path) -> Path:
    """The finished run with only its first checkpoint (step 4): the one the disk-full run must keep."""
    run_dir = interrupted(finished, tmp_path)
    shutil.rmtree(run_dir / "checkpoint" / "step_8")
    (run_dir / "checkpoint" / "latest.json").write_text(json.dumps(
        {"step": 4, "folder": "step_4", "procs": 1, "format": lbt.engine.checkpoint.FORMAT}))
    return run_dir


def file_size_limit(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.slow
def test_a_full_disk_is_one_line_not_retried_and_the_previous_checkpoint_still_loads(finished, tmp_path, capfd):
    """RLIMIT_FSIZE: a file past 16 KiB fails with EFBIG ("File too large"), as a full disk fails a write;
    a checkpoint is about 28 KiB, the logs and Hydra's files less."""
    run_dir = checkpointed(finished, tmp_path)
    args = ["train", *FAST, *RUN, "dist.max_restarts=2", "trainer.resume=auto", f"hydra.run.dir={run_dir}"]
    full = lbt_cli(args, tmp_path, timeout=120, preexec_fn=file_size_limit(16 << 10))
    errors = [line for line in full.stderr.splitlines() if line.startswith("lbt: error:")]
    assert full.returncode == 2 and len(errors) == 1 and "File too large" in errors[0], full.stderr
    assert "the checkpoint at step 4 is still the latest" in errors[0] and "Traceback" not in full.stderr
    assert "restarting" not in full.stderr
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["latest.json", "step_4"]  # no partial
    capfd.readouterr()
    train(run_dir, [*RUN, "dist.max_restarts=2", "trainer.resume=auto"])  # the disk has room again
    assert "resumed from step 4" in capfd.readouterr().out
    assert same_params(finished, run_dir)


# -- 6: checkpoint fallback is total -------------------------------------------------------------------
def damage(run_dir: Path, step: int) -> None:
    (run_dir / "checkpoint" / f"step_{step}" / "rank0.pt").write_bytes(b"garbage")


def test_a_step_damaged_a_second_time_is_moved_aside_again(finished, tmp_path, capfd):
    run_dir = interrupted(finished, tmp_path)
    (run_dir / "checkpoint" / "step_8.damaged").mkdir()
    (run_dir / "checkpoint" / "step_8.damaged" / "rank0.pt").write_bytes(b"the first damage")
    damage(run_dir, 8)
    train(run_dir, RUN + ["trainer.resume=auto"])
    assert ("lbt: note: resuming from checkpoint step_4: step_8 is damaged (rank0.pt does not match its "
            "checksum), moved aside to step_8.damaged.2") in capfd.readouterr().err
    assert same_params(finished, run_dir)


def test_a_damaged_newest_checkpoint_that_cannot_be_moved_is_skipped(finished, tmp_path, capfd, monkeypatch):
    """A read-only folder (as root, chmod does not stop us: the rename is refused by hand)."""
    run_dir = interrupted(finished, tmp_path)
    damage(run_dir, 8)
    replace = os.replace

    def read_only(src, dst):
        if str(dst).endswith(".damaged"):
            raise OSError(30, "Read-only file system", str(src))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", read_only)
    train(run_dir, RUN + ["trainer.resume=auto"])
    assert "resuming from checkpoint step_4: step_8 is damaged (rank0.pt does not match its checksum), left in " \
           "place (Read-only file system)" in capfd.readouterr().err
    assert same_params(finished, run_dir)


def test_a_damaged_latest_json_is_said_and_the_newest_checkpoint_used(finished, tmp_path, capfd):
    run_dir = interrupted(finished, tmp_path)
    (run_dir / "checkpoint" / "latest.json").write_text('{"step": 8, "fol')
    train(run_dir, RUN + ["trainer.resume=auto"])
    out = capfd.readouterr()
    assert "resuming from checkpoint step_8: latest.json is damaged" in out.err and "resumed from step 8" in out.out
    assert same_params(finished, run_dir)


def test_a_checkpoint_file_that_passes_its_checksum_but_cannot_load_is_one_line(finished, tmp_path):
    run_dir = interrupted(finished, tmp_path)
    folder = run_dir / "checkpoint" / "step_8"
    (folder / "rank0.pt").write_bytes(b"not a torch file")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["rank0.pt"] = hashlib.sha256(b"not a torch file").hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"checkpoint file .*step_8/rank0.pt cannot be loaded"):
        train(run_dir, RUN + ["trainer.resume=auto"])


# -- 7: a stop at any moment ---------------------------------------------------------------------------
@pytest.mark.slow
def test_sigterm_in_the_first_second_is_a_stop_and_a_rerun_finishes(tmp_path):
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
    rerun = subprocess.run(args[:1] + args[3:], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0 and "done:" in rerun.stdout, rerun.stderr


@pytest.mark.slow
def test_sigterm_while_the_workers_start_is_a_stop_never_a_restart(tmp_path):
    args = ["train", *FAST, *RUN, "trainer.epochs=8", "dist.world_size=2", "dist.procs=2", "dist.max_restarts=2",
            "trainer.progress=false", f"hydra.run.dir={tmp_path / 'run'}"]
    # the workers' start line: the first step has not run
    code, _, err = signal_after_line(args, tmp_path, re.escape("world_size=2 (procs=2"), signal.SIGTERM, timeout=60)
    assert code == 143 and "restarting" not in err and "failed" not in err, err
    said = re.search(r"lbt: stopped \(SIGTERM\); rerun the same command( with trainer.resume=auto)? to continue",
                     err)
    assert said and "Traceback" not in err, err
    again = args + (["trainer.resume=auto"] if said.group(1) else [])
    rerun = lbt_cli(again, tmp_path)
    assert rerun.returncode == 0 and "done:" in rerun.stdout, rerun.stderr


# -- 9: dist.fuse_workers is part of the run -----------------------------------------------------------
def test_a_resume_refuses_another_fuse_workers(finished, tmp_path):
    run_dir = interrupted(finished, tmp_path)
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
