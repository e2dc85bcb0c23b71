"""`lbt study`: a Hydra multirun over recipes x GPU counts (conf/study/*.yaml), its extra grids, then its report."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from hydra.core.override_parser.overrides_parser import OverridesParser

from lbt.apps.compose import compose, one_line, sweep_settings
from lbt.apps.errors import fail
from lbt.apps.estimate import duration, run_samples, timed_rate
from lbt.apps.report import write_report
from lbt.apps.report.cli import REPORT_FLAGS, report_options
from lbt.apps.study_folder import STUDY_ENV, STUDY_PID, StudyJob, StudyRecord, claim, grid_jobs, jobs_to_run
from lbt.apps.train import check_sweep, train_command
from lbt.engine import make_spec
from lbt.errors import ConfigError
from lbt.metrics.text_log import CONSOLE
from lbt.parallel.process_group import pick_device
from lbt.paths import folder_lock
from lbt.spec.run import RunSpec
from lbt.stop import STOP_FILE, forget_stop, handling, note_stop, stop_asked

STUDY_HELP = """usage: lbt study [overrides]

Runs a study (a Hydra multirun over recipes x GPU counts, conf/study/*.yaml), any extra grids it
declares, then writes its report (report.md, PNG curves, summary.json, tb_summary/).

  lbt study                                  the default study (study=default) on MNIST-1D
  lbt study study=gpu_counts                 another study config
  lbt study trainer.epochs=3 trainer.seed=0,1   any `lbt train` override applies to every job
  lbt study hydra.sweep.dir=runs/study/mine  where it goes (default runs/study/<date>_<time>)
  lbt study hydra/launcher=slurm             on a cluster (README: Launchers)
  lbt study -v                               every job's whole log on the terminal too (else in its train.log)

Ctrl-C stops every job at its next log step with a checkpoint; the same command continues the study
in its folder (finished jobs are kept as they are, stopped ones resume exactly, missing ones run).

Then `lbt report DIR --target 0.95` re-reads the folder with another accuracy target
(`--metric loss --target 2.1`: a loss target, lower is better).
"""


@dataclass(frozen=True)
class StudyCommand:
    """`lbt study ARGS` read: the overrides each grid runs with, the study's folder and report options."""

    args: list[str]  # the main grid's, with the folder and trainer.resume=auto
    own_args: list[str]  # the same without the folder (each extra grid adds its own)
    given: list[str]  # what the user typed, to repeat it in the command that continues the study
    grids: list[tuple[str, list[str]]]  # the extra grids: (name, overrides)
    sweep_dir: str
    report_args: list[str]
    verbose: bool


def study_command(args: list[str]) -> None:
    """A study is a Hydra multirun (conf/study/*.yaml), any extra grids of it, then its report.

    Its folder holds one study (study.json): the same command continues it there, finished jobs kept
    as they are, stopped ones resumed from their checkpoints (every job runs with trainer.resume=auto).
    Ctrl-C or SIGTERM stops every job at its next log step with a checkpoint, starts none, writes no
    answer, and exits 130 or 143.
    """
    if any(a in ("-h", "--help") for a in args):
        print(STUDY_HELP)
        return
    if any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in args):
        # The composed config of the study's first job (and Hydra's), nothing run.
        args = [a for a in report_flags(args)[1] if a not in ("-v", "--verbose")]
        train_command(args if any(a.startswith("study=") for a in args) else ["study=default", *args])
        return
    command = read_command(args)
    with ExitStack() as held:
        try:
            settings = sweep_settings(command.own_args)
            record = study_record(command.own_args, command.grids, settings["params"])
            held.enter_context(folder_lock(command.sweep_dir))  # two commands on one study: the second is refused
            continued = claim(command.sweep_dir, record)
        except ConfigError as error:
            fail(str(error))
        run_study(command, record, continued, settings["launcher"])


def read_command(args: list[str]) -> StudyCommand:
    verbose = any(a in ("-v", "--verbose") for a in args)
    args = [a for a in args if a not in ("-v", "--verbose")]
    report_args, args = report_flags(args)
    if not any(a.startswith("study=") for a in args):
        args = ["study=default", *args]
    sweep_dir = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.sweep.dir=")), None)
    if sweep_dir is None:
        sweep_dir = f"runs/study/{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        args = [*args, f"hydra.sweep.dir={sweep_dir}"]
    given = [a for a in args if not a.startswith("study=default")]
    if not any(a.startswith("trainer.resume=") for a in args):
        args = [*args, "trainer.resume=auto"]  # a continued study resumes its stopped jobs, skips finished ones
    own_args = [a for a in args if not a.startswith("hydra.sweep.dir=")]
    return StudyCommand(args, own_args, given, extra_sweeps(args), sweep_dir, report_args, verbose)


def run_study(command: StudyCommand, record: StudyRecord, continued: bool, launcher: dict) -> None:
    """The study's grids, one after another, then its answer; stopped by a signal: no answer."""
    quiet = [] if command.verbose else ["hydra/hydra_logging=disabled", "hydra/job_logging=disabled"]
    started, sweep_dir = time.perf_counter(), command.sweep_dir
    left = jobs_to_run(sweep_dir, list(record.jobs))
    with study_signals(sweep_dir, command.verbose):
        say_header(record, sweep_dir, continued, launcher, command.grids, left)
        if left:  # a finished study is only reported again: starting its sweep would cost seconds for nothing
            multirun([*command.args, *quiet])
            for name, overrides in command.grids:
                if stop_asked() is None:
                    multirun([*command.own_args, *overrides, *quiet, f"hydra.sweep.dir={sweep_dir}/{name}"])
        signum = stop_asked()
    if signum is not None:
        exit_stopped(signum, record, sweep_dir, command.given)
    say_answer(sweep_dir, command.report_args)
    check_sweep(sweep_dir)
    print(f"study finished in {duration(time.perf_counter() - started)}; report: {Path(sweep_dir).resolve()}/report.md")


def say_answer(sweep_dir: str, report_args: list[str]) -> None:
    """Write the study's report; the terminal gets its key statements (report.md's bold lines), not all of it."""
    options = report_options([sweep_dir, *report_args])
    try:
        write_report(sweep_dir, options.target, options.tolerance, options.network, options.step_ms,
                     options.metric, options.hybrid_cap)
    except ConfigError as error:
        fail(str(error))
    for line in (Path(sweep_dir) / "report.md").read_text().splitlines():
        if line.startswith("**"):
            print(line.replace("**", ""), flush=True)


def study_record(args: list[str], grids: list[tuple[str, list[str]]], params: dict[str, str]) -> StudyRecord:
    """The study's command and every job of its grids, as Hydra will number them."""
    jobs = grid_jobs(params, args)
    for name, overrides in grids:
        jobs += grid_jobs(params, [*args, *overrides], prefix=f"{name}/")
    return StudyRecord(tuple(args), tuple(jobs))


def say_header(record: StudyRecord, sweep_dir: str, continued: bool, launcher: dict, grids: list,
               left: list[StudyJob]) -> None:
    """What will run, where, how, and for about how long (from 20 steps of the first job, timed here)."""
    jobs = list(record.jobs)
    main = [job for job in jobs if "/" not in job.dir]
    axes = " x ".join(f"{key} {n}" for key, n in swept_axes(main).items()) or "one job"
    extra = "".join(f" + {name} {sum(j.dir.startswith(name + '/') for j in jobs)}" for name, _ in grids)
    kind, parallel = launcher_name(launcher)
    print(f"study: {len(jobs)} jobs ({axes}{extra}); launcher {kind}; folder {Path(sweep_dir).resolve()}", flush=True)
    if continued and not left:
        print(f"study: all {len(jobs)} jobs finished earlier: its answer again, from their results", flush=True)
    elif continued:
        print(f"study: continuing: {len(jobs) - len(left)} of {len(jobs)} jobs finished, {len(left)} to run "
              "(stopped ones resume from their checkpoints)", flush=True)
    if left and kind != "slurm":
        spec = make_spec(compose(list(left[0].overrides)).config)
        rate, samples = timed_rate(spec), run_samples(spec)
        if samples:
            speedup = parallel_speedup(spec, parallel)
            seconds = len(left) * samples / rate / speedup
            print(f"study: about {duration(seconds)} ({len(left)} jobs of about {samples:,} samples at "
                  f"{rate:,.0f} samples/s, timed here; {parallel} at once, {speedup:g}x the pace of one"
                  f"{' on these cores' if speedup < parallel else ''}); each job's log is its train.log, "
                  "-v shows them here", flush=True)


def parallel_speedup(spec: RunSpec, parallel: int) -> int:
    """How much faster `parallel` jobs at once go than one: on a CPU, the timed job used every core its threads
    could, so jobs side by side share them (dividing by `parallel` alone would put a 1.5 h study at 38 min)."""
    if pick_device(spec.trainer.device, 0).type != "cpu":
        return parallel
    cores = os.cpu_count() or 1
    return max(1, min(parallel, cores // (spec.trainer.threads or cores)))


def swept_axes(jobs: list[StudyJob]) -> dict[str, int]:
    """The keys whose value differs between jobs, with how many values each takes."""
    values: dict[str, set[str]] = {}
    for job in jobs:
        for override in job.overrides:
            key, _, value = override.partition("=")
            values.setdefault(key, set()).add(value)
    return {key: len(v) for key, v in values.items() if len(v) > 1}


def launcher_name(launcher: dict) -> tuple[str, int]:
    """A Hydra launcher config in a word, and how many jobs it runs at once."""
    target = str(launcher.get("_target_", ""))
    if "joblib" in target.lower():
        n_jobs = launcher.get("n_jobs")
        parallel = int(n_jobs) if isinstance(n_jobs, int) and n_jobs > 0 else (os.cpu_count() or 1)
        return f"joblib ({parallel} at once)", parallel
    if "submitit" in target.lower():
        return "slurm", int(launcher.get("array_parallelism") or 1)
    return "basic (one at a time)", 1


@contextmanager
def study_signals(sweep_dir: str, verbose: bool) -> Iterator[None]:
    """While the study runs: SIGINT/SIGTERM ask every job to stop (lbt/stop.py) instead of killing the
    study; its jobs know their study and, unless -v, keep their output to their train.log."""
    folder = Path(sweep_dir).resolve()
    stop = folder / ".stop"
    stop.unlink(missing_ok=True)
    forget_stop()  # an earlier command in this process (a test, a notebook) was stopped, not this study
    env = {STOP_FILE: str(stop), STUDY_ENV: str(folder), STUDY_PID: str(os.getpid())}
    if not verbose:
        env[CONSOLE] = "log"
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        with handling(note_stop):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        stop.unlink(missing_ok=True)


def exit_stopped(signum: int, record: StudyRecord, sweep_dir: str, given: list[str]) -> NoReturn:
    """A stopped study: no answer, one line with the command that continues it (its folder named), and
    the exit code of the signal (130 for SIGINT, 143 for SIGTERM)."""
    done = sum((Path(sweep_dir) / job.dir / "result.json").is_file() for job in record.jobs)
    again = [a for a in given if not a.startswith("hydra.sweep.dir=")] + [f"hydra.sweep.dir={sweep_dir}"]
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name, signum = "asked to stop", signal.SIGINT
    print(f"lbt: study stopped ({name}): {done} of {len(record.jobs)} jobs finished, no answer; "
          f"the same command continues it: lbt study {' '.join(again)}", file=sys.stderr, flush=True)
    sys.exit(128 + signum)


def multirun(args: list[str]) -> None:
    """One grid of the study; its failed jobs are reported after the study's report, not here."""
    try:
        train_command(args, report_failures=False)
    except SystemExit as done:
        if done.code not in (0, None):
            raise


def extra_sweeps(args: list[str]) -> list[tuple[str, list[str]]]:
    """The study's further grids (`extra_sweeps` in conf/study/*.yaml) as (name, overrides).

    Hydra's basic sweeper runs one grid; a study may add others, e.g. more seeds at the large
    batches only, where runs vary most and cost least. A grid whose keys the command line sets is
    skipped: the user's sweep is the one they asked for.
    """
    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
        plain = [str(o.input_line) for o in parsed
                 if not o.is_sweep_override() and not o.key_or_group.startswith("hydra")]
        extra = compose(plain, job_name="lbt_study").config.get("extra_sweeps") or {}
    except ConfigError as error:
        fail(str(error))
    except Exception as error:  # Hydra's parser: an override it cannot read
        fail(one_line(error))
    given = {o.key_or_group for o in parsed}
    grids = []
    for name, overrides in extra.items():
        keys = {str(o).split("=", 1)[0] for o in overrides}
        if keys & given:
            print(f"lbt: note: extra sweep {name!r} skipped: the command line sets {', '.join(sorted(keys & given))}",
                  file=sys.stderr)
        else:
            grids.append((str(name), [str(o) for o in overrides]))
    return grids


def report_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """`lbt study`'s report options (as `lbt report` takes them) apart from its overrides, checked now,
    not after the study ran."""
    flags, rest, i = [], [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name not in REPORT_FLAGS:
            rest.append(args[i])
        elif "=" in args[i]:
            flags.append(args[i])
        elif i + 1 < len(args):
            flags += args[i:i + 2]
            i += 1
        else:
            fail(f"lbt study: {name} needs a value")
        i += 1
    report_options(["study_dir", *flags])
    return flags, rest
