"""`lbt probe`'s own settings (`probe.KEY=VALUE` on its command line), checked at once: one line per mistake."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

from lbt.errors import ConfigError
from lbt.spec.objective import Metric, metric_named
from lbt.spec.validate import integer, number


@dataclass(frozen=True)
class ProbeSettings:
    # The defaults are the probe bench/critical.py chose on its workloads (bench/results/2026-12-02-critical.md):
    # snapshots at 17% and 50% of the budget, held-LR branches of 5%, cooldowns of 20%.
    checkpoints: int = 2  # K snapshots of the base run, log-uniform in samples seen from `first` to `last`
    first: float = 0.171  # of the budget
    last: float = 0.5
    max_factor: int = 128  # branches at k x the base batch, k = 1, 2, 4, ... up to this
    delta: float = 0.05  # each held-LR branch's samples, as a fraction of the budget (at least 2 largest steps)
    cooldown: float = 0.2  # k=1 cooldowns from each snapshot, as a fraction of its samples (0: none)
    seeds: int = 1  # k=1 held-LR branches with different data orders at each checkpoint (2+: a noise floor)
    metric: str = "acc"  # the study's criterion: acc (points) or loss (nats)
    tolerance: float | None = None  # in the metric's units; default: the study's (1 point, 0.05 nats)
    evals: int = 8  # evaluations over each branch (the k=1 curve the samples ratio reads)
    diverge: float = 3.0  # a branch whose train loss passes this x its start loss stops, failed
    confirm: bool = False  # then full runs around the prediction, until they give the sweep's answer
    prune: bool = True  # a checkpoint closes at the first factor it predicts to fail (false: every factor runs)
    dir: str = ""  # the probe folder; default runs/probe/<date>_<time>

    @property
    def criterion(self) -> Metric:
        return metric_named(self.metric, "probe.metric")

    @property
    def within(self) -> float:
        return self.criterion.default_tolerance if self.tolerance is None else self.tolerance

    @property
    def factors(self) -> list[int]:
        return [2**i for i in range(int(math.log2(self.max_factor)) + 1)]

    def check(self) -> ProbeSettings:
        integer("probe.checkpoints", self.checkpoints, 1, 50)
        number("probe.first", self.first, low=0, high=1, low_open=True, high_open=True)
        number("probe.last", self.last, low=self.first, high=1, high_open=True)
        factor = integer("probe.max_factor", self.max_factor, 2, 1 << 20)
        if factor & (factor - 1):
            raise ConfigError(f"probe.max_factor={factor}: give a power of two (branches double the batch)")
        number("probe.delta", self.delta, low=0, high=1, low_open=True)
        number("probe.cooldown", self.cooldown, low=0, high=1)
        integer("probe.seeds", self.seeds, 1, 16)
        self.criterion  # noqa: B018 (checks the name)
        if self.tolerance is not None:
            number("probe.tolerance", self.tolerance, low=0, low_open=True)
        integer("probe.evals", self.evals, 1, 100)
        number("probe.diverge", self.diverge, low=1, low_open=True)
        check_dir(self.dir)
        return self


def split_args(args: list[str]) -> tuple[ProbeSettings, list[str]]:
    """(the probe's settings, the rest: `lbt train` overrides and Hydra's launcher choice)."""
    from lbt.apps.compose import compose_settings

    args = config_dir_flag(args)
    own = [a for a in args if a.lstrip("+~").startswith("probe.")]
    for arg in own:  # before Hydra reads it: a comma would make it a sweep, a space or a non-ASCII letter a job's
        if arg.startswith("probe.dir="):  # command line Hydra cannot take back
            check_dir(arg.removeprefix("probe.dir="))
    settings = compose_settings(ProbeSettings, "probe", own)  # `lbt probe --cfg job` shows them
    if not settings.dir:
        settings = replace(settings, dir=f"runs/probe/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    return settings.check(), [a for a in args if a not in own]


def check_dir(folder: str) -> None:
    if not re.fullmatch(r"[\w./~+-]+", folder, re.ASCII):
        raise ConfigError(f"probe.dir={folder}: give a path of letters, digits and . _ - / ~ + (its branches are "
                          "Hydra jobs, whose command line holds no spaces, commas or other characters)")


def config_dir_flag(args: list[str]) -> list[str]:
    """`--config-dir DIR` (or `-cd DIR`, `--config-dir=DIR`), your own configs as `lbt train` takes them, as one
    `--config-dir=/absolute/DIR` element: every run of the probe gets it, from any working directory."""
    out, given = [], iter(args)
    for arg in given:
        if arg in ("--config-dir", "-cd"):
            value = next(given, None)
            if value is None:
                raise ConfigError(f"{arg} needs a folder ({arg} DIR)")
            arg = f"--config-dir={value}"
        if arg.startswith("--config-dir="):
            arg = f"--config-dir={Path(arg.split('=', 1)[1]).expanduser().absolute()}"
        out.append(arg)
    return out
