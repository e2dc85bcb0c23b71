"""What every dataset builder returns, and the validation split shared by all."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence, Sized
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import torch
from torch.utils.data import Dataset, Subset

from lbt.errors import ConfigError


def dataset_size(dataset: Dataset) -> int:
    """A map-style dataset's length: torch's Dataset declares no __len__, though every one lbt samples from
    by index has one."""
    if not isinstance(dataset, Sized):
        raise TypeError(f"{type(dataset).__name__} has no len(): lbt samples map-style datasets by index")
    return len(dataset)


class InMemoryDataset(Dataset):
    """Inputs and labels held as two tensors, so a batch is one index_select.

    The trainer detects this type and gathers batches by index (no DataLoader,
    no per-sample Python work).
    """

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        if len(x) != len(y):
            raise ValueError(f"inputs ({len(x)}) and labels ({len(y)}) differ in length")
        self.x = x
        self.y = y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int):
        return self.x[index], self.y[index]

    def to(self, device: torch.device) -> InMemoryDataset:
        """The same samples on `device` (self when they are there already)."""
        if self.x.device == device and self.y.device == device:
            return self
        return InMemoryDataset(self.x.to(device), self.y.to(device))


class DataShape(NamedTuple):
    """What a dataset looks like without loading it (every builder returns this with shape_only=True)."""

    input_shape: tuple[int, ...]
    num_classes: int | None  # None: not known without reading the data (an image folder's classes)
    num_train: int | None  # training samples per epoch, after any validation split
    token: str | None = None  # a language model's inputs and labels are (T,) token ids ("char"), see DataSplits


def data_file(key: str, path: str, bytes_in_memory: float = 0.0) -> tuple[Path, int]:
    """A data file's path and size in bytes, or one line saying why it cannot be read as data: missing, a
    folder, a device or pipe (`/dev/zero` would be read until memory runs out), or, when the data is held in
    memory at `bytes_in_memory` per byte of file, larger than the memory this machine has free."""
    file = Path(str(path)).expanduser()
    try:
        info = file.stat()
    except FileNotFoundError:
        raise ConfigError(f"{key}={path}: no such file") from None
    except OSError as error:
        raise ConfigError(f"{key}={path}: cannot read it ({error.strerror or error})") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"{key}={path} is a folder: name a file")
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{key}={path} is not a regular file (a device, pipe or socket): name a file")
    free = available_memory()
    if bytes_in_memory and free and info.st_size * bytes_in_memory > free:
        raise ConfigError(f"{key}={path} is {info.st_size / 2**30:.1f} GiB; held in memory it needs about "
                          f"{info.st_size * bytes_in_memory / 2**30:.0f} GiB, and {free / 2**30:.0f} GiB is free")
    return file, info.st_size


def available_memory() -> int | None:
    """Bytes of memory free for a new allocation (Linux's MemAvailable), None where it cannot be told."""
    try:
        with open("/proc/meminfo") as meminfo:
            line = next(line for line in meminfo if line.startswith("MemAvailable:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError):
        pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
        return pages * os.sysconf("SC_PAGE_SIZE") if pages > 0 else None


def train_size(n: int, val_fraction: float) -> int:
    """Training samples left after holding out the validation split (as split_validation does)."""
    return n - round(n * val_fraction)


@dataclass
class DataSplits:
    """Datasets of one run.

    `val` is held out of the training set (data.val_fraction) and is what runs
    select on: it is evaluated during training. `test` is evaluated once, at the
    end. Without a validation split (val_fraction 0) `val` is None and the run
    evaluates `test` during training, under test's name.
    """

    train: Dataset
    val: Dataset | None
    test: Dataset | None
    num_classes: int
    input_shape: tuple[int, ...]
    # What one label is in a language model ("char": data=text); its loss in bits is bits per char.
    # None: one label per sample (classification).
    token: str | None = None

    @property
    def num_train(self) -> int:
        """Training samples per epoch (every lbt dataset has a length; torch's Dataset type does not say so)."""
        return dataset_size(self.train)

    def to(self, device: torch.device) -> DataSplits:
        """The in-memory splits moved to `device` once, so batches are gathered there; others stay as they are."""
        def moved(dataset: Dataset | None) -> Dataset | None:
            return dataset.to(device) if isinstance(dataset, InMemoryDataset) else dataset

        train = self.train.to(device) if isinstance(self.train, InMemoryDataset) else self.train
        return replace(self, train=train, val=moved(self.val), test=moved(self.test))


def split_validation(
    train: Dataset,
    test: Dataset | None,
    val_fraction: float,
    val_seed: int,
    num_classes: int,
    input_shape: Sequence[int],
    eval_train: Dataset | None = None,
) -> DataSplits:
    """Hold out a fixed random `val_fraction` of `train` as the validation split.

    With val_fraction == 0 there is no validation split (val=None). Otherwise
    the held-out samples depend only on `val_seed` and the training set size,
    so every run and every worker
    carves the same split. `eval_train`, when given, holds the same samples as
    `train` with evaluation transforms: validation samples are taken from it so
    they are not augmented.
    """
    input_shape = tuple(int(s) for s in input_shape)
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={val_fraction}: must be in [0, 1) (0 = no validation split)")
    if val_fraction == 0.0:
        if test is None:
            raise ConfigError("data.val_fraction=0 and the data has no test split: nothing to evaluate; "
                              "hold out a validation split with data.val_fraction > 0")
        return DataSplits(train, val=None, test=test, num_classes=num_classes, input_shape=input_shape)

    n = dataset_size(train)
    n_val = n - train_size(n, val_fraction)
    if not 0 < n_val < n:
        raise ConfigError(
            f"data.val_fraction={val_fraction} of {n} training samples leaves {n_val} for validation "
            f"and {n - n_val} for training: both must be non-empty"
        )
    # A private generator: the split must not depend on, or disturb, the global RNG.
    order = torch.randperm(n, generator=torch.Generator().manual_seed(val_seed))
    val_idx, train_idx = order[:n_val], order[n_val:]
    val_source = train if eval_train is None else eval_train
    new_train: Dataset
    val: Dataset
    if isinstance(train, InMemoryDataset) and isinstance(val_source, InMemoryDataset):
        # Index the tensors so the trainer keeps its fast batch gathering.
        new_train = InMemoryDataset(train.x[train_idx], train.y[train_idx])
        val = InMemoryDataset(val_source.x[val_idx], val_source.y[val_idx])
    else:
        new_train, val = Subset(train, train_idx.tolist()), Subset(val_source, val_idx.tolist())
    return DataSplits(new_train, val=val, test=test, num_classes=num_classes, input_shape=input_shape)
