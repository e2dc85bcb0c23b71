"""Composing lbt's config with Hydra: the typed schemas, and Hydra's errors folded into one line.

Used by the entry points (lbt/cli.py, lbt/tune.py), the tests and the benchmarks.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from lbt.config import DistConfig, ScheduleConfig, TrainerConfig


def one_line(error: BaseException) -> str:
    """Fold a (possibly multi-line) Hydra/OmegaConf error into one readable line."""
    messages = [str(error)]
    if error.__cause__ is not None and str(error.__cause__) not in messages[0]:
        messages.append(str(error.__cause__))
    noise = ("full_key:", "object_type=", "reference_type=", "Set the environment", "To append")
    parts: list[str] = []
    for message in messages:
        for raw in message.splitlines():
            line = raw.strip()
            if not line or line.startswith(noise):
                continue
            if raw[:1] in ("\t", " ") and parts:  # an item of a listed set of options
                parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
            else:
                parts.append(line)
    return " ".join(parts) or type(error).__name__


def register_schemas() -> None:
    """The typed schemas of conf/{dist,trainer,schedule}/ (their `defaults` name them); call before composing."""
    store = ConfigStore.instance()
    store.store(group="dist", name="dist_schema", node=DistConfig)
    store.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    store.store(group="schedule", name="schedule_schema", node=ScheduleConfig)
