"""Bad input ends with one clear line and a non-zero exit: no traceback, no hang."""

import pytest

from conftest import FAST, lbt_cli

CASES = {
    "global_batch_not_divisible": (["dist.world_size=3", "trainer.global_batch=64"], "not divisible"),
    "batches_disagree": (["dist.world_size=4", "trainer.global_batch=64", "trainer.per_worker_batch=32"], "disagree"),
    "procs_not_dividing": (["dist.world_size=4", "dist.procs=3"], "does not divide"),
    "unknown_model": (["model=resnet9000"], "model/resnet9000"),
    "unknown_torchvision_model": (["model=torchvision", "model.name=notanet"], "notanet"),
    "non_numeric_batch": (["trainer.per_worker_batch=abc"], "per_worker_batch"),
    "typo_in_key": (["dist.wrold_size=4"], "wrold_size"),
    "negative_epochs": (["trainer.epochs=-1"], "trainer.epochs"),
    "batch_larger_than_data": (["trainer.global_batch=100000"], "larger than the training set"),
    "unknown_scaling_rule": (["schedule.scaling=lnear"], "schedule.scaling must be one of none, linear, sqrt"),
    "lars_is_an_optimizer_now": (["technique=[lars]"], "technique/lars"),
    "zero_lr": (["optim.lr=0"], "optim.lr must be a positive number"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gives_one_line(name, tmp_path):
    overrides, expected = CASES[name]
    result = lbt_cli(["train", *FAST, *overrides, f"hydra.run.dir={tmp_path}"], tmp_path, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("lbt: error:") and expected in lines[0]


def test_missing_cifar_folder_names_the_path(tmp_path):
    missing = tmp_path / "no_cifar_here"
    result = lbt_cli(["train", "data=cifar10", f"data.root={missing}", "model=resnet20", "trainer.progress=false",
                      f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and lines[0].startswith("lbt: error:")
    assert str(missing) in lines[0]


def test_run_folder_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = lbt_cli(["train", *FAST, f"hydra.run.dir={blocker / 'run'}"], tmp_path, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr and "hydra.run.dir" in lines[0] and "is a file" in lines[0]
