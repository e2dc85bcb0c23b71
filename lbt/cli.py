"""`lbt` command line: `lbt train [hydra overrides]`.

Together with lbt/train.py, the only place that imports Hydra. A config
mistake ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import os
import sys

USAGE = """usage: lbt COMMAND [args]

commands:
  train [overrides]     one training run, e.g. `lbt train model=mlp dist.world_size=16`
                        (-m for a Hydra multirun sweep, --cfg job to print the config)
  study [overrides]     run a study (default: study=default, recipes x GPU counts on MNIST-1D)
                        and write its report; e.g. `lbt study study=gpu_counts`
  report DIR [--target ACC]
                        turn a multirun folder into report.md, PNG curves, summary.json, tb_summary/
  plan [options]        predict time per epoch vs GPU count from measured compute and a network
                        model: where adding GPUs stops paying (`lbt plan --help`)
"""


def one_line(error: BaseException) -> str:
    """Fold a (possibly multi-line) Hydra/OmegaConf error into one readable line."""
    messages = [str(error)]
    if error.__cause__ is not None and str(error.__cause__) not in messages[0]:
        messages.append(str(error.__cause__))
    noise = ("full_key:", "object_type=", "reference_type=", "Set the environment", "To append")
    parts: list[str] = []
    for message in messages:
        for raw in message.splitlines():
            line = raw.strip()
            if not line or line.startswith(noise):
                continue
            if raw[:1] in ("\t", " ") and parts:  # an item of a listed set of options
                parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
            else:
                parts.append(line)
    return " ".join(parts) or type(error).__name__


def fail(message: str) -> None:
    print(f"lbt: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def precheck(overrides: list[str]) -> None:
    """Compose the config as Hydra will and validate it, before Hydra's own reporting.

    Hydra prints composition errors over several lines with a hint about
    HYDRA_FULL_ERROR; composing here first turns them into one line.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lbt.errors import ConfigError
    from lbt.paths import conf_dir
    from lbt.train import _check_layout
    from lbt import dist as lbt_dist

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
        _check_layout(config, lbt_dist.torchrun_env())
        # The output folder: as given, else under ./runs (both defaults of conf/config.yaml).
        # Read from the overrides: composing Hydra's own config here (which loads every
        # launcher plugin) made the spawned workers of a later P=2 run abort at exit
        # (SIGABRT, "terminate called without an active exception") in ~7% of runs.
        folders = {o.key_or_group: o.value() for o in parsed if o.key_or_group in ("hydra.run.dir", "hydra.sweep.dir")}
        for key, folder in (folders or {"hydra.run.dir": "runs"}).items():
            check_writable(str(folder), key)
    except ConfigError as error:
        fail(str(error))
    except Exception as error:  # Hydra / OmegaConf composition errors
        fail(one_line(error))


def check_writable(folder: str, key: str) -> None:
    """The run folder can be created and written, or one line says why (before Hydra tries)."""
    from pathlib import Path

    from lbt.errors import ConfigError

    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={folder}: cannot create the run folder, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={folder}: cannot write the run folder, {existing} is not writable")


def train_command(args: list[str]) -> None:
    from lbt.dist import torchrun_env

    env = torchrun_env()
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
    from lbt.train import hydra_main

    sys.argv = ["lbt train", *args]
    hydra_main()


def extra_sweeps(args: list[str]) -> list[tuple[str, list[str]]]:
    """The study's further grids (`extra_sweeps` in conf/study/*.yaml) as (name, overrides).

    Hydra's basic sweeper runs one grid; a study may add others, e.g. more seeds
    at the large batches only, where runs vary most and cost least. A grid whose
    keys the command line sets is skipped: the user's sweep is the one they asked for.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    import lbt.train  # noqa: F401  (registers the config schemas)
    from lbt.paths import conf_dir

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


def report_command(args: list[str]) -> None:
    import argparse

    from lbt.errors import ConfigError
    from lbt.report import write_report

    parser = argparse.ArgumentParser(prog="lbt report", description="Report of a study (multirun) folder.")
    parser.add_argument("study_dir")
    parser.add_argument("--target", type=float, default=0.95, help="accuracy for steps-to-target (default 0.95)")
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
    if command == "train":
        train_command(args)
    elif command == "study":
        study_command(args)
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
