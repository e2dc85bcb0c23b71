"""Any timm (pytorch-image-models) model by name, randomly initialized."""

from __future__ import annotations

from torch import nn

from lbt.errors import ConfigError
from lbt.models.by_name import unknown_name

INSTALL = "pip install 'lbt[models]'"


def timm_model(name: str, input_shape=(3, 224, 224), num_classes: int = 1000, **kwargs) -> nn.Module:
    """`timm.create_model(name, pretrained=False, num_classes=..., in_chans=...)`: never pretrained.

    The channels come from the data's input shape (C, H, W), so grayscale images need no change, and so
    does the image size of a model built for one size (ViT, Swin: timm's `fixed_input_size`), so a ViT
    trains on 32x32 CIFAR. Extra keyword arguments go to the model builder (e.g. `drop_rate`).
    """
    # Imported here: timm is an optional extra, and importing it takes ~2 s that runs which never
    # touch it should not pay in every process.
    try:
        import timm
    except ImportError:
        raise ConfigError(f"model=timm needs timm, which is not installed: {INSTALL}") from None

    if not timm.is_model(name):
        fallback = timm.list_models(f"*{name[:4]}*")[:3] or ["resnet18", "resnet50", "vit_small_patch16_224"]
        raise unknown_name(name, timm.list_models(), "timm", fallback,
                           "timm.list_models(), e.g. timm.list_models('resnet*')")
    if kwargs.pop("pretrained", False) or kwargs.get("checkpoint_path"):
        raise ConfigError("model.pretrained: lbt trains from scratch and never downloads weights; remove it")
    if len(input_shape) != 3:
        raise ConfigError(f"model.name={name!r}: timm models take images (C, H, W), the data gives "
                          f"{tuple(input_shape)}")
    if "img_size" not in kwargs and fixed_size(timm, name, tuple(input_shape[1:])):
        kwargs["img_size"] = tuple(int(d) for d in input_shape[1:])
    return timm.create_model(name, pretrained=False, num_classes=num_classes, in_chans=int(input_shape[0]),
                             **kwargs)


def fixed_size(timm, name: str, size: tuple[int, ...]) -> bool:
    """Whether the model takes only its default image size (a ViT's patch grid, a Swin's windows) and the
    data's images have another."""
    cfg = timm.models.get_pretrained_cfg(name)
    return bool(cfg is not None and cfg.fixed_input_size and tuple(cfg.input_size[1:]) != size)
