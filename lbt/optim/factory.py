"""Build the optimizer once: parameter groups first, then the optimizer class (timm's `create_optimizer_v2`).

One filter (lbt.optim.param_groups.is_excluded) decides which parameters get
no weight decay and no trust ratio, so `optim=sgd|lars|lamb|muon` all read
`optim.no_bn_weight_decay` the same way; optim=muon then splits each group
into Muon's matrices and AdamW's rest (lbt.optim.muon.muon_split).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lbt.errors import ConfigError
from lbt.optim.muon import MuonAdamW, muon_groups
from lbt.optim.param_groups import param_groups
from lbt.spec.targets import locate
from lbt.spec.validate import number

# Optimizers that step on DTensor shards exactly as on whole tensors, by class name: element-wise updates, and
# LARS and LAMB, whose layer norms go through DTensor reductions (`whole`). With layers split (tensor parallel,
# FSDP) any other is refused: a matrix optimizer (Muon, SOAP, Shampoo) transforms each weight whole, and one
# never run on shards could do so unnoticed.
SHARD_OPTIMIZERS = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adamax", "NAdam", "RAdam", "LARS", "LAMB")


def create_optimizer(model: nn.Module, optimizer_class: str | type, lr: float, weight_decay: float = 0.0,
                     no_bn_weight_decay: bool = False, **options) -> torch.optim.Optimizer:
    """`optimizer_class` (a class or its import path, e.g. torch.optim.SGD) over `model`'s parameter groups.

    With `no_bn_weight_decay`, bias and normalization parameters get weight
    decay 0 and `exclude_from_trust` (LARS and LAMB give them a trust ratio of
    1); the others get `weight_decay`. `lr` is the base LR, which the trainer
    replaces at every step by the schedule's (lbt/spec/lr.py).
    """
    number("optim.lr", lr, low=0, low_open=True)
    build: Any = locate("optim.optimizer_class", optimizer_class, torch.optim.Optimizer) \
        if isinstance(optimizer_class, str) else optimizer_class
    refuse_unfit(model, build)
    groups = param_groups(model, weight_decay, exclude_bias_and_norm=no_bn_weight_decay)
    if isinstance(build, type) and issubclass(build, MuonAdamW):
        groups = muon_groups(model, groups)
    if options.get("fused") == "auto":
        options["fused"] = _fused_kernel_for(build, model)
    try:
        return build(groups, lr=lr, weight_decay=weight_decay, **options)
    except (TypeError, ValueError) as error:  # torch.optim checks its hyper-parameters here
        raise ConfigError(f"optim: {str(error).splitlines()[0]}") from None


def refuse_unfit(model: nn.Module, optimizer_class: Any) -> None:
    """One line for an optimizer that cannot train this model in lbt's loop: its step needs a closure
    (schedule-free's *Closure classes), it does not step on shards and the layers are split across processes,
    or it takes 2-D parameters only (torch's Muon) and the model has others."""
    name = getattr(optimizer_class, "__name__", str(optimizer_class))
    step = inspect.signature(optimizer_class.step).parameters.get("closure") \
        if isinstance(optimizer_class, type) and hasattr(optimizer_class, "step") else None
    if step is not None and step.default is inspect.Parameter.empty:
        raise ConfigError(f"optim.optimizer_class={name}: its step needs a closure that evaluates the model, which "
                          "lbt's loop does not pass; for schedule-free use optim=schedulefree_adamw or "
                          "schedulefree_sgd, whose evaluation mode lbt switches itself")
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    refuse_split_layers(optimizer_class, any(hasattr(p, "full_tensor") for _, p in params))  # DTensor shards
    if optimizer_class is getattr(torch.optim, "Muon", None):
        shape = next(((n, tuple(p.shape)) for n, p in params if p.ndim != 2), None)
        if shape is not None:
            raise ConfigError(f"optim.optimizer_class=torch.optim.Muon cannot take parameter {shape[0]} of shape "
                              f"{shape[1]}: torch's Muon updates 2-D matrices only; use optim=muon, which gives "
                              "biases, norms, embeddings and the head to AdamW and views kernels as matrices")


def refuse_split_layers(optimizer_class: Any, split: bool) -> None:
    """One line when the run splits layers across processes (`split`: dist.tensor_parallel > 1 or dist.shard=fsdp;
    the parameters are DTensor shards) and the optimizer (a class or its import path) is not one that steps on
    shards (SHARD_OPTIMIZERS).

    The factory checks the built model's parameters; the engine checks the spec before the processes start,
    and an optimizer built without the factory once it is built."""
    name = optimizer_class if isinstance(optimizer_class, str) else getattr(optimizer_class, "__name__", "?")
    name = name.rsplit(".", 1)[-1]
    if split and name not in SHARD_OPTIMIZERS:
        raise ConfigError(f"optim.optimizer_class={name} with layers split across processes (dist.tensor_parallel "
                          "> 1 or dist.shard=fsdp): a process holds a shard of each split weight, and lbt runs only "
                          f"optimizers that step on shards exactly ({', '.join(SHARD_OPTIMIZERS)}); a matrix "
                          "optimizer (Muon, SOAP, Shampoo) needs each weight whole: keep the layers whole")


def _fused_kernel_for(optimizer_class: Any, model: nn.Module) -> bool | None:
    """`fused=auto`: True where torch has a fused kernel for the optimizer on the parameters' device
    (AdamW on CPU and CUDA: one kernel for all tensors instead of a loop over them); None (torch's own
    default) elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        return None
    try:
        optimizer_class(params, fused=True)
    except (TypeError, RuntimeError, ValueError):
        return None
    return True
