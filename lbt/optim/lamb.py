"""LAMB: Adam moments with a layer-wise trust ratio.

You et al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in
76 minutes" (https://arxiv.org/abs/1904.00962), Algorithm 2, with phi the
identity. Each parameter tensor's Adam-with-weight-decay step u is rescaled to
||w|| / ||u|| of its length times the LR, so every layer moves by about lr
times its own norm.

Written to read like timm's `timm/optim/lamb.py` (the NVIDIA FusedLAMB
variant); differences from it:
- The trust ratio is applied to every group unless the group says
  `exclude_from_trust: True` (set by lbt.optim.param_groups). timm adapts only
  groups whose weight_decay != 0 unless `always_adapt=True`.
- max_grad_norm defaults to None (no clipping) instead of 1.0: lbt clips
  gradients as a separate technique, and clipping twice would be surprising.
- Bias correction is always on (Algorithm 2); timm has a `bias_correction` flag.
- The step count is kept per parameter, like torch.optim.Adam; timm keeps one
  per group and counts steps where a parameter had no gradient.
- No decoupled weight decay or "caution" options.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim import Optimizer

from lbt.optim.param_groups import EXCLUDE_FROM_TRUST
from lbt.parallel.tensor_parallel import whole


def lamb_trust_ratio(
    w_norm: Tensor | float, update_norm: Tensor | float, trust_clip: bool = False
) -> Tensor:
    """||w|| / ||u||, or 1 when either norm is 0 (a zero-initialized layer must still move).

    With `trust_clip` the ratio is capped at 1 (timm's LAMBC), so a layer never
    steps further than the plain Adam-with-weight-decay update would take it.
    """
    w_norm, update_norm = torch.as_tensor(w_norm), torch.as_tensor(update_norm)
    # torch.where rather than `if`: the norms stay on the device, no GPU sync per tensor.
    ratio = w_norm / update_norm
    ratio = torch.where((w_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))
    if trust_clip:
        ratio = ratio.clamp(max=1.0)
    return ratio


class LAMB(Optimizer):
    """LAMB with bias-corrected Adam moments (Algorithm 2 of You et al. 2019).

    Per parameter tensor w with gradient g, at step t:

        m = beta1 * m + (1 - beta1) * g       ((1 - beta1) -> 1 with grad_averaging=False)
        v = beta2 * v + (1 - beta2) * g^2
        u = (m / (1 - beta1^t)) / (sqrt(v / (1 - beta2^t)) + eps) + wd * w
        w -= lr * lamb_trust_ratio(||w||, ||u||) * u

    Groups with `exclude_from_trust: True` (bias and norm parameters) use ratio 1
    and their group's weight decay, which lbt.optim.param_groups sets to 0.
    `max_grad_norm` clips the global gradient norm over all groups before the
    moments are updated, as the paper's reference implementation does.
    """

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        grad_averaging: bool = True,
        max_grad_norm: float | None = None,
        trust_clip: bool = False,
    ):
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"LAMB needs lr, eps, weight_decay >= 0 and betas in [0, 1); got "
                f"lr={lr} eps={eps} weight_decay={weight_decay} betas={betas}"
            )
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise ValueError(f"LAMB max_grad_norm must be positive or None, got {max_grad_norm}")
        # One norm over all groups, so it is not a per-group setting.
        self.max_grad_norm = max_grad_norm
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            trust_clip=trust_clip,
            **{EXCLUDE_FROM_TRUST: False},
        )
        super().__init__(params, defaults)

    def _grad_clip_divisor(self) -> Tensor | None:
        """max(global grad norm / max_grad_norm, 1), or None when clipping is off."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.max_grad_norm is None or not grads:
            return None
        norms = torch.stack([whole(torch.linalg.vector_norm(g)) for g in grads])  # whole: split layers' shards
        global_norm = torch.linalg.vector_norm(norms)
        return (global_norm / self.max_grad_norm).clamp(min=1.0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()

        clip_divisor = self._grad_clip_divisor()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            grad_weight = 1 - beta1 if group["grad_averaging"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad if clip_divisor is None else p.grad / clip_divisor
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]

                m.mul_(beta1).add_(grad, alpha=grad_weight)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                m_hat = m / (1 - beta1**t)
                v_hat = v / (1 - beta2**t)
                update = m_hat / (v_hat.sqrt() + group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                if not group[EXCLUDE_FROM_TRUST]:
                    update.mul_(lamb_trust_ratio(p.norm(), update.norm(), group["trust_clip"]))
                p.add_(update, alpha=-group["lr"])
        return loss
