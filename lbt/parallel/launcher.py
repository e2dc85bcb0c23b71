"""lbt's local launcher: start a job's processes, watch them, and name the one that brought the job down.

Processes are started by `torch.multiprocessing` (spawn) and meet through a TCPStore the launcher
owns on 127.0.0.1, on a port the OS picks. Restarts and the run itself are the engine's
(lbt/engine/worker.py); this module only starts, watches and stops processes.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from lbt.parallel.process_group import HOST


class WorkerDied(RuntimeError):
    """A worker process of a locally launched job exited abnormally.

    `rank` and `how` name the worker that brought the job down; rank None: a
    config error the worker already printed (never worth a restart).
    """

    def __init__(self, message: str, rank: int | None = None, how: str | None = None):
        super().__init__(message)
        self.rank, self.how = rank, how

    @property
    def restartable(self) -> bool:
        return self.rank is not None


def step_board(procs: int):
    """One shared integer per process, each worker's last finished step: read after a worker dies
    (a SIGKILLed process can say nothing), so a restart can record where it happened."""
    return mp.get_context("spawn").RawArray("q", procs)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch_local(fn: Callable, args: tuple, procs: int) -> None:
    """Start `procs` processes running fn(rank, store_port, *args) and watch them.

    The parent owns the rendezvous store (port chosen by the OS, so no port can
    be "in use"). If any process fails, the rest are stopped within seconds and
    WorkerDied names the rank that caused it (see `_cause`).
    """
    store = dist.TCPStore(HOST, 0, procs + 1, is_master=True, wait_for_workers=False)
    if mp.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # A job of a sweep run by Hydra's joblib launcher (loky workers) carries loky's start method, which
        # the spawned workers would try to restore and cannot ("cannot find context for 'loky'").
        mp.set_start_method("spawn", force=True)
    context = mp.start_processes(fn, args=(store.port, *args), nprocs=procs, join=False, start_method="spawn")
    processes = context.processes

    def forward(signum, frame):
        # Preemption reaches the launcher: the workers checkpoint and stop together.
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed = _watch(processes)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not failed:
        return
    _stop_all(processes, failed, procs)


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


def _stop_all(processes: list, failed: list[int], procs: int) -> None:
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
    cause = _cause(codes, failed)
    if codes[cause] == 2:
        # A config error inside the worker: it already printed its one line.
        raise WorkerDied("")
    how = _exit_reason(codes[cause])
    raise WorkerDied(f"worker rank {cause} failed ({how}); stopped the other {procs - 1} worker(s)", cause, how)


def _cause(codes: dict[int, int | None], failed: list[int]) -> int:
    """The rank whose death brought the job down.

    A peer that loses its partner mid-collective either raises (an exit code)
    or, inside gloo's C++ threads, aborts ("terminate called without an active
    exception", SIGABRT), and it may do so in the same instant the real cause
    dies. So a rank killed by any other signal (OOM killer, SIGKILL, SIGSEGV)
    is the cause first, then a rank that exited with an error, then SIGABRT;
    ties go to the rank seen failing first.
    """
    def kind(code: int) -> int:
        if code < 0:
            return 2 if -code == signal.SIGABRT else 0
        return 1

    seen_later = [rank for rank, code in codes.items() if code not in (None, 0) and rank not in failed]
    dead = failed + seen_later  # in the order they were seen; min() keeps the first of equal kinds
    return min(dead, key=lambda rank: kind(codes[rank]))


