"""Checkpoints that make a resumed run continue exactly where the stopped one was.

Layout in the run folder:

    checkpoint/step_<S>/rank<r>.pt     rank 0: model, optimizer, loop state and result so far;
                                       every rank: its BN buffers, RNG states and technique state
    checkpoint/step_<S>/shards/        a sharded run's (dist.shard=fsdp) model and optimizer state, written by
                                       torch.distributed.checkpoint: each rank its own shards, rank 0 the metadata;
                                       it loads on any number of processes (resharded as it loads)
    checkpoint/step_<S>/manifest.json  each file's SHA-256, the process count and the run's config
    checkpoint/latest.json             the newest step folder (for people and scripts; loading
                                       trusts the manifests)
    snapshots/samples_<N>.pt           lbt probe's base run: its whole state after N samples (rank 0's),
                                       which branches start from; kept, never pruned

A checkpoint is complete or absent: every rank writes into `step_<S>.partial/`,
rank 0 then hashes the files, writes the manifest and renames the folder to
`step_<S>` (one rename(2): a kill or a full disk at any moment leaves the
previous checkpoints as they were). The last `keep` checkpoints stay, so a
damaged newest one (a bad disk, a truncated copy) is detected by its checksums
and the one before is used. The manifest's config ties a checkpoint to its run:
resuming with a different run-defining config is refused (lbt.spec.run.run_identity).
Files hold tensors and plain Python values only, so they load with
torch.load(weights_only=True).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lbt.errors import ConfigError, os_error_of
from lbt.metrics.text_log import say
from lbt.parallel.process_group import DistContext
from lbt.parallel.tensor_parallel import full_tensors, load_full_state
from lbt.paths import atomic_write
from lbt.spec.result import EvalPoint, RunResult
from lbt.spec.run import identity_differences

LATEST = "latest.json"
MANIFEST = "manifest.json"
PARTIAL = ".partial"  # a step folder being written
DAMAGED = ".damaged"  # a step folder that failed its checksums, kept aside for inspection
SHARDS = "shards"  # a sharded run's model and optimizer (torch.distributed.checkpoint's files)
# Bumped when what a checkpoint holds changes (an older one is refused with one line, not misread).
FORMAT = 4

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
    def save(self, step: int, main_state: dict, rank_state: dict, shards: dict | None = None) -> None:
        """Rank 0's `main_state` and every rank's own `rank_state`; `shards` (a sharded run's model and
        optimizer, DTensors) through torch.distributed.checkpoint, a collective of all ranks."""
        partial = self.root / f"step_{step}{PARTIAL}"
        payload = {**rank_state, **(main_state if self.rank == 0 else {})}
        with self._writing(partial):
            partial.mkdir(parents=True, exist_ok=True)
            atomic_write(partial / f"rank{self.rank}.pt", lambda f: torch.save(payload, f))
            if shards is not None:
                import torch.distributed.checkpoint as dcp

                dcp.save(shards, checkpoint_id=partial / SHARDS)
        if self.procs > 1:
            dist.barrier()  # every rank's file is on disk before rank 0 publishes the folder
        if self.rank == 0:
            with self._writing(partial):
                self._publish(partial, step)
            self._prune()
        if self.procs > 1:
            # Published and pruned before any rank goes on: a checkpoint saved right after (a stop read at
            # an epoch's end, after the epoch's) would otherwise be written into a folder rank 0 clears.
            dist.barrier()

    def _publish(self, partial: Path, step: int) -> None:
        """Manifest, then one rename: the step folder appears complete or not at all."""
        files = {f"rank{r}.pt": file_sha256(partial / f"rank{r}.pt") for r in range(self.procs)}
        sharded = (partial / SHARDS).is_dir()
        if sharded:
            files.update({str(path.relative_to(partial)): file_sha256(path)
                          for path in sorted((partial / SHARDS).iterdir()) if path.is_file()})
        manifest = {"step": step, "procs": self.procs, "format": FORMAT, "files": files, "run": self.identity,
                    "sharded": sharded}
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
    def _writing(self, partial: Path) -> Iterator[None]:
        """A full disk, a read-only folder: one line; the partial folder goes, the previous checkpoints stay.
        (torch.save reports a full disk as a RuntimeError raised while handling the file's OSError.)"""
        try:
            yield
        except (OSError, RuntimeError) as raised:
            error = os_error_of(raised)
            if error is None:
                raise
            shutil.rmtree(partial, ignore_errors=True)
            latest = self.latest()
            kept = f"the checkpoint at step {latest['step']} is still the latest" if latest else "none was written"
            raise ConfigError(f"cannot write checkpoint {self.root / partial.name.removesuffix(PARTIAL)}: "
                              f"{error.strerror or error} (errno {error.errno}); {kept}") from None

    # -- reading --------------------------------------------------------------
    def _complete(self) -> list[Path]:
        """Published step folders, newest first."""
        folders = [p for p in self.root.glob("step_*") if p.is_dir() and p.name.removeprefix("step_").isdigit()]
        return sorted(folders, key=_step_of, reverse=True)

    def latest(self) -> dict | None:
        """latest.json, or None when it is missing or damaged (loading trusts the manifests, not this file)."""
        path = self.root / LATEST
        try:
            meta = json.loads(path.read_text()) if path.is_file() else None
            return meta if isinstance(meta, dict) and isinstance(meta.get("step"), int) else None
        except (OSError, ValueError):
            return None

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
                say(f"lbt: note: no checkpoint in {self.root}; starting from scratch", stderr=True)
            return None
        if isinstance(choice, str):  # every rank raises the same error; rank 0 prints it
            raise ConfigError(choice)
        name, manifest = choice
        self._check_belongs(manifest, say_reshard=self.rank == 0)
        main = _load(self.root / name / "rank0.pt")
        # Resharded onto more processes: a new rank takes the state (RNG, buffers) of rank r mod the old count.
        own_rank = self.rank % manifest["procs"]
        own = main if own_rank == 0 else _load(self.root / name / f"rank{own_rank}.pt")
        if manifest.get("sharded"):
            main["shards_dir"] = str(self.root / name / SHARDS)
        return main, own

    def _choose(self) -> tuple[str, dict] | str | None:
        """The newest step folder whose files match their manifest, or an error message, or None.

        Damaged newer folders are moved aside (to a name of their own) and one line says which checkpoint
        the run resumes from and why; none intact, or a folder that cannot be read, is one error naming it.
        """
        if self.root.is_dir() and not os.access(self.root, os.R_OK | os.X_OK):
            return f"cannot read the checkpoint folder {self.root} (permission denied); make it readable"
        meta = self.latest()
        if meta is not None and meta.get("format", 1) != FORMAT:
            return (f"the checkpoint in {self.root} is in format {meta.get('format', 1)} of an older lbt, which this "
                    f"one (format {FORMAT}) cannot continue; start a new run folder")
        damaged: list[tuple[Path, str]] = []
        for folder in self._complete():
            manifest, problem = _verify(folder)
            if manifest is None:
                damaged.append((folder, f"{problem}"))
                continue
            why = [f"{bad.name} is damaged ({problem}), {_move_aside(bad)}" for bad, problem in damaged]
            if meta is None and (self.root / LATEST).exists():
                why.append(f"{LATEST} is damaged (loading trusts the step folders' manifests)")
            if why:
                say(f"lbt: note: resuming from checkpoint {folder.name}: {'; '.join(why)}", stderr=True)
            return folder.name, manifest
        if damaged:  # nothing is moved: the folder stays as it was for whoever looks at it
            problems = "; ".join(f"{bad.name}: {problem}" for bad, problem in damaged)
            return f"no intact checkpoint in {self.root} ({problems}); start a new run folder"
        return None

    def _check_belongs(self, manifest: dict, say_reshard: bool = False) -> None:
        differ = identity_differences(manifest.get("run", {}), self.identity)
        if differ and all(d.startswith("dist.shard ") for d in differ):
            written = "sharded (dist.shard=fsdp)" if manifest.get("sharded") else "replicated (dist.shard=none)"
            raise ConfigError(f"the checkpoint in {self.root} was written by a {written} run, and a checkpoint keeps "
                              f"its layout: resume it as it was written ({differ[0]}), or start the other layout in "
                              "another folder (hydra.run.dir=...)")
        if manifest.get("procs") != self.procs and not manifest.get("sharded"):
            raise ConfigError(
                f"the checkpoint in {self.root} was written by {manifest['procs']} processes; "
                f"resume it with dist.procs={manifest['procs']}"
            )
        if differ:
            raise ConfigError(
                f"the checkpoint in {self.root} belongs to another run: {', '.join(differ)}; resume with the "
                "checkpoint's values, or start this run in another folder (hydra.run.dir=...)"
            )
        if manifest.get("procs") != self.procs and say_reshard:
            more = (f"; process r takes the random streams of process r mod {manifest['procs']}"
                    if self.procs > manifest["procs"] else "")
            say(f"lbt: note: the checkpoint was written by {manifest['procs']} processes and is resharded onto "
                f"{self.procs}: the same steps up to float rounding{more}", stderr=True)


def _move_aside(folder: Path) -> str:
    """Rename a damaged step folder to a free `.damaged` name (a step damaged a second time gets
    `.damaged.2`), kept for inspection; what happened, for the note."""
    target, n = folder.with_name(folder.name + DAMAGED), 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}{DAMAGED}.{n}")
    try:
        os.replace(folder, target)
    except OSError as error:  # a read-only folder: the damaged one stays, and is skipped again next time
        return f"left in place ({error.strerror or error})"
    return f"moved aside to {target.name}"


def _load(path: Path) -> dict:
    """A checkpoint file that passed its checksum, or one line naming it (a foreign or unreadable file)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ConfigError(f"checkpoint file {path} cannot be loaded ({type(error).__name__}: {first}); "
                          "move its step folder aside to resume from the one before") from None


def _verify(folder: Path) -> tuple[dict | None, str | None]:
    """(manifest, None) when every file matches its recorded checksum, else (None, what is wrong)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("procs"), int):
            return None, f"{MANIFEST} is not a manifest"
        if manifest.get("format") != FORMAT:
            return None, f"format {manifest.get('format')}, expected {FORMAT}"
        for name, digest in manifest["files"].items():
            path = folder / name
            if not path.is_file():
                return None, f"{name} is missing"
            if file_sha256(path) != digest:
                return None, f"{name} does not match its checksum"
        return manifest, None
    except OSError as error:
        return None, f"cannot read {Path(error.filename or folder).name}: {error.strerror or error}"
    except (ValueError, KeyError, AttributeError, TypeError) as error:
        return None, f"unreadable manifest: {error}"


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (a power cut after it must not undo it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def full_state(state: dict, ctx: DistContext) -> dict:
    """A model's or optimizer's state dict as one process would save it: under tensor parallelism or
    sharding every split tensor gathered whole (a collective: every rank calls it)."""
    return full_tensors(state) if ctx.tensor_parallel > 1 or ctx.sharded else state


def moved(state: dict, device: torch.device) -> dict:
    """`state` with its tensors on `device`, each tensor copied once: tensors that share memory (a tied
    embedding and head) stay one tensor, as torch.save keeps them."""
    copies: dict[tuple, torch.Tensor] = {}

    def move(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.device == device:
            return value
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
               value.dtype)
        if key not in copies:
            copies[key] = value.to(device)
        return copies[key]

    return {name: move(value) for name, value in state.items()}


def exported_model(model: torch.nn.Module, ctx: DistContext) -> dict:
    """The trained model as one ordinary state dict of whole CPU tensors on rank 0 (the others get {}), for
    final_model.pt, which then loads on a machine without the GPU it was trained on. A sharded model is
    gathered one tensor at a time into rank 0's memory alone, so no rank ever holds the whole model beside
    its training state (a collective: every rank calls it)."""
    if not ctx.sharded:
        state = full_state(model.state_dict(), ctx)
        return moved(state, torch.device("cpu")) if ctx.is_main else {}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def weights_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict:
    """The model and optimizer for rank 0's checkpoint file: whole tensors, or nothing when sharded (they go
    to the checkpoint's shards, `shard_state`)."""
    if ctx.sharded:
        return {}
    return {"model": full_state(model.state_dict(), ctx), "optimizer": full_state(optimizer.state_dict(), ctx)}


def shard_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx: DistContext) -> dict | None:
    """A sharded run's model and optimizer as torch.distributed.checkpoint saves them (parameters' names as
    keys, each rank's shards as DTensors); None for a run that is not sharded."""
    if not ctx.sharded:
        return None
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def load_model_and_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer, main: dict,
                             ctx: DistContext) -> None:
    """Load what `weights_state` or `shard_state` saved (split again into this rank's shards under tensor
    parallelism; read from the shards, on any number of processes, when sharded)."""
    if "shards_dir" in main:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # The layout to read into: this run's shards, or whole tensors where one process holds the whole model
        # (dist.shard=fsdp on one process shards nothing): torch.distributed.checkpoint reshards as it reads.
        state = shard_state(model, optimizer, ctx)
        if state is None:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            state = {"model": model_state, "optimizer": optimizer_state}
        with warnings.catch_warnings():  # one process without a group: what dcp says it assumes is meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=main["shards_dir"], no_dist=not dist.is_initialized())
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    elif ctx.tensor_parallel > 1 or ctx.sharded:
        load_full_state(model, optimizer, main["model"], main["optimizer"])
    else:
        model.load_state_dict(main["model"])
        optimizer.load_state_dict(main["optimizer"])


def own_buffers(model: torch.nn.Module) -> dict:
    """A copy of this rank's buffers (BN statistics: each process keeps its own during training)."""
    return {k: v.detach().clone() for k, v in model.named_buffers()}


def load_buffers(model: torch.nn.Module, saved: dict) -> None:
    buffers = dict(model.named_buffers())
    for name, value in saved.items():
        buffers[name].copy_(value)


def checkpointed_result(result: RunResult) -> dict:
    """The result so far, as plain values (the step timings restart with the resumed run)."""
    return {k: v for k, v in asdict(result).items() if k not in ("stopped", "step_seconds")}


def restored_result(values: dict) -> RunResult:
    return RunResult(**{**values, "history": [EvalPoint(**point) for point in values["history"]]})


def snapshot_path(run_dir: str | Path, samples: int) -> Path:
    return Path(run_dir) / "snapshots" / f"samples_{samples}.pt"


def checksum_path(snapshot: Path) -> Path:
    """A snapshot's SHA-256, beside it, as a checkpoint's manifest holds its files'."""
    return snapshot.with_suffix(".sha256")


def save_snapshot(run_dir: str | Path, samples: int, state: dict) -> None:
    """Publish a snapshot whole (a branch never reads half of one), then its checksum; one written before with
    its checksum is kept: the run that wrote it was the same up to here (a resumed run is exact)."""
    path = snapshot_path(run_dir, samples)
    if path.exists() and checksum_path(path).exists():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(state, f))
        atomic_write(checksum_path(path), lambda f: f.write(file_sha256(path).encode()))
    except OSError as error:
        raise ConfigError(f"cannot write snapshot {path}: {error.strerror or error}") from None


def snapshot_problem(run_dir: str | Path, samples: int) -> str | None:
    """Why the snapshot at `samples` cannot be branched from (missing, no checksum, or not matching it), or None."""
    path = snapshot_path(run_dir, samples)
    if not path.is_file():
        have = sorted(p.name for p in path.parent.glob("samples_*.pt")) if path.parent.is_dir() else []
        return f"no snapshot {path}" + (f" (there: {', '.join(have)})" if have else " (the folder holds no snapshots)")
    try:
        expected = checksum_path(path).read_text().strip()
    except OSError:
        return f"snapshot {path} has no checksum ({checksum_path(path).name}): it was cut off while written"
    if file_sha256(path) != expected:
        return f"snapshot {path} does not match its SHA-256: it is damaged"
    return None


def load_snapshot(run_dir: str | Path, samples: int) -> dict:
    path = snapshot_path(run_dir, samples)
    problem = snapshot_problem(run_dir, samples)
    if problem:
        raise ConfigError(f"trainer.branch_at={samples}: {problem}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a foreign file with a matching checksum: one line, not a pickle traceback
        raise ConfigError(f"snapshot {path} cannot be read ({type(error).__name__}); delete it and run the "
                          "base run again") from None
