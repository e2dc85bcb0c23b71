"""Character-level language modelling on any UTF-8 text file (`data=text data.path=FILE`).

The vocabulary is the file's distinct characters in code-point order (so one file always gives the
same ids). The file's last `test_fraction` of characters is the test split, contiguous and never
trained on; the rest is cut into non-overlapping windows of `context` characters, each labelled
with the next character at every position (inputs (T,) and labels (T,), int64), and
`val_fraction` of those windows is held out as the validation split (split_validation).
A model reads (N, T) ids and returns (N, vocab, T) logits: model=char_transformer.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from lbt.data.base import DataShape, DataSplits, InMemoryDataset, data_file, split_validation, train_size
from lbt.errors import ConfigError
from lbt.spec.validate import integer


def build_text(
    path: str,
    context: int = 64,
    test_fraction: float = 0.1,
    val_fraction: float = 0.1,
    val_seed: int = 0,
    shape_only: bool = False,
) -> DataSplits | DataShape:
    integer("data.context", context)
    if not 0.0 <= test_fraction < 1.0:
        raise ConfigError(f"data.test_fraction={test_fraction}: must be in [0, 1) (0 = no test split)")
    text = read_text(path)
    vocab, ids = encode(text)
    cut = len(ids) - round(len(ids) * test_fraction)
    train = windows(ids[:cut], context)
    test = windows(ids[cut:], context) if cut < len(ids) else None
    if len(train) == 0 or (test is not None and len(test) == 0):
        raise ConfigError(
            f"data.path={path} has {len(ids):,} characters: too short for one window of data.context={context} "
            f"(plus the next character) in training and in the test split (its last data.test_fraction="
            f"{test_fraction}); use a longer file or a smaller data.context")
    if shape_only:
        return DataShape((context,), len(vocab), train_size(len(train), val_fraction), token="char")
    splits = split_validation(train, test, val_fraction, val_seed, num_classes=len(vocab), input_shape=(context,))
    return replace(splits, token="char")


def read_text(path: str) -> str:
    """The file's text, or one line saying why it cannot be the training text."""
    # In memory: the bytes, the UTF-32 copy (4 per byte at most) and the int64 ids (8 per character).
    file, _ = data_file("data.path", path, bytes_in_memory=1 + 4 + 8)
    try:
        raw = file.read_bytes()
    except OSError as error:
        raise ConfigError(f"data.path={path}: cannot read it ({error.strerror or error})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(f"data.path={path} is not UTF-8 text (byte {error.start:,}: "
                          f"{raw[error.start:error.start + 1]!r}); convert it, e.g. iconv -t UTF-8") from None
    if not text:
        raise ConfigError(f"data.path={path} is empty: a language model needs text to learn from")
    return text


def encode(text: str) -> tuple[list[str], torch.Tensor]:
    """The vocabulary (distinct characters in code-point order) and the text as int64 ids into it."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    points, ids = np.unique(codes, return_inverse=True)
    return [chr(p) for p in points], torch.from_numpy(ids.astype(np.int64))


def windows(ids: torch.Tensor, context: int) -> InMemoryDataset:
    """Non-overlapping windows of `context` ids, each labelled with the ids shifted by one."""
    n = max(len(ids) - 1, 0) // context
    x = ids[:n * context].view(n, context)
    y = ids[1:n * context + 1].view(n, context)
    return InMemoryDataset(x.clone(), y.clone())
