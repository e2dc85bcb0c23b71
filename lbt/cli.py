"""The `lbt` command: `lbt train | study | tune | report | plan`, also as `python -m lbt` and `torchrun -m lbt`.

The one entry module: Hydra's main, argument handling and failure recording
live here; the library (`lbt.train.run` and what it builds) never imports it.
Hydra is imported here, in lbt/compose.py (schemas, one-line errors), in
lbt/train.py (objects built with hydra.utils.instantiate) and in lbt/tune.py
(the tuner composes each trial's config); nowhere else in lbt/. A config
mistake ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lbt import dist as lbt_dist
from lbt.compose import explain, one_line, register_schemas
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
  report DIR [--target ACC] [--metric loss --target LOSS]
                        turn a multirun folder into report.md, PNG curves, summary.json, tb_summary/
  plan [options]        predict time per epoch vs GPU count from measured compute and a network
                        model: where adding GPUs stops paying (`lbt plan --help`)
"""


STUDY_HELP = """usage: lbt study [overrides]

Runs a study (a Hydra multirun over recipes x GPU counts, conf/study/*.yaml), any extra grids it
declares, then writes its report (report.md, PNG curves, summary.json, tb_summary/).

  lbt study                                  the default study (study=default) on MNIST-1D
  lbt study study=gpu_counts                 another study config
  lbt study trainer.epochs=3 seeds=0,1       any `lbt train` override applies to every job
  lbt study hydra.sweep.dir=runs/study/mine  where it goes (default runs/study/<date>_<time>)
  lbt study hydra/launcher=slurm             on a cluster (README: Launchers)

Then `lbt report DIR --target 0.95` re-reads the folder with another accuracy target
(`--metric loss --target 2.1`: a loss target, lower is better).
"""


def fail(message: str) -> None:
    print(f"lbt: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# A sweep's jobs are each composed and checked before it starts, up to this many; beyond, each swept value
# is checked once (with the other sweeps at their first value), which still catches a mistyped name.
MAX_CHECKED_JOBS = 64


def precheck(overrides: list[str], config_dir: str | None = None, config_name: str = "config") -> None:
    """Compose the config as Hydra will and validate it, before Hydra's own reporting.

    Hydra prints composition errors over several lines with a hint about
    HYDRA_FULL_ERROR; composing here first turns them into one line. In a sweep
    every job is composed, so `recipe=goyal,baseline` fails before any job runs.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as error:
        fail(one_line(error))
    search = [conf_dir()] + ([Path(config_dir).expanduser().absolute()] if config_dir else [])
    if config_dir and not search[-1].is_dir():
        fail(f"--config-dir {config_dir}: no such folder")
    searchpath = [f"hydra.searchpath=[file://{search[-1]}]"] if config_dir else []
    # Hydra's own settings (launcher, sweeper, run folder) are Hydra's to check.
    ours = [o for o in parsed if not o.key_or_group.startswith("hydra")]
    jobs = sweep_jobs(ours)
    for index, job in enumerate(jobs):
        # A mistake of every job is reported plainly; one of a later job names that job.
        label = " ".join(o for o, swept in job if swept) if index else ""
        try:
            config = check_job([o for o, _ in job] + searchpath, config_name, search, whole=len(jobs) == 1)
        except ConfigError as error:
            fail(f"job {label}: {error}" if label and not str(error).startswith(label.split()[0]) else str(error))
    folders = {o.key_or_group: o.value() for o in parsed if o.key_or_group in ("hydra.run.dir", "hydra.sweep.dir")}
    try:
        for key, folder in (folders or {"hydra.run.dir": "runs"}).items():
            check_writable(str(folder), key)
        if "hydra.run.dir" in folders and len(jobs) == 1:
            # Refused before Hydra writes the command's .hydra/ config over the run it would not continue.
            check_run_folder(config, str(folders["hydra.run.dir"]))
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
    sizes = [len(axis) for axis in axes]
    if math.prod(sizes) <= MAX_CHECKED_JOBS:
        return [list(job) for job in itertools.product(*axes)]
    first = [axis[0] for axis in axes]
    return [first] + [first[:i] + [value] + first[i + 1:] for i, axis in enumerate(axes) for value in axis[1:]]


def check_job(overrides: list[str], config_name: str, search: list[Path], whole: bool = True) -> dict:
    """One job's config: composed, every mandatory value given, the layout checked; else a ConfigError.

    Of a sweep's jobs (`whole=False`) only the composition is checked, which Hydra needs to launch
    any job: a job whose values are wrong (a batch that does not divide) is recorded in its
    result.json and the sweep goes on, as a diverged job is.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf.errors import MissingMandatoryValue

    with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name="lbt_precheck"):
        try:
            cfg = compose(config_name, overrides=overrides)
        except Exception as error:  # Hydra / OmegaConf composition errors, with the closest name if mistyped
            raise ConfigError(explain(error, composed_without(overrides, config_name, error), search)) from None
    if not whole:
        return {}
    try:
        config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        key = error.full_key
        raise ConfigError(f"{key} has no default and must be given, e.g. {key}=...") from None
    except Exception as error:  # an interpolation that does not resolve
        raise ConfigError(one_line(error)) from None
    check_layout(config, lbt_dist.torchrun_env())
    return config


def composed_without(overrides: list[str], config_name: str, error: BaseException) -> dict | None:
    """The config without the override an error names, to suggest the key the user meant."""
    from hydra import compose

    culprit = str(error).split("'")[1] if str(error).count("'") >= 2 else None
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != culprit]
    try:
        return OmegaConf.to_container(compose(config_name, overrides=keep), resolve=False)
    except Exception:
        return None


def check_writable(folder: str, key: str) -> None:
    """The run folder can be created and written, or one line says why (before Hydra tries)."""
    from pathlib import Path

    path = Path(folder).expanduser().absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={folder}: cannot create the run folder, {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={folder}: cannot write the run folder, {existing} is not writable")


def hydra_options(args: list[str]):
    """Hydra's own command line (`-m`, `--cfg`, `--config-dir`, overrides), read with Hydra's parser in any order."""
    from hydra._internal.utils import get_args_parser

    try:
        return get_args_parser().parse_intermixed_args(args)
    except SystemExit:
        sys.exit(2)  # argparse printed its one-line usage error


def train_command(args: list[str], report_failures: bool = True) -> None:
    options = hydra_options(args)
    if options.help or options.hydra_help or options.info or options.shell_completion:
        sys.argv = ["lbt train", *args]
        hydra_main()  # Hydra's own help and introspection, untouched
        return
    overrides = list(options.overrides)
    left = list(overrides)
    flags = [a for a in args if not (left and a == left[0] and left.pop(0) is not None)]
    if options.cfg and (options.multirun or first_job(overrides) != overrides):
        # Hydra prints one config, not a sweep's: show the first job's, and say so.
        flags = [a for a in flags if a not in ("-m", "--multirun")]
        overrides = first_job(overrides)
        print(f"lbt: note: --cfg shows the sweep's first job ({' '.join(overrides)})", file=sys.stderr)
        options.multirun = False
    env = lbt_dist.torchrun_env()
    if (env["rank"] if env else 0) == 0:
        if not options.config_path:
            precheck(overrides, options.config_dir, options.config_name or "config")
    else:
        # Only torchrun's rank 0 owns the run folder: the others must not
        # create folders or log files of their own (see lbt.train._agree_on_run_dir).
        overrides += ["hydra.output_subdir=null", "hydra.run.dir=.",
                      "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    sweep_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.dir=")), None)
    if options.multirun and not options.cfg and sweep_dir is None:
        # Named here (as the config's default would), so the sweep's results can be read when it ends.
        sweep_dir = f"runs/multirun/{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        overrides.append(f"hydra.sweep.dir={sweep_dir}")
    sys.argv = ["lbt train", *flags, *overrides]
    hydra_main()
    if options.multirun and not options.cfg and report_failures:
        check_sweep(sweep_dir)


def first_job(overrides: list[str]) -> list[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" if o.is_sweep_override()
            else o.input_line for o in parsed]


def check_sweep(sweep_dir: str) -> None:
    """A sweep in which no job succeeded ends with one line and a non-zero exit, not 0."""
    results = []
    for path in sorted(Path(sweep_dir).glob("**/result.json")):
        try:
            results.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            results.append({"error": f"unreadable {path}"})
    failed = [r for r in results if "error" in r]
    if results and len(failed) == len(results):
        fail(f"every job of the sweep failed ({len(failed)} of {len(results)}), the first with: "
             f"{failed[0]['error']}; results in {sweep_dir}")


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
        train_command(args, report_failures=False)  # the study reports its failed jobs after its report
    except SystemExit as done:
        if done.code not in (0, None):
            raise


def study_command(args: list[str]) -> None:
    """A study is a Hydra multirun (conf/study/*.yaml), any extra grids of it, then its report."""
    if any(a in ("-h", "--help") for a in args):
        print(STUDY_HELP)
        return
    report_options, args = report_flags(args)
    if not any(a.startswith("study=") for a in args):
        args = ["study=default", *args]
    if any(a in ("--cfg", "-c") or a.startswith("--cfg=") for a in args):
        train_command(args)  # the composed config of the study's first job (and Hydra's), nothing run
        return
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
    report_command([sweep_dir, *report_options])
    check_sweep(sweep_dir)
    print(f"study finished in {time.perf_counter() - started:.0f} s; report: {Path(sweep_dir).resolve()}/report.md")


def report_flags(args: list[str]) -> tuple[list[str], list[str]]:
    """`lbt study`'s report options (--metric, --target, --tolerance, --network, --step-ms, --hybrid-cap, as
    `lbt report` takes them)
    apart from its overrides."""
    flags, rest, i = [], [], 0
    while i < len(args):
        name = args[i].split("=", 1)[0]
        if name in ("--metric", "--target", "--tolerance", "--network", "--step-ms", "--hybrid-cap"):
            if "=" in args[i]:
                flags.append(args[i])
            elif i + 1 < len(args):
                flags += args[i:i + 2]
                i += 1
            else:
                fail(f"lbt study: {name} needs a value")
            i += 1
            continue
        rest.append(args[i])
        i += 1
    report_options(["study_dir", *flags])  # checked now, not after the study ran
    return flags, rest


def tune_command(args: list[str]) -> None:
    from lbt.tune import tune

    try:
        tune(args)
    except ConfigError as error:
        fail(str(error))


def accuracy_target(text: str) -> float:
    """`0.95` or `95%`; a bare 95 is refused rather than read as an accuracy no run can reach."""
    import argparse

    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (give 0.95 or 95%)") from None
    if not 0 < value <= 1:
        hint = f" (for {value:g} percent write {value:g}%)" if 1 < value <= 100 and not text.endswith("%") else ""
        raise argparse.ArgumentTypeError(f"{text} is not an accuracy between 0 and 1{hint}")
    return value


def points(text: str) -> float:
    """Accuracy points, e.g. `1` or `0.5` (of 100)."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of accuracy points (e.g. 1 or 0.5)") from None
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 100 accuracy points")
    return value


def loss_value(text: str) -> float:
    """A loss in nats (a target, or a tolerance), e.g. `2.1` or `0.05`."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a loss in nats (e.g. 2.1)") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not a positive loss in nats")
    return value


# How --target and --tolerance read for each --metric: accuracy (0.95 or 95%; points) or loss (nats).
METRIC_READERS = {"acc": (accuracy_target, points), "loss": (loss_value, loss_value)}


def report_parser():
    import argparse

    from lbt.objective import METRICS

    parser = argparse.ArgumentParser(prog="lbt report", description="Report of a study (multirun) folder.")
    parser.error = lambda message: fail(f"lbt report: {message}")  # one line, not usage + error
    parser.add_argument("study_dir")
    parser.add_argument("--metric", choices=list(METRIC_READERS), default="acc",
                        help="judge the runs by final val accuracy (acc, higher is better) or val loss (loss, in "
                             "nats, lower is better; a language model's bits per char x ln 2)")
    parser.add_argument("--target", default=None,
                        help="for steps-to-target: an accuracy as 0.95 or 95%%, or with --metric loss a loss in "
                             "nats (default: the base batch's final value, worse by "
                             f"{METRICS['acc'].units(METRICS['acc'].target_margin)} of accuracy or "
                             f"{METRICS['loss'].units(METRICS['loss'].target_margin)} of loss)")
    parser.add_argument("--tolerance", default=None,
                        help="how many GPUs: the largest batch within this many accuracy points (or nats of loss) "
                             f"of the smallest batch (default {METRICS['acc'].units(METRICS['acc'].default_tolerance)}"
                             f", {METRICS['loss'].units(METRICS['loss'].default_tolerance)})")
    parser.add_argument("--network", help="also answer which GPU count reaches the target soonest on this network "
                                          "(lbt plan's presets, e.g. 10gbe, ib-fdr)")
    parser.add_argument("--step-ms", type=float, help="with --network: a worker's step time measured elsewhere "
                                                      "(default: from the study's smallest-batch run)")
    parser.add_argument("--hybrid-cap", type=int, metavar="B",
                        help="past this global batch, more GPUs split the model (data x tensor parallelism) "
                             "instead of growing the batch: the report's hybrid section and accuracy_vs_gpus.png "
                             "(default: each recipe's largest batch within the tolerance)")
    return parser


def report_options(args: list[str]):
    """`lbt report`'s options, --target and --tolerance read in the terms of --metric."""
    import argparse

    options = report_parser().parse_args(args)
    for flag, reader in zip(("target", "tolerance"), METRIC_READERS[options.metric]):
        text = getattr(options, flag)
        try:
            setattr(options, flag, None if text is None else reader(text))
        except argparse.ArgumentTypeError as error:
            fail(f"lbt report: argument --{flag}: {error}")
    return options


def report_command(args: list[str]) -> None:
    from lbt.report import write_report

    options = report_options(args)
    if not os.path.isdir(options.study_dir):
        fail(f"no such study folder: {options.study_dir}")
    try:
        if options.step_ms is not None and (options.network is None or not options.step_ms > 0):
            raise ConfigError("--step-ms takes a positive time in ms and goes with --network")
        if options.hybrid_cap is not None and options.hybrid_cap < 1:
            raise ConfigError(f"--hybrid-cap {options.hybrid_cap}: give a global batch of at least 1")
        summary = write_report(options.study_dir, options.target, options.tolerance, options.network,
                               options.step_ms, options.metric, options.hybrid_cap)
    except ConfigError as error:
        fail(str(error))
    print(open(os.path.join(options.study_dir, "report.md")).read())
    print(f"wrote {', '.join(summary['files'])}/ ({len(summary['jobs'])} jobs) in {options.study_dir}")


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
        from lbt.plan_cli import plan_main

        sys.exit(plan_main(args))
    else:
        print(USAGE, file=sys.stderr)
        fail(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
