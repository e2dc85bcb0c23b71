"""Checkpoints that make a resumed run continue exactly where the stopped one was.

Layout in the run folder:

    checkpoint/step_<S>/rank<r>.pt     rank 0: model, optimizer, loop state and result so far;
                                       every rank: its BN buffers, RNG states and technique state
    checkpoint/step_<S>/manifest.json  each file's SHA-256, the process count and the run's config
    checkpoint/latest.json             the newest step folder (for people and scripts; loading
                                       trusts the manifests)

A checkpoint is complete or absent: every rank writes into `step_<S>.partial/`,
rank 0 then hashes the files, writes the manifest and renames the folder to
`step_<S>` (one rename(2): a kill or a full disk at any moment leaves the
previous checkpoints as they were). The last `keep` checkpoints stay, so a
damaged newest one (a bad disk, a truncated copy) is detected by its checksums
and the one before is used. The manifest's config ties a checkpoint to its run:
resuming with a different run-defining config is refused (`run_identity`).
Files hold tensors and plain Python values only, so they load with
torch.load(weights_only=True).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from lbt.errors import ConfigError
from lbt.paths import atomic_write

LATEST = "latest.json"
MANIFEST = "manifest.json"
PARTIAL = ".partial"  # a step folder being written
DAMAGED = ".damaged"  # a step folder that failed its checksums, kept aside for inspection
# Bumped when what a checkpoint holds changes; 2: loop state as LoopState, technique state per rank;
# 3: step folders published whole, with a manifest of checksums and the run's config.
FORMAT = 3

# Config keys that may differ between a checkpoint and the run that resumes it (README "Faults"):
# the budget (to extend a run), how it is run and shown, where data lives, and labels. Every other
# key defines the run (model, data, batches, world size, optimizer, schedule, techniques, seed).
MAY_CHANGE = (
    "trainer.epochs", "trainer.max_steps", "trainer.resume", "trainer.progress", "trainer.log_every",
    "trainer.evals", "trainer.device", "trainer.threads", "trainer.checkpoint_every", "trainer.keep_checkpoints",
    "trainer.compile", "trainer.channels_last", "trainer.loader_workers",
    "dist.procs",  # checked on its own: the per-process files need the same count
    "dist.backend", "dist.timeout_s", "dist.fuse_workers", "dist.max_restarts",
    "data.data_dir", "data.root", "recipe", "overrides", "tune", "study", "extra_sweeps",
)


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


def run_identity(config: dict, per_worker_batch: int, global_batch: int) -> dict:
    """The run-defining part of a resolved config, as dotted keys: every key but MAY_CHANGE.

    The batch sizes are the derived ones, so `global_batch=128` and `per_worker_batch=64` at
    world size 2 are the same run.
    """
    flat = {key: value for key, value in _flatten(config).items() if not _may_change(key)}
    flat["trainer.per_worker_batch"], flat["trainer.global_batch"] = per_worker_batch, global_batch
    return flat


def _flatten(node, prefix: str = "") -> dict:
    if not isinstance(node, dict):
        return {prefix: node}
    flat = {}
    for key, value in node.items():
        flat.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in MAY_CHANGE)


def identity_differences(saved: dict, new: dict) -> list[str]:
    """`key (saved -> new)` for each run-defining key whose value differs, sorted."""
    missing = object()

    def shown(value) -> str:
        return "absent" if value is missing else json.dumps(value)

    def same(a, b) -> bool:  # json: NaN equals NaN, as it reads back from the manifest
        return a == b or (a is not missing and b is not missing and json.dumps(a) == json.dumps(b))

    return [f"{key} ({shown(saved.get(key, missing))} -> {shown(new.get(key, missing))})"
            for key in sorted(saved.keys() | new.keys()) if not same(saved.get(key, missing), new.get(key, missing))]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _step_of(folder: Path) -> int:
    return int(folder.name.removeprefix("step_"))


class Checkpointer:
    def __init__(self, run_dir: str | Path, rank: int, procs: int, keep: int = 2, identity: dict | None = None):
        self.root = Path(run_dir) / "checkpoint"
        self.rank, self.procs, self.keep = rank, procs, keep
        self.identity = identity or {}

    # -- writing --------------------------------------------------------------
    def save(self, step: int, main_state: dict, rank_state: dict) -> None:
        partial = self.root / f"step_{step}{PARTIAL}"
        payload = {**rank_state, **(main_state if self.rank == 0 else {})}
        with self._writing():
            partial.mkdir(parents=True, exist_ok=True)
            atomic_write(partial / f"rank{self.rank}.pt", lambda f: torch.save(payload, f))
        if self.procs > 1:
            dist.barrier()  # every rank's file is on disk before rank 0 publishes the folder
        if self.rank == 0:
            with self._writing():
                self._publish(partial, step)
            self._prune()

    def _publish(self, partial: Path, step: int) -> None:
        """Manifest, then one rename: the step folder appears complete or not at all."""
        files = {f"rank{r}.pt": file_sha256(partial / f"rank{r}.pt") for r in range(self.procs)}
        manifest = {"step": step, "procs": self.procs, "format": FORMAT, "files": files, "run": self.identity}
        atomic_write(partial / MANIFEST, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        folder = self.root / f"step_{step}"
        if folder.exists():  # the same step saved again, by a run resumed from an earlier checkpoint
            shutil.rmtree(folder)
        os.replace(partial, folder)
        _fsync_dir(self.root)
        meta = {"step": step, "folder": folder.name, "procs": self.procs, "format": FORMAT}
        atomic_write(self.root / LATEST, lambda f: f.write(json.dumps(meta).encode()))

    def _prune(self) -> None:
        """Keep the newest `keep` checkpoints; drop older ones and what failed writes left behind."""
        for old in self._complete()[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.root.glob(f"step_*{PARTIAL}"):
            shutil.rmtree(leftover, ignore_errors=True)

    @contextmanager
    def _writing(self):
        try:
            yield
        except OSError as error:  # a full disk, a read-only folder: the previous checkpoints are intact
            raise ConfigError(f"cannot write checkpoint under {self.root}: {error.strerror or error}; "
                              f"the previous checkpoint is intact") from None

    # -- reading --------------------------------------------------------------
    def _complete(self) -> list[Path]:
        """Published step folders, newest first."""
        folders = [p for p in self.root.glob("step_*") if p.is_dir() and p.name.removeprefix("step_").isdigit()]
        return sorted(folders, key=_step_of, reverse=True)

    def latest(self) -> dict | None:
        path = self.root / LATEST
        return json.loads(path.read_text()) if path.is_file() else None

    def refuse_other_run(self, tidy: bool = True) -> None:
        """A fresh start must not leave an earlier run's checkpoint for a later resume to pick up, nor mix
        its checkpoints with that run's. `tidy`: remove what a run killed in its first checkpoint left."""
        folders = self._complete()
        if folders:
            raise ConfigError(
                f"{self.root.parent} already holds a checkpoint (step {_step_of(folders[0])}); continue that run "
                "with trainer.resume=auto, or start this one in another folder (hydra.run.dir=...)")
        if tidy and self.rank == 0:
            self._prune()

    def check_newest_belongs(self) -> None:
        """The newest readable manifest against this run, without reading the checkpoint files
        (a quick check before anything is written; load_latest checks again, with the checksums)."""
        for folder in self._complete():
            try:
                manifest = json.loads((folder / MANIFEST).read_text())
                manifest["procs"]
            except (OSError, ValueError, KeyError, TypeError):
                continue  # damaged: load_latest falls back, and says so
            self._check_belongs(manifest)
            return

    def load_latest(self) -> tuple[dict, dict] | None:
        """(rank 0's main state, this rank's own state) of the newest intact checkpoint; None, with a note, if none.

        Rank 0 checks the checksums and tells the others which folder to load, so all ranks load the same one.
        """
        choice = self._choose() if self.rank == 0 else None
        if self.procs > 1:
            holder = [choice]
            dist.broadcast_object_list(holder, src=0)
            choice = holder[0]
        if choice is None:
            if self.rank == 0:
                print(f"lbt: note: no checkpoint in {self.root}; starting from scratch", file=sys.stderr, flush=True)
            return None
        if isinstance(choice, str):  # every rank raises the same error; rank 0 prints it
            raise ConfigError(choice)
        name, manifest = choice
        self._check_belongs(manifest)
        folder = self.root / name
        main = torch.load(folder / "rank0.pt", weights_only=True, map_location="cpu")
        own = main if self.rank == 0 else torch.load(folder / f"rank{self.rank}.pt", weights_only=True,
                                                      map_location="cpu")
        return main, own

    def _choose(self) -> tuple[str, dict] | str | None:
        """The newest step folder whose files match their manifest, or an error message, or None."""
        meta = self.latest()
        if meta is not None and meta.get("format", 1) != FORMAT:
            return (f"the checkpoint in {self.root} is in format {meta.get('format', 1)} of an older lbt, which this "
                    f"one (format {FORMAT}) cannot continue; start a new run folder")
        damaged, problems = [], []
        for folder in self._complete():
            manifest, problem = _verify(folder)
            if problem is None:
                for bad in damaged:
                    os.replace(bad, bad.with_name(bad.name + DAMAGED))
                if damaged:
                    print(f"lbt: note: moved the damaged checkpoint(s) aside "
                          f"({', '.join(b.name + DAMAGED for b in damaged)}); resuming from {folder.name}",
                          file=sys.stderr, flush=True)
                return folder.name, manifest
            print(f"lbt: note: checkpoint {folder} is damaged ({problem}); trying the one before",
                  file=sys.stderr, flush=True)
            damaged.append(folder)
            problems.append(f"{folder.name}: {problem}")
        if damaged:
            return f"no intact checkpoint in {self.root} ({'; '.join(problems)}); start a new run folder"
        return None

    def _check_belongs(self, manifest: dict) -> None:
        if manifest["procs"] != self.procs:
            raise ConfigError(
                f"the checkpoint in {self.root} was written by {manifest['procs']} processes; "
                f"resume it with dist.procs={manifest['procs']}"
            )
        differ = identity_differences(manifest.get("run", {}), self.identity)
        if differ:
            raise ConfigError(
                f"the checkpoint in {self.root} belongs to another run: {', '.join(differ)}; resume with the "
                "checkpoint's values, or start this run in another folder (hydra.run.dir=...)"
            )


def _verify(folder: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) when every file matches its recorded checksum, else (None, what is wrong)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            return None, f"format {manifest.get('format')}, expected {FORMAT}"
        for name, digest in manifest["files"].items():
            path = folder / name
            if not path.is_file():
                return None, f"{name} is missing"
            if file_sha256(path) != digest:
                return None, f"{name} does not match its checksum"
        return manifest, None
    except (OSError, ValueError, KeyError, AttributeError) as error:
        return None, f"unreadable manifest: {error}"


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (a power cut after it must not undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
