"""Your own data: a function of yours returning (train, test) datasets, split and served as lbt's own.

`data=custom data.dataset=mypackage.load data.num_classes=10 data.input_shape=[40]` calls
`mypackage.load(**data.args)`; it returns two torch Datasets of (input tensor, integer label)
pairs (test may be None). lbt holds out `val_fraction` of train as the validation split, as it
does for its own data; TensorDatasets become in-memory datasets (one index_select per batch).
"""

from __future__ import annotations

from collections.abc import Sized

from torch.utils.data import Dataset, TensorDataset

from lbt.data.base import DataShape, DataSplits, InMemoryDataset, split_validation
from lbt.errors import ConfigError
from lbt.spec.targets import locate
from lbt.spec.validate import integer


def build_custom(
    dataset: str,
    num_classes: int,
    input_shape: list[int],
    args: dict | None = None,
    val_fraction: float = 0.1,
    val_seed: int = 0,
    shape_only: bool = False,
) -> DataSplits | DataShape:
    integer("data.num_classes", num_classes)
    if not input_shape or not all(isinstance(s, int) and s > 0 for s in input_shape):
        raise ConfigError(f"data.input_shape must be positive integers, got {input_shape!r}")
    if shape_only:
        return DataShape(tuple(input_shape), num_classes, None)  # the training set's size needs the data
    load = locate("data.dataset", dataset, tuple)
    loaded = load(**(args or {}))
    if not (isinstance(loaded, tuple) and len(loaded) == 2):
        raise ConfigError(f"data.dataset={dataset} must return (train, test) datasets, got {type(loaded).__name__}")
    train, test = (in_memory(d) for d in loaded)
    if not isinstance(train, Dataset) or not isinstance(train, Sized) or not len(train):
        raise ConfigError(f"data.dataset={dataset}: its train split is not a non-empty torch Dataset")
    sample = train[0][0]
    if tuple(sample.shape) != tuple(input_shape):
        raise ConfigError(f"data.input_shape={list(input_shape)} but {dataset}'s samples have shape "
                          f"{list(sample.shape)}")
    return split_validation(train, test, val_fraction, val_seed, num_classes, input_shape)


def in_memory(dataset):
    """A TensorDataset of (inputs, labels) as lbt's InMemoryDataset: batches by index, no DataLoader."""
    if isinstance(dataset, TensorDataset) and len(dataset.tensors) == 2:
        return InMemoryDataset(*dataset.tensors)
    return dataset

