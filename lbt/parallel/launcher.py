"""lbt's local launcher: start a job's processes, watch them, and name the one that brought the job down.

Processes are started by `torch.multiprocessing` (spawn) and meet through a TCPStore the launcher
owns on 127.0.0.1, on a port the OS picks. Restarts and the run itself are the engine's
(lbt/engine/worker.py); this module starts, watches and stops processes, checks the machine has
room for them (`check_resources`), and carries a worker's failure to the parent (`report_failure`).

A failed worker writes why into a file of the launcher's (`report_failure`: the exception's type,
message and the line of lbt or user code that raised it); the parent reads the first such report
and names it in WorkerDied. A stop (SIGTERM/SIGINT to the launcher) reaches the workers through the
job's stop file and is never a failure: `launch_local` returns the signal, whatever the workers' exit codes.
"""

from __future__ import annotations

import json
import os
import signal
import sysconfig
import tempfile
import time
import traceback
from multiprocessing import resource_tracker
from multiprocessing.connection import wait as wait_for_sentinels
from pathlib import Path
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from lbt.errors import LASTING_ERRNOS, ConfigError, os_error_of
from lbt.parallel.process_group import HOST
from lbt.paths import atomic_write
from lbt.stop import STOP_SIGNALS, ask_stop, handling, job_stop_file, note_stop

ERRORS = "LBT_WORKER_ERRORS"  # the folder a spawned worker reports its failure into (set by launch_local)
# Set to 1 (the test suite does), the core and memory check passes, as dist.allow_oversubscribe=true does.
OVERSUBSCRIBE = "LBT_ALLOW_OVERSUBSCRIBE"


class WorkerDied(RuntimeError):
    """A worker process of a locally launched job exited abnormally.

    `rank` and `how` name the worker that brought the job down; rank None: a
    config error the worker already printed (never worth a restart). `retry`
    False: an error a restart would meet again (a full disk, a config error).
    """

    def __init__(self, message: str, rank: int | None = None, how: str | None = None, retry: bool = True):
        super().__init__(message)
        self.rank, self.how, self.retry = rank, how, retry

    @property
    def restartable(self) -> bool:
        return self.rank is not None and self.retry


def step_board(procs: int):
    """One shared integer per process, each worker's last finished step: read after a worker dies
    (a SIGKILLed process can say nothing), so a restart can record where it happened."""
    return mp.get_context("spawn").RawArray("q", procs)


# -- resources ------------------------------------------------------------------------------------
def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity: a cgroup or taskset may give fewer than the machine)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def memory_left() -> int | None:
    """Bytes of memory a new process can still get: MemAvailable, or less where a cgroup limits us; None if unknown."""
    left = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                left = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            left = min(left if left is not None else 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    return left


def worker_memory() -> int | None:
    """A worker's memory, measured as this process's resident set: a worker imports what this process
    did (torch, lbt) and builds the model and data again, so it needs at least as much."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def check_resources(procs: int, allow: bool = False) -> None:
    """Refuse, in one line with both numbers, more processes than cores or than the memory left holds."""
    if procs <= 1 or allow or os.environ.get(OVERSUBSCRIBE) == "1":
        return
    insist = "or dist.allow_oversubscribe=true to start them anyway"
    cores = usable_cores()
    if procs > cores:
        raise ConfigError(f"dist.procs={procs} but this machine gives lbt {cores} cores (its CPU affinity): use "
                          f"dist.procs={cores} or fewer (dist.world_size simulates the rest exactly), {insist}")
    need, left = worker_memory(), memory_left()
    if need and left is not None and procs * need > left:
        raise ConfigError(f"dist.procs={procs} needs about {procs * need / 2**30:.1f} GiB ({need / 2**20:,.0f} MiB "
                          f"per worker, measured as this process's resident memory) but {left / 2**30:.1f} GiB is "
                          f"left, room for {left // need} workers: use fewer, {insist}")


# -- a worker's failure ---------------------------------------------------------------------------
def lasting(error: BaseException) -> bool:
    """Whether a restart would meet this error again (a full disk, permissions, a config error)."""
    found = os_error_of(error)
    return isinstance(error, ConfigError) or (found is not None and found.errno in LASTING_ERRNOS)


def where(error: BaseException) -> str:
    """`path:line` of the innermost frame in lbt or user code (not the standard library's, torch's or another
    installed package's) of an exception's traceback."""
    skip = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if not f.filename.startswith(skip) and not f.filename.startswith("<")] or frames
    if not own:
        return "?"
    path = Path(own[-1].filename)
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if path.is_relative_to(root):
            path = path.relative_to(root)
            break
    return f"{path}:{own[-1].lineno}"


def describe(error: BaseException) -> str:
    """One line: the exception's type and message (a full disk as its OSError), and where it was raised."""
    found = os_error_of(error)
    shown = found if found is not None and not isinstance(error, ConfigError) else error
    text = " ".join(str(shown).split()) or type(shown).__name__
    return f"{type(shown).__name__}: {text[:400]} ({where(error)})"


def report_failure(rank: int, message: str, retry: bool, lost_peers: bool = False) -> None:
    """In a spawned worker: tell the launcher why this rank fails (no-op in other processes)."""
    folder = os.environ.get(ERRORS)
    if not folder:
        return
    report = {"message": message, "retry": retry, "lost_peers": lost_peers, "time": time.time()}
    try:
        atomic_write(Path(folder) / f"rank{rank}.json", lambda f: f.write(json.dumps(report).encode()))
    except OSError:
        pass  # the parent still names the rank and its exit code


def _reports(folder: str) -> dict[int, dict]:
    reports = {}
    for path in Path(folder).glob("rank*.json"):
        try:
            reports[int(path.stem.removeprefix("rank"))] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return reports


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


# -- starting and watching ------------------------------------------------------------------------
def _entry(rank: int, fn: Callable, *args) -> None:
    """A spawned worker's first code. It started with SIGTERM/SIGINT blocked (`_start`), so a stop that came
    while it imported torch waited, and did not kill it; from here a signal asks the stop (`ask_stop`: this
    process's, and the job's stop file) until the run installs its own handlers."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, note_stop)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    fn(rank, *args)


def launch_local(fn: Callable, args: tuple, procs: int) -> int | None:
    """Start `procs` processes running fn(rank, store_port, *args) and watch them.

    The parent owns the rendezvous store (port chosen by the OS, so no port can
    be "in use"). If any process fails, the rest are stopped within seconds and
    WorkerDied names the rank that caused it and why (see `_cause`). A SIGTERM
    or SIGINT to the parent is a stop for the whole job: written into the job's
    stop file (lbt/stop.py), which the workers poll, so it reaches a worker
    that is still starting too. The job's end is then the signal, never a failure.
    """
    store = dist.TCPStore(HOST, 0, procs + 1, is_master=True, wait_for_workers=False)
    if mp.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # A job of a sweep run by Hydra's joblib launcher (loky workers) carries loky's start method, which
        # the spawned workers would try to restore and cannot ("cannot find context for 'loky'").
        mp.set_start_method("spawn", force=True)
    stopped: list[int] = []
    processes: list = []
    with tempfile.TemporaryDirectory(prefix="lbt-workers-") as errors, job_stop_file(Path(errors) / "stop"):
        def forward(signum, frame):
            stopped.append(signum)
            if not ask_stop(signum):  # no stop file to write (a full disk): the workers that can take it
                for p in processes:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGTERM)

        with handling(forward):
            processes += _start(fn, (store.port, *args), procs, errors)
            failed = _watch(processes)
        try:
            if failed:
                _stop_all(processes, failed, procs, errors)
        except WorkerDied:
            if not stopped:
                raise
    return stopped[0] if stopped else None


def _start(fn: Callable, args: tuple, procs: int, errors: str) -> list:
    """The processes, with the folder for their failure reports in their environment, spawned with the stop
    signals blocked: they inherit the mask of the thread that spawns them (only the launcher's thread is
    blocked: a stop that comes meanwhile reaches the launcher's handler through another of its threads,
    which is why the signals are blocked, not ignored: an ignored signal is dropped, whichever thread)."""
    # multiprocessing's resource tracker, started by a process's first spawn, unblocks SIGINT and SIGTERM
    # once it runs: started here, before the block, it leaves the block in place for the workers.
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    os.environ[ERRORS] = errors
    try:
        context = mp.start_processes(_entry, args=(fn, *args), nprocs=procs, join=False, start_method="spawn")
        return context.processes
    finally:
        del os.environ[ERRORS]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _watch(processes: list) -> list[int]:
    """Wait until all processes ended well, or one failed; return the failed ranks."""
    pending = {p.sentinel: rank for rank, p in enumerate(processes)}
    failed: list[int] = []
    while pending and not failed:
        for sentinel in wait_for_sentinels(list(pending)):
            rank = pending.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0:
                failed.append(rank)
    return failed


def _stop_all(processes: list, failed: list[int], procs: int, errors: str) -> None:
    # Give the peers a moment to notice on their own, so the report can tell the
    # rank that died from the ranks that merely lost their peer.
    deadline = time.monotonic() + 3.0
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = {rank: p.exitcode for rank, p in enumerate(processes)}
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
    reports = _reports(errors)
    cause = _cause(codes, failed, reports)
    report = reports.get(cause, {})
    if codes[cause] == 2 and codes.get(0) == 2:
        # A config error inside the workers: rank 0 already printed its one line, also when another rank,
        # refusing the same thing, reported first.
        raise WorkerDied("", retry=False)
    how = _exit_reason(codes[cause])
    why = f": {report['message']}" if report.get("message") else f" ({how})"
    logged = report.get("message") and not report.get("lost_peers")
    raise WorkerDied(f"worker rank {cause} failed{why}; stopped the other {procs - 1} worker(s)"
                     + ("; its traceback is in train.log" if logged else ""),
                     cause, how, retry=report.get("retry", True) and codes[cause] != 2)


def _cause(codes: dict[int, int | None], failed: list[int], reports: dict[int, dict] | None = None) -> int:
    """The rank whose death brought the job down.

    A rank that reported its own error (not a lost peer) is the cause first, the
    earliest report first. Otherwise: a peer that loses its partner mid-collective
    either raises (an exit code) or, inside gloo's C++ threads, aborts ("terminate
    called without an active exception", SIGABRT), and it may do so in the same
    instant the real cause dies. So a rank killed by any other signal (OOM killer,
    SIGKILL, SIGSEGV) is the cause first, then a rank that exited with an error,
    then SIGABRT; ties go to the rank seen failing first.
    """
    def kind(code: int) -> int:
        if code < 0:
            return 2 if -code == signal.SIGABRT else 0
        return 1

    exited = {rank: code for rank, code in codes.items() if code is not None}
    seen_later = [rank for rank, code in exited.items() if code != 0 and rank not in failed]
    dead = failed + seen_later  # in the order they were seen; min() keeps the first of equal kinds
    own = [rank for rank in dead if not (reports or {}).get(rank, {"lost_peers": True})["lost_peers"]]
    if own and not any(exited[rank] < 0 and -exited[rank] != signal.SIGABRT for rank in dead):
        return min(own, key=lambda rank: (reports or {})[rank]["time"])
    return min(dead, key=lambda rank: kind(exited[rank]))
