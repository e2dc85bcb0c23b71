"""Composing lbt's config as `lbt train` does: the one function every command, test and benchmark uses.

    compose(["model=mlp", "dist.world_size=16"]) -> Composed(config, recipe)   # a plain dict, resolved

Hydra composes conf/ (its groups, the recipe's deltas, the command line's overrides) against typed
schemas derived from the run spec's dataclasses (lbt/spec/run.py), so a mistyped key or a wrong type
fails here; its errors become one line (`explain`), with the closest name where the user likely
mistyped one.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Literal, Optional, TypeVar, Union

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import MissingMandatoryValue

from lbt.errors import ConfigError, closest
from lbt.spec.lr import ScheduleSpec
from lbt.spec.run import DistSpec, TrainerSpec
from lbt.spec.targets import keyword_names
from lbt.spec.validate import one_of

PLAIN_TYPES = (int, float, str, bool)
S = TypeVar("S")  # a command's settings dataclass
# Added keys nothing checks: Hydra's own, and the marks `lbt tune` leaves in its final runs' configs.
OPEN_SECTIONS = ("hydra.", "tune.")


def conf_dir() -> Path:
    """lbt's Hydra config tree: conf/ beside lbt/ in a checkout, lbt/conf in an installed wheel."""
    package = Path(__file__).resolve().parents[1]
    source_checkout = package.parent / "conf"
    if (source_checkout / "config.yaml").is_file():
        return source_checkout
    return package / "conf"


def hydra_schema(spec: type) -> type:
    """A spec dataclass as a Hydra structured config: the same keys and defaults, types OmegaConf takes
    (a union of two kinds, `bool | str`, is Any there; a tuple is a list), not frozen (Hydra merges into it)."""
    hints = typing.get_type_hints(spec)
    fields = []
    for f in dataclasses.fields(spec):
        kind = omegaconf_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[operator]
        value: Any = dataclasses.field(default_factory=functools.partial(list, default)) if isinstance(default, tuple) \
            else dataclasses.field(default=default)
        fields.append((f.name, kind, value))
    return dataclasses.make_dataclass(f"{spec.__name__}Schema", fields)


def omegaconf_type(kind: Any) -> Any:
    if kind in PLAIN_TYPES:
        return kind
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    origin = typing.get_origin(kind)
    if origin is Literal and all(isinstance(a, str) for a in args):  # a mode: one_of checks the value
        return str
    if origin in (Union, types.UnionType) and len(args) == 1 and typing.get_origin(args[0]) is Literal:
        return Optional[omegaconf_type(args[0])]
    if origin in (Union, types.UnionType) and len(args) == 1 and args[0] in PLAIN_TYPES:
        return Optional[args[0]]
    if origin is tuple and args and args[0] in PLAIN_TYPES:
        return List[args[0]]  # type: ignore[valid-type]
    return Any


def compose_settings(spec: type[S], key: str, overrides: list[str]) -> S:
    """A command's own settings (`KEY.NAME=VALUE`, Hydra overrides of the `spec` dataclass; `lbt probe`'s, `lbt
    plan`'s): the same types, errors and "did you mean" as any key of a run's config. Each Literal field is checked
    to be one of its values here, since the schema holds it as a plain string."""
    name = f"lbt_{key}_settings"
    ConfigStore.instance().store(name=name, node={key: hydra_schema(spec)})
    settings = spec(**compose(overrides, config_name=name, job_name=f"lbt_{key}").config[key])
    hints = typing.get_type_hints(spec)
    for field in dataclasses.fields(spec):  # type: ignore[arg-type]
        kind, optional = hints[field.name], False
        if typing.get_origin(kind) in (Union, types.UnionType):
            optional, (kind,) = True, [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) is Literal:
            one_of(f"{key}.{field.name}", getattr(settings, field.name), (*typing.get_args(kind), *[None] * optional))
    return settings


def register_schemas() -> None:
    """The typed schemas of conf/{dist,trainer,schedule}/ (their `defaults` name them); call before composing."""
    store = ConfigStore.instance()
    for group, spec in (("dist", DistSpec), ("trainer", TrainerSpec), ("schedule", ScheduleSpec)):
        store.store(group=group, name=f"{group}_schema", node=hydra_schema(spec))


@dataclass(frozen=True)
class Composed:
    config: dict[str, Any]  # resolved, without the hydra node
    recipe: str  # the recipe group's choice ("custom" when none)
    choices: Mapping[str, str] = dataclasses.field(default_factory=dict)  # each group's choice (model: mlp)


def compose(overrides: list[str] | tuple[str, ...] = (), config_dir: str | Path | None = None,
            config_name: str = "config", job_name: str = "lbt") -> Composed:
    """The resolved config `lbt train OVERRIDES` would run, and its recipe; any mistake is one ConfigError line.

    `config_dir`: a folder of the user's own configs searched after lbt's (`--config-dir`).
    """
    register_schemas()
    search = [conf_dir()] + ([Path(config_dir).expanduser().absolute()] if config_dir else [])
    extra = [f"hydra.searchpath=[file://{search[-1]}]"] if config_dir else []
    with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name=job_name):
        try:
            cfg = hydra_compose(config_name, overrides=[*overrides, *extra], return_hydra_config=True)
        except Exception as error:  # Hydra / OmegaConf composition errors, with the closest name if mistyped
            known = composed_without(list(overrides), config_name, error, extra)
            raise ConfigError(explain(error, known, search)) from None
        recipe = cfg.hydra.runtime.choices.get("recipe") or "custom"
        choices = {str(k): str(v) for k, v in cfg.hydra.runtime.choices.items() if v is not None}
        check_added_keys(list(overrides), cfg, config_name, extra, search)
    with open_dict(cfg):
        del cfg["hydra"]
    try:
        config = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as error:
        key = error.full_key
        raise ConfigError(f"{key} has no default and must be given, e.g. {key}=...") from None
    except Exception as error:  # an interpolation that does not resolve
        raise ConfigError(one_line(error)) from None
    assert isinstance(config, dict)
    return Composed({str(k): v for k, v in config.items()}, str(recipe), choices)


def check_added_keys(overrides: list[str], cfg: Any, config_name: str, extra: list[str],
                     search: list[Path]) -> None:
    """`+trainer.epoch=1` adds a key nothing reads, and the run would silently train the default: an added
    key (`+key`, or `++key` that was not there) is refused with the nearest valid key, unless it is a
    keyword the node's `_target_` takes (a model's or a data builder's own arguments, an optimizer's)."""
    added = {o.split("=", 1)[0].lstrip("+"): o for o in overrides if o.startswith("+")}
    added = {key: o for key, o in added.items() if not key.startswith(OPEN_SECTIONS) and not any(c in key for c in "@/")
             and ("." in key or not any((folder / key).is_dir() for folder in search))}  # `+group=x`: Hydra's
    base = None
    if any(o.startswith("++") for o in added.values()):  # `++` may override a key that exists
        kept = [o for o in overrides if o not in added.values()]
        base = hydra_compose(config_name, overrides=[*kept, *extra])
    for key in added:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if base is not None and OmegaConf.select(base, key, default=None) is not None:
            continue
        if OmegaConf.is_dict(node) and "_target_" in node:
            if leaf not in ("_target_", "_partial_"):
                check_keyword(key, node)
            continue
        siblings = [str(k) for k in node if str(k) not in (leaf, "hydra")] if OmegaConf.is_dict(node) else []
        close = closest(leaf, siblings)
        hint = f"did you mean {'.'.join(filter(None, (parent, close)))}?" if close else "nothing would read it"
        raise ConfigError(f"{key}: no such key in {parent or 'the config'}; {hint}")


def check_keyword(key: str, node: Any) -> None:
    """An added key under a `_target_` node must be a keyword its callable takes."""
    parent, _, leaf = key.rpartition(".")
    accepted = keyword_names(OmegaConf.to_container(node, resolve=False), parent)  # type: ignore[arg-type]
    if accepted is None or leaf in accepted:
        return
    close = closest(leaf, sorted(accepted))
    hint = f"did you mean {parent}.{close}?" if close else f"it takes: {', '.join(sorted(accepted))}"
    builder = node.get("optimizer_class") or node["_target_"]
    raise ConfigError(f"{key}: {builder} takes no argument {leaf}; {hint}")


def cfg_job_flag(args: list[str], command: str, shows: str) -> tuple[bool, list[str]]:
    """Whether `--cfg job` was given (as `lbt train` takes it) to a command that composes a run, and the
    arguments without it; another value is one ConfigError line saying what `job` `shows`."""
    for i, arg in enumerate(args):
        if arg in ("--cfg", "-c"):
            if args[i + 1:i + 2] != ["job"]:
                raise ConfigError(f"lbt {command} {arg} takes job ({shows})")
            return True, args[:i] + args[i + 2:]
    return False, args


def sweep_grid(lines: list[str] | tuple[str, ...], where: str = "") -> list[list[str]]:
    """The jobs Hydra's basic sweeper makes of these overrides, in its order, each as `key=value` overrides: the
    one sweep expander of lbt (a study's grids, `lbt train -m`'s check, a tune's cells), so each is Hydra's."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(lines))
    except Exception as error:
        raise ConfigError(f"{where}{one_line(error)}") from None
    (batch,) = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for job in batch]


def sweep_settings(overrides: list[str] | tuple[str, ...] = (), config_name: str = "config") -> dict[str, Any]:
    """Hydra's own settings for `lbt train -m OVERRIDES`: `params` (the sweeper's grid, as `key: values`
    strings), `launcher` (its config, unresolved) and `sweep_dir`."""
    register_schemas()
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except Exception as error:
        raise ConfigError(one_line(error)) from None
    plain = [str(o.input_line) for o in parsed if not o.is_sweep_override()]  # one job's config says the sweep's
    with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name="lbt_sweep"):
        try:
            hydra_node = hydra_compose(config_name, overrides=plain, return_hydra_config=True).hydra
        except Exception as error:
            raise ConfigError(one_line(error)) from None
        params = OmegaConf.to_container(hydra_node.sweeper.get("params") or {}, resolve=False)
        launcher = OmegaConf.to_container(hydra_node.launcher, resolve=False)
    assert isinstance(params, dict) and isinstance(launcher, dict)
    return {"params": {str(k): str(v) for k, v in params.items()}, "launcher": launcher}


def composed_without(overrides: list[str], config_name: str, error: BaseException,
                     extra: list[str] | tuple = ()) -> dict | None:
    """The config without the override an error names, to suggest the key the user meant
    (`extra`: the search path of the user's own configs)."""
    culprit = str(error).split("'")[1] if str(error).count("'") >= 2 else None
    keep = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != culprit]
    try:
        container = OmegaConf.to_container(hydra_compose(config_name, overrides=[*keep, *extra]), resolve=False)
    except Exception:
        return None
    return container if isinstance(container, dict) else None


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


def group_options(group: str, search_dirs: list[Path]) -> list[str]:
    """The config names a group offers (`technique` -> batch_ramp, ghost_bn, ...) in the search folders."""
    names = {path.stem for folder in search_dirs for path in (folder / group).glob("*.yaml")}
    return sorted(name for name in names if not name.startswith("_"))


def explain(error: BaseException, defaults: Mapping | None, search_dirs: list[Path]) -> str:
    """A composition error as one line, with the closest name when the user likely mistyped one.

    `defaults`: the config composed without the failing override, to look keys up in.
    """
    message = one_line(error)
    missing = re.search(r"Could not (?:find|load) '([\w/]+)/([^'/]+)'", message)
    unknown = re.search(r"Could not override '([^']+)'", message)
    option = (missing.group(1), missing.group(2)) if missing else None
    moved = strategy_named(option, unknown.group(1) if unknown else None, search_dirs)
    if moved:
        return moved
    if missing:
        group, name = missing.groups()
        options = group_options(group, search_dirs)
        close = closest(name, options)
        hint = f"did you mean {group}={close}? " if close else ""
        return f"{group}={name}: no such {group} config; {hint}available: {', '.join(options) or 'none'}"
    if unknown and defaults is not None:
        return unknown_key(unknown.group(1).lstrip("+~"), defaults) or message
    return message


def strategy_named(option: tuple[str, str] | None, key: str | None, search_dirs: list[Path]) -> str | None:
    """A step strategy given as a technique (`technique=local_sgd`, `technique.local_sgd.period=8`): the line
    naming its own group's key, since a strategy replaces the step where a technique hooks into it."""
    strategies = group_options("strategy", search_dirs)
    if option is not None and option[0] == "technique" and option[1] in strategies:
        return f"technique={option[1]}: {option[1]} is a step strategy; give strategy={option[1]}"
    parts = (key or "").lstrip("+~").split(".")
    if len(parts) > 2 and parts[0] == "technique" and parts[1] in strategies:
        return (f"{'.'.join(parts)}: {parts[1]} is a step strategy; give strategy={parts[1]} "
                f"strategy.{'.'.join(parts[2:])}=...")
    return None


def unknown_key(dotted: str, config: Mapping) -> str | None:
    """`trainer.epoch: no such key in trainer; did you mean trainer.epochs?` (None: its parent is not a node)."""
    parent, _, leaf = dotted.rpartition(".")
    node: Any = config
    for part in parent.split(".") if parent else []:
        node = node.get(part) if isinstance(node, Mapping) else None
    if not isinstance(node, Mapping):
        return None
    close = closest(leaf, node)
    where = parent or "the config"
    if close:
        return f"{dotted}: no such key in {where}; did you mean {'.'.join(filter(None, (parent, close)))}?"
    return (f"{dotted}: no such key in {where} (keys: {', '.join(sorted(map(str, node)))}); "
            f"a new key needs a leading +, e.g. +{dotted}=...")
