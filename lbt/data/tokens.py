"""Language modelling on a tokenised corpus (`data=tokens data.path=DIR`): nanoGPT's binary files.

DIR holds `train.bin`, and optionally `val.bin` and `test.bin`: flat arrays of token ids of type
`data.dtype` (uint16 or uint32), as `np.array(ids, dtype=np.uint16).tofile("train.bin")` writes them
with any tokenizer (`lbt tokens TEXT DIR` writes a byte-level one; docs/language-models.md).
`data.vocab_size` and `data.dtype`, when null, come from DIR/meta.json ({"vocab_size": 256,
"dtype": "uint16"}, as `lbt tokens` writes it).

Every file is memory-mapped, never read whole: a sample reads its own window (`TokenWindows`). A sample is
a non-overlapping window of `context` tokens labelled with the next token at every position (inputs (T,)
and labels (T,), int64), the layout of data=text, so model=gpt (or char_transformer) reads both. Windows
are samples like any other: a step's batch is the global batch's share of lbt's one data order
(lbt.data.sampling), so simulated and real workers see the same tokens.

Splits follow data=text's protocol, with contiguous tails instead of random windows (a corpus is
ordered; a tail shares no window with training):
    test: test.bin, else the last `test_fraction` of train.bin's tokens (0: no test split), never trained on
    val:  val.bin, else the last `val_fraction` of the tokens before the test tail (0: no validation split)
    train: the rest of train.bin
`eval_windows` caps val and test at that many windows, evenly spaced over the split (a big corpus's
evaluation, run ~20 times per run, stays cheap); null: every window.

Token ids are checked against the vocabulary once, by reading each file in chunks of CHECK_CHUNK ids
(exact, bounded memory: ~1 s per GB from the page cache); `check_ids: false` skips it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lbt.data.base import DataShape, DataSplits
from lbt.errors import ConfigError
from lbt.paths import atomic_write
from lbt.spec.validate import integer

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
CHECK_CHUNK = 2**24  # token ids per read when checking them against the vocabulary
BYTE_VOCAB = 256  # `lbt tokens`: one token per byte


class TokenWindows(Dataset):
    """`count` windows of `context` tokens (plus the next one, the labels) in a token file, window i starting at
    token `start + i * stride`. The file is memory-mapped on first use in each process (a pickled dataset,
    e.g. sent to a DataLoader worker, carries its path, not its tokens)."""

    def __init__(self, path: Path, dtype: str, start: int, count: int, context: int, stride: int | None = None):
        self.path, self.dtype, self.start, self.count = Path(path), dtype, start, count
        self.context, self.stride = context, stride or context
        self._tokens: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=DTYPES[self.dtype], mode="r")
        return self._tokens

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.count <= index < self.count:
            raise IndexError(f"window {index} of {self.count}")
        offset = self.start + (index % self.count) * self.stride
        window = torch.from_numpy(self.tokens[offset:offset + self.context + 1].astype(np.int64))
        return window[:-1], window[1:]

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_tokens": None}


def build_tokens(
    path: str,
    context: int = 256,
    vocab_size: int | None = None,
    dtype: str | None = None,
    test_fraction: float = 0.1,
    val_fraction: float = 0.1,
    eval_windows: int | None = None,
    check_ids: bool = True,
    shape_only: bool = False,
) -> DataSplits | DataShape:
    integer("data.context", context)
    if eval_windows is not None:
        integer("data.eval_windows", eval_windows)
    folder = token_folder(path)
    vocab_size, dtype = vocabulary(folder, path, vocab_size, dtype)
    spans = split_spans(folder, path, dtype, context, test_fraction, val_fraction)
    train = windows(spans["train"], dtype, context)
    if shape_only:
        return DataShape((context,), vocab_size, len(train), token="token")
    if check_ids:
        for file in sorted({span[0] for span in spans.values() if span is not None}):
            check_token_ids(file, dtype, vocab_size, path)
    val, test = (windows(spans[s], dtype, context, eval_windows) if spans[s] else None for s in ("val", "test"))
    if val is None and test is None:
        raise ConfigError("data.val_fraction=0 and data.test_fraction=0 with no val.bin or test.bin in "
                          f"data.path={path}: nothing to evaluate; hold out a validation split")
    return DataSplits(train, val=val, test=test, num_classes=vocab_size, input_shape=(context,), token="token")


def token_folder(path: str) -> Path:
    """The folder, or one line saying why it cannot be one."""
    folder = Path(str(path)).expanduser()
    if not folder.exists():
        raise ConfigError(f"data.path={path}: no such folder")
    if not folder.is_dir():
        raise ConfigError(f"data.path={path} is a file: name the folder holding train.bin (and val.bin), "
                          "e.g. as `lbt tokens TEXT_FILE DIR` writes it")
    if not (folder / "train.bin").is_file():
        raise ConfigError(f"data.path={path} has no train.bin: a flat file of token ids (nanoGPT's format; "
                          "`lbt tokens TEXT_FILE DIR` writes one, docs/language-models.md)")
    return folder


def vocabulary(folder: Path, path: str, vocab_size: int | None, dtype: str | None) -> tuple[int, str]:
    """data.vocab_size and data.dtype, a null one taken from DIR/meta.json (dtype: uint16 without one)."""
    meta: dict[str, Any] = {}
    if (folder / "meta.json").is_file() and (vocab_size is None or dtype is None):
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError) as error:
            raise ConfigError(f"data.path={path}: meta.json is unreadable ({error}); set data.vocab_size "
                              "and data.dtype instead") from None
    dtype = dtype if dtype is not None else meta.get("dtype", "uint16")
    if dtype not in DTYPES:
        raise ConfigError(f"data.dtype={dtype}: must be one of {', '.join(DTYPES)}")
    vocab_size = vocab_size if vocab_size is not None else meta.get("vocab_size")
    if vocab_size is None:
        raise ConfigError(f"data.vocab_size is not set and data.path={path} has no meta.json saying it: "
                          "set data.vocab_size to your tokenizer's vocabulary size")
    limit = 2 ** (8 * np.dtype(DTYPES[dtype]).itemsize)  # ids up to the type's largest
    integer("data.vocab_size", vocab_size, minimum=2, maximum=limit)
    return vocab_size, dtype


def token_count(file: Path, dtype: str, path: str) -> int:
    """Tokens in a file, or one line when its size is not a whole number of them."""
    size, itemsize = file.stat().st_size, np.dtype(DTYPES[dtype]).itemsize
    if size % itemsize:
        raise ConfigError(f"data.path={path}: {file.name} has {size:,} bytes, not a whole number of "
                          f"data.dtype={dtype} tokens ({itemsize} bytes each): written with another dtype?")
    return size // itemsize


Span = tuple[Path, int, int]  # a file and its tokens [start, stop)


def split_spans(folder: Path, path: str, dtype: str, context: int, test_fraction: float,
                val_fraction: float) -> dict[str, Span | None]:
    """Where each split's tokens are (see the module's docstring); one line for a split too short for a window."""
    for key, fraction in (("data.test_fraction", test_fraction), ("data.val_fraction", val_fraction)):
        if not 0.0 <= fraction < 1.0:
            raise ConfigError(f"{key}={fraction}: must be in [0, 1) (0 = no such split carved from train.bin)")
    train_file = folder / "train.bin"
    stop = token_count(train_file, dtype, path)
    spans: dict[str, Span | None] = {}
    for split, fraction in (("test", test_fraction), ("val", val_fraction)):
        own = folder / f"{split}.bin"
        if own.is_file():
            spans[split] = (own, 0, token_count(own, dtype, path))
        elif fraction > 0:
            cut = stop - round(stop * fraction)
            spans[split], stop = (train_file, cut, stop), cut
        else:
            spans[split] = None
    spans["train"] = (train_file, 0, stop)
    for split in ("train", "val", "test"):
        span = spans[split]
        if span is not None and span[2] - span[1] < context + 1:
            carved = f", or a larger data.{split}_fraction" if split != "train" and span[0] == train_file else ""
            raise ConfigError(
                f"data.context={context} is longer than the {split} split of data.path={path} ({span[2] - span[1]:,} "
                f"tokens of {span[0].name}; a window needs context + 1): use a smaller data.context or more "
                f"tokens{carved}")
    return spans


def windows(span: Span | None, dtype: str, context: int, cap: int | None = None) -> TokenWindows:
    """The span's non-overlapping windows, or `cap` of them evenly spaced over it."""
    assert span is not None
    file, start, stop = span
    count = (stop - start - 1) // context
    stride = context * max(1, count // cap) if cap else context
    return TokenWindows(file, dtype, start, min(count, cap) if cap else count, context, stride)


def check_token_ids(file: Path, dtype: str, vocab_size: int, path: str) -> None:
    """Every id in the file below vocab_size: read in chunks (never the whole file at once); one line naming the
    first id that is not."""
    with open(file, "rb") as stream:
        done = 0
        while True:
            chunk = np.fromfile(stream, dtype=DTYPES[dtype], count=CHECK_CHUNK)
            if chunk.size == 0:
                return
            if int(chunk.max()) >= vocab_size:
                at = int(np.argmax(chunk >= vocab_size))
                raise ConfigError(f"data.path={path}: {file.name} holds token id {int(chunk[at]):,} (token "
                                  f"{done + at:,}), not below data.vocab_size={vocab_size:,}: set data.vocab_size to "
                                  "the tokenizer's vocabulary size, or data.dtype to the type the file was written as")
            done += chunk.size


def write_byte_tokens(text_file: str, out_dir: str, val_fraction: float = 0.1,
                      chunk_bytes: int = 2**24) -> dict[str, int]:
    """A token folder from any file with a byte-level tokenizer (one uint16 id per byte, vocabulary 256):
    train.bin, val.bin (its last `val_fraction` of bytes) and meta.json. Streams the file in chunks.
    Returns the tokens per file."""
    source, out = Path(text_file).expanduser(), Path(out_dir).expanduser()
    if not source.is_file():
        raise ConfigError(f"{text_file}: no such file (or not a regular file)")
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"--val-fraction {val_fraction}: must be in (0, 1)")
    size = source.stat().st_size
    n_val = round(size * val_fraction)
    if size - n_val < 2 or n_val < 2:
        raise ConfigError(f"{text_file} has {size:,} bytes: too few for a training and a validation file")
    out.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as stream:
        for name, count in (("train.bin", size - n_val), ("val.bin", n_val)):
            with open(out / name, "wb") as sink:
                for start in range(0, count, chunk_bytes):
                    raw = stream.read(min(chunk_bytes, count - start))
                    np.frombuffer(raw, dtype=np.uint8).astype(np.uint16).tofile(sink)
    meta = {"vocab_size": BYTE_VOCAB, "dtype": "uint16", "tokenizer": "bytes", "source": str(source)}
    atomic_write(out / "meta.json", lambda f: f.write((json.dumps(meta, indent=2) + "\n").encode()))
    return {"train.bin": size - n_val, "val.bin": n_val}
