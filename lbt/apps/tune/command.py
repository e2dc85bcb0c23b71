"""`lbt tune [overrides]`: tune every cell of the grid, train its finals, write the report."""

from __future__ import annotations

import time

import optuna

from lbt.apps.tune.finals import earlier_cells, finish_cell
from lbt.apps.tune.grid import tune_grid
from lbt.apps.tune.report import summarize, write_tune_report
from lbt.apps.tune.trials import Stopped, open_study, tune_cell
from lbt.errors import ConfigError


def tune(args: list[str]) -> dict | None:
    """Tune every cell, train the finals, write the report; return its summary (None if stopped)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial is printed here instead
    grid = tune_grid(args)
    folder, s = grid.settings.dir, grid.settings
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(f"tune.dir={folder}: cannot create the tune folder: {error.strerror or error}") from None
    storage = optuna.storages.RDBStorage(f"sqlite:///{folder / 'optuna.db'}")
    print(f"tune: {count(len(grid.cells), 'cell')} x {count(s.trials, 'trial')} (TPE, seed {s.seed}; pruner "
          f"{s.pruner}), then the best{' and the defaults' if s.untuned else ''} x {count(s.seeds, 'seed')}; "
          f"folder {folder}", flush=True)
    started, new_runs = time.perf_counter(), {"trials": 0, "finals": 0}
    # Every cell's study is opened (and checked against this command) before any trial runs.
    studies = [open_study(storage, grid, cell) for cell in grid.cells]
    try:
        cells = []
        for cell, study in zip(grid.cells, studies):
            tune_cell(grid, cell, study, new_runs)
            cells.append(finish_cell(grid, cell, study, new_runs))
    except (Stopped, KeyboardInterrupt):
        print(f"tune: stopped; run the same command again to continue ({folder})", flush=True)
        return None
    summary = summarize(grid, cells + earlier_cells(grid, cells))
    write_tune_report(folder, summary)
    print(f"tune finished in {time.perf_counter() - started:.0f} s: {count(new_runs['trials'], 'new trial')}, "
          f"{count(new_runs['finals'], 'new final run')}", flush=True)
    print(f"report: {folder / 'tune_report.md'}; trials: optuna-dashboard sqlite:///{folder / 'optuna.db'}; "
          f"final runs, tuned vs untuned: lbt report {folder / 'final'}", flush=True)
    return summary


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"
