"""A tune's workers: every process of `tune.workers=N`, and every `lbt tune` on the same tune.dir, runs this loop.

    until every cell of the grid is finished:
        a cell whose trials are all done and whose final runs no worker holds: train its finals
        else a free trial slot in any cell (claimed under tune.dir's lock): run that trial
        else wait: the other workers' trials are running (a dead worker's trial is retried once stale)
    the report, written once: by the first worker to see every cell finished (the others find it current)

The lock around a claim is what keeps a cell at exactly tune.trials trials; the heartbeat
(storage.py) is what frees the slot of a worker that died mid-trial.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import optuna

from lbt.apps.errors import raise_if_stopped
from lbt.apps.estimate import duration
from lbt.apps.tune.finals import cell_path, earlier_cells, finish_cell, finished, read_cell
from lbt.apps.tune.grid import TuneGrid
from lbt.apps.tune.report import summarize, write_tune_report
from lbt.apps.tune.storage import TuneStorage, cell_lock, claim_lock
from lbt.apps.tune.trials import TrialState, claim_trial, run_trial
from lbt.stop import asked_again, stop_asked

HELPER = "LBT_TUNE_HELPER"  # set in the extra processes of tune.workers=N: they leave the talking to the first
HELPER_PATIENCE_S = 5.0  # how long helpers told to stop may take before the tune says it waits for them


def work(grid: TuneGrid, storage: TuneStorage, studies: list[list[optuna.Study]], new_runs: dict) -> None:
    """Finals, trials, or a wait, until every cell of the grid is finished (by this worker or others).

    `studies`: each cell's Optuna studies, one per independent search (tune.studies)."""
    for cell, searches in zip(grid.cells, studies):
        if finished(grid, cell, searches) and not os.environ.get(HELPER):
            print(f"[{cell.name}] done before: its trials and final runs", flush=True)
    waited = False
    while True:
        raise_if_stopped()
        if finish_next_cell(grid, studies, new_runs) or run_next_trial(grid, storage, studies, new_runs):
            waited = False
            if not os.environ.get(HELPER):
                say_progress(grid, studies)
            continue
        left = [cell.name for cell, searches in zip(grid.cells, studies) if not finished(grid, cell, searches)]
        if not left:
            return
        if not waited:
            print(f"tune: waiting for other workers ({', '.join(left)})", flush=True)
        waited = True
        time.sleep(min(storage.heartbeat, 2))


def say_progress(grid: TuneGrid, studies: list[list[optuna.Study]]) -> None:
    """After each trial of the first worker, and each cell's final runs: the tune's runs done of all (every
    worker's, earlier commands' too), and about how long the rest takes: the runs left x the mean complete
    trial's time / tune.workers (a final run trains as long as a trial; other commands' workers not counted)."""
    s = grid.settings
    cells = [(finished(grid, cell, searches), [study.get_trials(deepcopy=False) for study in searches])
             for cell, searches in zip(grid.cells, studies)]
    done, total, seconds = runs_done(s.trials, s.seeds * (2 if s.untuned else 1), cells)
    left = f"; about {duration((total - done) * sum(seconds) / len(seconds) / s.workers)} left" \
        if seconds and done < total else ""
    print(f"tune: {done} of {total} runs done ({done / total:.0%}){left}", flush=True)


def runs_done(trials: int, finals_per_cell: int,
              cells: list[tuple[bool, list[list[optuna.trial.FrozenTrial]]]]) -> tuple[int, int, list[float]]:
    """(runs done, runs in all, seconds of each complete trial) of a tune of `trials` per search; `cells`: per
    cell, whether it is finished (its final runs done) and each of its searches' trials."""
    done = total = 0
    seconds = []
    for finished_cell, searches in cells:
        for trials_of_search in searches:
            counted = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials_of_search)
            done += trials if finished_cell else min(counted, trials)
            seconds += [t.duration.total_seconds() for t in trials_of_search
                        if t.state == TrialState.COMPLETE and t.duration]
        done += finals_per_cell if finished_cell else 0
        total += trials * len(searches) + finals_per_cell
    return done, total, seconds


def run_next_trial(grid: TuneGrid, storage: TuneStorage, studies: list[list[optuna.Study]], new_runs: dict) -> bool:
    """Claim and run the first free trial slot of the grid (a cell's searches in turn); False if there is none."""
    for cell, searches in zip(grid.cells, studies):
        for search, study in enumerate(searches):
            claim = claim_trial(grid, cell, study, storage, search)
            if claim is not None:
                run_trial(study, grid, cell, claim, storage)
                new_runs["trials"] += 1
                return True
    return False


def trials_done(grid: TuneGrid, searches: list[optuna.Study]) -> bool:
    """tune.trials finished or pruned trials in each of the cell's searches, and none running or waiting in
    any worker."""
    for study in searches:
        trials = study.get_trials(deepcopy=False)
        counted = sum(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
        if counted < grid.settings.trials or any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials):
            return False
    return True


def finish_next_cell(grid: TuneGrid, studies: list[list[optuna.Study]], new_runs: dict) -> bool:
    """Train the final runs of the first cell that is ready for them and that no other worker is finishing."""
    for cell, searches in zip(grid.cells, studies):
        if not trials_done(grid, searches) or finished(grid, cell, searches):
            continue
        with cell_lock(grid.settings.dir, cell.folder) as mine:
            if mine and not finished(grid, cell, searches):
                finish_cell(grid, cell, searches, new_runs)
                return True
    return False


def write_report_once(grid: TuneGrid, storage: TuneStorage) -> tuple[dict, bool]:
    """The summary of every finished cell; written (with the report) unless it is on disk already, as the
    worker that finished first left it. Returns it, and whether this call wrote it."""
    folder = grid.settings.dir
    with claim_lock(folder):
        cells = [read_cell(cell_path(grid, cell))[0] for cell in grid.cells]
        summary = summarize(grid, cells + earlier_cells(grid, cells), storage.dashboard)
        current = folder / "tune_summary.json"
        files = [current, folder / "tune_report.md", folder / "best_lr_vs_batch.png"]
        if all(f.is_file() for f in files) and current.read_text() == json.dumps(summary, indent=2):
            return summary, False
        write_tune_report(folder, summary)
        return summary, True


@contextlib.contextmanager
def helpers(args: list[str], workers: int) -> Iterator[None]:
    """tune.workers=N: N - 1 more `lbt tune` processes of the same command, working beside this one.

    They end on their own once every cell is finished; if this one stops or fails, they are stopped too
    (SIGTERM: a running trial is told failed, and run again by the same command). One that does not stop
    (hung) is killed on a second Ctrl-C or SIGTERM to this process: its trial's heartbeat stops, and the next
    command runs it again.
    """
    argv = [a for a in args if not a.lstrip("+").startswith("tune.workers=")] + ["tune.workers=1"]
    env = {**os.environ, HELPER: "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "lbt", "tune", *argv], env=env) for _ in range(workers - 1)]
    ended = False
    try:
        yield
        ended = True
    finally:
        stop_helpers(procs, stopping=not ended)


def stop_helpers(procs: list[subprocess.Popen], stopping: bool) -> None:
    """Wait for the helpers: to finish their cells, or, `stopping` (or once a stop is asked), to stop; a second
    stop asked kills those still running after saying so."""
    told_at, killed, said = 0.0, False, False
    while any(proc.poll() is None for proc in procs):
        if not told_at and (stopping or stop_asked() is not None):
            told_at = time.monotonic()
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
        if told_at and not said and time.monotonic() - told_at > HELPER_PATIENCE_S:
            said = True  # a trial stops at its next log step: seconds, unless a helper hangs
            print("tune: waiting for the other workers to stop; Ctrl-C again kills them", file=sys.stderr,
                  flush=True)
        if told_at and asked_again() and not killed:
            killed = True
            hung = [proc for proc in procs if proc.poll() is None]
            for proc in hung:
                proc.kill()
            print(f"tune: killed {len(hung)} worker(s) that had not stopped; their trials run again next time",
                  file=sys.stderr, flush=True)
        time.sleep(0.1)
    for proc in procs:
        if proc.returncode != 0 and not told_at:
            print(f"tune: worker pid {proc.pid} ended with exit code {proc.returncode}", flush=True)
