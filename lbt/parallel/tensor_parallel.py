"""Hybrid data x tensor parallelism: P processes as DP data-parallel groups x T tensor-parallel ranks.

The T ranks of a tensor-parallel group work on the same samples and each holds 1/T of every dense
layer that is split (Krizhevsky 2014: data parallelism for the convolutions, model parallelism for
the dense layers). Splits use torch's tensor-parallel API on a 2-D `DeviceMesh` ("dp", "tp"):

    pair of Linears (only elementwise modules between):  ColwiseParallel, RowwiseParallel
        forward: one allreduce of the pair's output; backward: one of the first layer's input gradient
        (Megatron-LM's split: the activation between the two never leaves its rank)
    attention (a module declaring `split_by_heads`, e.g. lbt's SelfAttention): its qkv and out projections
        as such a pair, by heads: a rank computes H/T whole heads, since attention mixes positions but never heads
    a lone Linear (cnn1d's head):  ColwiseParallel with its output gathered (an all-gather)

A model that has pairs keeps an unpaired trailing Linear (the classifier head) whole: its output
is small and the pair before it already gives each rank the full activation. Everything else
(convolutions, norms, embeddings) stays replicated in every rank of the group.

Gradients of all parameters (local shards of the split ones) are then averaged over the DP ranks
by `DataParallelGradients`: one allreduce over the "dp" process group per bucket. Not DDP: DDP over
tensor-parallel parameters needs `torch.distributed.tensor.parallel.ddp._pre_dp_module_transform`,
after whose first forward `model.parameters()` and `state_dict()` are empty, which the optimizers,
techniques and checkpoints read. FSDP2's `replicate` on the dp sub-mesh works on gloo in torch 2.14,
but it lives in a private module (`torch.distributed._composable.replicate_with_fsdp`, its signature
changed between releases) and makes every parameter a DTensor. So DDP's communication hooks
(compression, delay, local SGD, the gns measurement between real workers) do not run here, and
those techniques refuse a tensor-parallel run.

Exact: the split changes only the order of float sums, so DP x T on P processes takes the same steps
as DP data-parallel workers (tests/test_tensor_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from lbt.errors import ConfigError

# Modules that act on each activation separately: a Linear pair split around them stays exact.
ELEMENTWISE = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Dropout, nn.Identity)
BUCKET_BYTES = 25 * 2**20  # DDP's default bucket size


@dataclass(frozen=True)
class Split:
    """How one Linear is split: 'colwise' (output features sharded), 'rowwise' (input features sharded)
    or 'gather' (colwise, with the output gathered back to every rank)."""

    name: str
    style: str
    width: int  # the sharded dimension: out_features (colwise, gather) or in_features (rowwise)
    unit: str = "features"  # or "heads": an attention projection shards whole heads


def dense_splits(model: nn.Module) -> list[Split]:
    """Which Linears to split, by the rule in this module's docstring (pure: reads the model only).

    Pairs are found in every nn.Sequential (consecutive Linears, elementwise modules between), in
    every attention module that declares `split_by_heads = (qkv, out)` and has `heads` (lbt's
    SelfAttention; its width is its heads) and in every nn.TransformerEncoderLayer (its MLP: linear1,
    linear2; torch's packed attention stays whole). Without a pair, a model with a single Linear
    splits that one (gathered); a model with several unpaired Linears and no pair splits none.
    """
    splits: list[Split] = []
    for prefix, module in model.named_modules():
        dotted = f"{prefix}." if prefix else ""
        by_heads = getattr(module, "split_by_heads", None)
        if by_heads is not None:
            qkv, out = by_heads
            splits += [Split(f"{dotted}{qkv}", "colwise", module.heads, "heads"),
                       Split(f"{dotted}{out}", "rowwise", module.heads, "heads")]
        elif isinstance(module, nn.TransformerEncoderLayer):
            splits += [Split(f"{dotted}linear1", "colwise", module.linear1.out_features),
                       Split(f"{dotted}linear2", "rowwise", module.linear2.in_features)]
        elif isinstance(module, nn.Sequential):
            splits += _sequential_pairs(module, dotted)
    if splits:
        return splits
    linears = [(name, m) for name, m in model.named_modules() if type(m) is nn.Linear]
    if len(linears) == 1:
        name, linear = linears[0]
        return [Split(name, "gather", linear.out_features)]
    return []


def _sequential_pairs(sequence: nn.Sequential, dotted: str) -> list[Split]:
    pairs, first = [], None
    for name, child in sequence.named_children():
        if type(child) is nn.Linear:
            if first is not None:
                pairs += [Split(f"{dotted}{first[0]}", "colwise", first[1].out_features),
                          Split(f"{dotted}{name}", "rowwise", child.in_features)]
                first = None
            else:
                first = (name, child)
        elif not isinstance(child, ELEMENTWISE):
            first = None
    return pairs


def why_not(splits: list[Split], tensor_parallel: int) -> str | None:
    """Why T cannot split a model with these splits (None: it can)."""
    if tensor_parallel == 1:
        return None
    if not splits:
        return ("no dense layer to split (lbt splits pairs of Linear layers in an nn.Sequential, lbt's SelfAttention "
                "by heads, the MLP of an nn.TransformerEncoderLayer, or a model's only Linear)")
    for split in splits:
        if split.width % tensor_parallel:
            if split.unit == "features":
                return (f"width {split.width} of layer {split.name} ({split.style} split) is not divisible by "
                        f"{tensor_parallel}")
            return (f"the {split.width} {split.unit} of layer {split.name} ({split.style} split) do not divide among "
                    f"{tensor_parallel} ranks")
    return None


def check_splittable(splits: list[Split], tensor_parallel: int, model_name: str) -> None:
    """One line for a model with nothing to split, or a split width T does not divide."""
    reason = why_not(splits, tensor_parallel)
    if reason is not None:
        raise ConfigError(f"dist.tensor_parallel={tensor_parallel} cannot split {model_name}: {reason}")


def device_mesh(device: torch.device, procs: int, tensor_parallel: int):
    """The job's 2-D mesh: rank r is data-parallel rank r // T, tensor-parallel rank r % T
    (a group's T ranks are neighbours, so on a multi-GPU node they share its fast links)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (procs // tensor_parallel, tensor_parallel), mesh_dim_names=("dp", "tp"))


def parallelize(model: nn.Module, mesh, model_name: str) -> list[Split]:
    """Split the model's dense layers over the mesh's "tp" dimension, in place; return the splits."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

    tensor_parallel = mesh["tp"].size()
    splits = dense_splits(model)
    check_splittable(splits, tensor_parallel, model_name)
    styles: dict[str, Callable[[], ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
              "gather": lambda: ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, mesh["tp"], {split.name: styles[split.style]() for split in splits})
    return splits


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (the local shard of a DTensor; a plain tensor as it is)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor of the whole value: a reduction of a DTensor (a split layer's gradient norm) is
    completed over the tensor-parallel ranks, so it adds up with the norms of replicated parameters."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def unfuse(optimizer: torch.optim.Optimizer) -> None:
    """The per-parameter loop for torch's optimizers: their fused and multi-tensor kernels take one tensor
    type per call, and a split model mixes DTensor shards with plain (replicated) parameters."""
    for group in optimizer.param_groups:
        for key in ("fused", "foreach"):
            if key in group:
                group[key] = False


class DataParallelGradients:
    """Averages the gradients over the data-parallel ranks: an allreduce over the "dp" group per bucket
    of about BUCKET_BYTES, of the flattened local gradients (shards of split layers, whole others)."""

    def __init__(self, model: nn.Module, group, dp_procs: int):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.group, self.dp_procs = group, dp_procs

    def average(self) -> None:
        if self.dp_procs == 1:
            return
        grads = [local(p.grad) for p in self.params if p.grad is not None]
        bucket, size = [], 0
        for grad in grads:
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= BUCKET_BYTES:
                self._reduce(bucket)
                bucket, size = [], 0
        if bucket:
            self._reduce(bucket)

    def _reduce(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.div_(self.dp_procs)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def local_parameter_count(model: nn.Module) -> int:
    """Parameters this rank holds (1/T of each split layer): what its data-parallel allreduce carries."""
    return sum(local(p).numel() for p in model.parameters() if p.requires_grad)


def full_tensors(state):
    """A state dict (nested dicts and lists) with every DTensor gathered whole: a checkpoint of a
    tensor-parallel run reads like one process's. A collective: every rank calls it."""
    if hasattr(state, "full_tensor"):
        return state.full_tensor()
    if isinstance(state, dict):
        return {key: full_tensors(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(full_tensors(value) for value in state)
    return state


def _shard_like(full: torch.Tensor, like) -> torch.Tensor:
    """The part of `full` that this rank holds of the DTensor `like` (sliced locally, no communication)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.device), like.device_mesh, like.placements, src_data_rank=None)


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                    optimizer_state: dict) -> None:
    """Load whole tensors (as `full_tensors` saved them) into a model whose split layers hold DTensors."""
    own = model.state_dict()
    with torch.no_grad():
        for name, value in model_state.items():
            target = own[name]
            local(target).copy_(local(_shard_like(value, target)) if hasattr(target, "to_local") else value)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    optimizer.load_state_dict(optimizer_state)
    for param in params:  # state tensors shaped like a split parameter become its shards again
        if not hasattr(param, "to_local"):
            continue
        for key, value in optimizer.state.get(param, {}).items():
            if torch.is_tensor(value) and value.shape == param.shape and not hasattr(value, "to_local"):
                optimizer.state[param][key] = _shard_like(value, param)
