"""Dataset builders: each returns DataSplits (train, val, test, num_classes, input_shape)."""

from lbt.data.base import DataShape, DataSplits, InMemoryDataset, split_validation
from lbt.data.cifar import build_cifar10
from lbt.data.custom import build_custom
from lbt.data.imagefolder import build_imagefolder
from lbt.data.mnist1d import build_mnist1d
from lbt.data.synthetic import build_synthetic
from lbt.data.text import build_text
from lbt.data.tokens import build_tokens

__all__ = [
    "DataShape",
    "DataSplits",
    "InMemoryDataset",
    "split_validation",
    "build_cifar10",
    "build_custom",
    "build_imagefolder",
    "build_mnist1d",
    "build_synthetic",
    "build_text",
    "build_tokens",
]
