"""Checkpoints that make a resumed run continue exactly where the stopped one was.

Layout in the run folder:

    checkpoint/latest.json          which step folder is complete (written last)
    checkpoint/step_<S>/rank<r>.pt  rank 0: model, optimizer, loop state and result so far;
                                    every rank: its BN buffers, RNG states and technique state

Each file is written to a temporary name and renamed (`atomic_write`);
latest.json moves only after every rank has written its file, so a kill at any
moment leaves the previous checkpoint intact. Files hold tensors and plain
Python values only, so they load with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lbt.errors import ConfigError
from lbt.paths import atomic_write

LATEST = "latest.json"
# Bumped when what a checkpoint holds changes; 2: loop state as LoopState, technique state per rank.
FORMAT = 2


def numpy_rng_state(state: tuple) -> list:
    """np.random's state tuple with its key array as a tensor (torch.load(weights_only=True) reads it)."""
    name, keys, *rest = state
    return [name, torch.from_numpy(keys.astype(np.int64)), *rest]


def numpy_rng_tuple(state: list) -> tuple:
    name, keys, *rest = state
    return (name, keys.numpy().astype(np.uint32), *rest)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": numpy_rng_state(np.random.get_state()),
             "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(numpy_rng_tuple(state["numpy"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    def __init__(self, run_dir: str | Path, rank: int, procs: int):
        self.root = Path(run_dir) / "checkpoint"
        self.rank, self.procs = rank, procs

    def save(self, step: int, main_state: dict, rank_state: dict) -> None:
        folder = self.root / f"step_{step}"
        payload = {**rank_state, **(main_state if self.rank == 0 else {})}
        try:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write(folder / f"rank{self.rank}.pt", lambda f: torch.save(payload, f))
        except OSError as error:
            raise ConfigError(f"cannot write checkpoint under {self.root}: {error.strerror or error}") from None
        if self.procs > 1:
            dist.barrier()  # every rank's file is on disk before latest.json points at it
        if self.rank == 0:
            meta = {"step": step, "folder": folder.name, "procs": self.procs, "format": FORMAT}
            atomic_write(self.root / LATEST, lambda f: f.write(json.dumps(meta).encode()))
            for old in self.root.glob("step_*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> dict | None:
        path = self.root / LATEST
        return json.loads(path.read_text()) if path.is_file() else None

    def load_latest(self) -> tuple[dict, dict] | None:
        """(rank 0's main state, this rank's own state) of the latest checkpoint; None, with a note, if none."""
        meta = self.latest()
        if meta is None:
            if self.rank == 0:
                print(f"lbt: note: no checkpoint in {self.root}; starting from scratch", file=sys.stderr, flush=True)
            return None
        if meta.get("format", 1) != FORMAT:
            raise ConfigError(
                f"the checkpoint in {self.root} is in format {meta.get('format', 1)} of an older lbt, which this "
                f"one (format {FORMAT}) cannot continue; start a new run folder"
            )
        if meta["procs"] != self.procs:
            raise ConfigError(
                f"the checkpoint in {self.root} was written by {meta['procs']} processes; "
                f"resume it with dist.procs={meta['procs']}"
            )
        folder = self.root / meta["folder"]
        main = torch.load(folder / "rank0.pt", weights_only=True, map_location="cpu")
        own = main if self.rank == 0 else torch.load(folder / f"rank{self.rank}.pt", weights_only=True,
                                                      map_location="cpu")
        return main, own
