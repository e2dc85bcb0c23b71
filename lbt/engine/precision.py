"""How a run uses its device: mixed precision, torch.compile and channels_last (trainer.precision,
trainer.compile, trainer.channels_last). None of them changes what a run computes beyond rounding.

The step with mixed precision (lbt/engine/step.py):

    with precision.autocast():             # bf16/fp16 matmuls and convolutions; fp32 where torch keeps it
        loss = loss_fn(model(inputs), labels)
    precision.backward(loss)               # fp16: the loss times the scale, so small gradients survive fp16
    precision.unscale(optimizer)           # fp16: true gradients again, before techniques (clipping,
    for t in techniques: t.after_backward  #   noise scale) and the optimizer (LARS/LAMB trust ratios) read them
    precision.step(optimizer)              # fp16: skipped when a gradient overflowed; the scale adapts

bf16 keeps fp32's exponent range and needs no scaling; fp32 is a no-op throughout.
"""

from __future__ import annotations

import shutil
from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn

from lbt.errors import ConfigError, first_line
from lbt.spec.validate import one_of

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast around forward and loss, and fp16's GradScaler (whose state goes into checkpoints)."""

    def __init__(self, name: str = "fp32", device_type: str = "cpu"):
        self.name = str(one_of("trainer.precision", name, tuple(PRECISIONS)))
        self.dtype, self.device_type = PRECISIONS[name], device_type
        self.scaler = torch.amp.GradScaler(device_type) if name == "fp16" else None
        self.skipped_steps = 0  # fp16 steps skipped because a gradient overflowed
        self._skipped: torch.Tensor | None = None  # counted on the device, read at log steps (no sync per step)

    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.dtype) if self.dtype is not None else nullcontext()

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def backward(self, loss: torch.Tensor) -> None:
        self.scale(loss).backward()

    @property
    def grad_scale(self) -> torch.Tensor | float:
        """What the gradients of this step's backward are multiplied by (a device tensor under fp16)."""
        scale = None if self.scaler is None else self.scaler._get_scale_async()  # get_scale() would synchronise
        return 1.0 if scale is None else scale

    def unscaled(self, grads) -> list[torch.Tensor]:
        """Gradients of a scaled loss (`scale`) divided by the scale: what they are without fp16's scaling."""
        if self.scaler is None:
            return list(grads)
        scale = self.grad_scale
        return [g / scale for g in grads]

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale; note (on the device) whether this step will be skipped."""
        if self.scaler is None:
            return
        self.scaler.unscale_(optimizer)
        # The overflow flags scaler.step reads: non-zero when this step's gradients hold an inf or a NaN.
        found = sum(self.scaler._found_inf_per_device(optimizer).values())
        self._skipped = found if self._skipped is None else self._skipped + found

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)  # skipped when unscale found an overflow
        self.scaler.update()

    def metrics(self) -> dict[str, float]:
        """amp/skipped_steps (so far in the run) and amp/scale, under fp16; read at log steps."""
        if self.scaler is None:
            return {}
        if self._skipped is not None:
            self.skipped_steps += int(self._skipped)  # a device tensor: one sync, here
            self._skipped = None
        return {"amp/skipped_steps": float(self.skipped_steps), "amp/scale": self.scaler.get_scale()}

    def state_dict(self) -> dict:
        if self.scaler is None:
            return {}
        self.metrics()  # folds the steps counted on the device into skipped_steps
        return {"scaler": self.scaler.state_dict(), "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is None or not state:
            return
        self.scaler.load_state_dict(state["scaler"])
        self.skipped_steps, self._skipped = state["skipped_steps"], None

    def describe(self) -> str:
        return {"fp32": "fp32", "bf16": "bf16 (autocast)", "fp16": "fp16 (autocast, loss scaling)"}[self.name]


def compile_forward(module: nn.Module, device: torch.device, techniques: list) -> Callable:
    """torch.compile of the training forward (the DDP module when there is one, so DDP's optimizer splits
    the graph at its buckets); a failure to compile becomes one ConfigError line at the first step."""
    if device.type == "cpu" and not any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        raise ConfigError("trainer.compile=true: torch.compile's CPU backend builds C++ and this machine has no "
                          "C++ compiler (g++, clang++); install one or run with trainer.compile=false")
    compiled = torch.compile(module)
    names = ", ".join(t.name for t in techniques) or "none"
    checked = False

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        nonlocal checked
        if checked:
            return compiled(inputs)
        try:
            outputs = compiled(inputs)
        except torch._dynamo.exc.TorchDynamoException as error:
            first = first_line(error)
            raise ConfigError(f"trainer.compile=true: torch.compile cannot compile this model with these "
                              f"techniques ({names}): {first}; run with trainer.compile=false") from None
        checked = True
        return outputs

    return forward


def check_channels_last(input_shape: tuple[int, ...]) -> None:
    """channels_last is a layout of 4-D (N, C, H, W) tensors: images for 2-D convolutions."""
    if len(input_shape) != 3:
        raise ConfigError(f"trainer.channels_last=true is for 2-D convolutional models on images (samples of "
                          f"shape (C, H, W)); this data's samples are {tuple(input_shape)}: drop it")


def memory_format(channels_last: bool):
    return torch.channels_last if channels_last else torch.contiguous_format
