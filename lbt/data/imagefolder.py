"""Any image classification folder: root/train/<class>/* and optionally root/val/<class>/*."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lbt.data.base import DataShape, DataSplits, split_validation
from lbt.errors import ConfigError

# ImageNet statistics: the usual choice for natural photos of unknown origin.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def build_imagefolder(
    root: str, image_size: int = 224, val_fraction: float = 0.0, val_seed: int = 0, augment: bool = True,
    shape_only: bool = False,
) -> DataSplits | DataShape:
    """ImageFolder datasets with the standard ImageNet-style transforms.

    Training: random resized crop and horizontal flip (with `augment`).
    Evaluation: resize the short side to image_size x 256/224, centre crop.
    Without `root/val`, there is no test split and the validation split must
    be carved from the training set with `val_fraction`.
    """
    if shape_only:  # the classes and images are only known by reading the folder
        return DataShape((3, image_size, image_size), None, None)
    root_path = Path(root).expanduser()
    train_dir, val_dir = root_path / "train", root_path / "val"
    if not train_dir.is_dir():
        raise ConfigError(f"data.root: no training images at {train_dir}: expected "
                          f"{root_path}/train/<class>/<image files>")
    if not val_dir.is_dir() and val_fraction == 0:
        raise ConfigError(f"data.val_fraction: {val_dir} does not exist, so set data.val_fraction > 0 to hold out "
                          "part of the training set for validation, or add root/val/<class>/*")
    train_tf, eval_tf = image_transforms(image_size, augment)
    train = image_folder(train_dir, train_tf)
    test = None
    if val_dir.is_dir():
        test = image_folder(val_dir, eval_tf)
        # ImageFolder numbers classes by sorted folder name: both sides must agree.
        if test.classes != train.classes:
            raise ConfigError(f"data.root: class folders differ between {train_dir} ({len(train.classes)}) "
                              f"and {val_dir} ({len(test.classes)}): both need the same <class> subfolders")
    # Validation samples come from the training set without augmentation.
    eval_train = image_folder(train_dir, eval_tf) if val_fraction > 0 and augment else None
    return split_validation(train, test, val_fraction, val_seed, len(train.classes), (3, image_size, image_size),
                            eval_train=eval_train)


def image_transforms(image_size: int, augment: bool) -> tuple[Any, Any]:
    """(training, evaluation) transforms: ImageNet-style crops and normalisation."""
    # Imported here: torchvision takes ~2 s to import, which runs that never
    # touch images (MNIST-1D, synthetic) should not pay in every process.
    from torchvision import transforms

    to_input = [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    eval_tf = transforms.Compose([transforms.Resize(round(image_size * 256 / 224)), transforms.CenterCrop(image_size),
                                  *to_input])
    if not augment:
        return eval_tf, eval_tf
    return transforms.Compose([transforms.RandomResizedCrop(image_size), transforms.RandomHorizontalFlip(),
                               *to_input]), eval_tf


def image_folder(path: Path, transform: Any) -> Any:
    """torchvision's ImageFolder of `path`, or one line saying why it is not one."""
    from torchvision import datasets

    try:
        return datasets.ImageFolder(str(path), transform=transform)
    except FileNotFoundError as error:  # no class folders, or a class without images
        raise ConfigError(f"data.root: {path} is not an image folder ({error}): expected "
                          f"{path}/<class>/<image files>") from error
