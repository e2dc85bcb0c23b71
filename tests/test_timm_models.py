"""`model=timm model.name=NAME`: any timm model by name, trained and planned like lbt's own."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from conftest import FAST, train

from lbt.apps.plan.cli import plan_main
from lbt.errors import ConfigError
from lbt.models import timm_model

# timm is a dev dependency (pyproject.toml); found, not imported, at collection: it costs a second to import.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed")

# A small timm ResNet (4.9M parameters) on 32x32 synthetic images: a forward pass costs milliseconds.
IMAGES = ["data=synthetic", "data.input_shape=[3,32,32]", "data.num_train=64", "data.num_test=32"]
TIMM = ["model=timm", "model.name=resnet10t"]


def test_channels_and_classes_come_from_the_data():
    model = timm_model("resnet10t", input_shape=(1, 16, 16), num_classes=7)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 7)


def test_a_fixed_size_model_takes_the_datas_image_size_and_builder_arguments():
    """A ViT built for 224x224 trains on 32x32 images; `depth` goes to timm's builder (`+model.depth=1`)."""
    model = timm_model("vit_tiny_patch16_224", input_shape=(3, 32, 32), num_classes=10, depth=1)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_never_pretrained_and_images_only():
    with pytest.raises(ConfigError, match="never downloads weights"):
        timm_model("resnet10t", input_shape=(3, 32, 32), num_classes=10, pretrained=True)
    with pytest.raises(ConfigError, match=r"\(C, H, W\)"):
        timm_model("resnet10t", input_shape=(40,), num_classes=10)


def test_without_timm_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)  # `import timm` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'lbt\[models\]'"):
        timm_model("resnet10t", input_shape=(3, 32, 32), num_classes=10)


def test_model_timm_trains_two_steps(tmp_path):
    result = train(tmp_path, [*TIMM, *IMAGES, "trainer.per_worker_batch=8", "trainer.max_steps=2"])
    assert result["steps"] == 2
    assert result["config"]["model"] == {"_target_": "lbt.models.timm_model", "name": "resnet10t"}


def test_unknown_timm_model_is_one_line_exit_2(tmp_path, monkeypatch, capfd):
    from lbt.apps.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as done:
        main(["train", *FAST, *IMAGES, "model=timm", "model.name=resnet1800", f"hydra.run.dir={tmp_path}"])
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert done.value.code == 2 and len(lines) == 1
    assert lines[0].startswith("lbt: error: model.name='resnet1800'") and "resnet18" in lines[0]


def test_plan_profiles_a_timm_model_with_train_overrides(tmp_path, capsys):
    code = plan_main([*TIMM, *IMAGES, "trainer.per_worker_batch=4", "plan.repeats=1", "plan.max_workers=4",
                      f"plan.out={tmp_path / 'plan.png'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "4,927,618 parameters" in out and "timm resnet10t at batch 4" in out


def test_plan_takes_a_torchvision_model_by_name(tmp_path, capsys):
    """`lbt plan model=torchvision model.name=resnet18`, on data of the shape it is given."""
    code = plan_main(["model=torchvision", "model.name=resnet18", "data=synthetic", "data.input_shape=[3,32,32]",
                      "plan.step_ms=3", "plan.max_workers=2", f"plan.out={tmp_path / 'plan.png'}"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "11,181,642 parameters" in out  # torchvision's resnet18 with 10 classes


def test_plan_override_mistakes_are_one_line(tmp_path, capsys):
    assert plan_main([*TIMM[:1], "model.name=resnet1800", *IMAGES, "plan.step_ms=3"]) == 2
    assert "resnet18" in capsys.readouterr().err
    assert plan_main(["model=mlp", "model.widht=3", "plan.step_ms=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lbt: error:") and err.count("\n") == 1
