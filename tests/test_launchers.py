"""torchrun runs the same entry point unchanged, one node or two, and gives the
same result as lbt's own local launcher; a dead worker ends the whole job."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
from conftest import FAST, final_params, relative_diff

from lbt.parallel.launcher import _cause, launch_local
from lbt.stop import forget_stop

RUN = FAST + ["model=mlp", "data.num_train=640", "trainer.epochs=2", "trainer.global_batch=64"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(args: list[str], cwd: Path, **kwargs) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--local-addr=127.0.0.1", *args]
    return subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kwargs)


def read_result(run_dir: Path) -> dict:
    import json

    return json.loads((run_dir / "result.json").read_text())


@pytest.mark.slow
def test_torchrun_matches_local_launcher(tmp_path, capfd, monkeypatch):
    """torchrun starts `lbt train` unchanged; the local launcher's run is started in this process."""
    from test_cli_errors import run_main

    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", *RUN, "dist.world_size=2", "dist.procs=2", f"hydra.run.dir={tmp_path / 'local'}"],
                         capfd)
    assert code == 0, err
    port = free_port()
    job = torchrun(
        ["--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
         "-m", "lbt", "train", *RUN, f"hydra.run.dir={tmp_path / 'torchrun'}"],
        tmp_path,
    )
    out, _ = job.communicate(timeout=180)
    assert job.returncode == 0, out
    a, b = read_result(tmp_path / "local"), read_result(tmp_path / "torchrun")
    assert b["world_size"] == 2 and b["procs"] == 2  # W defaults to torchrun's world size
    assert a["final_test_acc"] == b["final_test_acc"]
    assert relative_diff(final_params(tmp_path / "local"), final_params(tmp_path / "torchrun")) < 1e-6
    # only rank 0 wrote a run folder: no stray Hydra folders from rank 1
    assert not (tmp_path / "runs").exists() and not (tmp_path / "outputs").exists()


@pytest.mark.slow
def test_two_torchrun_nodes_on_localhost(tmp_path):
    port = free_port()
    common = ["--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
              "--rdzv-id=lbt-two-nodes"]
    run_dir = tmp_path / "two_nodes"
    nodes = [
        torchrun([*common, f"--node-rank={rank}", "-m", "lbt", "train", *RUN, "dist.world_size=4",
                  f"hydra.run.dir={run_dir}"], tmp_path)
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=180)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    result = read_result(run_dir)
    assert result["procs"] == 2 and result["world_size"] == 4 and result["global_batch"] == 64
    assert result["steps"] == 2 * (640 // 64)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


@pytest.mark.slow
def test_dead_worker_stops_the_job_and_names_its_rank(tmp_path):
    args = ["train", *FAST, "model=mlp", "data.num_train=4096", "trainer.epochs=10000",
            "dist.world_size=2", "dist.procs=2", f"hydra.run.dir={tmp_path / 'run'}"]
    job = subprocess.Popen([sys.executable, "-m", "lbt", *args], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    # wait until training is under way (rank 0 prints a line per epoch)
    line = ""
    while "epoch 1/" not in line:
        line = job.stdout.readline()
        assert line or job.poll() is None, job.stderr.read()
    workers = [p for p in _children(job.pid) if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]
    assert len(workers) == 2
    rank1 = sorted(workers, key=_start_time)[1]
    killed_at = time.monotonic()
    os.kill(rank1, signal.SIGKILL)
    _, err = job.communicate(timeout=60)
    assert time.monotonic() - killed_at < 30
    assert job.returncode != 0
    assert "rank 1" in err and "SIGKILL" in err
    assert "Traceback" not in err


def _say_the_word(rank: int, store_port: int) -> None:
    print(f"rank {rank}: {os.environ.get('LBT_TEST_WORD')}", flush=True)


@pytest.mark.slow
def test_workers_get_the_launchers_environment_and_output_as_they_are_at_each_launch(capfd, monkeypatch):
    """Each launch's workers see the launcher's environment and output as they are at that launch (a study's
    later job sets other variables; a test captures the output)."""
    for word in ("first", "second"):
        monkeypatch.setenv("LBT_TEST_WORD", word)
        launch_local(_say_the_word, (), 2)
        assert sorted(capfd.readouterr().out.splitlines()) == [f"rank 0: {word}", f"rank 1: {word}"]


def _wait_for_a_stop(rank: int, store_port: int, folder: str) -> None:
    from lbt.stop import stop_asked

    deadline = time.monotonic() + 60
    while stop_asked() is None:
        if time.monotonic() > deadline:
            sys.exit(1)
        time.sleep(0.05)
    (Path(folder) / f"told{rank}").touch()


def _launch_told(monkeypatch, folder: Path, tell: Callable[[list], None]) -> int | None:
    """launch_local of two workers that wait for a stop, with `tell(processes)` run as their start returns."""
    import lbt.parallel.launcher as launcher

    start = launcher._start

    def started_and_told(*args):
        processes = start(*args)
        tell(processes)
        return processes

    monkeypatch.setattr(launcher, "_start", started_and_told)
    began = time.monotonic()
    try:
        return launch_local(_wait_for_a_stop, (str(folder),), 2)
    finally:
        forget_stop()  # this process was told to stop: the next test's runs are not
        assert time.monotonic() - began < 30  # not the workers' 60 s wait


@pytest.mark.slow
def test_a_stop_while_the_workers_start_reaches_them(monkeypatch, tmp_path):
    """SIGTERM to the launcher before its workers run any code reaches each of them as a stop, not as a
    kill: the job returns the signal."""
    assert _launch_told(monkeypatch, tmp_path, lambda processes: os.kill(os.getpid(), signal.SIGTERM)) \
        == signal.SIGTERM
    assert sorted(p.name for p in tmp_path.iterdir()) == ["told0", "told1"]


@pytest.mark.slow
def test_a_stop_to_every_process_while_the_workers_import_does_not_kill_them(monkeypatch, tmp_path):
    """A scheduler's SIGTERM (or a terminal's Ctrl-C) to the launcher and to workers still importing torch:
    the workers live on and stop as told."""
    def everyone(processes):
        for p in processes:
            os.kill(p.pid, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    assert _launch_told(monkeypatch, tmp_path, everyone) == signal.SIGINT
    assert sorted(p.name for p in tmp_path.iterdir()) == ["told0", "told1"]


FIRST_LAUNCH = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from multiprocessing.context import SpawnProcess
from lbt.parallel.launcher import launch_local
from test_launchers import _wait_for_a_stop

start, started = SpawnProcess.start, []

def start_then_interrupted(self):
    start(self)  # this process's first spawn starts multiprocessing's resource tracker
    os.kill(self.pid, signal.SIGINT)  # the worker has not run a line of Python yet
    started.append(self)
    if len(started) == 2:
        os.kill(os.getpid(), signal.SIGINT)

SpawnProcess.start = start_then_interrupted
print("returned", int(launch_local(_wait_for_a_stop, ({folder!r},), 2)))
"""


@pytest.mark.slow
def test_a_ctrl_c_during_a_processs_first_launch_does_not_kill_its_workers(tmp_path):
    """A process's first spawn starts multiprocessing's resource tracker, which unblocks SIGINT and SIGTERM in
    the launcher: unless it starts first, the workers start without the block and die of a Ctrl-C in torch's import."""
    code = FIRST_LAUNCH.format(tests=str(Path(__file__).parent), folder=str(tmp_path))
    job = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LBT_ALLOW_OVERSUBSCRIBE": "1"})
    assert job.returncode == 0 and f"returned {int(signal.SIGINT)}" in job.stdout, job.stderr[-2000:]
    assert "KeyboardInterrupt" not in job.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["told0", "told1"]


@pytest.mark.parametrize("codes, failed, cause", [
    # rank 1 SIGKILLed; rank 0 aborted in gloo in the same instant and was seen first
    ({0: -signal.SIGABRT, 1: -signal.SIGKILL}, [0, 1], 1),
    # rank 2 raised; rank 0 then aborted on the lost peer, rank 1 still running
    ({0: -signal.SIGABRT, 1: None, 2: 1}, [0], 2),
    # two ranks raised: the one seen first
    ({0: 1, 1: 1}, [1], 1),
    # only aborts: still name one
    ({0: -signal.SIGABRT, 1: -signal.SIGABRT}, [1, 0], 1),
])
def test_dead_worker_report_names_the_cause_not_the_peer_that_lost_it(codes, failed, cause):
    assert _cause(codes, failed) == cause
