"""Learning-rate factors, as pure functions of samples seen.

The learning rate at any point of a run is a product of independent factors:

    lr = base_lr * scaling_factor(...) * warmup_factor(...) * decay_factor(...)

Progress is measured in samples seen, not steps, so a run whose global batch
grows mid-training (Smith et al. 2017) follows the same LR curve per sample as
one with a fixed batch, and a resumed run needs no hidden scheduler state.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from lbt.errors import ConfigError

SCALING_RULES = ("none", "linear", "sqrt")
WARMUP_MODES = ("linear", "constant")
DECAY_SCHEDULES = ("constant", "cosine", "poly", "step")


def scaling_factor(global_batch: int, base_batch: int, rule: str) -> float:
    """How much to multiply the base LR by when training at `global_batch`.

    - "none": 1.
    - "linear": B / base_batch, the linear scaling rule (Goyal et al. 2017,
      "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour").
    - "sqrt": sqrt(B / base_batch), which keeps the variance of the update
      constant (Krizhevsky 2014, "One weird trick for parallelizing CNNs").
    """
    if global_batch <= 0 or base_batch <= 0:
        raise ConfigError(
            f"global_batch ({global_batch}) and base_batch ({base_batch}) must be positive"
        )
    ratio = global_batch / base_batch
    if rule == "none":
        return 1.0
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    raise ConfigError(
        f"unknown LR scaling rule {rule!r}: expected one of {', '.join(SCALING_RULES)}"
    )


def warmup_factor(
    samples_seen: float, warmup_samples: float, start_factor: float, mode: str = "linear"
) -> float:
    """Warmup multiplier: `start_factor` at 0 samples, 1.0 from `warmup_samples` on.

    - "linear": gradual warmup, a straight line from start_factor to 1.0
      (Goyal et al. 2017, 5 epochs). With start_factor = 1/k, where k is the
      scaling factor, the run starts at the unscaled base LR as in the paper.
    - "constant": hold start_factor until warmup_samples, then jump to 1.0
      (the "constant warmup" Goyal et al. compare against).

    warmup_samples == 0 means no warmup.
    """
    if mode not in WARMUP_MODES:
        raise ConfigError(
            f"unknown warmup mode {mode!r}: expected one of {', '.join(WARMUP_MODES)}"
        )
    if warmup_samples < 0:
        raise ConfigError(f"warmup_samples ({warmup_samples}) must be >= 0")
    if samples_seen >= warmup_samples:
        return 1.0
    if mode == "constant":
        return start_factor
    progress = max(samples_seen, 0.0) / warmup_samples
    return start_factor + (1.0 - start_factor) * progress


def decay_factor(
    samples_seen: float,
    total_samples: float,
    schedule: str,
    *,
    milestones_samples: Sequence[float] = (),
    gamma: float = 0.1,
    power: float = 2.0,
    final_factor: float = 0.0,
    start_samples: float = 0.0,
) -> float:
    """Decay multiplier, 1.0 at the start of training.

    - "constant": 1.
    - "cosine": final + (1 - final) * (1 + cos(pi t)) / 2 (Loshchilov & Hutter
      2017, SGDR, without restarts).
    - "poly": final + (1 - final) * (1 - t) ** power, the polynomial decay of
      the LARS papers (You et al. 2017 use power 2).
    - "step": gamma ** (number of milestones reached), milestones given as
      absolute sample counts (Goyal et al. 2017 divide by 10 at epochs 30, 60, 80).

    For cosine and poly, t = (samples_seen - start_samples) / (total_samples -
    start_samples), clamped to [0, 1]. `start_samples` holds the factor at 1.0
    until decay should begin, e.g. the end of warmup or of a batch ramp, so the
    decay spans exactly the rest of training instead of being partly hidden
    under the warmup.
    """
    if schedule == "constant":
        return 1.0
    if schedule == "step":
        # bisect_right counts milestones <= samples_seen: a milestone applies from its sample on.
        return gamma ** bisect.bisect_right(sorted(milestones_samples), samples_seen)
    if schedule not in DECAY_SCHEDULES:
        raise ConfigError(
            f"unknown LR decay schedule {schedule!r}: expected one of {', '.join(DECAY_SCHEDULES)}"
        )
    if total_samples <= start_samples:
        raise ConfigError(
            f"total_samples ({total_samples}) must exceed start_samples ({start_samples}) "
            f"for the {schedule!r} decay"
        )
    t = (samples_seen - start_samples) / (total_samples - start_samples)
    t = min(max(t, 0.0), 1.0)
    if schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * t))
    else:
        shape = (1.0 - t) ** power
    return final_factor + (1.0 - final_factor) * shape
