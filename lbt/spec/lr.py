"""The learning rate: one pure function of samples seen, `lr_at(samples_seen, schedule)`.

The `schedule` config node (conf/schedule/, checked as a ScheduleSpec below) holds
everything the LR depends on: the scaling rule and its base batch, the warmup, the decay. `build_schedule`
turns it, once per run, into a `Schedule` whose lengths are sample counts on
step boundaries; `lr_at` reads it top to bottom. Progress is counted in samples
seen, not steps, so a batch ramp does not distort the curve and a resumed run
needs no scheduler state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal, get_args

from lbt.errors import ConfigError
from lbt.spec.batching import Budget
from lbt.spec.validate import integer, number, one_of

Scaling = Literal["none", "linear", "sqrt", "adam_sqrt"]
WeightDecayScaling = Literal["none", "timescale"]
WarmupMode = Literal["linear", "constant"]
# linear and 1-sqrt: the decay of a warmup-stable-decay schedule (schedule=wsd), over the last decay_fraction
Decay = Literal["constant", "cosine", "poly", "step", "linear", "1-sqrt"]
SCALING_RULES: tuple[Scaling, ...] = get_args(Scaling)
WEIGHT_DECAY_SCALINGS: tuple[WeightDecayScaling, ...] = get_args(WeightDecayScaling)
WARMUP_MODES: tuple[WarmupMode, ...] = get_args(WarmupMode)
DECAYS: tuple[Decay, ...] = get_args(Decay)
# A probe branch's LR from where it starts: the base run's schedule on, frozen there, or from there linearly to 0.
BranchLR = Literal["follow", "hold", "cooldown"]


@dataclass(frozen=True)
class ScheduleSpec:
    """The `schedule` node: everything the LR depends on besides the base LR."""

    scaling: Scaling = "none"
    weight_decay_scaling: WeightDecayScaling = "none"
    base_batch: int = 64
    warmup_epochs: float = 0.0
    warmup_samples: int | None = None
    warmup_start: float | None = None
    warmup_mode: WarmupMode = "linear"
    decay: Decay = "cosine"
    decay_fraction: float = 1.0
    final_factor: float = 0.0
    power: float = 2.0
    milestones: tuple[float, ...] = ()
    gamma: float = 0.1

    def check(self) -> ScheduleSpec:
        one_of("schedule.scaling", self.scaling, SCALING_RULES)
        one_of("schedule.weight_decay_scaling", self.weight_decay_scaling, WEIGHT_DECAY_SCALINGS)
        one_of("schedule.warmup_mode", self.warmup_mode, WARMUP_MODES)
        one_of("schedule.decay", self.decay, DECAYS)
        integer("schedule.base_batch", self.base_batch)
        number("schedule.warmup_epochs", self.warmup_epochs, low=0)
        if self.warmup_samples is not None:
            integer("schedule.warmup_samples", self.warmup_samples, 0)
            if self.warmup_epochs:
                raise ConfigError("schedule: give warmup_epochs or warmup_samples, not both")
        if self.warmup_start is not None:
            number("schedule.warmup_start", self.warmup_start, low=0, high=1, low_open=True)
        number("schedule.decay_fraction", self.decay_fraction, low=0, high=1, low_open=True)
        number("schedule.final_factor", self.final_factor, low=0, high=1)
        number("schedule.power", self.power, low=0, low_open=True)
        number("schedule.gamma", self.gamma, low=0, high=1, low_open=True)
        for milestone in self.milestones:
            number("schedule.milestones", milestone, low=0)
        return self

def scaling_factor(global_batch: int, base_batch: int, rule: str) -> float:
    """How much the scaling rule multiplies the base LR by at `global_batch`.

    - "none": 1.
    - "linear": B / base_batch (Goyal et al. 2017, "Accurate, Large Minibatch SGD", sec. 2.1).
    - "sqrt": sqrt(B / base_batch), which keeps the variance of the update
      constant (Krizhevsky 2014, "One weird trick for parallelizing CNNs").
    - "adam_sqrt": sqrt(B / base_batch) too, the LR part of Malladi et al.'s square-root rule
      for Adam, which also moves the betas and eps (`adam_sqrt_moments`).
    """
    ratio = global_batch / base_batch
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio), "adam_sqrt": math.sqrt(ratio)}[rule]


def adam_sqrt_moments(kappa: float, betas: tuple[float, float], eps: float) -> tuple[tuple[float, float], float]:
    """Adam's betas and eps at kappa x the base batch under the square-root scaling rule.

    Malladi, Lyu, Panigrahi, Arora 2022, "On the SDEs and Scaling Rules for Adaptive Gradient
    Algorithms", sec. 4 (the square-root scaling rule, SRSR, derived from the Adam SDE): batch
    x kappa -> LR x sqrt(kappa), (1 - beta1) x kappa, (1 - beta2) x kappa, eps / sqrt(kappa).
    The rule holds while kappa (1 - beta) < 1; past that a beta would be 0 or negative, and it is
    clamped to 0 (no averaging), which the run reports (`adam_sqrt_out_of_range`).
    """
    scaled = tuple(max(0.0, 1.0 - kappa * (1.0 - beta)) for beta in betas)
    return (scaled[0], scaled[1]), eps / math.sqrt(kappa)


def timescale_weight_decay(kappa: float, lr_factor: float) -> float:
    """The weight-decay multiplier that keeps AdamW's timescale in epochs fixed.

    AdamW's decoupled decay shrinks weights by (1 - lr x wd) per step, an EMA over
    1 / (lr x wd) steps, i.e. tau = B / (lr x wd x N) epochs (Wang & Aitchison 2024;
    Bergsma et al. 2025, "Power Lines": the optimal tau stays fixed as the batch changes).
    Batch x kappa with LR x lr_factor keeps tau when wd is multiplied by kappa / lr_factor.
    """
    return kappa / lr_factor


@dataclass(frozen=True)
class Schedule:
    """The LR schedule of one run, every length in samples seen (see `build_schedule`)."""

    base_lr: float  # optim.lr: the LR at base_batch, before scaling
    global_batch: int  # the run's configured global batch (a batch ramp does not move it)
    base_batch: int
    scaling: str  # none | linear | sqrt
    warmup_samples: int  # warmup ends, and decay starts, on this step boundary
    warmup_start: float | None  # start LR as a fraction of the peak; None: the unscaled base LR
    warmup_mode: str  # linear | constant
    decay: str  # constant | cosine | poly | step | linear | 1-sqrt
    total_samples: int
    final_factor: float = 0.0
    power: float = 2.0
    # (samples, multiplier): step-decay milestones, and a capped batch ramp's LR divisions
    drops: tuple[tuple[int, float], ...] = ()
    # Adam's betas and eps at base_batch (optim.betas, optim.eps): moved with the batch under adam_sqrt.
    betas: tuple[float, float] | None = None
    eps: float | None = None
    weight_decay_scaling: WeightDecayScaling = "none"  # `timescale_weight_decay`
    # A probe branch (lbt/apps/probe) at another batch than its base run: over `rewarm_samples` from
    # `rewarm_from` the LR climbs linearly from `rewarm_start` x its value to its value, so the jump to
    # the scaled LR is not taken in one step.
    rewarm_from: int = 0
    rewarm_samples: int = 0
    rewarm_start: float = 1.0
    # A probe branch from `branch_from` samples: its LR shape after that (see BranchLR), over `branch_samples`.
    branch_lr: BranchLR = "follow"
    branch_from: int = 0
    branch_samples: int = 0
    # The decay runs over the last decay_fraction of the run (not before warmup ends); the LR holds its peak
    # until then. 1: all of the run after warmup. Warmup-stable-decay (schedule=wsd) takes e.g. 0.2.
    decay_fraction: float = 1.0


def lr_at(samples_seen: float, s: Schedule, global_batch: int | None = None) -> float:
    """The LR of the step taken after `samples_seen` samples; the one place lbt computes it.

    `global_batch`: the batch the scaling rule follows, when not the run's configured one
    (an automatic batch ramp scales the LR with the batch it reached).

        peak    = base_lr x scaling(global_batch / base_batch)
        warmup  : from the start LR to the peak over [0, warmup_samples)       (Goyal 2017, sec. 2.2)
        stable  : the peak, until the decay starts (with decay_fraction < 1: warmup-stable-decay)
        decay   : from the peak at max(warmup_samples, (1 - decay_fraction) x total_samples) to
                  final_factor x peak at total_samples
        drops   : x multiplier from each (samples, multiplier) reached         (step decay, Smith 2017 ramp)
    """
    if s.branch_lr != "follow" and samples_seen >= s.branch_from:
        # A branch measured without the decay the base run would take next (hold), or a short cooldown from
        # there that stands in for a shorter run's end (Haegele et al. 2024).
        lr = lr_at(s.branch_from, replace(s, branch_lr="follow", rewarm_samples=0), global_batch)
        if s.branch_lr == "cooldown":
            lr *= max(0.0, 1.0 - (samples_seen - s.branch_from) / max(s.branch_samples, 1))
        return rewarmed(lr, samples_seen, s)
    peak = s.base_lr * scaling_factor(global_batch or s.global_batch, s.base_batch, s.scaling)
    if samples_seen < s.warmup_samples:
        start = min(s.base_lr, peak) if s.warmup_start is None else s.warmup_start * peak
        if s.warmup_mode == "constant":
            lr = start
        else:
            lr = start + (peak - start) * samples_seen / s.warmup_samples
    else:
        decay_from = s.warmup_samples if s.decay_fraction >= 1 else \
            max(s.warmup_samples, s.total_samples * (1.0 - s.decay_fraction))
        decay_span = s.total_samples - decay_from
        t = min(1.0, max(0.0, samples_seen - decay_from) / decay_span) if decay_span > 0 else 1.0
        if s.decay == "cosine":  # Loshchilov & Hutter 2017 (SGDR), without restarts
            shape = 0.5 * (1.0 + math.cos(math.pi * t))
        elif s.decay == "poly":  # (1 - t)^power, the LARS papers' decay (You et al. 2017: power 2)
            shape = (1.0 - t) ** s.power
        elif s.decay == "linear":  # a linear cooldown (Haegele et al. 2024, arXiv:2405.18392)
            shape = 1.0 - t
        elif s.decay == "1-sqrt":  # the cooldown Haegele et al. 2024 found better than linear
            shape = 1.0 - math.sqrt(t)
        else:  # constant, and step (whose milestones are drops)
            shape = 1.0
        lr = peak * (s.final_factor + (1.0 - s.final_factor) * shape)
    for at, multiplier in s.drops:
        if samples_seen >= at:
            lr *= multiplier
    return rewarmed(lr, samples_seen, s)


def rewarmed(lr: float, samples_seen: float, s: Schedule) -> float:
    if s.rewarm_from <= samples_seen < s.rewarm_from + s.rewarm_samples:
        lr *= s.rewarm_start + (1.0 - s.rewarm_start) * (samples_seen - s.rewarm_from) / s.rewarm_samples
    return lr


def optimizer_settings(samples_seen: float, s: Schedule, global_batch: int | None = None) -> dict[str, object]:
    """What the trainer writes into every parameter group before a step: `lr`; under adam_sqrt Adam's
    `betas` and `eps`; under timescale weight decay the `weight_decay_factor` (x each group's own)."""
    batch = global_batch or s.global_batch
    settings: dict[str, object] = {"lr": lr_at(samples_seen, s, batch)}
    kappa = batch / s.base_batch
    if s.scaling == "adam_sqrt":
        assert s.betas is not None and s.eps is not None  # build_schedule keeps them under adam_sqrt
        settings["betas"], settings["eps"] = adam_sqrt_moments(kappa, s.betas, s.eps)
    if s.weight_decay_scaling == "timescale":
        settings["weight_decay_factor"] = timescale_weight_decay(kappa, scaling_factor(batch, s.base_batch, s.scaling))
    return settings


def adam_sqrt_out_of_range(s: Schedule, global_batch: int) -> str | None:
    """A warning when adam_sqrt at `global_batch` would take a beta to 0 or below (it is clamped), else None."""
    if s.scaling != "adam_sqrt":
        return None
    kappa = global_batch / s.base_batch
    clamped = [f"beta{i + 1}={b:g}" for i, b in enumerate(s.betas or ()) if kappa * (1 - b) >= 1]
    if not clamped:
        return None
    return (f"schedule.scaling=adam_sqrt at {kappa:g}x the base batch: 1 - kappa (1 - beta) <= 0 for "
            f"{', '.join(clamped)} (Malladi et al.'s rule holds for kappa < 1/(1 - beta)); clamped to 0. "
            "Raise the base betas or schedule.base_batch")


def peak(s: Schedule, budget: Budget) -> tuple[float, int]:
    """(the highest LR the run reaches, samples seen at the step that takes it).

    That step is the first after warmup (drops never come before it, see
    `build_schedule`), or the run's last step if warmup outlasts the run.
    """
    at = min(s.warmup_samples, budget.last_step_samples)
    return lr_at(at, s), at


def build_schedule(spec: ScheduleSpec, base_lr: float, global_batch: int, budget: Budget,
                   betas: tuple[float, float] | None = None, eps: float | None = None) -> Schedule:
    """The run's Schedule from its (checked) `schedule` node; `betas` and `eps` are the optimizer's
    (optim.betas, optim.eps), which adam_sqrt scales.

    Epoch counts mean epochs of the steps the run takes (with drop_last an
    epoch at batch B is N // B steps) and land on a step boundary, so the step
    that ends warmup runs at exactly the peak LR.
    """
    if spec.warmup_samples is not None:
        warmup_samples = budget.step_boundary(spec.warmup_samples)[1]
    else:
        warmup_samples = budget.samples_at(spec.warmup_epochs)
    drops = _drops(spec, budget)
    early = [at for at, _ in drops if at < warmup_samples]
    if early:
        raise ConfigError(f"schedule: the LR would drop at sample {min(early):,}, before warmup ends at "
                          f"{warmup_samples:,}; put step milestones and batch-ramp milestones after the warmup")
    adam = spec.scaling == "adam_sqrt"
    return Schedule(base_lr, global_batch, spec.base_batch, spec.scaling, warmup_samples, spec.warmup_start,
                    spec.warmup_mode, spec.decay, budget.total_samples, spec.final_factor, spec.power,
                    tuple(sorted(drops)), betas if adam else None, eps if adam else None, spec.weight_decay_scaling,
                    decay_fraction=spec.decay_fraction)


def _drops(spec: ScheduleSpec, budget: Budget) -> list[tuple[int, float]]:
    """(samples, multiplier): step decay's milestones, and where a capped batch ramp divides the LR instead
    of growing the batch (Smith et al. 2017); none after the run's last step."""
    drops = [(budget.samples_at(m), spec.gamma) for m in spec.milestones] if spec.decay == "step" else []
    previous = 1.0
    for epoch, layout in enumerate(budget.layouts):
        if layout.lr_factor != previous:
            drops.append((budget.samples_at(epoch), layout.lr_factor / previous))
            previous = layout.lr_factor
    return [(at, multiplier) for at, multiplier in drops if at < budget.total_samples]


def warmup_outlasts_run(s: Schedule, budget: Budget) -> str | None:
    """A warning when the run ends before its warmup does (the LR never reaches its scaled peak), else None."""
    if s.warmup_samples <= budget.last_step_samples:
        return None
    nominal = s.base_lr * scaling_factor(s.global_batch, s.base_batch, s.scaling)
    top, _ = peak(s, budget)
    if top >= nominal * (1 - 1e-6):  # a flat warmup (from the peak itself) loses nothing
        return None
    return (f"the warmup ({s.warmup_samples:,} samples) outlasts the run (its last step starts at sample "
            f"{budget.last_step_samples:,}): "
            f"the LR stops at {top:g}, never reaching its scaled peak {nominal:g}; shorten schedule.warmup_epochs "
            "or train longer")


def describe(s: Schedule, budget: Budget) -> str:
    """`lr: peak 6.4 at sample 286,720 (step 70) = base 0.1 x linear 64; linear warmup from 0.1; cosine decay`."""
    top, at = peak(s, budget)
    scale = scaling_factor(s.global_batch, s.base_batch, s.scaling)
    parts = [f"base {s.base_lr:g}" + (f" x {s.scaling} {scale:g}" if s.scaling != "none" else "")]
    if s.warmup_samples:
        start = min(s.base_lr, top) if s.warmup_start is None else s.warmup_start * top
        parts.append(f"{s.warmup_mode} warmup from {start:g}")
    decay = s.decay if s.decay in ("constant", "step") else f"{s.decay} decay to {s.final_factor:g} x peak"
    if s.decay_fraction < 1 and s.decay not in ("constant", "step"):
        decay += f" over the last {s.decay_fraction:.0%} of the run"
    drops = len(s.drops)
    parts.append(decay + (f", {drops} LR drop{'s' if drops > 1 else ''}" if drops else ""))
    line = f"lr: peak {top:g} at sample {at:,} (step {budget.step_boundary(at)[0]}) = {'; '.join(parts)}"
    settings = optimizer_settings(at, s)
    if s.scaling == "adam_sqrt" and s.betas is not None and s.eps is not None:
        (beta1, beta2), eps = adam_sqrt_moments(s.global_batch / s.base_batch, s.betas, s.eps)
        line += f"; betas ({beta1:.4g}, {beta2:.6g}) eps {eps:.3g} (adam_sqrt, Malladi et al. 2022)"
    if "weight_decay_factor" in settings:
        line += f"; weight decay x{settings['weight_decay_factor']:.3g} (fixed AdamW timescale)"
    return line
