"""`lbt study`: a Hydra multirun over recipes x GPU counts (conf/study/*.yaml), its extra grids, then its report."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser

from lbt.apps.compose import compose
from lbt.apps.errors import fail
from lbt.apps.report.cli import REPORT_FLAGS, report_command, report_options
from lbt.apps.train import check_sweep, train_command
from lbt.errors import ConfigError

STUDY_HELP = """usage: lbt study [overrides]

Runs a study (a Hydra multirun over recipes x GPU counts, conf/study/*.yaml), any extra grids it
declares, then writes its report (report.md, PNG curves, summary.json, tb_summary/).

  lbt study                                  the default study (study=default) on MNIST-1D
  lbt study study=gpu_counts                 another study config
  lbt study trainer.epochs=3 trainer.seed=0,1   any `lbt train` override applies to every job
  lbt study hydra.sweep.dir=runs/study/mine  where it goes (default runs/study/<date>_<time>)
  lbt study hydra/launcher=slurm             on a cluster (README: Launchers)

Then `lbt report DIR --target 0.95` re-reads the folder with another accuracy target
(`--metric loss --target 2.1`: a loss target, lower is better).
"""


def study_command(args: list[str]) -> None:
    """A study is a Hydra multirun (conf/study/*.yaml), any extra grids of it, then its report."""
    if any(a in ("-h", "--help") for a in args):
        print(STUDY_HELP)
        return
    report_args, args = report_flags(args)
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
    multirun(args)
    own_args = [a for a in args if not a.startswith("hydra.sweep.dir=")]
    for name, overrides in grids:
        print(f"extra sweep {name}: {' '.join(overrides)}", flush=True)
        multirun([*own_args, *overrides, f"hydra.sweep.dir={sweep_dir}/{name}"])
    report_command([sweep_dir, *report_args])
    check_sweep(sweep_dir)
    print(f"study finished in {time.perf_counter() - started:.0f} s; report: {Path(sweep_dir).resolve()}/report.md")


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
        plain = [o.input_line for o in parsed if not o.is_sweep_override() and not o.key_or_group.startswith("hydra")]
        extra = compose(plain, job_name="lbt_study").config.get("extra_sweeps") or {}
    except ConfigError as error:
        fail(str(error))
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
