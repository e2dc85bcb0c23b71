"""A stop asked of every job of a study at once: the signal's number in a file the jobs poll.

Signals reach a study's jobs unevenly: a scheduler's SIGTERM reaches the study's own process only,
a launcher's worker process may be between jobs when Ctrl-C arrives. So a study names a file in
LBT_STOP_FILE; whoever gets SIGINT/SIGTERM writes the signal's number there (`ask_stop`), every run
reads it at its log steps as it reads its own signal flag (all ranks agree there), and a job that
would start after it appeared does not start (`stop_asked`).
"""

from __future__ import annotations

import os
from pathlib import Path

STOP_FILE = "LBT_STOP_FILE"


def stop_file() -> Path | None:
    path = os.environ.get(STOP_FILE)
    return Path(path) if path else None


def stop_asked() -> int | None:
    """The signal number a stop was asked with, or None (also when no stop file is set)."""
    path = stop_file()
    if path is None or not path.is_file():
        return None
    try:
        return int(path.read_text().strip() or 0)
    except (OSError, ValueError):
        return 0  # being written, or damaged: a stop all the same


def ask_stop(signum: int) -> None:
    """Record a stop for every job (no-op outside a study); the first signal's number is kept."""
    path = stop_file()
    if path is not None and not path.exists():
        try:
            path.write_text(str(signum))
        except OSError:
            pass  # the run that got the signal stops anyway; the others stop on their own signal
