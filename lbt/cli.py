"""The `lbt` command: `lbt train | study | tune | report | plan`, also as `python -m lbt` and `torchrun -m lbt`.

The one entry module: Hydra's main, argument handling and failure recording
live here; the library (`lbt.train.run` and what it builds) never imports it.
Hydra is imported here, in lbt/compose.py (schemas, one-line errors), in
lbt/train.py (objects built with hydra.utils.instantiate) and in lbt/tune.py
(the tuner composes each trial's config); nowhere else in lbt/. A config
mistake ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import os
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lbt import dist as lbt_dist
from lbt.compose import one_line, register_schemas
from lbt.errors import ConfigError
from lbt.paths import conf_dir
from lbt.train import check_layout, check_run_folder, exit_worker, record_failure, run

USAGE = """usage: lbt COMMAND [args]

commands:
  train [overrides]     one training run, e.g. `lbt train model=mlp dist.world_size=16`
                        (-m for a Hydra multirun sweep, --cfg job to print the config)
  study [overrides]     run a study (default: study=default, recipes x GPU counts on MNIST-1D)
                        and write its report; e.g. `lbt study study=gpu_counts`
  tune [overrides]      the same tuning budget (Optuna trials, chosen on val) for every cell of
                        recipes x world sizes, then the best and the untuned defaults over seeds,
                        scored on test; e.g. `lbt tune recipe=baseline,lamb dist.world_size=16,64`
  report DIR [--target ACC]
                        turn a multirun folder into report.md, PNG curves, summary.json, tb_summary/
  plan [options]        predict time per epoch vs GPU count from measured compute and a network
                        model: where adding GPUs stops paying (`lbt plan --help`)
"""


def fail(message: str) -> None:
    print(f"lbt: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def precheck(overrides: list[str]) -> None:
    """Compose the config as Hydra will and validate it, before Hydra's own reporting.

    Hydra prints composition errors over several lines with a hint about
    HYDRA_FULL_ERROR; composing here first turns them into one line.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as error:
        fail(one_line(error))
    if any(override.is_sweep_override() for override in parsed):
        return  # a sweep: every job validates its own config and records a failure
    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name="lbt_precheck"):
            cfg = compose("config", overrides=overrides)
        config = OmegaConf.to_container(cfg, resolve=True)
        check_layout(config, lbt_dist.torchrun_env())
        # The output folder, read from the overrides (as given, else under ./runs): composing
        # Hydra's own config here made later P=2 workers abort at exit (bench/README.md "Known incidents").
        folders = {o.key_or_group: o.value() for o in parsed if o.key_or_group in ("hydra.run.dir", "hydra.sweep.dir")}
        for key, folder in (folders or {"hydra.run.dir": "runs"}).items():
            check_writable(str(folder), key)
        if "hydra.run.dir" in folders:
            # Refused before Hydra writes the command's .hydra/ config over the run it would not continue.
            check_run_folder(config, str(folders["hydra.run.dir"]))
    except ConfigError as error:
        fail(str(error))
    except Exception as error:  # Hydra / OmegaConf composition errors
        fail(one_line(error))


def check_writable(folder: str, key: str) -> None:
    """The run folder can be created and written, or one line says why (before Hydra tries)."""
    from pathlib import Path

    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={folder}: cannot create the run folder, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={folder}: cannot write the run folder, {existing} is not writable")


def train_command(args: list[str]) -> None:
    env = lbt_dist.torchrun_env()
    worker_rank = env["rank"] if env else 0
    plain_overrides = not any(arg.startswith("-") for arg in args)
    if plain_overrides:
        if worker_rank == 0:
            precheck(args)
        else:
            # Only torchrun's rank 0 owns the run folder: the others must not
            # create folders or log files of their own (see lbt.train._agree_on_run_dir).
            args = args + ["hydra.output_subdir=null", "hydra.run.dir=.",
                           "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    sys.argv = ["lbt train", *args]
    hydra_main()


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    recipe = hydra_cfg.runtime.choices.get("recipe")
    # In a sweep, a failing job is recorded in its result.json and the sweep goes on.
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    try:
        run(cfg, output_dir, recipe=recipe, overrides=overrides)
        return
    except (ConfigError, lbt_dist.WorkerDied) as error:
        if str(error):
            print(f"lbt: error: {error}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(2 if isinstance(error, ConfigError) or not str(error) else 1)
        message = str(error) or "config error in a worker"
    except Exception as error:  # a crash in one job of a sweep must not stop the others
        if not sweeping:
            raise
        print(f"lbt: job failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        message = f"{type(error).__name__}: {error}"
    config = OmegaConf.to_container(cfg, resolve=True)
    record_failure({**config, "recipe": recipe, "overrides": overrides}, output_dir, message)


def extra_sweeps(args: list[str]) -> list[tuple[str, list[str]]]:
    """The study's further grids (`extra_sweeps` in conf/study/*.yaml) as (name, overrides).

    Hydra's basic sweeper runs one grid; a study may add others, e.g. more seeds
    at the large batches only, where runs vary most and cost least. A grid whose
    keys the command line sets is skipped: the user's sweep is the one they asked for.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([a for a in args if not a.startswith("-")])
        plain = [o.input_line for o in parsed if not o.is_sweep_override() and not o.key_or_group.startswith("hydra")]
        with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name="lbt_study"):
            extra = compose("config", overrides=plain).get("extra_sweeps") or {}
    except Exception as error:
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


def _multirun(args: list[str]) -> None:
    try:
        train_command(args)
    except SystemExit as done:
        if done.code not in (0, None):
            raise


def study_command(args: list[str]) -> None:
    """A study is a Hydra multirun (conf/study/*.yaml), any extra grids of it, then its report."""
    import time
    from pathlib import Path

    if not any(a.startswith("study=") for a in args):
        args = ["study=default", *args]
    sweep_dir = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.sweep.dir=")), None)
    if sweep_dir is None:
        sweep_dir = f"runs/study/{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        args = [*args, f"hydra.sweep.dir={sweep_dir}"]
    grids = extra_sweeps(args)
    started = time.perf_counter()
    _multirun(args)
    own_args = [a for a in args if not a.startswith("hydra.sweep.dir=")]
    for name, overrides in grids:
        print(f"extra sweep {name}: {' '.join(overrides)}", flush=True)
        _multirun([*own_args, *overrides, f"hydra.sweep.dir={sweep_dir}/{name}"])
    report_command([sweep_dir])
    print(f"study finished in {time.perf_counter() - started:.0f} s; report: {Path(sweep_dir).resolve()}/report.md")


def tune_command(args: list[str]) -> None:
    from lbt.tune import tune

    try:
        tune(args)
    except ConfigError as error:
        fail(str(error))


def report_command(args: list[str]) -> None:
    import argparse

    from lbt.report import write_report

    parser = argparse.ArgumentParser(prog="lbt report", description="Report of a study (multirun) folder.")
    parser.add_argument("study_dir")
    parser.add_argument("--target", type=float, default=None,
                        help="accuracy for steps-to-target (default: the base batch's final accuracy minus 1 point)")
    options = parser.parse_args(args)
    if not os.path.isdir(options.study_dir):
        fail(f"no such study folder: {options.study_dir}")
    try:
        summary = write_report(options.study_dir, options.target)
    except ConfigError as error:
        fail(str(error))
    print(open(os.path.join(options.study_dir, "report.md")).read())
    print(f"wrote report.md, accuracy_vs_batch.png, steps_to_target.png, summary.json, tb_summary/ "
          f"({len(summary['jobs'])} jobs) in {options.study_dir}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, args = argv[0], argv[1:]
    register_schemas()
    if command == "train":
        train_command(args)
        if lbt_dist.torchrun_env() is not None:  # a torchrun worker: see lbt.train.exit_worker
            exit_worker()
    elif command == "study":
        study_command(args)
    elif command == "tune":
        tune_command(args)
    elif command == "report":
        report_command(args)
    elif command == "plan":
        from lbt.plan import plan_main

        sys.exit(plan_main(args))
    else:
        print(USAGE, file=sys.stderr)
        fail(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
