"""Muon for the hidden weight matrices, AdamW for every other parameter: one optimizer, one state dict.

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) takes SGD-momentum's step for a
weight matrix and replaces it by the nearest semi-orthogonal matrix (five Newton-Schulz iterations), so
every direction of the layer moves by the same amount. It is meant for the hidden layers only: the
reference implementation (KellerJordan/Muon, README and `muon.py`) gives embeddings, the classifier head,
gains and biases to AdamW, and trains hidden convolution kernels with Muon by viewing (out, in, k...) as
the (out, in x k...) matrix, the first convolution excepted. lbt does the same (`muon_split`).

The Muon step is torch's (`torch.optim.Muon`, torch >= 2.9: the same momentum, Newton-Schulz coefficients
and LR adjustments, bit for bit with ns_dtype=bfloat16), written out here for two reasons: torch's class
takes 2-D parameters only, and it always orthogonalizes in bfloat16, the fast type of GPUs, which a CPU
without bfloat16 units runs 2-4x slower than float32 (ns_dtype=auto: bfloat16 on CUDA, float32 elsewhere).
The AdamW step is a `torch.optim.AdamW` over the same parameter groups and the same state, so
`fused`/`foreach` work as for optim=adamw. Every group holds `lr` and `weight_decay` (the trainer writes
the step's LR into all of them, lbt/spec/lr.py) and `use_muon`.

Batch scaling. With `adjust_lr_fn="match_rms_adamw"` (Liu et al. 2025, "Muon is Scalable for LLM
Training", arXiv:2502.16982, sec. 2.2) each matrix's step is scaled by 0.2 sqrt(max(A, B)), which gives
Muon's update the RMS of AdamW's: the one LR and weight decay serve both halves, tuned as AdamW's are.
lbt then scales that LR with the batch as it does AdamW's, by the square root (schedule.scaling=sqrt;
recipe=muon). No Muon-specific batch rule is published: Essential AI (arXiv:2505.02222) report that Muon
keeps its data efficiency past AdamW's critical batch, tuning the LR at each batch (muP + telescoping);
bench/ is where lbt measures it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

USE_MUON = "use_muon"  # parameter-group key: True for Muon's matrices, False for AdamW's parameters

MATRIX_LAYERS = (nn.Linear, nn.modules.conv._ConvNd)
# The layers whose order decides the input layer and the head: a model's first weight layer reads the
# data (an embedding, a first convolution or projection), its last writes the logits.
WEIGHT_LAYERS = (*MATRIX_LAYERS, nn.Embedding, nn.EmbeddingBag)


def muon_split(model: nn.Module) -> dict[str, bool]:
    """Parameter name -> whether Muon updates it (else AdamW), for every trainable parameter.

    Muon takes the weight of every nn.Linear and convolution that is neither the model's first weight
    layer (the input layer) nor its last (the output head), in registration order, which is the data's
    path through lbt's, torchvision's and timm's models; and the packed input projection of torch's
    nn.MultiheadAttention. Everything else goes to AdamW: embeddings (nn.Embedding, and parameters of
    their own such as a position table), the input layer, the head, biases, and norm gains and shifts.
    A convolution kernel goes to Muon as its (out_channels, in_channels x kernel) matrix (the reference's
    choice), not to AdamW, so a convolutional model (cnn1d) has Muon layers at all.
    """
    layers = [m for m in model.modules() if isinstance(m, WEIGHT_LAYERS)]
    ends = {id(layers[0]), id(layers[-1])} if layers else set()
    hidden: set[int] = set()
    for module in model.modules():
        if isinstance(module, MATRIX_LAYERS) and id(module) not in ends and module.weight.ndim >= 2:
            hidden.add(id(module.weight))
        elif isinstance(module, nn.MultiheadAttention) and module.in_proj_weight is not None:
            hidden.add(id(module.in_proj_weight))
    return {name: id(p) in hidden for name, p in model.named_parameters() if p.requires_grad}


def muon_groups(model: nn.Module, groups: list[dict]) -> list[dict]:
    """`groups` (lbt.optim.param_groups's: weight decay decided) each split into its Muon matrices and the
    rest (`use_muon` True / False); empty groups left out."""
    uses = muon_split(model)
    muon_ids = {id(p) for name, p in model.named_parameters() if uses.get(name)}
    split = []
    for group in groups:
        for use in (True, False):
            params = [p for p in group["params"] if (id(p) in muon_ids) == use]
            if params:
                split.append({**group, "params": params, USE_MUON: use})
    return split


def as_matrix(tensor: Tensor) -> Tensor:
    """A weight (out, in, k...) as the (out, in x k...) matrix Muon orthogonalizes; a view where it can be."""
    return tensor if tensor.ndim == 2 else tensor.reshape(tensor.shape[0], -1)


def muon_lr(lr: float, shape: tuple[int, ...], rule: str | None) -> float:
    """The LR of one (A, B) matrix's orthogonalized step, as torch.optim.Muon adjusts it (`adjust_lr_fn`):

    - None / "original": lr x sqrt(max(1, A / B)) (Jordan et al. 2024, the reference implementation)
    - "match_rms_adamw": lr x 0.2 sqrt(max(A, B)), the RMS of AdamW's update (Liu et al. 2025, sec. 2.2)
    - "spectral_unclamped": lr x sqrt(A / B) (Bernstein, "Deriving Muon")
    """
    a, b = shape[0], shape[1]
    if rule is None or rule == "original":
        return lr * math.sqrt(max(1, a / b))
    if rule == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr * math.sqrt(a / b)


def orthogonalize(update: Tensor, steps: int, dtype: torch.dtype) -> Tensor:
    """About U V^T of update = U S V^T: torch.optim.Muon's quintic Newton-Schulz iteration (Jordan et al.'s
    coefficients, which trade exactness, singular values in about [0.7, 1.2], for few steps), in `dtype`."""
    a, b, c = NS_COEFFICIENTS
    x = update.to(dtype, copy=True)  # never in place: the update may be the momentum buffer
    tall = update.size(0) > update.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=NS_EPS))  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # torch.optim._muon's DEFAULT_A, _B, _C
NS_EPS = 1e-7
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class MuonAdamW(Optimizer):
    """torch's Muon on the groups with `use_muon: True` (2-D or convolution weights), torch's AdamW on
    the others. Build it through lbt.optim.create_optimizer (optim=muon), which splits the groups.

    Muon's hyper-parameters: `momentum`, `nesterov`, `ns_steps`, `adjust_lr_fn` (torch's names and
    defaults, except adjust_lr_fn, see the module), `ns_dtype` (auto, bfloat16, float32); AdamW's: `betas`,
    `eps`, `fused`, `foreach`. `lr` and `weight_decay` are shared (decoupled in both: p *= 1 - lr x wd).
    """

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.01, momentum: float = 0.95,
                 nesterov: bool = True, ns_steps: int = 5, adjust_lr_fn: str | None = "match_rms_adamw",
                 ns_dtype: str = "auto", betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 fused: bool | None = None, foreach: bool | None = None):
        if lr < 0 or weight_decay < 0 or momentum < 0 or not 0 < ns_steps < 100:
            raise ValueError(f"Muon needs lr, weight_decay, momentum >= 0 and 0 < ns_steps < 100; got lr={lr} "
                             f"weight_decay={weight_decay} momentum={momentum} ns_steps={ns_steps}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw", "spectral_unclamped"):
            raise ValueError(f"adjust_lr_fn must be original, match_rms_adamw or spectral_unclamped, got "
                             f"{adjust_lr_fn!r}")
        if ns_dtype != "auto" and ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be auto, bfloat16 or float32, got {ns_dtype!r}")
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, betas=betas, eps=eps, fused=fused,
                        foreach=foreach, **{USE_MUON: False})
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if group[USE_MUON] and p.ndim < 2:
                    raise ValueError(f"Muon takes matrices and convolution kernels, not a tensor of shape "
                                     f"{tuple(p.shape)}")
        self._adamw()  # AdamW checks its values (and fused's devices) now, not at the first step

    def _adamw(self) -> torch.optim.AdamW | None:
        """torch's AdamW over this optimizer's AdamW groups (the same dicts) and its state, built again when
        load_state_dict (or a copy) replaced them."""
        groups = [g for g in self.param_groups if not g[USE_MUON]]
        inner = getattr(self, "_inner", None)
        current = inner is not None and inner.state is self.state and len(inner.param_groups) == len(groups) \
            and all(a is b for a, b in zip(inner.param_groups, groups))
        if not current:
            inner = None
            if groups:
                inner = torch.optim.AdamW(groups, fused=groups[0]["fused"], foreach=groups[0]["foreach"])
                inner.state = self.state  # one state: state_dict and load_state_dict see AdamW's too
            self._inner = inner
        return inner

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group[USE_MUON]:
                self._muon_step(group)
        adamw = self._adamw()
        if adamw is not None:
            adamw.step()
        return loss

    def _muon_step(self, group: dict) -> None:
        """torch.optim.Muon's step (its `_single_tensor_muon`) on each parameter seen as a matrix."""
        lr, momentum = group["lr"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            grad, matrix = as_matrix(p.grad), as_matrix(p)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.contiguous_format)
            buffer = state["momentum_buffer"]
            buffer.lerp_(grad, 1 - momentum)
            update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            dtype = NS_DTYPES.get(group["ns_dtype"], torch.bfloat16 if p.is_cuda else torch.float32)
            update = orthogonalize(update, group["ns_steps"], dtype)
            matrix.mul_(1 - lr * group["weight_decay"])
            matrix.add_(update, alpha=-muon_lr(lr, tuple(matrix.shape), group["adjust_lr_fn"]))
            if matrix.data_ptr() != p.data_ptr():  # a kernel that was not contiguous: updated in a copy
                p.copy_(matrix.view_as(p))
