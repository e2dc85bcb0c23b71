"""Checkpoints that cannot be lost and belong to their run.

A write failing part-way (a full disk, injected) leaves the previous checkpoint
usable; a damaged newest checkpoint is found by its checksums and the one
before is used, ending bitwise equal to the run trained straight; none intact,
a different run's config, or a fresh start over a checkpoint each end with one
error and leave the folder as it was; a checkpoint that passes its checksum and cannot load, a damaged
latest.json, a step damaged a second time and an older format each end in a resume or one line; a full disk
(a real one, through the command) is one line that leaves the previous checkpoint loadable. Tiny runs
(synthetic data, MLP), in process but for the command-line ones.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
from pathlib import Path

import pytest
import torch
from conftest import CHECKPOINTED_RUN, FAST, interrupted, lbt_cli, train

import lbt.engine.checkpoint
from lbt.errors import ConfigError

STEPS_PER_EPOCH = 4  # 256 samples / global batch 64
RUN = CHECKPOINTED_RUN  # 4 epochs; the run trained straight through is `finished_run`


def step_folders(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoint").iterdir() if p.is_dir())


def snapshot(run_dir: Path) -> dict[str, str]:
    """Every file under run_dir with its SHA-256: what 'nothing overwritten' compares. train.log is
    appended to (a refused attempt is logged too), so only its earlier content must stay."""
    files = {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "train.log"}
    log = run_dir / "train.log"
    return {**files, "train.log": log.read_text() if log.is_file() else ""}


def same_snapshot(after: dict[str, str], before: dict[str, str]) -> bool:
    def without_log(files: dict) -> dict:
        return {k: v for k, v in files.items() if k != "train.log"}

    return (without_log(after) == without_log(before)
            and after["train.log"].startswith(before["train.log"]))


def assert_same_params(a: Path, b: Path) -> None:
    sa, sb = (torch.load(d / "final_model.pt", weights_only=True) for d in (a, b))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def straight(finished_run) -> Path:
    """The run trained without interruption (checkpoints after epochs 1-3, the last two kept)."""
    return finished_run


def test_the_last_two_checkpoints_are_kept_each_with_a_manifest(straight):
    assert step_folders(straight) == ["step_12", "step_8"]  # epochs 2 and 3; step_4 pruned
    manifest = json.loads((straight / "checkpoint" / "step_12" / "manifest.json").read_text())
    assert manifest["step"] == 12 and set(manifest["files"]) == {"rank0.pt"}
    assert manifest["run"]["dist.world_size"] == 1 and "trainer.epochs" not in manifest["run"]


@pytest.mark.parametrize("failing", ["rank0.pt", "manifest.json"])
def test_a_write_failing_part_way_leaves_the_previous_checkpoint_usable(straight, tmp_path, monkeypatch, failing):
    real_write, saves = lbt.engine.checkpoint.atomic_write, []

    def disk_fills_up(path, write):
        """The second checkpoint's `failing` file: some bytes reach the disk, then ENOSPC."""
        path = Path(path)
        if path.name == "rank0.pt":
            saves.append(path)
        if path.name == failing and len(saves) == 2:
            def half(f):
                f.write(b"PK\x03\x04 half a file")
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_write(path, half)
        return real_write(path, write)

    monkeypatch.setattr(lbt.engine.checkpoint, "atomic_write", disk_fills_up)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="cannot write checkpoint .* No space left on device"):
        train(run_dir, RUN)
    assert "step_4" in step_folders(run_dir) and "step_8" not in step_folders(run_dir)
    assert json.loads((run_dir / "checkpoint" / "latest.json").read_text())["folder"] == "step_4"

    monkeypatch.setattr(lbt.engine.checkpoint, "atomic_write", real_write)  # the disk has room again
    resumed = train(run_dir, RUN + ["trainer.resume=auto"])
    assert resumed["steps"] == 4 * STEPS_PER_EPOCH
    assert_same_params(straight, run_dir)
    assert step_folders(run_dir) == ["step_12", "step_8"]  # the failed write's leftovers are gone


def damage(run_dir: Path, step: int) -> None:
    (run_dir / "checkpoint" / f"step_{step}" / "rank0.pt").write_bytes(b"garbage")


@pytest.mark.parametrize("damaged_before", [False, True], ids=["first", "again"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(straight, tmp_path, capfd, damaged_before):
    """Found by its checksum, moved aside for inspection (beside an earlier damage of the same step too), the
    fresh step 12 replaces it."""
    run_dir = interrupted(straight, tmp_path)
    newest = run_dir / "checkpoint" / "step_12" / "rank0.pt"
    if damaged_before:
        (run_dir / "checkpoint" / "step_12.damaged").mkdir()
        (run_dir / "checkpoint" / "step_12.damaged" / "rank0.pt").write_bytes(b"the first damage")
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])  # truncated by a bad disk
    capfd.readouterr()
    resumed = train(run_dir, RUN + ["trainer.resume=auto"])
    out, err = capfd.readouterr()
    aside = "step_12.damaged.2" if damaged_before else "step_12.damaged"
    assert ("lbt: note: resuming from checkpoint step_8: step_12 is damaged (rank0.pt does not match its "
            f"checksum), moved aside to {aside}") in err
    assert "resumed from step 8 " in out
    assert resumed["steps"] == 4 * STEPS_PER_EPOCH
    assert_same_params(straight, run_dir)
    assert step_folders(run_dir) == sorted({"step_12", "step_8", "step_12.damaged", aside})


def test_a_damaged_newest_checkpoint_that_cannot_be_moved_is_skipped(straight, tmp_path, capfd, monkeypatch):
    """A read-only folder (as root, chmod does not stop us: the rename is refused by hand)."""
    run_dir = interrupted(straight, tmp_path)
    damage(run_dir, 12)
    replace = os.replace

    def read_only(src, dst):
        if str(dst).endswith(".damaged"):
            raise OSError(30, "Read-only file system", str(src))
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", read_only)
    train(run_dir, RUN + ["trainer.resume=auto"])
    assert "resuming from checkpoint step_8: step_12 is damaged (rank0.pt does not match its checksum), left in " \
           "place (Read-only file system)" in capfd.readouterr().err
    assert_same_params(straight, run_dir)


def test_a_damaged_latest_json_is_said_and_the_newest_checkpoint_used(straight, tmp_path, capfd):
    run_dir = interrupted(straight, tmp_path)
    (run_dir / "checkpoint" / "latest.json").write_text('{"step": 12, "fol')
    train(run_dir, RUN + ["trainer.resume=auto"])
    out = capfd.readouterr()
    assert "resuming from checkpoint step_12: latest.json is damaged" in out.err and "resumed from step 12" in out.out
    assert_same_params(straight, run_dir)


def test_a_checkpoint_file_that_passes_its_checksum_but_cannot_load_is_one_line(straight, tmp_path):
    run_dir = interrupted(straight, tmp_path)
    folder = run_dir / "checkpoint" / "step_12"
    (folder / "rank0.pt").write_bytes(b"not a torch file")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["rank0.pt"] = hashlib.sha256(b"not a torch file").hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"checkpoint file .*step_12/rank0.pt cannot be loaded"):
        train(run_dir, RUN + ["trainer.resume=auto"])


def test_no_intact_checkpoint_is_one_error_and_nothing_changes(straight, tmp_path):
    run_dir = interrupted(straight, tmp_path)
    for step in (8, 12):
        (run_dir / "checkpoint" / f"step_{step}" / "rank0.pt").write_bytes(b"garbage")
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match=r"no intact checkpoint in .*step_12: rank0.pt does not match"):
        train(run_dir, RUN + ["trainer.resume=auto"])
    assert same_snapshot(snapshot(run_dir), before)


def test_resuming_with_another_runs_config_names_the_keys_and_changes_nothing(straight, tmp_path):
    run_dir = interrupted(straight, tmp_path)
    before = snapshot(run_dir)
    with pytest.raises(ConfigError) as error:
        train(run_dir, RUN + ["trainer.resume=auto", "dist.world_size=2", "optim.lr=0.2"])
    message = str(error.value)
    assert "belongs to another run" in message and "\n" not in message
    assert "dist.world_size (1 -> 2)" in message and "trainer.per_worker_batch (64 -> 32)" in message
    assert "optim.lr (0.1 -> 0.2)" in message and "trainer.epochs" not in message
    assert same_snapshot(snapshot(run_dir), before)


def test_a_run_may_be_extended_on_resume(straight, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(straight, run_dir)
    extended = train(run_dir, RUN + ["trainer.resume=auto", "trainer.epochs=5", "trainer.log_every=3"])
    assert extended["steps"] == 5 * STEPS_PER_EPOCH


def test_a_fresh_start_over_a_checkpoint_is_refused(straight, tmp_path):
    run_dir = interrupted(straight, tmp_path)
    before = snapshot(run_dir)
    with pytest.raises(ConfigError, match=r"already holds a checkpoint \(step 12\); continue that run with "
                                          r"trainer.resume=auto, or start this one in another folder"):
        train(run_dir, RUN)
    assert same_snapshot(snapshot(run_dir), before)


@pytest.mark.parametrize("latest, older", [({}, 1), ({"format": 2}, 2)], ids=["no_format_key", "format_2"])
def test_a_checkpoint_of_an_older_format_is_a_one_line_error(tmp_path, latest, older):
    (tmp_path / "checkpoint" / "step_8").mkdir(parents=True)
    (tmp_path / "checkpoint" / "latest.json").write_text(
        json.dumps({"step": 8, "folder": "step_8", "procs": 1, **latest}))
    with pytest.raises(ConfigError, match=f"format {older} of an older lbt"):
        lbt.engine.checkpoint.Checkpointer(tmp_path, 0, 1).load_latest()


def checkpointed(finished: Path, tmp_path: Path) -> Path:
    """The finished run with only its first kept checkpoint (step 8): the one the disk-full run must keep."""
    run_dir = interrupted(finished, tmp_path)
    shutil.rmtree(run_dir / "checkpoint" / "step_12")
    (run_dir / "checkpoint" / "latest.json").write_text(json.dumps(
        {"step": 8, "folder": "step_8", "procs": 1, "format": lbt.engine.checkpoint.FORMAT}))
    return run_dir


def file_size_limit(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@pytest.mark.slow
def test_a_full_disk_is_one_line_not_retried_and_the_previous_checkpoint_still_loads(straight, tmp_path, capfd):
    """RLIMIT_FSIZE: a file past 16 KiB fails with EFBIG ("File too large"), as a full disk fails a write;
    a checkpoint is about 28 KiB, the logs and Hydra's files less."""
    run_dir = checkpointed(straight, tmp_path)
    args = ["train", *FAST, *RUN, "dist.max_restarts=2", "trainer.resume=auto", f"hydra.run.dir={run_dir}"]
    full = lbt_cli(args, tmp_path, timeout=120, preexec_fn=file_size_limit(16 << 10))
    errors = [line for line in full.stderr.splitlines() if line.startswith("lbt: error:")]
    assert full.returncode == 2 and len(errors) == 1 and "File too large" in errors[0], full.stderr
    assert "the checkpoint at step 8 is still the latest" in errors[0] and "Traceback" not in full.stderr
    assert "restarting" not in full.stderr
    assert sorted(p.name for p in (run_dir / "checkpoint").iterdir()) == ["latest.json", "step_8"]  # no partial
    capfd.readouterr()
    train(run_dir, [*RUN, "dist.max_restarts=2", "trainer.resume=auto"])  # the disk has room again
    assert "resumed from step 8" in capfd.readouterr().out
    assert_same_params(straight, run_dir)


@pytest.mark.slow
def test_refusals_are_one_line_from_the_command_line_with_two_processes(tmp_path, capfd, monkeypatch):
    """What a user sees: exit code 2, one `lbt: error:` line, the run folder untouched (P=2: rank 0 checks
    the checkpoint and tells rank 1). `lbt train` in this process; its exit code as a process is
    tests/test_cli_errors.py's."""
    from test_cli_errors import run_main

    monkeypatch.chdir(tmp_path)
    args = ["train", *FAST, *RUN, "trainer.epochs=2", "dist.world_size=2", "dist.procs=2",
            f"hydra.run.dir={tmp_path / 'run'}"]
    code, err = run_main(args, capfd)
    assert code == 0, err
    before = snapshot(tmp_path / "run")
    for extra, expected in [([], "holds this run, finished (8 steps): nothing to do"),
                            (["trainer.resume=auto", "dist.world_size=4"], "dist.world_size (2 -> 4)")]:
        code, err = run_main(args + extra, capfd)
        lines = [line for line in err.splitlines() if line.strip() and not line.startswith("lbt: note:")]
        assert code == 2 and len(lines) == 1 and lines[0].startswith("lbt: error:"), err
        assert expected in lines[0]
        assert same_snapshot(snapshot(tmp_path / "run"), before)  # refused before Hydra writes its .hydra/ config


def test_the_exported_model_moves_each_tensor_once_and_keeps_tied_weights_tied():
    """final_model.pt's tensors are moved to the CPU (here, for want of a GPU, from the CPU to "meta"): tensors
    sharing memory, as a tied embedding and head do in a state dict, stay one tensor."""
    from lbt.engine.checkpoint import moved

    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, as lbt's GPT ties its head to its token embedding
    state = model.state_dict()
    assert state["0.weight"] is not state["1.weight"]  # state_dict detaches each name on its own
    out = moved({**state, "step": 3}, torch.device("meta"))
    assert all(v.device.type == "meta" for k, v in out.items() if k != "step") and out["step"] == 3
    assert out["0.weight"] is out["1.weight"] and out["1.bias"] is not out["0.weight"]
    assert moved(state, torch.device("cpu"))["1.bias"] is state["1.bias"]  # already there: not copied
