"""Models: each takes `input_shape` and `num_classes` keywords plus its own hyper-parameters."""

from lbt.models.cnn1d import CNN1d
from lbt.models.gpt import GPT
from lbt.models.mlp import MLP
from lbt.models.resnet20 import BasicBlock, ResNet20
from lbt.models.timm_models import timm_model
from lbt.models.torchvision_models import torchvision_model
from lbt.models.transformer1d import Transformer1d

__all__ = ["CNN1d", "GPT", "MLP", "BasicBlock", "ResNet20", "timm_model", "torchvision_model", "Transformer1d"]
