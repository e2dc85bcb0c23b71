"""CIFAR-10 read from a local copy of the python version (never downloaded)."""

from __future__ import annotations

from pathlib import Path

from lbt.data.base import DataShape, DataSplits, split_validation, train_size
from lbt.errors import ConfigError

# Per-channel mean and standard deviation of the CIFAR-10 training images.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def build_cifar10(root: str, val_fraction: float = 0.0, val_seed: int = 0, augment: bool = True,
                  shape_only: bool = False) -> DataSplits | DataShape:
    """CIFAR-10 from `root/cifar-10-batches-py/`, normalized per channel.

    With `augment`, training images get the standard random 32x32 crop of the
    4-pixel padded image and a random horizontal flip (He et al. 2016).
    Returns torchvision datasets: the transforms run per sample, so the
    trainer needs a DataLoader for them.
    """
    if shape_only:
        return DataShape((3, 32, 32), 10, train_size(50_000, val_fraction))
    # Imported here: torchvision takes ~2 s to import, which runs that never
    # touch images (MNIST-1D, synthetic) should not pay in every process.
    from torchvision import datasets, transforms

    root_path = Path(root).expanduser()
    if not (root_path / "cifar-10-batches-py").is_dir():
        raise ConfigError(
            f"data.root: CIFAR-10 not found under {root_path}: put the python version "
            "(cifar-10-batches-py/ from cifar-10-python.tar.gz) there, or set data.root=... (or LBT_CIFAR10_DIR)"
        )

    to_input = [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
    eval_tf = transforms.Compose(to_input)
    train_tf = eval_tf
    if augment:
        train_tf = transforms.Compose(
            [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip(), *to_input]
        )

    def load(train: bool, transform):
        try:
            return datasets.CIFAR10(str(root_path), train=train, transform=transform, download=False)
        except RuntimeError as e:
            # torchvision checks every file's md5; its message suggests download=True, which lbt never does.
            raise ConfigError(
                f"data.root: CIFAR-10 under {root_path}/cifar-10-batches-py is incomplete or corrupted "
                "(a file is missing or fails torchvision's md5 check): extract cifar-10-python.tar.gz there again"
            ) from e

    train, test = load(True, train_tf), load(False, eval_tf)
    # Validation samples come from the training set without augmentation.
    eval_train = load(True, eval_tf) if val_fraction > 0 and augment else None
    return split_validation(
        train, test, val_fraction, val_seed, len(train.classes), (3, 32, 32), eval_train=eval_train
    )
