"""Sharded data parallelism: FSDP2 (`torch.distributed.fsdp.fully_shard`), `dist.shard=fsdp`.

DDP keeps the whole model, its gradients and its optimizer state on every data-parallel rank. FSDP2
keeps 1/D of each parameter on each of the D data-parallel ranks (a DTensor sharded on dim 0) and
moves whole parameters only while they are needed:

    forward, per block:   all-gather the block's parameters, compute, free the gathered copy
    backward, per block:  all-gather again, compute the gradient, reduce-scatter it (each rank keeps
                          the mean gradient of its own shard), free
    optimizer step:       on the shards only (an elementwise optimizer needs nothing else)

The update is DDP's: the reduce-scatter averages the same gradients the allreduce does, so a sharded
run takes the same steps as a replicated one (tests/test_fsdp.py). A block is the unit gathered at
once: the model declares its blocks (`shard_blocks`, the name of a ModuleList/Sequential attribute,
as lbt's transformer1d, gpt and resnet20 do; torchtitan shards each transformer block the same way),
else each parameter-holding child of the model is one, looking one level into containers. The root
takes what no block holds (embeddings, heads, tied weights). With tensor parallelism the mesh is
2-D ("dp", "tp"): layers are split over "tp" first, then sharded over "dp" (torchtitan's order).

Traffic per step per rank (lbt/cost/data_parallel.py: fsdp_bytes_sent): an all-gather of each block's
parameters in forward and again in backward, and a reduce-scatter of its gradients, each moving
(D-1)/D of the block's bytes: 3 (D-1)/D of the model against DDP's ring allreduce 2 (D-1)/D, the 1.5x
of Rajbhandari et al. 2020 (ZeRO, arXiv:1910.02054, sec. 7: stage 3 moves 3 psi per step, data
parallelism 2 psi). FSDP2 does not free the root's parameters between forward and backward, so the
root's part is gathered once: 3 (D-1)/D is the bound, and the planner uses it.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lbt.errors import ConfigError


def shard_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks `fully_shard` wraps one by one (this module's docstring says how they are found)."""
    declared = getattr(model, "shard_blocks", None)
    if declared is not None:
        container = getattr(model, declared, None)
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            raise ConfigError(f"the model declares shard_blocks={declared!r}, which is not a ModuleList or "
                              "Sequential of it")
        return [(f"{declared}.{name}", block) for name, block in container.named_children()]
    units: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        inner = child.named_children() if isinstance(child, (nn.ModuleList, nn.Sequential)) else [("", child)]
        for sub, module in inner:
            if any(True for _ in module.parameters()):
                units.append((f"{name}.{sub}" if sub else name, module))
    return _without_shared(model, units)


def _without_shared(model: nn.Module, units: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Blocks that share no parameter with the rest of the model: a tied weight (an embedding that is also the
    head) stays with the root, where one all-gather serves both uses."""
    owners: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [(name, unit) for name, unit in units if all(owners[id(p)] == 1 for p in unit.parameters())]


def check_shardable(model: nn.Module, model_name: str) -> list[tuple[str, nn.Module]]:
    """The model's blocks, or one line when there are fewer than two (sharding would gather it whole at once)."""
    units = shard_units(model)
    if len(units) < 2:
        found = "blocks (its `shard_blocks`)" if getattr(model, "shard_blocks", None) else \
            "child modules holding parameters (it declares no `shard_blocks` ModuleList)"
        raise ConfigError(f"dist.shard=fsdp cannot shard {model_name}: it has {len(units)} {found}, and sharding "
                          "gathers one block at a time, so it needs at least two; use dist.shard=none")
    return units


def mixed_precision(precision: str):
    """FSDP2's policy for trainer.precision: bf16/fp16 parameters while gathered (half the all-gather bytes),
    gradients reduced in fp32 (a sum of many small gradients loses bits in 16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def shard_model(model: nn.Module, dp_mesh, precision: str, model_name: str) -> list[str]:
    """Shard each block, then the root, over the mesh's data-parallel dimension; the blocks' names."""
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns of every model returning a view (a causal LM's transposed logits): an in-place op on it would
    # skip a backward hook, and lbt's loss functions make none.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    units = check_shardable(model, model_name)
    policy = mixed_precision(precision)
    for _, unit in units:
        fully_shard(unit, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)
    return [name for name, _ in units]


def replica_parameter_count(model: nn.Module) -> int:
    """Parameters of one data-parallel replica's part, the bytes a sharded step gathers and scatters: whole
    tensors, with a tensor-parallel split counted at 1/T (its dimensions over the "dp" mesh are not a split)."""
    count = 0
    for param in model.parameters():
        if not param.requires_grad:
            continue
        numel = param.numel()  # a DTensor's is the whole tensor's
        mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", ())
        for dim, placement in enumerate(placements):
            if placement.is_shard() and mesh is not None and mesh.mesh_dim_names[dim] != "dp":
                numel //= mesh.size(dim)
        count += numel
    return count
