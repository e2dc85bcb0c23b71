"""A killed worker costs time, not results: with dist.max_restarts the
launcher starts the job again from its last checkpoint, and the run ends bitwise equal to one
never interrupted; result.json records the restart. Config errors are not retried."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import FAST, train

from lbt.errors import ConfigError
from lbt.techniques import Technique

STEPS_PER_EPOCH = 4  # 256 samples / global batch 64
RUN = ["model=mlp", "model.hidden=16", "data.num_train=256", "data.num_test=64", "trainer.global_batch=64",
       "trainer.epochs=3", "trainer.log_every=2", "trainer.evals=0", "dist.world_size=2", "dist.procs=2"]
KILL_AT = 6  # during step 7: the middle of epoch 2, after epoch 1's checkpoint (step 4)


class SigkillAt(Technique):
    """Test-only: rank `rank` SIGKILLs itself during step `step` (counted from 0); with a `marker`
    file, once (a restart passes the same step again and must live), else at every attempt."""

    name = "sigkill"

    def __init__(self, step: int, rank: int, marker: str | None = None):
        self.step, self.rank, self.marker = step, rank, Path(marker) if marker else None

    def after_backward(self, model, progress) -> None:
        if progress.step != self.step or dist.get_rank() != self.rank:
            return
        if self.marker is not None:
            if self.marker.exists():
                return
            self.marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def sigkill_at(step: int, rank: int, marker: Path | None = None) -> list[str]:
    # Importable by name in the spawned workers: they inherit the test process's sys.path.
    return [f"+technique.sigkill._target_={__name__}.SigkillAt", f"+technique.sigkill.step={step}",
            f"+technique.sigkill.rank={rank}", f"+technique.sigkill.marker={marker or 'null'}"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory) -> Path:
    """RUN trained without interruption (the run each restarted one must equal)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    train(run_dir, RUN)
    return run_dir


@pytest.mark.slow
def test_a_sigkilled_worker_is_restarted_and_the_run_equals_an_uninterrupted_one(straight_run, tmp_path, capfd):
    straight = json.loads((straight_run / "result.json").read_text())
    restarted = train(tmp_path / "run", RUN + ["dist.max_restarts=1", *sigkill_at(KILL_AT, 1, tmp_path / "killed")])
    err = capfd.readouterr().err
    assert (tmp_path / "killed").exists()  # the worker really died
    assert "worker rank 1 failed (killed by signal SIGKILL)" in err and "restarting (1 of 1)" in err
    assert restarted["restarts"] == [{"rank": 1, "how": "killed by signal SIGKILL", "step": KILL_AT,
                                      "resumed_from_step": STEPS_PER_EPOCH}]
    assert restarted["steps"] == straight["steps"] == 3 * STEPS_PER_EPOCH
    a = torch.load(straight_run / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "run" / "final_model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("final_train_loss", "final_test_loss", "final_test_acc", "test_history"):
        assert restarted[key] == straight[key], key


@pytest.mark.slow
def test_restarts_run_out(tmp_path, capfd):
    """A worker that dies at every attempt ends the job after max_restarts restarts, naming it."""
    from lbt.parallel.launcher import WorkerDied

    with pytest.raises(WorkerDied, match="worker rank 0 failed"):
        train(tmp_path / "run", RUN + ["dist.max_restarts=1", *sigkill_at(1, 0)])
    assert capfd.readouterr().err.count("restarting (") == 1


@pytest.mark.slow
def test_a_config_error_in_a_worker_is_not_retried(tmp_path, capfd):
    (tmp_path / "run" / "checkpoint" / "step_4").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "step_4" / "manifest.json").write_text("{}")
    # A fresh start over a checkpoint: the workers refuse it as a config error, once.
    from lbt.parallel.launcher import WorkerDied

    with pytest.raises((WorkerDied, ConfigError)):
        train(tmp_path / "run", RUN + ["dist.max_restarts=2"])
    err = capfd.readouterr().err
    assert "already holds a checkpoint" in err and "restarting" not in err


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_by_itself(straight_run, tmp_path):
    """Under torchrun --max-restarts the agent restarts the workers; lbt sees TORCHELASTIC_RESTART_COUNT
    and continues from the run folder's checkpoint."""
    straight = json.loads((straight_run / "result.json").read_text())
    tests_dir = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests_dir, os.environ.get("PYTHONPATH")]))}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    run_dir = tmp_path / "run"
    job = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--local-addr=127.0.0.1", "--nnodes=1",
         "--nproc-per-node=2", "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "-m", "lbt", "train", *FAST, *[o for o in RUN if not o.startswith("dist.procs")],
         *sigkill_at(KILL_AT, 1, tmp_path / "killed"), f"hydra.run.dir={run_dir}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stdout + job.stderr
    assert (tmp_path / "killed").exists()
    result = json.loads((run_dir / "result.json").read_text())
    assert result["restarts"] == [{"by": "torchrun --max-restarts", "restarts": 1}]
    assert f"resumed from step {STEPS_PER_EPOCH} " in job.stdout
    assert result["steps"] == straight["steps"]
    a = torch.load(straight_run / "final_model.pt", weights_only=True)
    b = torch.load(run_dir / "final_model.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
