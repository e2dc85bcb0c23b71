"""MNIST-1D (Greydanus 2020), generated offline and cached as an .npz file."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from lbt.data.base import DataShape, DataSplits, InMemoryDataset, available_memory, split_validation, train_size
from lbt.errors import ConfigError
from lbt.paths import atomic_write, waiting_lock
from lbt.stop import stoppable

# The generator's peak memory per sample: 3.8 KB measured (tracemalloc, 20,000 samples), doubled for what
# it does not trace. It refuses a data.num_samples beyond memory at once, not after minutes of generating.
GENERATOR_BYTES_PER_SAMPLE = 8 * 1024


def build_mnist1d(
    num_samples: int = 70000,
    train_split: float = 6 / 7,
    data_dir: str = "~/.cache/lbt/data",
    seed: int = 42,
    val_fraction: float = 0.0,
    val_seed: int = 0,
    progress: bool = True,
    shape_only: bool = False,
    **generator_overrides,
) -> DataSplits | DataShape:
    """MNIST-1D: float32 inputs of shape (N, 40), int64 labels, 10 classes.

    The defaults give 60,000 train / 10,000 test samples, like MNIST. Extra
    keyword arguments override `mnist1d.data.get_dataset_args()` (e.g.
    `shuffle_seq=True`). Generating 70,000 samples takes ~40 s, so the arrays
    are generated once and cached under `data_dir`.
    """
    if shape_only:  # mnist1d's make_dataset keeps int(train_split * N) samples for training
        return DataShape((40,), 10, train_size(int(num_samples * train_split), val_fraction))
    overrides = dict(generator_overrides)
    path = _cache_path(data_dir, num_samples=int(num_samples), train_split=float(train_split), seed=int(seed),
                       **overrides)
    if not path.exists():
        _generate_once(path, num_samples, train_split, seed, overrides, progress)
    with np.load(path) as arrays:
        train = InMemoryDataset(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]))
        test = InMemoryDataset(torch.from_numpy(arrays["x_test"]), torch.from_numpy(arrays["y_test"]))
    return split_validation(train, test, val_fraction, val_seed, num_classes=10, input_shape=(train.x.shape[1],))


def _cache_path(data_dir: str, **args) -> Path:
    """Cache file named after a hash of the arguments and the mnist1d version.

    The key holds the arguments we pass rather than the generator's full
    defaults, so a cache hit never imports mnist1d (scipy and matplotlib, ~1.5 s
    in every process of a run).
    """
    args["mnist1d_version"] = importlib.metadata.version("mnist1d")
    # default=list: Hydra hands list values (e.g. padding) over as ListConfig.
    key = json.dumps(args, sort_keys=True, default=list)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return Path(data_dir).expanduser() / f"mnist1d_{args['num_samples']}_{digest}.npz"


def _check_size(num_samples: int) -> None:
    # make_dataset makes num_samples // 10 samples per class: refuse a silent shortfall.
    if num_samples <= 0 or num_samples % 10:
        raise ConfigError(f"data.num_samples={num_samples}: must be a positive multiple of 10 (one tenth per class)")
    free = available_memory()
    if free and num_samples * GENERATOR_BYTES_PER_SAMPLE > free:
        raise ConfigError(f"data.num_samples={num_samples:,}: generating it needs about "
                          f"{num_samples * GENERATOR_BYTES_PER_SAMPLE / 2**30:,.0f} GiB of memory, and "
                          f"{free / 2**30:.0f} GiB is free (at most {free // GENERATOR_BYTES_PER_SAMPLE:,} samples)")


def _generate_once(path: Path, num_samples: int, train_split: float, seed: int, overrides: dict,
                   progress: bool) -> None:
    """Generate the cache file unless another process does: the ranks of a job and a study's parallel jobs
    ask for it at once on a fresh machine, and each generating its own copy took ~30 s of CPU per process."""
    _check_size(num_samples)
    path.parent.mkdir(parents=True, exist_ok=True)
    waiting = f"lbt: waiting for another process generating MNIST-1D into {path} ..." if progress else None
    lock = path.with_name(path.name + ".lock")
    with waiting_lock(lock, waiting):
        if path.exists():  # the other process published it while this one waited
            return
        if progress:
            print(f"lbt: generating MNIST-1D ({num_samples} samples) into {path}, once ...", file=sys.stderr,
                  flush=True)
        with stoppable():  # a stop ends generation at once: nothing is published
            arrays = _generate(num_samples, train_split, seed, overrides)
        atomic_write(path, lambda f: np.savez(f, **arrays))  # type: ignore[arg-type]  # a reader never sees a half-written file
        # Safe to remove: every process checks for the file again once it holds a lock, whichever lock file.
        lock.unlink(missing_ok=True)


def _generate(num_samples: int, train_split: float, seed: int, overrides: dict) -> dict[str, np.ndarray]:
    """Run the generator without leaving a trace on the global RNGs."""
    # Imported here, only when generating: see _cache_path.
    from mnist1d.data import get_dataset_args, make_dataset
    from mnist1d.utils import ObjectView

    args = get_dataset_args(as_dict=True)
    unknown = sorted(set(overrides) - set(args))
    if unknown:
        raise ConfigError(f"data.{unknown[0]}: not an MNIST-1D generator argument; valid: {', '.join(sorted(args))}")
    if not 0.0 < train_split < 1.0:
        raise ConfigError(f"data.train_split={train_split}: must be in (0, 1)")
    args.update(overrides, num_samples=int(num_samples), train_split=float(train_split), seed=int(seed))

    # make_dataset reseeds Python's and NumPy's global RNGs, which would silently
    # change everything random that the caller does afterwards.
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        data = make_dataset(ObjectView(args))
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
    return {
        "x": data["x"].astype(np.float32),
        "y": data["y"].astype(np.int64),
        "x_test": data["x_test"].astype(np.float32),
        "y_test": data["y_test"].astype(np.int64),
    }
