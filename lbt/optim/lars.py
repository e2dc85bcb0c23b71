"""LARS: SGD with momentum and a layer-wise trust ratio.

You, Gitman, Ginsburg 2017, "Large Batch Training of Convolutional Networks"
(https://arxiv.org/abs/1708.03888), Algorithm 1. Each parameter tensor's step
is scaled by eta * ||w|| / (||g|| + wd * ||w||), so no layer moves by more than
a fixed fraction of its own norm, whatever the global LR. With `clip=True` it is
LARC (NVIDIA apex `LARC(clip=True)`): the ratio is capped so the layer's LR
never exceeds the global LR.

Written to read like timm's `timm/optim/lars.py`; differences from it:
- The trust ratio is applied to every group unless the group says
  `exclude_from_trust: True` (set by lbt.optim.param_groups). timm instead
  adapts only groups whose weight_decay != 0 unless `always_adapt=True`, so
  LARS with weight_decay 0 would silently be plain SGD there.
- momentum defaults to 0.9 (the paper's setting) instead of 0, there is no
  dampening, and lr has no default (the trainer sets it every step).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from lbt.optim.param_groups import EXCLUDE_FROM_TRUST


def lars_trust_ratio(
    w_norm: Tensor | float,
    g_norm: Tensor | float,
    weight_decay: float,
    trust_coefficient: float,
    eps: float = 0.0,
    clip_lr: float | None = None,
) -> Tensor:
    """Local LR multiplier eta * ||w|| / (||g|| + wd * ||w|| + eps).

    The ratio is 1 when ||w|| or ||g|| is 0: a zero-initialized layer must still
    be able to move, and a layer with no gradient has nothing to scale.
    With `clip_lr` (LARC), the ratio becomes min(ratio / clip_lr, 1), so that
    clip_lr * ratio = min(local LR, global LR).
    """
    w_norm, g_norm = torch.as_tensor(w_norm), torch.as_tensor(g_norm)
    ratio = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + eps)
    # torch.where rather than `if`: the norms stay on the device, no GPU sync per tensor.
    ratio = torch.where((w_norm > 0) & (g_norm > 0), ratio, torch.ones_like(ratio))
    if clip_lr is not None:
        ratio = torch.clamp(ratio / clip_lr, max=1.0)
    return ratio


class LARS(Optimizer):
    """LARS (or LARC with `clip=True`) on top of SGD with momentum.

    Per parameter tensor w with gradient g, for a group not excluded from trust:

        d   = ratio * (g + wd * w),  ratio = lars_trust_ratio(||w||, ||g||, wd, eta, eps)
        buf = momentum * buf + d
        w  -= lr * buf                  (nesterov: w -= lr * (d + momentum * buf))

    Groups with `exclude_from_trust: True` (bias and norm parameters, see
    lbt.optim.param_groups) take the same step with ratio 1: plain SGD with
    their group's weight decay, which that filter sets to 0.
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        nesterov: bool = False,
        clip: bool = False,
    ):
        if lr < 0 or momentum < 0 or weight_decay < 0 or trust_coefficient <= 0 or eps < 0:
            raise ValueError(
                f"LARS needs lr, momentum, weight_decay, eps >= 0 and trust_coefficient > 0; got "
                f"lr={lr} momentum={momentum} weight_decay={weight_decay} "
                f"trust_coefficient={trust_coefficient} eps={eps}"
            )
        if nesterov and momentum == 0:
            raise ValueError("LARS nesterov=True needs momentum > 0")
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            nesterov=nesterov,
            clip=clip,
            **{EXCLUDE_FROM_TRUST: False},
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        for group in self.param_groups:
            lr, wd, momentum = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                d = p.grad.add(p, alpha=wd)  # a new tensor: p.grad stays as the user left it
                if not group[EXCLUDE_FROM_TRUST]:
                    ratio = lars_trust_ratio(
                        p.norm(), p.grad.norm(), wd, group["trust_coefficient"], group["eps"],
                        clip_lr=lr if group["clip"] else None,
                    )
                    d.mul_(ratio)
                if momentum != 0:
                    # Momentum accumulates the already-scaled step, as in the paper's Algorithm 1.
                    state = self.state[p]
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = torch.zeros_like(p)
                    buf = state["momentum_buffer"]
                    buf.mul_(momentum).add_(d)
                    d = d.add(buf, alpha=momentum) if group["nesterov"] else buf
                p.add_(d, alpha=-lr)
        return loss
