"""`lbt report DIR`'s command line: its options, read in the terms of --metric, and the report it prints."""

from __future__ import annotations

import argparse
import math
import os

from lbt.apps.errors import fail
from lbt.apps.report import write_report
from lbt.errors import ConfigError
from lbt.spec.objective import METRICS

# The flags `lbt study` hands over to its report (each takes a value).
REPORT_FLAGS = ("--metric", "--target", "--tolerance", "--network", "--step-ms", "--hybrid-cap")


def accuracy_target(text: str) -> float:
    """`0.95` or `95%`; a bare 95 is refused rather than read as an accuracy no run can reach."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (give 0.95 or 95%)") from None
    if not 0 < value <= 1:
        hint = f" (for {value:g} percent write {value:g}%)" if 1 < value <= 100 and not text.endswith("%") else ""
        raise argparse.ArgumentTypeError(f"{text} is not an accuracy between 0 and 1{hint}")
    return value


def bounded(text: str, what: str, example: str, high: float, within: str) -> float:
    """A number in (0, high] (or (0, inf) with high inf), read from the command line; `within` says the range."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what} (e.g. {example})") from None
    if not 0 < value <= high or value == math.inf:
        raise argparse.ArgumentTypeError(f"{text} is not {within}")
    return value


def points(text: str) -> float:
    """Accuracy points, e.g. `1` or `0.5` (of 100)."""
    return bounded(text, "a number of accuracy points", "1 or 0.5", 100, "between 0 and 100 accuracy points")


def loss_value(text: str) -> float:
    """A loss in nats (a target, or a tolerance), e.g. `2.1` or `0.05`."""
    return bounded(text, "a loss in nats", "2.1", math.inf, "a positive loss in nats")


# How --target and --tolerance read for each --metric: accuracy (0.95 or 95%; points) or loss (nats).
METRIC_READERS = {"acc": (accuracy_target, points), "loss": (loss_value, loss_value)}


def report_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lbt report", description="Report of a study (multirun) folder.")
    parser.error = lambda message: fail(f"lbt report: {message}")  # type: ignore[method-assign]
    parser.add_argument("study_dir")
    parser.add_argument("--metric", choices=list(METRIC_READERS), default="acc",
                        help="judge the runs by final val accuracy (acc, higher is better) or val loss (loss, in "
                             "nats, lower is better; a language model's bits per char or token x ln 2)")
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
                                          "(lbt plan's presets, e.g. 10gbe, ib-hdr)")
    parser.add_argument("--step-ms", type=float, help="with --network: a worker's step time measured elsewhere "
                                                      "(default: from the study's smallest-batch run)")
    parser.add_argument("--hybrid-cap", type=int, metavar="B",
                        help="past this global batch, more GPUs split the model (data x tensor parallelism) "
                             "instead of growing the batch: the report's hybrid section and accuracy_vs_gpus.png "
                             "(default: each recipe's largest batch within the tolerance)")
    return parser


def report_options(args: list[str]) -> argparse.Namespace:
    """`lbt report`'s options, --target and --tolerance read in the terms of --metric."""
    options = report_parser().parse_args(args)
    for flag, reader in zip(("target", "tolerance"), METRIC_READERS[options.metric]):
        text = getattr(options, flag)
        try:
            setattr(options, flag, None if text is None else reader(text))
        except argparse.ArgumentTypeError as error:
            fail(f"lbt report: argument --{flag}: {error}")
    return options


def report_command(args: list[str]) -> None:
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
