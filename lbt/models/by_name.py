"""What timm and torchvision models by name share: the one line for a name the library does not have."""

from __future__ import annotations

import difflib

from lbt.errors import ConfigError


def unknown_name(name: str, names: list[str], library: str, fallback: list[str], listing: str) -> ConfigError:
    """`model.name='resnet1800': not a timm model; try resnet18, ... (all N: timm.list_models())`."""
    close = difflib.get_close_matches(name, names, n=3) or fallback
    return ConfigError(f"model.name={name!r}: not a {library} model; try {', '.join(close)} "
                       f"(all {len(names)}: {listing})")
