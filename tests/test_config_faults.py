"""Faults of the config and the numbers: a typo'd added key,
a dotted path to the wrong kind of code, an LR beyond float32, a non-finite validation loss, a device as a
data file, a sweep of no jobs. Each is one `lbt: error:` line (exit 2) or a run recorded as diverged."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST, compose_config, train
from test_cli_errors import run_main
from torch import nn

from lbt.data.base import data_file
from lbt.engine import make_spec
from lbt.engine.build import check_targets
from lbt.errors import ConfigError

ONE_LINE = {
    # An added key nothing reads: the run would train the default silently.
    "added_typo_in_trainer": (["+trainer.epoch=1"], "trainer.epoch: no such key in trainer; did you mean "
                                                    "trainer.epochs?"),
    "added_top_level_key": (["+foo=3"], "foo: no such key in the config"),
    "added_typo_in_optimizer": (["+optim.momentm=0.9"], "torch.optim.SGD takes no argument momentm; did you mean "
                                                        "optim.momentum?"),
    "added_typo_in_model": (["model=mlp", "+model.hiden=3"], "lbt.models.MLP takes no argument hiden; did you mean "
                                                             "model.hidden?"),
    "forced_typo": (["++trainer.epoch=1"], "did you mean trainer.epochs?"),
    # A dotted path imports code: only of the kind the key builds, checked before anything runs.
    "dataset_is_a_builtin": (["data=custom", "data.dataset=os.system", "data.num_classes=2", "data.input_shape=[4]"],
                             "data.dataset=os.system is a builtin_function_or_method"),
    "model_is_another_class": (["model._target_=subprocess.Popen"], "model._target_ must name an nn.Module subclass"),
    "optimizer_is_a_layer": (["optim.optimizer_class=torch.nn.Linear"], "must name a torch.optim.Optimizer subclass"),
    "model_from_the_standard_library": (["model._target_=shutil.rmtree"], "is a function from shutil"),
    # A run stopped at a target: one target, in range, on the val split only.
    "stop_at_two_targets": (["trainer.stop_at_val_acc=0.9", "trainer.stop_at_val_loss=0.1"],
                            "trainer.stop_at_val_acc and trainer.stop_at_val_loss are both set: give one target"),
    "stop_at_a_percentage": (["trainer.stop_at_val_acc=95"],
                             "trainer.stop_at_val_acc must be a number in (0, 1], got 95.0"),
    "stop_at_test": (["data.val_fraction=0", "trainer.stop_at_val_acc=0.9"],
                     "stops on the val split, and this data holds none out"),
    # Files that are not data files.
    "data_path_is_a_device": (["data=text", "data.path=/dev/zero"], "is not a regular file"),
}


@pytest.mark.parametrize("name", sorted(ONE_LINE))
def test_bad_input_is_one_line(name, tmp_path, capfd, monkeypatch):
    overrides, expected = ONE_LINE[name]
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", *FAST, *overrides, "trainer.max_steps=1", f"hydra.run.dir={tmp_path / 'run'}"],
                         capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("lbt: error:") and expected in lines[0], lines[0]
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.parametrize("sweep", [["-m", "dist.world_size=range(0)"], ["-m", "trainer.seed=range(3,3)"]])
def test_a_sweep_of_no_jobs_is_refused(sweep, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", *sweep, *FAST, f"hydra.sweep.dir={tmp_path / 'sweep'}"], capfd)
    assert code == 2 and "sweeps no values" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "sweep").exists()


def test_a_study_of_no_jobs_writes_nothing(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["study", "dist.world_size=range(0)", f"hydra.sweep.dir={tmp_path / 'study'}"], capfd)
    assert code == 2 and "lbt: error: dist.world_size=range(0) sweeps no values" in err, err
    assert not (tmp_path / "study").exists()


ADDED = [["+optim.dampening=0.1"], ["++trainer.epochs=2"],
         ["model=custom", f"model._target_={__name__}.own_model", "+model.width=4"],
         [f"+technique.marker._target_={__name__}.Marker", "+technique.marker.tag=x"]]


@pytest.mark.parametrize("added", ADDED)
def test_added_keys_that_something_reads_are_kept(added):
    config, _ = compose_config([*FAST, *added])
    key, value = added[-1].lstrip("+").split("=")
    node = config
    for part in key.split("."):
        node = node[part]
    assert str(node).lower() == value


def test_an_added_key_its_builder_does_not_take_is_refused():
    with pytest.raises(ConfigError, match="takes no argument colour"):
        compose_config([*FAST, f"+technique.marker._target_={__name__}.Marker", "+technique.marker.colour=red"])


class Marker:
    """A technique-shaped class a test config adds by path (it is never built)."""

    def __init__(self, tag: str = "") -> None:
        self.tag = tag


def own_model(input_shape, num_classes, width: int = 8) -> nn.Module:
    """A user's model factory: a plain function, accepted by path."""
    return nn.Sequential(nn.Linear(input_shape[0], width), nn.ReLU(), nn.Linear(width, num_classes))


def test_user_factories_and_lbt_targets_pass_the_kind_check():
    config, recipe = compose_config([*FAST, "model=custom", f"model._target_={__name__}.own_model"])
    check_targets(make_spec(config, recipe))  # no error


def test_an_lr_beyond_float32_is_a_diverged_run(tmp_path):
    """torch cannot turn 1e39 into a float32 step (it raised a RuntimeError with a traceback)."""
    result = train(tmp_path, ["model=mlp", "optim.lr=1e39", "trainer.max_steps=3"])
    assert result["diverged"] and result["error"] is None
    assert "beyond float32" in (tmp_path / "train.log").read_text()


class NanWhenEvaluated(nn.Module):
    """Trains normally; its evaluation outputs are NaN (as a model whose running statistics blew up)."""

    def __init__(self, input_shape, num_classes) -> None:
        super().__init__()
        self.linear = nn.Linear(input_shape[0], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        return out if self.training else out * float("nan")


def test_a_non_finite_validation_loss_is_a_diverged_run(tmp_path):
    result = train(tmp_path, ["model=custom", f"model._target_={__name__}.NanWhenEvaluated", "trainer.max_steps=4",
                              "trainer.evals=2"])
    assert result["diverged"], result
    assert "loss at step 1 is nan" in (tmp_path / "train.log").read_text()


def test_a_data_file_must_be_a_regular_file_that_fits(tmp_path):
    with pytest.raises(ConfigError, match="is a folder"):
        data_file("data.path", str(tmp_path))
    with pytest.raises(ConfigError, match="no such file"):
        data_file("data.path", str(tmp_path / "none"))
    big = tmp_path / "big.txt"
    big.write_bytes(b"x" * 1000)
    assert data_file("data.path", str(big))[1] == 1000
    with pytest.raises(ConfigError, match="GiB is free"):
        data_file("data.path", str(big), bytes_in_memory=1e15)


def test_a_seed_past_64_bits_is_one_line(capfd):
    """`trainer.seed=99999999999999999999999` is one line, not torch's "Overflow when unpacking long long"."""
    from test_cli_errors import run_main

    code, err = run_main(["train", "trainer.seed=99999999999999999999999", "data=synthetic", "--cfg", "job"], capfd)
    lines = err.strip().splitlines()
    assert code == 2 and lines == ["lbt: error: trainer.seed must be an integer from 0 to 9,223,372,036,854,775,807, "
                                   "got 99999999999999999999999"], err
