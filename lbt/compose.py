"""Composing lbt's config with Hydra: the typed schemas, and Hydra's errors folded into one line.

Used by the entry points (lbt/cli.py, lbt/tune.py), the tests and the benchmarks.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

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


def group_options(group: str, search_dirs: list[Path]) -> list[str]:
    """The config names a group offers (`technique` -> batch_ramp, ghost_bn, ...) in the search folders."""
    names = {path.stem for folder in search_dirs for path in (folder / group).glob("*.yaml")}
    return sorted(name for name in names if not name.startswith("_"))


def explain(error: BaseException, defaults: dict | None, search_dirs: list[Path]) -> str:
    """A composition error as one line, with the closest name when the user likely mistyped one.

    `defaults`: the config composed without the failing override, to look keys up in.
    """
    message = one_line(error)
    missing = re.search(r"Could not (?:find|load) '([\w/]+)/([^'/]+)'", message)
    if missing:
        group, name = missing.groups()
        options = group_options(group, search_dirs)
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
        hint = f"did you mean {group}={close[0]}? " if close else ""
        return f"{group}={name}: no such {group} config; {hint}available: {', '.join(options) or 'none'}"
    unknown = re.search(r"Could not override '([^']+)'", message)
    if unknown and defaults is not None:
        dotted = unknown.group(1).lstrip("+~")
        parent, _, leaf = dotted.rpartition(".")
        node = defaults
        for part in parent.split(".") if parent else []:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            close = difflib.get_close_matches(leaf, [str(k) for k in node], n=1, cutoff=0.6)
            where = f"{parent}" if parent else "the config"
            if close:
                return f"{dotted}: no such key in {where}; did you mean {'.'.join(filter(None, (parent, close[0])))}?"
            return (f"{dotted}: no such key in {where} (keys: {', '.join(sorted(map(str, node)))}); "
                    f"a new key needs a leading +, e.g. +{dotted}=...")
    return message
