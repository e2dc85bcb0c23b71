"""Bad input ends with one clear line and a non-zero exit: no traceback, no hang."""

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import FAST, compose_config, lbt_cli

from lbt.errors import ConfigError

CASES = {
    "global_batch_not_divisible": (["dist.world_size=3", "trainer.global_batch=64"], "not divisible"),
    "batches_disagree": (["dist.world_size=4", "trainer.global_batch=64", "trainer.per_worker_batch=32"], "disagree"),
    "procs_not_dividing": (["dist.world_size=4", "dist.procs=3"], "does not divide"),
    "unknown_model": (["model=resnet9000"], "model=resnet9000: no such model config"),
    "unknown_torchvision_model": (["model=torchvision", "model.name=notanet"], "notanet"),
    "non_numeric_batch": (["trainer.per_worker_batch=abc"], "per_worker_batch"),
    "typo_in_key": (["dist.wrold_size=4"], "did you mean dist.world_size?"),
    "typo_in_group": (["modle=mlp"], "did you mean model?"),
    "unknown_technique_lists_them": (["technique=[warmpu]"], "available: batch_ramp, bn_epoch_average"),
    "unknown_recipe_suggests": (["recipe=goyal"], "did you mean recipe=goyal2017?"),
    "missing_mandatory_value": (["data=imagefolder"], "data.root has no default and must be given"),
    "model_cannot_read_data": (["model=resnet20"], "the model cannot read this data's samples (shape (40,))"),
    "nccl_on_cpu": (["dist.backend=nccl"], "dist.backend=nccl with trainer.device=cpu"),
    "world_size_zero": (["dist.world_size=0"], "dist.world_size must be a positive integer, got 0"),
    "negative_epochs": (["trainer.epochs=-1"], "trainer.epochs"),
    "batch_larger_than_data": (["trainer.global_batch=100000"], "larger than the training set"),
    "unknown_scaling_rule": (["schedule.scaling=lnear"], "schedule.scaling must be one of none, linear, sqrt"),
    "lars_is_an_optimizer_now": (["technique=[lars]"], "technique=lars: no such technique config"),
    "zero_lr": (["optim.lr=0"], "optim.lr must be a positive number"),
}


def run_main(args: list[str], capture) -> tuple[int, str]:
    """`lbt ARGS` in this process (lbt.apps.cli.main, as the command runs it): exit code and stderr."""
    code, _, err = run_main_io(args, capture)
    return code, err


def run_main_io(args: list[str], capture) -> tuple[int, str, str]:
    """`lbt ARGS` in this process: exit code, stdout and stderr (`capture`: pytest's capfd or capsys)."""
    from lbt.apps.cli import main

    capture.readouterr()
    code = 0
    try:
        main(args)
    except SystemExit as done:
        code = done.code or 0
    out, err = capture.readouterr()
    return code, out, err


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_gives_one_line(name, tmp_path, capfd, monkeypatch):
    """In this process, for speed; test_a_mistake_on_the_real_command_line runs the command itself."""
    overrides, expected = CASES[name]
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", *FAST, *overrides, f"hydra.run.dir={tmp_path}"], capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("lbt: error:") and expected in lines[0]


@pytest.mark.slow
def test_a_mistake_on_the_real_command_line(tmp_path):
    result = lbt_cli(["train", *FAST, "dist.wrold_size=4", f"hydra.run.dir={tmp_path}"], tmp_path, timeout=60)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("lbt: error:") and "did you mean dist.world_size?" in lines[0]


def test_missing_cifar_folder_names_the_path(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = tmp_path / "no_cifar_here"
    code, err = run_main(["train", "data=cifar10", f"data.root={missing}", "model=resnet20", "trainer.progress=false",
                          f"hydra.run.dir={tmp_path / 'run'}"], capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err and lines[0].startswith("lbt: error:")
    assert str(missing) in lines[0]


def test_run_folder_that_cannot_be_created(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    code, err = run_main(["train", *FAST, f"hydra.run.dir={blocker / 'run'}"], capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "Traceback" not in err and "hydra.run.dir" in lines[0] and "is a file" in lines[0]


@pytest.mark.parametrize("folder, says", [("/dev/null", "File exists"), ("/dev/null/study", "Not a directory"),
                                           ("/proc/self/study", "No such file or directory")])
def test_a_study_folder_that_cannot_be_made_is_one_line(folder, says, tmp_path, capfd, monkeypatch):
    """`lbt study hydra.sweep.dir=/dev/null` (or under /proc) is one line, not a traceback from the folder's lock."""
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["study", *FAST, "model=mlp", "dist.world_size=1,2", f"hydra.sweep.dir={folder}"], capfd)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("lbt: note:")]
    assert code == 2 and lines == [f"lbt: error: cannot use {folder} as a folder: {says} ({folder}): give another "
                                   "path"], err


@pytest.mark.parametrize("number, says, code", [
    (errno.EROFS, "it is on a read-only file system", 2), (errno.EACCES, "lbt may not write there", 2),
    (errno.EDQUOT, "its disk quota is used up", 1), (errno.ENOENT, None, None)])
def test_a_file_system_error_is_one_line_naming_the_path(number, says, code):
    """A read-only folder or a used-up quota, under any exception that carries it (torch.save's RuntimeError
    around its OSError): one line naming the path. Any other error is not taken for one."""
    from lbt.errors import place_problem

    try:
        try:
            raise OSError(number, os.strerror(number), "/data/run/result.json")
        except OSError as error:
            raise RuntimeError("PytorchStreamWriter failed writing file") from error
    except RuntimeError as wrapped:
        problem = place_problem(wrapped)
    if says is None:
        assert problem is None
    else:
        assert problem == (f"cannot write /data/run/result.json: {says} ({os.strerror(number)}); "
                           + ("give another path" if code == 2 else "free space there, then run the same command "
                              "again to continue"), code)


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr, result.stderr
    assert len(lines) == 1 and lines[0].startswith("lbt: error:"), result.stderr
    return lines[0]


@pytest.mark.parametrize("flags", [["-m"], ["--multirun"], ["-m", "--config-dir", "CONFIG_DIR"]])
def test_dash_flags_keep_the_one_line_errors(flags, tmp_path, capfd, monkeypatch):
    """Multirun and --config-dir get the same checks: every job of the sweep, before any runs."""
    (tmp_path / "own" / "model").mkdir(parents=True)
    (tmp_path / "own" / "model" / "tiny.yaml").write_text("defaults:\n  - cnn1d\n  - _self_\nchannels: 4\n")
    flags = [str(tmp_path / "own") if f == "CONFIG_DIR" else f for f in flags]
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", *flags, *FAST, "recipe=goyal,baseline", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "did you mean recipe=goyal2017?" in lines[0], err
    assert not (tmp_path / "sweep").exists()  # no job started


def test_config_dir_models_are_checked_too(tmp_path, capfd, monkeypatch):
    (tmp_path / "own" / "model").mkdir(parents=True)
    (tmp_path / "own" / "model" / "tiny.yaml").write_text("defaults:\n  - cnn1d\n  - _self_\nchannels: 4\n")
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "--config-dir", str(tmp_path / "own"), *FAST, "model=tiny", "dist.wrold_size=2",
                          f"hydra.run.dir={tmp_path / 'run'}"], capfd)
    assert code == 2 and "did you mean dist.world_size?" in err and len(err.strip().splitlines()) == 1, err


def test_cfg_of_a_sweep_shows_its_first_job(tmp_path, capfd, monkeypatch):
    """The README's `lbt train -m hydra/launcher=slurm recipe=baseline,goyal2017 --cfg hydra`."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main_io(["train", "-m", "hydra/launcher=slurm", "recipe=baseline,goyal2017", "--cfg", "hydra"],
                                 capfd)
    assert code == 0, err
    assert "Traceback" not in err and "--cfg shows the sweep's first job" in err
    assert "submitit" in out and "recipe=baseline" in out


def test_study_help(tmp_path, capsys, monkeypatch):
    from lbt.apps.cli import main

    monkeypatch.chdir(tmp_path)
    try:
        main(["study", "--help"])
    except SystemExit as done:
        assert done.code in (0, None)
    assert capsys.readouterr().out.startswith("usage: lbt study")
    assert not (tmp_path / "runs").exists()


def test_a_sweep_in_which_every_job_failed_exits_non_zero(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = tmp_path / "sweep"
    code, err = run_main(["train", "-m", *FAST, "trainer.global_batch=100000,200000", f"hydra.sweep.dir={sweep}"],
                         capfd)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("lbt: error: every job of the sweep failed (2 of 2)"), err
    assert len(list(sweep.glob("*/result.json"))) == 2


@pytest.mark.parametrize("text, value", [("0.95", 0.95), ("95%", 0.95), ("99.5%", 0.995), ("1", 1.0)])
def test_report_target_as_fraction_or_percent(text, value):
    from lbt.apps.report.cli import accuracy_target

    assert accuracy_target(text) == pytest.approx(value)


@pytest.mark.parametrize("text, expected", [("95", "write 95%"), ("0", "between 0 and 1"), ("abc", "not a number")])
def test_report_target_refused_in_one_line(text, expected, tmp_path, capfd):
    code, err = run_main(["report", str(tmp_path), "--target", text], capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lbt: error:") and expected in lines[0], err


def test_more_nccl_processes_than_gpus_is_one_line(tmp_path, capfd, monkeypatch):
    """Two NCCL ranks on one GPU fail inside NCCL ("invalid usage") or hang: lbt's launcher refuses to start
    them. The machine is told it has one GPU (the check reads only the count); CPU runs, gloo, and processes
    another launcher placed (torchrun, one GPU per SLURM task) are let through."""
    import torch

    from lbt.engine import make_spec
    from lbt.engine.worker import check_gpus_per_process

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", "data=synthetic", "trainer.progress=false", "dist.world_size=4", "dist.procs=2",
                          f"hydra.run.dir={tmp_path}"], capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0] == ("lbt: error: dist.procs=2 NCCL processes and this machine has 1 CUDA GPU: NCCL needs a GPU "
                        "per process; start at most 1 (the dist.world_size workers are simulated on them) "
                        "or trainer.device=cpu")
    with pytest.raises(ConfigError, match=r"start at most 1 \(the dist.world_size workers are simulated on them\)$"):
        check_gpus_per_process("nccl", "cuda", 2)  # no trainer.device=cpu offered: NCCL refuses the CPU
    for backend, device, procs in (("auto", "cpu", 2), ("gloo", "auto", 2), ("auto", "auto", 1), ("nccl", "cuda", 1)):
        check_gpus_per_process(backend, device, procs)  # none of these is refused
    # Tensor parallelism: dist.procs is a multiple of dist.tensor_parallel, so the advice says which to change.
    with pytest.raises(ConfigError, match=r"^dist.tensor_parallel=2 NCCL processes .* give dist.tensor_parallel at "
                                          r"most 1 or trainer.device=cpu$"):
        check_gpus_per_process("auto", "auto", 2, tensor_parallel=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(ConfigError, match=r"^dist.procs=4 .* 3 CUDA GPUs: .* start at most 2, a multiple of "
                                          r"dist.tensor_parallel=2 \("):
        check_gpus_per_process("nccl", "cuda", 4, tensor_parallel=2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)  # started by torchrun: its placement stands
    config, recipe = compose_config(["data=synthetic", "dist.world_size=4"])
    assert make_spec(config, recipe).procs == 2


@pytest.mark.slow
@pytest.mark.parametrize("command", [["report", "no_such_folder"], ["plan", "model=mlp", "plan.step_ms=5"]])
def test_ctrl_c_in_a_command_without_runs_is_one_line_and_130(tmp_path, command):
    """Ctrl-C while report or plan imports or works is one line and 130, not a KeyboardInterrupt traceback (nor a
    half-imported numpy's AttributeError). The process is frozen (SIGSTOP) while it is sent SIGINT, so the signal lands
    at that moment: 0 to 0.4 s after the stop handler is installed (while torch imports, here)."""
    args = [sys.executable, "-X", "importtime", "-m", "lbt", *command]
    for delay in (0.0, 0.1, 0.4):
        job = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert job.stderr is not None
        seen = False  # the first import after lbt.apps.errors's: lbt/__main__.py has installed the handler
        for line in job.stderr:
            if seen:
                break
            seen = line.split("|")[-1].strip() == "lbt.apps.errors"
        time.sleep(delay)
        job.send_signal(signal.SIGSTOP)
        assert job.poll() is None, f"lbt {command[0]} ended within {delay} s: the signal would test nothing"
        job.send_signal(signal.SIGINT)
        job.send_signal(signal.SIGCONT)
        _, err = job.communicate(timeout=60)
        err = "\n".join(line for line in err.splitlines() if not line.startswith("import time:"))
        assert job.returncode == 130, (delay, job.returncode, err)
        assert err.strip() == "lbt: stopped (SIGINT); rerun the same command to continue", (delay, err)


def test_a_torch_below_the_floor_is_refused_in_one_line(monkeypatch, capsys):
    """`lbt train` under torch 2.5 (fully_shard not yet public) says which torch it needs and exits 2."""
    from importlib import metadata

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "2.5.1" if name == "torch" else real(name))
    code, err = run_main(["train", "--cfg", "job"], capsys)
    assert code == 2 and err.strip() == ("lbt: error: lbt needs torch>=2.6 (fully_shard and DTensor), this is "
                                         "torch 2.5.1: pip install 'torch>=2.6'")


def test_the_torch_floor_is_pyprojects_and_the_installed_torch_has_what_it_stands_for():
    """pyproject.toml's `torch>=X.Y` is lbt's TORCH_FLOOR, and the APIs that set it import here: a floor
    below them would install a torch lbt cannot run on."""
    import re
    from pathlib import Path

    from torch.distributed.fsdp import fully_shard  # noqa: F401
    from torch.distributed.tensor import DTensor  # noqa: F401

    from lbt.apps.cli import TORCH_FLOOR, torch_problem

    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    torch_pin = re.search(r'^\s*"(torch[<>=!~][^"]*)"', pyproject, re.MULTILINE)[1]
    assert re.fullmatch(r"torch>=(\d+)\.(\d+)", torch_pin), torch_pin  # a floor and no ceiling
    assert tuple(map(int, torch_pin.removeprefix("torch>=").split("."))) == TORCH_FLOOR
    assert torch_problem("2.6.0") is None and torch_problem("2.14.1+cu128") is None
    assert torch_problem("2.5.1") is not None and torch_problem("1.13.0") is not None
