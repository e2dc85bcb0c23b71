"""What a study, a report and a tune judge runs by: accuracy (higher is better) or loss (lower is better).

One definition of "better" for all of them: a Metric turns a value into a score that is always
higher-is-better (`score`), and every comparison (reaching a target, the best trial, staying
within a tolerance of the smallest batch) goes through it. `name` is the key the trainer writes:
an evaluation point's "acc" / "loss", result.json's final_val_acc / final_val_loss, test_acc / test_loss.

Tolerances and margins are in the metric's `unit`: accuracy points (0.01 of accuracy) or nats of
loss. A language model's loss in bits per character is `bits(loss)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lbt.errors import ConfigError


@dataclass(frozen=True)
class Metric:
    name: str  # "acc" or "loss": the key of evaluation points and result.json fields
    label: str  # how tables and axes name it
    higher_is_better: bool
    unit: str  # of tolerances and margins: "point" (of accuracy) or "nat" (of loss)
    unit_size: float  # one unit in the metric's own values: 0.01 of accuracy, 1 of loss
    target_margin: float  # default target: the base batch's final value, this many units worse
    default_tolerance: float  # how many GPUs: within this many units of the smallest batch
    start: float | None  # the value at step 0 when known (accuracy 0); None: unknown (a loss)
    worst: float  # a diverged run's value: it spent its budget and counts as the worst
    scale: float  # shown as value x scale (accuracy in percent)
    decimals: int
    suffix: str  # after a shown value in a sentence ("%")

    @property
    def direction(self) -> Literal["minimize", "maximize"]:
        """Optuna's word for it: maximize or minimize."""
        return "maximize" if self.higher_is_better else "minimize"

    @property
    def gap_spec(self) -> str:
        """Format of a signed gap in units (points to 2 decimals, nats to 4)."""
        return f"+.{self.decimals}f"

    def score(self, value: float) -> float:
        """Higher is better, whatever the metric."""
        return value if self.higher_is_better else -value

    def reached(self, value: float, target: float) -> bool:
        """Whether `value` is at or beyond `target` (acc >= target; loss <= target)."""
        return self.score(value) >= self.score(target)

    def best(self, values) -> float:
        """The best of the finite `values`; NaN if none is."""
        return max((v for v in values if v is not None and math.isfinite(v)), key=self.score, default=math.nan)

    def worse_by(self, value: float, units: float) -> float:
        """`value` made worse by `units` of tolerance: the floor (acc) or ceiling (loss) still accepted."""
        return value - math.copysign(units * self.unit_size, self.score(1.0))

    def gap(self, value: float, reference: float) -> float:
        """How many units `value` is worse than `reference` (negative: better)."""
        return (self.score(reference) - self.score(value)) / self.unit_size

    def show(self, value: float | None) -> str:
        if value is None or not math.isfinite(value):
            return "-"
        return f"{value * self.scale:.{self.decimals}f}"

    def units(self, amount: float) -> str:
        return f"{amount:g} {self.unit}{'s' if amount != 1 else ''}"


ACC = Metric("acc", "accuracy", True, "point", 0.01, target_margin=1.0, default_tolerance=1.0, start=0.0,
             worst=0.0, scale=100, decimals=2, suffix="%")
LOSS = Metric("loss", "loss", False, "nat", 1.0, target_margin=0.05, default_tolerance=0.05, start=None,
              worst=math.inf, scale=1, decimals=4, suffix="")
METRICS = {m.name: m for m in (ACC, LOSS)}


def metric_named(name: str, where: str) -> Metric:
    """`acc` or `loss`, or one line naming the choices."""
    if name not in METRICS:
        raise ConfigError(f"{where}={name}: choose one of {', '.join(METRICS)}")
    return METRICS[name]


def bits(nats: float | None) -> float | None:
    """A loss in nats as bits (per character, for a character-level language model)."""
    return None if nats is None else nats / math.log(2)
