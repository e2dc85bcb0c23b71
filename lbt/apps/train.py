"""`lbt train`: Hydra's main around the engine's `run`, with every job's config checked before Hydra starts.

    lbt train [overrides]      -> precheck (compose, build the spec: one line per mistake) -> Hydra -> run(spec)
    lbt train -m [sweeps]      -> every job checked first; a job that fails in the sweep leaves a result.json
                                  saying why, and the sweep goes on
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lbt.apps.compose import Composed, compose, conf_dir, one_line, register_schemas
from lbt.apps.errors import Stopped, continue_with, end_on, fail, stopped
from lbt.apps.study_folder import STUDY_PID, job_line, study_of_job
from lbt.engine import make_spec, run
from lbt.engine.build import check_targets
from lbt.engine.worker import check_run_folder
from lbt.errors import ConfigError, naming, place_problem
from lbt.parallel import process_group as pg
from lbt.parallel.launcher import WorkerDied
from lbt.spec.batching import DEFAULT_PER_WORKER_BATCH
from lbt.spec.result import ResultError, RunResult, read_result, write_result
from lbt.stop import SWEEP_PID, end_with_sweep, stop_asked, stop_kept, stopped_by

# A sweep's jobs are each composed and checked before it starts, up to this many; beyond, each swept value
# is checked once (with the other sweeps at their first value), which still catches a mistyped name.
MAX_CHECKED_JOBS = 64


def hydra_flags() -> argparse.ArgumentParser:
    """The flags of Hydra's command line (`-m`, `--cfg`, `--config-dir`, ...; Hydra's own parser is private),
    so lbt can tell them from the overrides before it hands argv to Hydra, in any order."""
    parser = argparse.ArgumentParser(prog="lbt train", add_help=False)
    parser.error = lambda message: fail(f"lbt train: {message}")  # type: ignore[method-assign]
    parser.add_argument("overrides", nargs="*")
    for flags in (("-m", "--multirun"), ("-h", "--help"), ("-hh", "--hydra-help"), ("--resolve",)):
        parser.add_argument(*flags, action="store_true")
    for flags in (("-c", "--cfg"), ("-p", "--package"), ("-cp", "--config-path"), ("-cn", "--config-name"),
                  ("-cd", "--config-dir"), ("-sc", "--shell-completion"), ("--experimental-rerun",)):
        parser.add_argument(*flags)
    parser.add_argument("-i", "--info", nargs="?", const="all")
    return parser


def precheck(overrides: list[str], config_dir: str | None = None, config_name: str = "config") -> None:
    """Compose the config as Hydra will and check it, before Hydra's own reporting.

    Hydra prints composition errors over several lines with a hint about HYDRA_FULL_ERROR; composing
    here first turns them into one line. In a sweep every job is composed, so `recipe=goyal,baseline`
    fails before any job runs.
    """
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as error:
        fail(one_line(error))
    if config_dir and not Path(config_dir).expanduser().is_dir():
        fail(f"--config-dir {config_dir}: no such folder")
    # Hydra's own settings (launcher, sweeper, run folder) are Hydra's to check.
    jobs = sweep_jobs([o for o in parsed if not o.key_or_group.startswith("hydra")])
    empty = [o.input_line for o in parsed if o.is_sweep_override() and not list(o.sweep_string_iterator())]
    if empty:
        fail(f"{empty[0]} sweeps no values: the sweep would run no job")
    composed = None
    for index, job in enumerate(jobs):
        # A mistake of every job is reported plainly; one of a later job names that job.
        label = " ".join(o for o, swept in job if swept) if index else ""
        try:
            composed = check_job([o for o, _ in job], config_dir, config_name, whole=len(jobs) == 1)
        except ConfigError as error:
            fail(f"job {label}: {error}" if label and not str(error).startswith(label.split()[0]) else str(error))
    folders = {o.key_or_group: o.value() for o in parsed if o.key_or_group in ("hydra.run.dir", "hydra.sweep.dir")}
    try:
        for key, folder in (folders or {"hydra.run.dir": "runs"}).items():
            check_writable(str(folder), key)
        if "hydra.run.dir" in folders and len(jobs) == 1 and composed is not None:
            # Refused before Hydra writes the command's .hydra/ config over the run it would not continue.
            check_run_folder(make_spec(composed.config, composed.recipe), str(folders["hydra.run.dir"]))
    except ConfigError as error:
        fail(str(error))


def sweep_jobs(parsed: list) -> list[list[tuple[str, bool]]]:
    """The jobs of a sweep as override lists, each override marked with whether it was swept."""
    axes = []
    for o in parsed:
        if o.is_sweep_override():
            axes.append([(f"{o.get_key_element()}={value}", True) for value in o.sweep_string_iterator()])
        else:
            axes.append([(o.input_line, False)])
    if math.prod(len(axis) for axis in axes) <= MAX_CHECKED_JOBS:
        return [list(job) for job in itertools.product(*axes)]
    first = [axis[0] for axis in axes]
    return [first] + [first[:i] + [value] + first[i + 1:] for i, axis in enumerate(axes) for value in axis[1:]]


def check_job(overrides: list[str], config_dir: str | None, config_name: str, whole: bool = True) -> Composed:
    """One job's config: composed, every mandatory value given, the spec built; else a ConfigError.

    Of a sweep's jobs (`whole=False`) only the composition is checked, which Hydra needs to launch
    any job: a job whose values are wrong (a batch that does not divide) is recorded in its
    result.json and the sweep goes on, as a diverged job is.
    """
    composed = compose(overrides, config_dir, config_name, job_name="lbt_precheck")
    if whole:
        check_targets(make_spec(composed.config, composed.recipe))
    return composed


def check_writable(folder: str, key: str) -> None:
    """The run folder can be created and written, or one line says why (before Hydra tries)."""
    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={folder}: cannot create the run folder, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={folder}: cannot write the run folder, {existing} is not writable")


def train_command(args: list[str], report_failures: bool = True) -> None:
    """`lbt train ARGS`: checked, then run by Hydra's main (a multirun: by its sweeper and launcher)."""
    register_schemas()  # Hydra's own composition (hydra_main) reads them too
    options = hydra_flags().parse_intermixed_args(args)
    if options.help or options.hydra_help or options.info or options.shell_completion:
        sys.argv = ["lbt train", *args]
        hydra_main()  # Hydra's own help and introspection, untouched
        return
    overrides = list(options.overrides)
    flags = [a for a in args if a not in overrides]
    if options.cfg and (options.multirun or first_job(overrides) != overrides):
        # Hydra prints one config, not a sweep's: show the first job's, and say so.
        flags = [a for a in flags if a not in ("-m", "--multirun")]
        overrides = first_job(overrides)
        print(f"lbt: note: --cfg shows the sweep's first job ({' '.join(overrides)})", file=sys.stderr)
        options.multirun = False
    env = pg.torchrun_env()
    if (env["rank"] if env else 0) == 0:
        if not options.config_path:
            precheck(overrides, options.config_dir, options.config_name or "config")
    else:
        # Only torchrun's rank 0 owns the run folder: the others must not create folders or log files
        # of their own (see lbt.engine.worker._agree_on_run_dir).
        overrides += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled",
                      "hydra/hydra_logging=disabled"]
    if options.cfg == "job" and not options.package and not options.config_path:
        print_job_config(overrides, options.config_dir, options.config_name or "config")
        return
    sweep_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.dir=")), None)
    if options.multirun and not options.cfg and sweep_dir is None:
        # Named here (as the config's default would), so the sweep's results can be read when it ends.
        sweep_dir = f"runs/multirun/{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        overrides.append(f"hydra.sweep.dir={sweep_dir}")
    sys.argv = ["lbt train", *flags, *overrides]
    with hydra_raises(sweep_dir if options.multirun else None), sweep_owner():
        hydra_main()
    if options.multirun and not options.cfg and report_failures and sweep_dir is not None:
        check_sweep(sweep_dir)


@contextmanager
def sweep_owner() -> Iterator[None]:
    """A sweep's launcher workers know its process (SWEEP_PID), to end with it (`end_with_sweep`). A study's
    config makes its sweep (hydra.mode), not a -m flag: every Hydra main of lbt's names itself."""
    if os.environ.get(SWEEP_PID):
        yield
        return
    os.environ[SWEEP_PID] = str(os.getpid())
    try:
        yield
    finally:
        os.environ.pop(SWEEP_PID, None)


@contextmanager
def hydra_raises(sweep_dir: str | None) -> Iterator[None]:
    """Hydra's own failures (its sweeper writing multirun.yaml to a full disk) raised to `lbt`'s one-line
    reporting (lbt/apps/cli.py), instead of printed by Hydra as a traceback and exit 1."""
    saved = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except OSError as error:
        if sweep_dir is None or error.filename is not None:
            raise
        raise naming(error, sweep_dir) from error
    finally:
        if saved is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved


def print_job_config(overrides: list[str], config_dir: str | None, config_name: str) -> None:
    """`--cfg job`: the job's config, resolved, with the values lbt derives (both batch sizes, world size and
    processes) filled in where the config leaves them null."""
    hydra_free = [o for o in overrides if not o.startswith(("hydra.", "hydra/"))]
    try:
        composed = compose(hydra_free, config_dir, config_name, job_name="lbt_cfg")
        layout = make_spec(composed.config, composed.recipe).layout
    except ConfigError as error:
        fail(str(error))
    config = {**composed.config, "trainer": {**composed.config["trainer"], "per_worker_batch": layout.per_worker_batch,
                                             "global_batch": layout.global_batch},
              "dist": {**composed.config["dist"], "world_size": layout.world_size, "procs": layout.procs}}
    print(f"# recipe: {composed.recipe}; derived: world_size={layout.world_size} procs={layout.procs} "
          f"per_worker_batch={layout.per_worker_batch} global_batch={layout.global_batch}")
    print(OmegaConf.to_yaml(config), end="")


def first_job(overrides: list[str]) -> list[str]:
    parsed = OverridesParser.create().parse_overrides(overrides)
    return [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
            else str(o.input_line) for o in parsed]


def check_sweep(sweep_dir: str) -> None:
    """A sweep in which no job succeeded ends with one line and a non-zero exit, not 0."""
    errors = []
    for path in sorted(Path(sweep_dir).glob("**/result.json")):
        try:
            errors.append(read_result(path).error)
        except ResultError as error:
            errors.append(str(error))
    failed = [e for e in errors if e is not None]
    if errors and len(failed) == len(errors):
        fail(f"every job of the sweep failed ({len(failed)} of {len(errors)}), the first with: {failed[0]}; "
             f"results in {sweep_dir}")


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    recipe = hydra_cfg.runtime.choices.get("recipe")
    # In a sweep, a failing job is recorded in its result.json and the sweep goes on.
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    config = {str(k): v for k, v in container.items()}
    study = study_of_job()
    if sweeping and stop_asked() is not None:
        return  # its study is stopping: this job does not start (the same command runs it later)
    if sweeping:
        end_with_sweep()  # a launcher's worker process dies with the sweep's, however it dies
    if study is not None and os.environ.get(STUDY_PID) != str(os.getpid()):
        # A launcher's worker process: Ctrl-C reaches the study, which tells its jobs (lbt/stop.py);
        # a worker killed by it between jobs would take the launcher, and the running jobs, down with it.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    started, earlier = time.perf_counter(), finished_here(output_dir)
    try:
        result = run(make_spec(config, recipe, overrides), output_dir)
        if result.stopped and study is None and not sweeping:  # told to stop: 130/143, as at any moment
            if stop_kept():  # a run inside a probe (keep_stop): that command says how to continue it
                raise Stopped(stopped_by())
            stopped(stopped_by(), continue_with(config, output_dir))
        if result.stopped:  # no result.json: what the job is comes from its config
            result = replace(failure_result({**config, "overrides": overrides}, recipe, ""), error=None, stopped=True)
        if study is not None and not earlier:  # the study's header counts the jobs it keeps
            say_job(study, result, time.perf_counter() - started, hydra_cfg)
        return
    except (ConfigError, WorkerDied) as error:
        if str(error) and study is None:
            print(f"lbt: error: {error}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(2 if isinstance(error, ConfigError) or not str(error) else 1)
        message = str(error) or "config error in a worker"
    except Exception as error:  # a crash in one job of a sweep must not stop the others
        problem = place_problem(error)
        if problem is not None:  # a full disk or a read-only folder: every later job would fail the same way
            end_on(*problem)
        if not sweeping:
            raise
        if study is None:
            print(f"lbt: job failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        message = f"{type(error).__name__}: {error}"
    failure = failure_result({**config, "overrides": overrides}, recipe, message)
    if record_failure(output_dir, failure) and study is not None:
        say_job(study, failure, time.perf_counter() - started, hydra_cfg)


def record_failure(output_dir: str, failure: RunResult) -> bool:
    """A failed job's result.json, saying why; False where the folder holds another run's finished result,
    which is never replaced by why this one could not run."""
    if finished_here(output_dir):
        print(f"lbt: error: {failure.error}", file=sys.stderr, flush=True)
        return False
    try:
        write_result(output_dir, failure)
    except OSError as error:
        end_on(*(place_problem(error) or (f"cannot write {output_dir}/result.json: {one_line(error)}", 1)))
    return True


def finished_here(run_dir: str) -> bool:
    """Whether the folder holds a run's finished (not failed) result.json."""
    try:
        return not read_result(run_dir).failed if (Path(run_dir) / "result.json").is_file() else False
    except ResultError:
        return True  # damaged, but someone's: kept


def say_job(study: Path, result: RunResult, seconds: float, hydra_cfg: Any) -> None:
    """A study's job ends with one line on the terminal (its whole log is in its train.log)."""
    parallel = int(hydra_cfg.launcher.get("n_jobs") or 1) if "launcher" in hydra_cfg else 1
    print(job_line(study, result, seconds, parallel), flush=True)


def failure_result(config: dict[str, Any], recipe: str | None, message: str) -> RunResult:
    """What a failed job of a sweep was (recipe, batches, seed, as far as its config says) and why it failed."""
    trainer, world_size = config.get("trainer") or {}, (config.get("dist") or {}).get("world_size") or 1
    per_worker = trainer.get("per_worker_batch")
    if per_worker is None:
        per_worker = trainer["global_batch"] // world_size if trainer.get("global_batch") else DEFAULT_PER_WORKER_BATCH
    return RunResult(error=message, recipe=recipe or "custom", overrides=list(config.get("overrides") or []),
                     world_size=world_size, per_worker_batch=per_worker,
                     global_batch=trainer.get("global_batch") or per_worker * world_size, seed=trainer.get("seed"),
                     config=config)
