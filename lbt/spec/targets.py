"""Code a config names by a dotted path: `_target_` nodes, and the one function that imports such a path.

A config can name code to import and run (`model._target_=mypackage.MyNet`, `data.dataset=mypackage.load`,
`optim.optimizer_class=torch.optim.SGD`): lbt imports what it names, as Python would, so a config is code
and only a trusted one should be run. `locate` is the one place that imports, so a path that does not
import is the same one line everywhere; given the kind a key expects (an `nn.Module`, an `Optimizer`), it
also refuses what cannot be one: a class of another kind, a builtin or standard-library function
(`data.dataset=os.system`), a function annotated to return something else.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import typing
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


def locate(key: str, dotted: str, kind: type | tuple[type, ...] | None = None) -> Any:
    """package.module.name -> the object it names, or one line saying why not.

    `kind`: what the key builds; the object must be a subclass of it, or a function of the user's or a
    library's (not a builtin or the standard library's) not annotated to return something else.
    """
    module, _, name = str(dotted).rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"{key}={dotted}: cannot import it ({error}); is its package on PYTHONPATH?") from None
    if kind is not None and not is_kind(found, kind):
        kinds = " or ".join(kind_name(k) for k in (kind if isinstance(kind, tuple) else (kind,)))
        what = f"{'a class' if isinstance(found, type) else 'a ' + type(found).__name__} from " \
            f"{getattr(found, '__module__', None) or 'an unknown module'}"
        article = "an" if kinds[0].lower() in "aeiou" or kinds.startswith("nn.") else "a"
        raise ConfigError(f"{key}={dotted} is {what}; {key} must name {article} {kinds} subclass or a function "
                          "returning one (a config names code lbt imports and runs)")
    return found


def is_kind(found: Any, kind: type | tuple[type, ...]) -> bool:
    """Whether `found` builds a `kind`: a subclass of it, or a plain Python function outside the standard
    library whose return annotation (if any) is a `kind`."""
    if isinstance(found, type):
        return issubclass(found, kind)
    if not inspect.isfunction(found) and not inspect.ismethod(found):
        return False  # builtins (os.system), objects, modules
    if (getattr(found, "__module__", "") or "").split(".")[0] in sys.stdlib_module_names:
        return False  # subprocess.call, shutil.rmtree: nothing there builds a model, data or an optimizer
    try:
        returns = typing.get_type_hints(found).get("return")
    except Exception:  # an annotation that does not resolve says nothing either way
        return True
    if returns is None:
        return True
    union = typing.get_origin(returns) in (typing.Union, types.UnionType)
    options = [typing.get_origin(o) or o for o in (typing.get_args(returns) if union else (returns,))]
    return any(not isinstance(o, type) or issubclass(o, kind) for o in options)


def kind_name(kind: type) -> str:
    """`nn.Module`, `torch.optim.Optimizer`, `DataSplits`: as a user would write it."""
    if kind.__module__.startswith("torch.nn"):
        return f"nn.{kind.__name__}"
    if kind.__module__.startswith("torch.optim"):
        return f"torch.optim.{kind.__name__}"
    if kind is tuple:
        return "(train, test) tuple"
    return kind.__name__


def keyword_names(node: Mapping[str, Any], key: str) -> set[str] | None:
    """The keywords a `_target_` node's callable takes (None: any). A builder that passes its other
    keywords on to a class its node names (`optim`: create_optimizer to `optimizer_class`) takes that
    class's keywords too."""
    target = locate(f"{key}._target_", str(node["_target_"]))
    accepted = _parameters(target)
    if accepted is not None or not isinstance(node.get("optimizer_class"), str):
        return accepted
    passed_on = _parameters(locate(f"{key}.optimizer_class", node["optimizer_class"]))
    return None if passed_on is None else passed_on | (_parameters(target, var_keyword=False) or set())


def _parameters(function: Any, var_keyword: bool = True) -> set[str] | None:
    """The keyword names `function` takes; None when it takes any (**kwargs) and `var_keyword`."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return None
    if var_keyword and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return None
    return {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
