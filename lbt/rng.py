"""Random number generator states as checkpoint values: tensors and plain Python, which
torch.load(weights_only=True) reads back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def numpy_rng_state(state: tuple | dict[str, Any]) -> list:
    """np.random's state tuple with its key array as a tensor (torch.load(weights_only=True) reads it)."""
    assert isinstance(state, tuple), "np.random.get_state()'s legacy form is a tuple"
    name, keys, *rest = state
    return [name, torch.from_numpy(keys.astype(np.int64)), *rest]


def numpy_rng_tuple(state: list) -> tuple:
    name, keys, *rest = state
    return (name, keys.numpy().astype(np.uint32), *rest)


def rng_state() -> dict[str, Any]:
    """This process's torch, NumPy, Python (and CUDA) generator states."""
    state = {"torch": torch.get_rng_state(), "numpy": numpy_rng_state(np.random.get_state()),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_rng_tuple(state["numpy"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
