"""`lbt tune [overrides]`: tune every cell of the grid, train its finals, write the report."""

from __future__ import annotations

import os
import signal
import sys
import time

import optuna

from lbt.apps.errors import Stopped, raise_if_stopped, stop_between_runs
from lbt.apps.tune.grid import TuneGrid, tune_grid
from lbt.apps.tune.storage import TuneStorage, claim_lock, open_storage
from lbt.apps.tune.trials import open_study
from lbt.apps.tune.workers import HELPER, helpers, work, write_report_once
from lbt.errors import ConfigError


def tune(args: list[str]) -> dict:
    """Tune every cell, train the finals, write the report; return its summary.

    This process is one worker (workers.py); tune.workers=N starts N - 1 more beside it, and other
    `lbt tune` commands on the same tune.dir and storage are workers of the same tune. Told to stop
    (SIGINT, SIGTERM), it exits with the signal's code, 130 or 143, and the same command continues it.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial is printed here instead
    grid = tune_grid(args)
    folder, s = grid.settings.dir, grid.settings
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"tune.dir={folder}: cannot create the tune folder: {error.strerror or error}") from None
    storage = open_storage(s.storage, folder, s.heartbeat)
    helper = bool(os.environ.get(HELPER))
    if not helper:
        say_plan(grid, storage)
    started, new_runs = time.perf_counter(), {"trials": 0, "finals": 0}
    # Every cell's study is opened (and checked against this command) before any trial runs.
    with claim_lock(folder):
        studies = [[open_study(storage.optuna, grid, cell, k) for k in range(s.studies)] for cell in grid.cells]
    try:
        with stop_between_runs():
            with helpers(args, 1 if helper else s.workers):
                work(grid, storage, studies, new_runs)
            raise_if_stopped()  # told to stop while its helpers finished
        summary, written = write_report_once(grid, storage)
    except (Stopped, KeyboardInterrupt) as stop:
        if not helper:  # a helper stops with the command that started it, which says so once
            print(f"tune: stopped; run the same command again to continue ({folder})", flush=True)
        sys.exit(128 + (stop.signum if isinstance(stop, Stopped) else signal.SIGINT))
    if helper:
        return summary
    print(f"tune finished in {time.perf_counter() - started:.0f} s: {count(new_runs['trials'], 'new trial')}, "
          f"{count(new_runs['finals'], 'new final run')}{' in this process' if s.workers > 1 else ''}", flush=True)
    for warning in summary.get("warnings", []):
        print(f"warning: {warning}", flush=True)
    current = "" if written else " (current: written by another worker, or before)"
    print(f"report: {folder / 'tune_report.md'}{current}; trials: optuna-dashboard {storage.dashboard}; "
          f"final runs, tuned vs untuned: lbt report {folder / 'final'}", flush=True)
    return summary


def say_plan(grid: TuneGrid, storage: TuneStorage) -> None:
    s = grid.settings
    workers = f"; {s.workers} workers" if s.workers > 1 else ""
    searches = f" x {count(s.studies, 'independent study', 'independent studies')}" if s.studies > 1 else ""
    sampler = "TPE" if s.sampler == "tpe" else "quasi-random (Halton)"
    objective = f"; objective: steps to val {s.metric.name} {s.target:g}" if s.objective == "steps_to_target" else ""
    print(f"tune: {count(len(grid.cells), 'cell')} x {count(s.trials, 'trial')}{searches} ({sampler}, seed {s.seed}; "
          f"pruner {s.pruner}{objective}), then the best{' and the defaults' if s.untuned else ''} x "
          f"{count(s.seeds, 'seed')}; folder {s.dir}; trials in {storage.shown}{workers}", flush=True)


def count(n: int, noun: str, plural: str | None = None) -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
