"""`lbt train`: Hydra's main around the engine's `run`, with every job's config checked before Hydra starts.

    lbt train [overrides]      -> precheck (compose, build the spec: one line per mistake) -> Hydra -> run(spec)
    lbt train -m [sweeps]      -> every job checked first; a job that fails in the sweep leaves a result.json
                                  saying why, and the sweep goes on
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import hydra
from hydra._internal.utils import get_args_parser
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

import lbt
from lbt.apps.compose import Composed, compose, conf_dir, one_line, register_schemas, sweep_grid
from lbt.apps.errors import fail
from lbt.apps.job import HydraJob, finished_here, record_failure, say_job
from lbt.engine import make_spec
from lbt.engine.build import check_targets
from lbt.engine.worker import check_run_folder
from lbt.errors import ConfigError, naming
from lbt.parallel import process_group as pg
from lbt.spec.result import ResultError, read_result
from lbt.stop import SWEEP_PID

# A sweep's jobs are each composed and checked before it starts, up to this many; beyond, each swept value
# is checked once (with the other sweeps at their first value), which still catches a mistyped name.
MAX_CHECKED_JOBS = 64


def hydra_flags() -> argparse.ArgumentParser:
    """Hydra's own command-line parser (`-m`, `--cfg`, `--config-dir`, ...; `hydra._internal`, as Hydra has no
    public one), so lbt can tell the flags from the overrides before it hands argv to Hydra, in any order; a
    mistake is one line."""
    parser = get_args_parser()
    parser.prog = "lbt train"
    parser.error = lambda message: fail(f"lbt train: {message}")  # type: ignore[method-assign]
    return parser


def precheck(overrides: list[str], config_dir: str | None = None, config_name: str = "config") -> Composed | None:
    """Compose the config as Hydra will and check it, before Hydra's own reporting; the job's composed config
    when there is one job (None for a sweep), which `--cfg job` prints without composing it again.

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
    own = [o for o in parsed if not o.key_or_group.startswith("hydra")]
    jobs, swept = checked_jobs(own), {o.get_key_element() for o in own if o.is_sweep_override()}
    empty = [o.input_line for o in parsed if o.is_sweep_override() and not list(o.sweep_string_iterator())]
    if empty:
        fail(f"{empty[0]} sweeps no values: the sweep would run no job")
    composed = None
    for index, job in enumerate(jobs):
        # A mistake of every job is reported plainly; one of a later job names that job.
        label = " ".join(o for o in job if o.split("=", 1)[0] in swept) if index else ""
        try:
            composed = check_job(job, config_dir, config_name, whole=len(jobs) == 1)
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
    return composed if len(jobs) == 1 else None


def checked_jobs(parsed: list) -> list[list[str]]:
    """The jobs `precheck` composes: every job of a sweep of at most MAX_CHECKED_JOBS (as Hydra's sweeper makes
    them), else the first job and each value of each swept key once, the others at their first value."""
    lines = [str(o.input_line) for o in parsed]
    sizes = [len(list(o.sweep_string_iterator())) if o.is_sweep_override() else 1 for o in parsed]
    if max(sizes, default=1) == 1:
        return [lines]  # one job: the overrides as given, as Hydra's run mode takes them
    if math.prod(sizes) <= MAX_CHECKED_JOBS:
        return sweep_grid(lines)
    first = first_job(lines)
    jobs = [first]
    for i, size in enumerate(sizes):
        if size > 1:
            jobs += sweep_grid(first[:i] + [lines[i]] + first[i + 1:])[1:]
    return jobs


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
    if "--version" in args:  # lbt's, with the Hydra it runs on (Hydra's own flag would name Hydra only)
        print(f"lbt {lbt.__version__} (Hydra {hydra.__version__})")
        return
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
    env, checked = pg.torchrun_env(), None
    if (env["rank"] if env else 0) == 0:
        if not options.config_path:
            checked = precheck(overrides, options.config_dir, options.config_name or "config")
    else:
        # Only torchrun's rank 0 owns the run folder: the others must not create folders or log files
        # of their own (see lbt.engine.worker._agree_on_run_dir).
        overrides += ["hydra.output_subdir=null", "hydra.run.dir=.", "hydra/job_logging=disabled",
                      "hydra/hydra_logging=disabled"]
    if options.cfg == "job" and not options.package and not options.config_path:
        print_job_config(overrides, options.config_dir, options.config_name or "config", checked)
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


def print_job_config(overrides: list[str], config_dir: str | None, config_name: str,
                     composed: Composed | None = None) -> None:
    """`--cfg job`: the job's config, resolved, with the values lbt derives (both batch sizes, world size and
    processes) filled in where the config leaves them null. `composed`: the job's config as `precheck`
    composed it (the same overrides less Hydra's own), else it is composed here."""
    hydra_free = [o for o in overrides if not o.startswith(("hydra.", "hydra/"))]
    try:
        if composed is None:
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
    """The sweep's first job, each swept key at its first value, the rest as given."""
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
    """One job as Hydra starts it: trained, and its outcome recorded (lbt/apps/job.py)."""
    job = HydraJob.current(cfg)
    if not job.prepare():
        return
    started, earlier = time.perf_counter(), finished_here(job.output_dir)
    try:
        result, recorded = job.train(), not earlier  # the study's header counts the jobs it keeps
    except Exception as error:  # a crash in one job of a sweep must not stop the others
        result = job.failed(error)
        recorded = record_failure(job.output_dir, result)
    if job.study is not None and recorded:
        say_job(job.study, result, time.perf_counter() - started, job.hydra_cfg)


