"""LR decay over the run (the `schedule` config group), counted in samples seen."""

from __future__ import annotations

from lbt.errors import ConfigError
from lbt.lr import DECAY_SCHEDULES, decay_factor
from lbt.techniques.base import Progress, Technique


class Decay(Technique):
    """cosine | poly (power p, as LARS papers use) | step (milestones in epochs) | constant.

    `after_warmup_epochs` starts the cosine/poly decay after that many epochs
    (holding 1.0 before), so it spans exactly the rest of training.
    """

    name = "decay"
    order = 30

    def __init__(self, name: str = "cosine", final_factor: float = 0.0, power: float = 2.0,
                 milestones: list[float] | tuple = (), gamma: float = 0.1, after_warmup_epochs: float = 0.0):
        if name not in DECAY_SCHEDULES:
            raise ConfigError(f"schedule.name must be one of {', '.join(DECAY_SCHEDULES)}, got {name!r}")
        if not 0.0 <= final_factor <= 1.0:
            raise ConfigError(f"schedule.final_factor must be in [0, 1], got {final_factor!r}")
        self.schedule, self.final_factor, self.power = name, final_factor, power
        self.milestones, self.gamma = list(milestones), gamma
        self.after_warmup_epochs = after_warmup_epochs

    def lr_factor(self, progress: Progress, scale: float) -> float:
        per_epoch = progress.samples_per_epoch
        return decay_factor(
            progress.samples_seen, progress.total_samples, self.schedule,
            milestones_samples=[m * per_epoch for m in self.milestones], gamma=self.gamma, power=self.power,
            final_factor=self.final_factor,
            start_samples=min(self.after_warmup_epochs * per_epoch, progress.total_samples - 1),
        )

    def describe(self) -> str:
        return f"{self.schedule} decay"
