"""What a run says: `say` (console and train.log) and `note` (rank 0's remarks).

train.log: the run's text log in its folder, for runs nobody watches (background, cluster jobs).

What a run says on the console (its resolved config, the start line, warnings and notes, the
epoch lines and the closing line) also goes, timestamped, to `<run_dir>/train.log` through the
`lbt.run` logger. lbt writes the file itself rather than relying on Hydra's job logging: the
processes of lbt's local launcher are spawned, and Hydra configured logging only in their parent.
"""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

LOG = logging.getLogger("lbt.run")
LOG.setLevel(logging.INFO)
LOG.propagate = False  # Hydra's root handlers would print every line a second time

# How much of it the console shows (train.log always gets everything): full; brief (not the resolved
# config); quiet (a run's closing line and stderr only); silent (stderr only); log (nothing: a study's
# jobs, which the study sums up in one line each). Set by commands that run many jobs (`lbt probe`,
# `lbt study`): an environment variable, so the processes of Hydra's launchers see it too.
CONSOLE = "LBT_RUN_CONSOLE"
SHOWN = {"full": ("config", "progress", "result"), "brief": ("progress", "result"), "quiet": ("result",),
         "silent": (), "log": ()}


@contextmanager
def text_log(run_dir: str | Path | None):
    """Append what `say` says to run_dir/train.log while the block runs (no file where run_dir is None)."""
    if run_dir is None:
        yield
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(Path(run_dir) / "train.log", encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
    # Hydra's `hydra/job_logging=disabled` (a quiet study's, a probe's) runs logging's dictConfig with
    # disable_existing_loggers, which disables this logger too: without this, every job's train.log is empty.
    LOG.disabled = False
    LOG.addHandler(handler)
    try:
        yield
    finally:
        LOG.removeHandler(handler)
        handler.close()


def say(line: str, stderr: bool = False, kind: str = "progress") -> None:
    """Print a line (stdout, or stderr for warnings and notes) and write it to the run's train.log.
    `kind` (config, progress, result) decides whether the console shows it (see CONSOLE)."""
    level = os.environ.get(CONSOLE, "full")
    if (stderr and level != "log") or kind in SHOWN.get(level, SHOWN["full"]):
        print(line, file=sys.stderr if stderr else sys.stdout, flush=True)
    LOG.info(line)


def say_once(line: str, stderr: bool = False) -> None:
    """`say`, from rank 0 only: every rank of a run reaches the same conclusions, one of them says so."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        say(line, stderr)


def note(message: str) -> None:
    """A `lbt: note:` line on stderr, from rank 0 only."""
    say_once(f"lbt: note: {message}", stderr=True)
