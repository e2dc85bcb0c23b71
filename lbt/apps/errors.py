"""How a command ends on a mistake the user can fix: one `lbt: error:` line on stderr and exit code 2;
and how it ends when told to stop (SIGTERM, SIGINT): one line and the signal's exit code, 143 or 130."""

from __future__ import annotations

import os
import signal
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, NoReturn

from lbt.stop import handling, keep_stop, note_stop, stop_asked


class Stopped(BaseException):
    """A command of many runs (tune, probe) told to stop: it ends with 128 + `signum`, and the same command
    continues it. A BaseException, as KeyboardInterrupt: no `except Exception` on its way up may take it
    for a failure."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def stop_between_runs() -> Iterator[None]:
    """SIGTERM and SIGINT between the runs of a tune or probe are recorded as a run records them
    (lbt/stop.py), and the command stops at its next safe point (`raise_if_stopped`); a run takes
    both signals over while it trains, and stops with a checkpoint. Raised from the handler instead, the
    stop landed anywhere: between a trial's claim and its `try` (left running), or inside OmegaConf, which
    re-raised it with its message for the signal number. Python's default SIGTERM ended the command at
    once, its helper workers left running."""
    with keep_stop():  # a stop asked just before a run starts stops that run, not forgotten by it
        with handling(note_stop):
            yield


def raise_if_stopped() -> None:
    """A safe point of a tune or probe: a stop asked since it started ends it here."""
    signum = stop_asked()
    if signum is not None:
        raise Stopped(signum or signal.SIGTERM)


def fail(message: str) -> NoReturn:
    end_on(message, 2)


def end_on(message: str, code: int) -> NoReturn:
    """One `lbt: error:` line: exit 2 for a mistake the user fixes by another input, 1 for a real failure."""
    print(f"lbt: error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def stopped(signum: int, resume: str = "") -> NoReturn:
    """A command told to stop, at any moment (before its run started too): 128 + the signal's number."""
    line, code = _stop_line(signum, resume)
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


def _stop_line(signum: int, resume: str) -> tuple[str, int]:
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name, signum = "asked to stop", signal.SIGTERM
    return f"lbt: stopped ({name}); rerun the same command{resume} to continue", 128 + signum


def continue_with(config: Mapping[str, Any], run_dir: str) -> str:
    """What the rerun adds: trainer.resume=auto once the stopped run left a checkpoint to continue from."""
    if (config.get("trainer") or {}).get("resume") == "auto":
        return ""
    return " with trainer.resume=auto" if (Path(run_dir) / "checkpoint" / "latest.json").is_file() else ""


def exit_when_stopped() -> None:
    """Until a run takes the signals over (lbt/engine/worker.py), SIGTERM/SIGINT end the command as a stopped
    run's: one line, 143/130, no traceback (nothing has started that a checkpoint could keep).

    The process ends at once (os._exit), not by raising SystemExit: raised in the middle of an import, a
    library's broad `except` can swallow it and leave a half-imported numpy that fails later with a traceback."""

    def end_now(signum: int, frame: Any) -> None:
        line, code = _stop_line(signum, "")
        sys.stdout.flush()
        print(line, file=sys.stderr, flush=True)
        os._exit(code)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, end_now)
