"""Checkpoints that make a resumed run continue exactly where the stopped one was.

Layout in the run folder:

    checkpoint/latest.json          which step folder is complete (written last)
    checkpoint/step_<S>/rank<r>.pt  rank 0: model, optimizer, loop and technique state;
                                    every rank: its BN buffers and RNG states

Each file is written to a temporary name and renamed; latest.json moves only
after every rank has written its file, so a kill at any moment leaves the
previous checkpoint intact. Files hold tensors and plain Python values only,
so they load with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lbt.errors import ConfigError

LATEST = "latest.json"


def rng_state() -> dict:
    numpy_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [numpy_state[0], torch.from_numpy(numpy_state[1].astype(np.int64)), *numpy_state[2:]],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save(payload: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    except OSError as error:
        raise ConfigError(f"cannot write checkpoint {path}: {error.strerror or error}") from None


class Checkpointer:
    def __init__(self, run_dir: str | Path, rank: int, procs: int):
        self.root = Path(run_dir) / "checkpoint"
        self.rank, self.procs = rank, procs

    def save(self, step: int, main_state: dict, rank_state: dict) -> None:
        folder = self.root / f"step_{step}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot write checkpoints under {self.root}: {error.strerror or error}") from None
        payload = {**rank_state, **(main_state if self.rank == 0 else {})}
        _save(payload, folder / f"rank{self.rank}.pt")
        if self.procs > 1:
            dist.barrier()  # every rank's file is on disk before latest.json points at it
        if self.rank == 0:
            tmp = self.root / (LATEST + ".tmp")
            tmp.write_text(json.dumps({"step": step, "folder": folder.name, "procs": self.procs}))
            os.replace(tmp, self.root / LATEST)
            for old in self.root.glob("step_*"):
                if old != folder:
                    shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> dict | None:
        path = self.root / LATEST
        return json.loads(path.read_text()) if path.is_file() else None

    def load(self, meta: dict) -> tuple[dict, dict]:
        """(rank 0's main state, this rank's own state) of the checkpoint `meta` names."""
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
