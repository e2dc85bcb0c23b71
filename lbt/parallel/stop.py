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
"""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

STOP_FILE = "LBT_STOP_FILE"
_asked: list[int] = []  # the stop this process was asked for (its first signal), file or not
_repeated: list[int] = []  # the signals asked after the first: a second Ctrl-C means "now" where waiting is long
_kept: list[bool] = []  # a command of many runs keeps the stop across its runs' starts (keep_stop)


def stop_file() -> Path | None:
    path = os.environ.get(STOP_FILE)
    return Path(path) if path else None


def stop_asked() -> int | None:
    """The signal number a stop was asked with (of this process, or in the stop file), or None."""
    if _asked:
        return _asked[0]
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
    if not _asked:
        _asked.append(signum)
    else:
        _repeated.append(signum)
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
    if not (run_start and _kept):
        _asked.clear()
        _repeated.clear()


def asked_again() -> bool:
    """Whether this process was asked to stop a second time (a second Ctrl-C): what waits for others to stop
    cleanly stops waiting."""
    return bool(_repeated)


@contextmanager
def keep_stop() -> Iterator[None]:
    """While a tune or probe runs: a stop asked of this process outlives its runs' starts, and none from
    before it (an earlier command in the same process) counts."""
    forget_stop()
    _kept.append(True)
    try:
        yield
    finally:
        _kept.pop()
        forget_stop()


def stop_kept() -> bool:
    """Whether a command of many runs (a tune, a probe) is running this one: it says how to continue."""
    return bool(_kept)


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
