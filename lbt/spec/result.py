"""result.json: the one schema of what a run reports, with its one writer and its one reader.

A run (lbt/engine) fills a RunResult and `write_result` publishes it; reports, tune, plan, bench and
notebooks read it back with `read_result`. In the file, every number is named after the split it was
measured on, so a val-named field never holds test data:

    final_val_acc, best_val_acc, final_val_loss, best_val_loss, val_history   (the split runs select on)
    final_test_acc, ... test_history        (instead, when the run holds out no validation split)
    test_acc, test_loss                     (the test split, scored once, at the end)
    final_val_bits_per_char, test_bits_per_char   (a language model's loss in bits per token)

A job of a sweep that failed writes a result too: what it was (recipe, batches, seed) and `error`.
Files without a `version` were written before version 2 and read the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lbt.paths import atomic_write
from lbt.spec.objective import bits

RESULT_VERSION = 2
# The fields named after the split evaluated during training (`eval_split`), e.g. final_acc -> final_val_acc.
SPLIT_NAMED = ("final_acc", "best_acc", "final_loss", "best_loss")


class ResultError(ValueError):
    """A result.json that cannot be read (damaged, or not lbt's)."""


@dataclass
class EvalPoint:
    """One evaluation of the held-out split during training (steps-to-target is read from these)."""

    step: int
    samples_seen: int
    global_batch: int
    acc: float
    loss: float


@dataclass
class RunResult:
    """What one run reports: the layout it ran, its numbers, and the resolved config."""

    # -- what was run ---------------------------------------------------------------------------------
    recipe: str = "custom"
    overrides: list[str] = field(default_factory=list)
    world_size: int = 1  # GPUs: data-parallel workers x tensor-parallel ranks
    procs: int = 1
    tensor_parallel: int = 1
    data_parallel: int = 1  # data-parallel workers (world_size / tensor_parallel)
    per_worker_batch: int = 0
    global_batch: int = 0
    steps_per_epoch: int = 0
    base_lr: float = math.nan
    peak_lr: float = math.nan
    peak_lr_samples: int = 0
    seed: int | None = None
    # -- what it measured -----------------------------------------------------------------------------
    # The split evaluated during training: "val", or "test" when the run holds out no validation split.
    eval_split: str = "val"
    final_acc: float = math.nan  # on eval_split
    best_acc: float = math.nan
    final_loss: float = math.nan
    best_loss: float = math.nan
    final_train_loss: float = math.nan
    test_acc: float | None = None  # the test split, once, at the end
    test_loss: float | None = None
    history: list[EvalPoint] = field(default_factory=list)
    steps: int = 0  # what ran (a resume never trains less than its checkpoint had: it is refused)
    samples_seen: int = 0
    epochs: float = 0.0  # epochs of training data seen (samples_seen / training samples), whatever trainer.epochs says
    train_seconds: float = 0.0
    eval_seconds: float = 0.0  # evaluating the held-out split during training (not in train_seconds)
    wall_seconds: float = 0.0
    samples_per_sec: float = 0.0
    device: str | None = None  # where the steps ran ("cpu", "cuda"): a CPU's timings are no GPU's (lbt plan)
    diverged: bool = False
    stopped: bool = False  # by SIGTERM/SIGINT after a checkpoint: a stopped run writes no result.json
    ended_at_target: bool = False  # trainer.stop_at_val_*: ended at the first evaluation that reached it
    technique_metrics: dict[str, float] = field(default_factory=dict)
    technique_curves: dict[str, list[list[float]]] = field(default_factory=dict)  # name -> [[samples, value]]
    # mean seconds per step: data, compute (forward+backward), comm (allreduce span), optimizer, measure
    step_seconds: dict[str, float] = field(default_factory=dict)
    # Model-sized allreduces (gradients, or local SGD's parameter averages) and the bytes each worker
    # sent for them (ring allreduce of fp32 values): what the run paid in communication.
    allreduces: int = 0
    bytes_sent: float = 0.0
    token: str | None = None  # a language model's label ("char"): its losses also read in bits per token
    techniques: list[str] = field(default_factory=list)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # a failed job of a sweep: why
    version: int = RESULT_VERSION

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def trained(self) -> bool:
        """Finished without an error and without diverging: its numbers can be compared."""
        return self.error is None and not self.diverged

    def bits_per_token(self, loss: float | None) -> float | None:
        """A language model's loss in bits per token; None for classification (a loss per sample)."""
        return None if self.token is None else bits(loss)

    def to_json(self) -> dict[str, Any]:
        """The file's fields, each named after its split (see the module docstring)."""
        if self.error is not None:
            return {"version": self.version, "error": self.error, "recipe": self.recipe, "overrides": self.overrides,
                    "world_size": self.world_size, "per_worker_batch": self.per_worker_batch,
                    "global_batch": self.global_batch, "seed": self.seed, "config": self.config}
        values = asdict(self)
        split = self.eval_split
        for key in SPLIT_NAMED:
            values[key.replace("_", f"_{split}_", 1)] = values.pop(key)
        values[f"{split}_history"] = values.pop("history")
        values.pop("stopped")
        if self.token is not None:
            values[f"final_{split}_bits_per_{self.token}"] = bits(self.final_loss)
            if self.test_loss is not None:
                values[f"test_bits_per_{self.token}"] = bits(self.test_loss)
        return values

    @classmethod
    def from_json(cls, values: dict[str, Any]) -> RunResult:
        """Read the fields `to_json` writes (unknown ones, and the derived bits, are left out), each checked."""
        check_fields(values)
        split = values.get("eval_split", "val")
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in known and k != "history"}
        for key in SPLIT_NAMED:
            named = key.replace("_", f"_{split}_", 1)
            if named in values:
                kwargs[key] = _number(values[named])
        kwargs["history"] = [EvalPoint(**point) for point in values.get(f"{split}_history") or []]
        if "data_parallel" not in values:  # written before tensor parallelism: every GPU a data-parallel worker
            kwargs["data_parallel"] = int(values.get("world_size") or 1) // int(values.get("tensor_parallel") or 1)
        if "token" not in values:  # written before `token`: the bits-per-token fields name it
            kwargs["token"] = next((k.rsplit("_per_", 1)[1] for k in values if "_bits_per_" in k), None)
        return cls(**kwargs)


LAYOUT_FIELDS = ("world_size", "per_worker_batch", "global_batch")
# A trained run's numbers and their ranges (accuracies are fractions); a missing one is not measured.
RANGES = {"acc": (0.0, 1.0), "loss": (0.0, math.inf)}


def check_fields(values: dict[str, Any]) -> None:
    """Every field a reader answers from has its type and range, or ValueError naming it: unchecked, a NaN
    accuracy would give an answer, a negative batch a critical batch of -64, and a string a traceback. A failed
    job's result says why it failed; its numbers are not read."""
    if values.get("error") is not None:
        return
    for key in LAYOUT_FIELDS:
        value = values.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} is {value!r}, not a positive whole number")
    diverged = values.get("diverged", False)
    if not isinstance(diverged, bool):
        raise ValueError(f"diverged is {diverged!r}, not true or false")
    split = values.get("eval_split", "val")
    for key in [f"{kind}_{split}_{m}" for kind in ("final", "best") for m in RANGES] + ["test_acc", "test_loss"]:
        value = values.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} is {value!r}, not a number")
        low, high = RANGES[key.rsplit("_", 1)[1]]
        if math.isnan(value) and (diverged or not key.startswith("final_")):
            continue  # a diverged run's value, or a best that was never measured
        if not low <= value <= high or math.isinf(value):
            raise ValueError(f"{key} is {value!r}, outside [{low:g}, {high:g}]")


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def write_result(run_dir: str | Path, result: RunResult) -> Path:
    """Publish the run's result.json whole (a reader never sees half a file)."""
    path = Path(run_dir) / "result.json"
    text = json.dumps(result.to_json(), indent=2, allow_nan=True)
    atomic_write(path, lambda f: f.write(text.encode()))
    return path


def read_result(path: str | Path) -> RunResult:
    """A run's result.json (or the result.json in a run folder); ResultError naming the file if it is not one."""
    path = Path(path)
    if path.is_dir():
        path = path / "result.json"
    try:
        values = json.loads(path.read_text())
        if not isinstance(values, dict):
            raise TypeError(f"a JSON {type(values).__name__}, not an object")
        return RunResult.from_json(values)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ResultError(f"{path}: not a readable lbt result.json ({error})") from None
