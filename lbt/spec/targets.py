"""Code a config names by a dotted path: `_target_` nodes, and the one function that imports such a path.

A config can name code to import and run (`model._target_=mypackage.MyNet`, `data.dataset=mypackage.load`,
`optim.optimizer_class=torch.optim.SGD`): lbt imports what it names, as Python would. `locate` is the
one place that does, so a path that does not import is the same one line everywhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lbt.errors import ConfigError


@dataclass(frozen=True)
class Target:
    """A `_target_` node of the config: the callable to build (a dotted path) and its keyword arguments."""

    key: str  # where it sits in the config, for messages: "model", "technique.gns"
    target: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    partial: bool = False  # `_partial_: true`: build a function that takes the rest (the optimizer's model)

    @property
    def name(self) -> str:
        """The callable's own name: `CNN1d` for lbt.models.CNN1d."""
        return self.target.rsplit(".", 1)[-1]


def target_of(node: Mapping[str, Any] | None, key: str) -> Target:
    """A `_target_` node as a Target; a node without one is one line."""
    if not isinstance(node, Mapping) or not node.get("_target_"):
        raise ConfigError(f"{key}: the config names nothing to build (no {key}._target_)")
    kwargs = {k: v for k, v in node.items() if k not in ("_target_", "_partial_")}
    return Target(key, str(node["_target_"]), kwargs, bool(node.get("_partial_", False)))


def locate(key: str, dotted: str) -> Any:
    """package.module.name -> the object it names, or one line saying why not."""
    module, _, name = str(dotted).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"{key}={dotted}: cannot import it ({error}); is its package on PYTHONPATH?") from None
