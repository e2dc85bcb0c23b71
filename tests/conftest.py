"""Shared helpers: compose lbt's config as the CLI does (lbt.apps.compose) and run it in-process."""

from __future__ import annotations

import contextlib
import copy
import functools
import gc
import multiprocessing.process
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from lbt.apps.compose import compose
from lbt.engine import make_spec, run
from lbt.engine.build import build_data, build_model
from lbt.engine.trainer import Trainer

# Generated tests draw the same examples on every run, so a red suite is red for the
# code and can be rerun; `pytest --hypothesis-profile=explore` draws fresh ones. Neither times an example
# or a draw: on a loaded 2-core machine one can stall for seconds (a 2 s draw of a float failed once), and
# speed is measured by bench/, not asserted by tests.
UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("repeatable", derandomize=True, **UNTIMED)
settings.register_profile("explore", derandomize=False, **UNTIMED)
settings.load_profile("repeatable")

# Tiny runs on the 2-core CI machine: quiet, CPU.
FAST = ["data=synthetic", "trainer.progress=false", "trainer.device=cpu"]
# The suite runs dist.procs=2..4 on a 2-core machine on purpose (exactness of real vs simulated workers):
# lbt's check of processes against cores and memory is told to let them start (tests/test_run_faults.py
# checks the refusal with this unset). Spawned workers and `lbt` commands inherit it.
os.environ.setdefault("LBT_ALLOW_OVERSUBSCRIBE", "1")
# `make test` runs two test files at once (pytest-xdist): one intra-op thread per process, in this process and
# in every run and worker it starts, so two busy files do not oversubscribe the cores (a run of 2 threads
# beside another took 10x longer). The same count everywhere keeps in-process and command runs bitwise alike.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# -- the fast lane ----------------------------------------------------------------------------------
# `make test-fast` (-m "not slow") is every test that starts no process and trains no more than a few steps, its
# fixtures included, but the docs' commands (tests/test_readme_commands.py, marked slow for their minute). The
# rule is checked, not trusted: a test not marked slow that starts a process or whose runs take more steps fails,
# whether the work is in its body or in a fixture it uses (a module fixture that trains counts for each test that
# uses it, whichever test set it up). Steps are the training loop's (Trainer.fit): an optimizer's unit test on a
# toy problem trains no model.
FAST_LANE_STEPS = 32


class Work:
    """Training steps taken and processes started in this test process, as running totals."""

    steps = 0
    processes = 0


def _counting_steps(fit):
    def counted(trainer):
        before = trainer.state.step
        try:
            return fit(trainer)
        finally:
            Work.steps += trainer.state.step - before
    return counted


def _counting_processes(start):
    def counted(*args, **kwargs):
        Work.processes += 1
        return start(*args, **kwargs)
    return counted


Trainer.fit = _counting_steps(Trainer.fit)  # type: ignore[method-assign]
subprocess.Popen._execute_child = _counting_processes(subprocess.Popen._execute_child)  # type: ignore[method-assign]
multiprocessing.process.BaseProcess.start = _counting_processes(multiprocessing.process.BaseProcess.start)
os.fork = _counting_processes(os.fork)
_fixture_work: dict[object, tuple[int, int]] = {}  # FixtureDef -> (steps, processes) of its last setup


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = (Work.steps, Work.processes)
    try:
        return (yield)
    finally:
        _fixture_work[fixturedef] = (Work.steps - before[0], Work.processes - before[1])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = (Work.steps, Work.processes)
    result = yield
    if item.get_closest_marker("slow") is None:
        fixtures = [_fixture_work.get(defs[-1], (0, 0)) for defs in item._fixtureinfo.name2fixturedefs.values()]
        steps = Work.steps - before[0] + sum(s for s, _ in fixtures)
        processes = Work.processes - before[1] + sum(p for _, p in fixtures)
        if processes or steps > FAST_LANE_STEPS:
            pytest.fail(f"not marked slow, yet it (or a fixture it uses) trained {steps} steps (at most "
                        f"{FAST_LANE_STEPS} in the fast lane) and started {processes} processes (none): "
                        "mark it @pytest.mark.slow or make it smaller", pytrace=False)
    return result


def compose_config(overrides: list[str]) -> tuple[dict, str]:
    """The composed config (a plain dict) and the selected recipe's name, as `lbt train OVERRIDES` composes them.
    A copy of the first composition of the same overrides (and environment the configs read): composing takes
    Hydra a tenth of a second, and the suite composes the same few hundred runs again and again."""
    config, recipe = _composed(tuple(overrides), os.environ.get("LBT_DATA_DIR"), os.environ.get("LBT_CIFAR10_DIR"))
    return copy.deepcopy(config), recipe


@functools.cache
def _composed(overrides: tuple[str, ...], *environment: str | None) -> tuple[dict, str]:
    composed = compose(list(overrides), job_name="test")  # a ConfigError is raised again at each call: not cached
    return composed.config, composed.recipe


def train(run_dir: Path, overrides: list[str]) -> dict:
    """One run through `lbt.engine.run`, as `lbt train OVERRIDES` would do it; result.json's fields
    (or {"stopped": True} for a run a signal stopped)."""
    config, recipe = compose_config(FAST + overrides)
    result = run(make_spec(config, recipe), run_dir)
    return {"stopped": True} if result.stopped else result.to_json()


# A run of 4 epochs of 4 steps (a tiny MLP on synthetic data), trained once per test process and only read by the
# tests that take `finished_run`: checkpoints after epochs 2 and 3 (steps 8 and 12; step 4's was pruned, as two are
# kept), result.json and final_model.pt at step 16.
CHECKPOINTED_RUN = ["model=mlp", "model.hidden=16", "data.num_train=256", "data.num_test=64",
                    "trainer.global_batch=64", "trainer.epochs=4", "trainer.log_every=2", "trainer.evals=0"]


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory) -> Path:
    """CHECKPOINTED_RUN trained straight through (copy it before changing anything: other tests read it)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    train(run_dir, CHECKPOINTED_RUN)
    return run_dir


def train_on_processes(procs: int, jobs: list) -> None:
    """Train several runs on `procs` real processes started once: each rank runs the jobs one after another,
    each in a process group of its own (met through its own store) and in its own run folder, as the launcher's
    workers run one (lbt.engine.worker.train_process). A process start costs seconds (torch's import), a tiny
    run far less. A job is (run_dir, overrides), composed here as compose_config composes them, or
    ("copy", src, dst): rank 0 copies a run folder as if interrupted (no result), for a later job to resume."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from lbt.parallel.process_group import HOST

    specs = [job if job[0] == "copy" else (str(job[0]), make_spec(*compose_config(job[1]))) for job in jobs]
    # One store per job, served by this process on a port the OS chose, as lbt's launcher does: ports found
    # free and released up front were taken by other processes before their job ran (EADDRINUSE).
    stores = [dist.TCPStore(HOST, 0, procs + 1, is_master=True, wait_for_workers=False) for _ in jobs]
    mp.spawn(_train_jobs, args=([store.port for store in stores], specs), nprocs=procs)


def _train_jobs(rank: int, ports: list[int], jobs: list) -> None:
    from lbt.engine.worker import exit_worker, train_process

    for port, job in zip(ports, jobs):
        if job[0] == "copy":
            if rank == 0:  # the other ranks wait for it in the next job's process group
                shutil.copytree(job[1], job[2], ignore=shutil.ignore_patterns("result.json", "final_model.pt"))
            continue
        run_dir, spec = job
        train_process(rank, port, spec, run_dir, rank, spec.procs)
    exit_worker()  # as lbt's own workers end: the interpreter's teardown of gloo objects sometimes aborts


def interrupted(finished: Path, tmp_path: Path) -> Path:
    """A finished run's folder as if it was killed after its last checkpoint: its checkpoints, no result."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir, ignore=shutil.ignore_patterns("result.json", "final_model.pt"))
    return run_dir


def names_val(key: str) -> bool:
    """Whether a result field or TensorBoard tag is named after the val split (val/acc, final_val_acc, val_history)."""
    return re.search(r"(^|[_/])val([_/]|$)", key) is not None


def final_params(run_dir: Path) -> torch.Tensor:
    return flat_params(torch.load(Path(run_dir) / "final_model.pt", weights_only=True))


def initial_params(overrides: list[str]) -> torch.Tensor:
    """The parameters a run with these overrides starts from, built as lbt.engine.build builds them
    (seed, then the model for the data's input shape and classes; no technique changes the model)."""
    config, recipe = compose_config(FAST + overrides)
    spec = make_spec(config, recipe)
    data = build_data(spec.data)
    with torch.random.fork_rng():
        torch.manual_seed(spec.trainer.seed)
        model = build_model(spec.model, data.input_shape, data.num_classes)
    return flat_params(model.state_dict())


def flat_params(state: dict) -> torch.Tensor:
    """Every floating-point tensor of a state_dict, in key order, as one float64 vector."""
    return torch.cat([v.flatten().double() for k, v in sorted(state.items()) if v.is_floating_point()])


def relative_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / a.norm()).item()


def lbt_cli(args: list[str], cwd: Path, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    """Run the installed `lbt` command the way a user does."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", "lbt", *args], cwd=cwd, env=env, capture_output=True, text=True,
        timeout=timeout, **kwargs,
    )


@contextlib.contextmanager
def one_gloo_process() -> Iterator[None]:
    """A gloo process group of one in this process, for the block (whose objects should live in a function it
    calls). Everything that holds the group (a comm hook's state, a pending future, a device mesh) is collected
    before the group is destroyed: its last reference must not be dropped on one of gloo's own threads, which
    would then join itself ("Resource deadlock avoided") and abort the test process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()
        dist.destroy_process_group()
        gc.collect()


def signal_after_line(args: list[str], cwd: Path, pattern: str, sig: int,
                      timeout: float = 120) -> tuple[int, str, str]:
    """Start `lbt ARGS` as a user does, send it `sig` once a line of its stdout matches `pattern` (re.search),
    and wait for it: (its exit code, its stdout after that line, its stderr). Its stderr goes to a file, so a
    chatty command never blocks on a full pipe; a line that never comes fails the test within `timeout`."""
    with tempfile.TemporaryFile("w+") as stderr:
        job = subprocess.Popen([sys.executable, "-m", "lbt", *args], cwd=cwd, stdout=subprocess.PIPE,
                               stderr=stderr, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in job.stdout or []], daemon=True)
        reader.start()
        try:
            seen, deadline = [], time.monotonic() + timeout
            while not seen or not re.search(pattern, seen[-1]):
                try:
                    seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
                except queue.Empty:
                    stderr.seek(0)
                    raise AssertionError(f"{pattern!r} never printed; stdout: {''.join(seen)[-2000:]} "
                                         f"stderr: {stderr.read()[-2000:]}") from None
            job.send_signal(sig)
            job.wait(timeout=timeout)
        finally:
            if job.poll() is None:
                job.kill()
                job.wait()
        reader.join(timeout=timeout)
        stderr.seek(0)
        return job.returncode, "".join(lines.get() for _ in range(lines.qsize())), stderr.read()
