"""Global gradient-norm clipping (Pascanu, Mikolov, Bengio 2013)."""

from __future__ import annotations

import torch
from torch import nn

from lbt.parallel.tensor_parallel import local, whole
from lbt.spec.validate import number
from lbt.techniques.base import Progress, Technique


def clip_coefficient(total_norm: torch.Tensor | float, max_norm: float) -> torch.Tensor:
    """The factor clipping multiplies every gradient by: min(1, max_norm / (||g|| + 1e-6)).

    The 1e-6 is torch.nn.utils.clip_grad_norm_'s, so clipping is the same as torch's.
    A tensor in, a tensor out: no device synchronisation per step.
    """
    return (max_norm / (torch.as_tensor(total_norm) + 1e-6)).clamp(max=1.0)


class GradClip(Technique):
    """Clip the global L2 norm of the gradient to `max_norm` before each optimizer step.

    after_backward runs once the gradient is averaged over all workers (the
    allreduce and the simulated workers' sum are done), so every worker clips
    the same averaged gradient and the result does not depend on the layout.
    """

    name = "grad_clip"
    order = 90  # late: measurement plug-ins at lower orders see the unclipped gradient

    def __init__(self, max_norm: float = 1.0):
        self.max_norm = number("technique.grad_clip.max_norm", max_norm, low=0, low_open=True)
        self.last_norm: torch.Tensor | None = None  # before clipping; a tensor, so no device sync per step

    def after_backward(self, model: nn.Module, progress: Progress) -> None:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:  # no gradient this step (the first steps of a gradient delay)
            return
        self.last_norm = torch.linalg.vector_norm(torch.stack([whole(torch.linalg.vector_norm(g)) for g in grads]))
        coefficient = clip_coefficient(self.last_norm, self.max_norm)
        for grad in grads:
            local(grad).mul_(coefficient)  # a split layer's shard, or the whole gradient

    def describe(self) -> str:
        return f"gradient norm clipped to {self.max_norm:g}"
