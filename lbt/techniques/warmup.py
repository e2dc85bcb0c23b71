"""Gradual (or constant) LR warmup, counted in samples seen."""

from __future__ import annotations

from typing import Optional

from lbt.errors import ConfigError
from lbt.lr import WARMUP_MODES, warmup_factor
from lbt.techniques.base import Progress, Technique


class Warmup(Technique):
    """Ramp the LR to its scaled target over `epochs` (or `samples`) (Goyal et al. 2017).

    start_factor null starts from the unscaled base LR, i.e. 1/k of the target
    when the scaling rule multiplies it by k (Goyal's gradual warmup);
    mode `constant` holds start_factor for the warmup, then jumps.
    """

    name = "warmup"
    order = 20

    def __init__(self, epochs: Optional[float] = 5.0, samples: Optional[int] = None,
                 start_factor: Optional[float] = None, mode: str = "linear"):
        if mode not in WARMUP_MODES:
            raise ConfigError(f"technique.warmup.mode must be one of {', '.join(WARMUP_MODES)}, got {mode!r}")
        if (epochs is None) == (samples is None):
            raise ConfigError("technique.warmup: give exactly one of epochs and samples")
        length = epochs if samples is None else samples
        if isinstance(length, bool) or not isinstance(length, (int, float)) or length < 0:
            raise ConfigError(f"technique.warmup length must be a non-negative number, got {length!r}")
        if start_factor is not None and not (0 < start_factor <= 1):
            raise ConfigError(f"technique.warmup.start_factor must be in (0, 1], got {start_factor!r}")
        self.epochs, self.samples, self.start_factor, self.mode = epochs, samples, start_factor, mode

    def warmup_samples(self, progress: Progress) -> float:
        return self.samples if self.samples is not None else self.epochs * progress.samples_per_epoch

    def lr_factor(self, progress: Progress, scale: float) -> float:
        start = self.start_factor if self.start_factor is not None else min(1.0, 1.0 / scale)
        return warmup_factor(progress.samples_seen, self.warmup_samples(progress), start, self.mode)

    def describe(self) -> str:
        length = f"{self.epochs:g} epochs" if self.samples is None else f"{self.samples} samples"
        start = "base LR" if self.start_factor is None else f"{self.start_factor:g} x target"
        return f"{self.mode} warmup over {length} from {start}"
