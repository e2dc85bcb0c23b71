"""A stop asked of every process of a job (or of a study's jobs) at once: the signal's number in a file
they poll.

Signals reach a job's processes unevenly: a scheduler's SIGTERM may reach the launcher only, a worker
may still be importing torch when Ctrl-C arrives, a study's worker process may be between jobs. So a
job names a file in LBT_STOP_FILE (a study's, or one the local launcher makes, `job_stop_file`);
whoever gets SIGINT/SIGTERM writes the signal's number there (`ask_stop`), every run reads it at its
log steps and before its first step as it reads its own signal flag (all ranks agree there), and a
job that would start after it appeared does not start (`stop_asked`).

A process also remembers the stop it was asked for (`ask_stop`), without a stop file too: a run
stopped before its first step stops as one stopped later, and the command that ran it exits with
the signal's code (`stopped_by`).

Every SIGINT/SIGTERM handler lbt installs for a while goes through `handling`, so each is put back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

STOP_FILE = "LBT_STOP_FILE"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class StopState:
    """What this process was asked: a signal handler may run between any two bytecodes, so it only appends."""

    asked: list[int] = field(default_factory=list)  # the stop asked (its first signal), file or not
    repeated: list[int] = field(default_factory=list)  # signals after the first: a second Ctrl-C means "now"
    kept: list[bool] = field(default_factory=list)  # a command of many runs keeps the stop (keep_stop)
    watching: list[int] = field(default_factory=list)  # the sweep process end_with_sweep watches


_state = StopState()


@contextmanager
def handling(handler: Callable[[int, Any], Any], signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """`handler` for SIGTERM and SIGINT while the block runs, the previous handlers back after it."""
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def note_stop(signum: int, frame: Any = None) -> None:
    """A handler that records the stop (`ask_stop`) for the next safe point to act on."""
    ask_stop(signum)


def stop_file() -> Path | None:
    path = os.environ.get(STOP_FILE)
    return Path(path) if path else None


def stop_asked() -> int | None:
    """The signal number a stop was asked with (of this process, or in the stop file), or None."""
    if _state.asked:
        return _state.asked[0]
    path = stop_file()
    if path is None or not path.is_file():
        return None
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0  # being written, or damaged: a stop all the same


def ask_stop(signum: int) -> bool:
    """Record a stop for this process and every job of its study; the first signal's number is kept.
    Whether the stop file holds it (False: no stop file, or it cannot be written: a full disk)."""
    if not _state.asked:
        _state.asked.append(signum)
    else:
        _state.repeated.append(signum)
    path = stop_file()
    if path is None:
        return False
    if not path.exists():
        try:
            path.write_text(str(signum))
        except OSError:
            return False  # the run that got the signal stops anyway; the others need a signal of their own
    return True


def forget_stop(run_start: bool = False) -> None:
    """A new run in this process starts unstopped (a test or notebook runs several in one process), unless a
    command of many runs keeps the stop for its next safe point (`keep_stop`): a stop asked after that
    command last looked, just before the run started, stops the run before its first step."""
    if not (run_start and _state.kept):
        _state.asked.clear()
        _state.repeated.clear()


def asked_again() -> bool:
    """Whether this process was asked to stop a second time (a second Ctrl-C): what waits for others to stop
    cleanly stops waiting."""
    return bool(_state.repeated)


@contextmanager
def keep_stop() -> Iterator[None]:
    """While a tune or probe runs: a stop asked of this process outlives its runs' starts, and none from
    before it (an earlier command in the same process) counts."""
    forget_stop()
    _state.kept.append(True)
    try:
        yield
    finally:
        _state.kept.pop()
        forget_stop()


def stop_kept() -> bool:
    """Whether a command of many runs (a tune, a probe) is running this one: it says how to continue."""
    return bool(_state.kept)


def stopped_by() -> int:
    """The signal a stopped run was stopped with (SIGTERM when it is not known: a scheduler's preemption)."""
    return stop_asked() or signal.SIGTERM


@contextmanager
def job_stop_file(path: Path) -> Iterator[None]:
    """While a job runs, its processes share a stop file: the study's when there is one, else `path`
    (it must not exist yet). Processes started meanwhile inherit it through their environment."""
    if stop_file() is not None:
        yield
        return
    os.environ[STOP_FILE] = str(path)
    try:
        yield
    finally:
        del os.environ[STOP_FILE]


class StoppedWhileBuilding(BaseException):
    """A stop asked while a run builds what it needs (a dataset generated for minutes): raised at once, where
    nothing half-made is published, and the run ends as one stopped before its first step. A BaseException:
    no `except Exception` on its way up takes it for a failure."""


@contextmanager
def stoppable() -> Iterator[None]:
    """While the block runs, SIGTERM/SIGINT are recorded as a run records them (`ask_stop`) and end the block at
    once with StoppedWhileBuilding. A run's own handlers only note a stop for its next log step, which a data
    generator of minutes would reach only when done."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return

    def stop_now(signum: int, frame: object) -> None:
        ask_stop(signum)
        raise StoppedWhileBuilding(signum)

    with handling(stop_now):
        if stop_asked() is not None:
            raise StoppedWhileBuilding(stop_asked())
        yield


SWEEP_PID = "LBT_SWEEP_PID"  # the process that runs a sweep's launcher (a study, a probe, `lbt train -m`)


def end_with_sweep() -> None:
    """In a launcher's worker process (joblib's loky workers): end this process once the process that runs
    the sweep is gone. `kill -9` of a study or probe left its workers training on, orphaned, and they ignore
    SIGTERM (the study tells its jobs to stop through the stop file). A daemon thread looks every second."""
    owner = os.environ.get(SWEEP_PID)
    if not owner or owner == str(os.getpid()) or _state.watching:
        return
    parent = os.getppid()
    _state.watching.append(parent)

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:  # adopted by init or a subreaper: the sweep's process died
                os._exit(128 + signal.SIGKILL)

    threading.Thread(target=watch, name="lbt-end-with-sweep", daemon=True).start()
