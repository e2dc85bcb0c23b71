"""Any torchvision classification model by name, randomly initialized."""

from __future__ import annotations

from torch import nn

from lbt.errors import ConfigError
from lbt.models.by_name import unknown_name


def torchvision_model(name: str, input_shape=(3, 224, 224), num_classes: int = 1000, **kwargs) -> nn.Module:
    """`torchvision.models.get_model(name, weights=None, ...)`: never pretrained.

    Pretrained weights would need a download, and a large-batch study compares
    training from scratch. Extra keyword arguments go to the model builder
    (e.g. `dropout`, `zero_init_residual`).
    """
    # Imported here: torchvision takes ~2 s to import, which runs that never
    # touch it (MNIST-1D, synthetic) should not pay in every process.
    import torchvision

    names = torchvision.models.list_models(module=torchvision.models)  # classification models only
    if name not in names:
        raise unknown_name(name, names, "torchvision classification", ["resnet18", "resnet50", "vit_b_16"],
                           "torchvision.models.list_models(module=torchvision.models)")
    if "weights" in kwargs:
        raise ConfigError("model.weights: lbt trains from scratch and never downloads weights; remove model.weights")
    if len(input_shape) != 3 or int(input_shape[0]) != 3:
        raise ConfigError(f"model.name={name!r}: torchvision models take RGB images (3, H, W), the data gives "
                          f"{tuple(input_shape)}")
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes, **kwargs)
