"""A tiny learnable dataset made in memory, for tests and quick checks."""

from __future__ import annotations

import math

import torch

from lbt.data.base import DataShape, DataSplits, InMemoryDataset, split_validation, train_size
from lbt.errors import ConfigError
from lbt.spec.validate import integer

# A dataset for tests and quick checks: bigger requests are mistakes.
MAX_SAMPLES = 1_000_000


def build_synthetic(
    num_train: int = 512,
    num_test: int = 256,
    input_shape: list[int] = [40],  # noqa: B006 (never mutated; mirrors the config)
    num_classes: int = 10,
    seed: int = 0,
    val_fraction: float = 0.0,
    val_seed: int = 0,
    shape_only: bool = False,
) -> DataSplits | DataShape:
    """Gaussian inputs labelled by a fixed random linear teacher.

    The label is the argmax of teacher logits, so a linear model can fit the
    data exactly: a few training steps must raise accuracy well above chance.
    Everything comes from one generator seeded by `seed`, never the global RNG,
    so the data does not depend on what ran before.
    """
    for key, value, limit in (("num_train", num_train, MAX_SAMPLES), ("num_test", num_test, MAX_SAMPLES),
                              ("num_classes", num_classes, 100_000)):
        integer(f"data.{key}", value, 1, limit)
    if not input_shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in input_shape) \
            or math.prod(input_shape) > 1_000_000:
        raise ConfigError(f"data.input_shape must be positive integers (at most 1M values), got {input_shape!r}")
    shape = tuple(int(s) for s in input_shape)
    if shape_only:
        return DataShape(shape, num_classes, train_size(num_train, val_fraction))
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(math.prod(shape), num_classes, generator=gen)

    def sample(n: int) -> InMemoryDataset:
        x = torch.randn(n, *shape, generator=gen)
        y = (x.flatten(1) @ teacher).argmax(dim=1)
        return InMemoryDataset(x, y)

    train, test = sample(num_train), sample(num_test)
    return split_validation(train, test, val_fraction, val_seed, num_classes, shape)
