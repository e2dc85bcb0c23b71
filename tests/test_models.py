"""Models build from (input_shape, num_classes) keywords, as the trainer calls them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lbt.errors import ConfigError
from lbt.models import MLP, BasicBlock, CNN1d, ResNet20, timm_model, torchvision_model


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@pytest.mark.parametrize(
    "build, input_shape",
    [
        (CNN1d, (40,)),
        (CNN1d, (2, 40)),
        (MLP, (40,)),
        (MLP, (3, 32, 32)),
        (ResNet20, (3, 32, 32)),
        (ResNet20, (1, 16, 16)),
    ],
)
def test_forward_gives_one_logit_per_class(build, input_shape):
    model = build(input_shape=input_shape, num_classes=7)
    assert model(torch.randn(4, *input_shape)).shape == (4, 7)


def test_cnn1d_accepts_inputs_without_channel_dim():
    model = CNN1d(input_shape=[40], num_classes=10).eval()
    x = torch.randn(5, 40)
    torch.testing.assert_close(model(x), model(x.unsqueeze(1)))


def test_cnn1d_has_batchnorm_after_each_conv():
    model = CNN1d(input_shape=(40,), num_classes=10, num_layers=3)
    kinds = [type(m) for m in model]
    assert kinds.count(nn.Conv1d) == 3
    for i, kind in enumerate(kinds):
        if kind is nn.Conv1d:
            assert kinds[i + 1] is nn.BatchNorm1d


def test_mlp_has_no_batchnorm_or_dropout():
    model = MLP(input_shape=(40,), num_classes=10, hidden=32, num_layers=3)
    assert not _has_batchnorm(model)
    assert not any(isinstance(m, nn.Dropout) for m in model.modules())
    assert sum(isinstance(m, nn.Linear) for m in model.modules()) == 4  # 3 hidden + head


def test_resnet20_matches_the_paper():
    model = ResNet20(input_shape=(3, 32, 32), num_classes=10)
    assert _has_batchnorm(model)
    # He et al. 2016, table 6: 0.27M parameters (option A shortcuts add none).
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(0.27e6, rel=0.01)
    blocks = [m for m in model.modules() if isinstance(m, BasicBlock)]
    assert len(blocks) == 9
    assert all(isinstance(b.bn2, nn.BatchNorm2d) for b in blocks)


def test_torchvision_model_by_name():
    model = torchvision_model("resnet18", input_shape=(3, 32, 32), num_classes=10)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


@pytest.mark.parametrize("build", [torchvision_model, timm_model])
def test_an_unknown_model_name_is_one_line_with_close_names(build):
    with pytest.raises(ConfigError, match="resnet1800") as info:
        build("resnet1800", input_shape=(3, 32, 32), num_classes=10)
    message = str(info.value)
    assert "\n" not in message and "resnet18" in message


def test_torchvision_model_never_takes_weights():
    with pytest.raises(ConfigError, match="model.weights"):
        torchvision_model("resnet18", input_shape=(3, 32, 32), num_classes=10, weights="DEFAULT")
