"""The cost of data x tensor parallelism: more GPUs without a bigger batch, by splitting the dense layers.

`lbt plan plan.tensor_parallel=auto` (lbt/apps/plan/) evaluates these formulas.

W GPUs run as DP data-parallel workers x T tensor-parallel ranks (W = DP x T). The T ranks of a
group compute the same per-worker batch b, each with 1/T of every split dense layer, so the
global batch is b x DP, not b x W (Krizhevsky 2014, "One weird trick": data parallelism for the
convolutions, model parallelism for the dense layers). One step of a DP x T split:

    compute = slowest worker's compute x (1 - s + s / T)      s = the split layers' share of the FLOPs
    tp comm = sum over the split layers' collectives among the T ranks, b x bytes-per-sample each:
              allreduce  2 (T-1)/T x bytes / bandwidth + 2 (T-1) x latency   (ring)
              all-gather   (T-1)/T x bytes / bandwidth +   (T-1) x latency   (ring, half an allreduce)
    dp comm = ring allreduce over DP workers of 4 x (replicated params + split params / T)
    step    = compute + tp comm + dp comm
    epoch   = N / (b DP) x step

T=1 is lbt plan's data-parallel step (its overlap applies there). With T > 1 every term is on the
critical path: the activation collectives sit between layers, and lbt's tensor-parallel runs
average gradients after the backward without DDP (no overlap, no compression hooks).

Which layers split, the runtime's rule (lbt/parallel/tensor_parallel.py; Megatron-LM's split):
- consecutive nn.Linear pairs in an nn.Sequential (only elementwise modules between), the qkv and
  out projections of lbt's SelfAttention (split by heads) and the MLP of every
  nn.TransformerEncoderLayer (linear1, linear2) become (colwise, rowwise): forward one
  allreduce of the pair's output (b x out_features of the second), backward one allreduce of the
  first layer's input gradient (b x in_features; none when that input needs no gradient, as the
  data of an MLP's first layer);
- a model without a pair splits its only Linear (cnn1d's head, mlp with num_layers=0) colwise with
  the output gathered: forward one all-gather of b x out_features, backward one allreduce of
  b x in_features (again only when the input needs a gradient);
- everything else (convolutions, norms, embeddings, an unpaired head) is replicated.
Bytes are fp32; per sample they count every position (a transformer's tokens), read from one
forward pass. A split width T does not divide makes that T impossible for the model.

Dettmers' arithmetic ("How to Parallelize Deep Learning on GPUs, Part 2/2", 2014): with 2 GPUs,
batch 128 and a 1000x500 layer, data parallelism sends the 500,000 weight gradients; the split
layer sends its 128 x 500 activations forward and their gradients backward, 128,000 numbers: about
a quarter (tests/test_plan_tp.py computes it with these functions).

The compute split assumes time follows FLOPs (torch's FlopCounterMode over one forward + backward:
matmuls and convolutions, not elementwise work), and that the optimizer step splits alike.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

from lbt.cost.data_parallel import (
    Compute,
    Network,
    epoch_seconds,
    gradient_bytes,
    ring_allreduce_seconds,
    step_seconds,
)
from lbt.parallel.tensor_parallel import Split, dense_splits, why_not

# `plan.tensor_parallel=auto` tries T = 2, 4, 8: a tensor-parallel group should stay inside one node's
# fast links (NVLink joins 8 GPUs), its activation allreduces run every layer.
AUTO_MAX_TENSOR_PARALLEL = 8


# -- what a split costs, per sample -----------------------------------------------------------------
@dataclass(frozen=True)
class Collective:
    """One activation collective among a group's T ranks per step; bytes of the whole tensor per sample."""

    layer: str
    op: str  # "allreduce" or "allgather"
    phase: str  # "forward" or "backward"
    bytes_per_sample: int


@dataclass(frozen=True)
class DenseSplit:
    """What splitting a model's dense layers costs, independent of T."""

    layers: tuple[Split, ...]
    collectives: tuple[Collective, ...]
    sharded_params: int  # held 1/T per rank
    replicated_params: int  # held whole by every rank (a rowwise layer's bias among them)
    dense_share: float  # s: the split layers' share of a step's FLOPs
    sizes: tuple[tuple[int, int], ...] = ()  # (in_features, out_features) of each split layer, as `layers`

    def local_params(self, tensor_parallel: int) -> int:
        """Parameters one rank holds: what its data-parallel allreduce carries."""
        return self.replicated_params + self.sharded_params // tensor_parallel


def dense_split(model, example) -> DenseSplit:
    """Collectives, parameter split and FLOP share of the model's split layers, from one forward and
    backward of `example` (a batch; its requires_grad says whether the input needs a gradient).

    Pure: runs on a copy of the model, in training mode (torch's fused inference path of a
    TransformerEncoderLayer would skip the Linears' hooks).
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = copy.deepcopy(model).train()
    layers = dense_splits(model)
    modules = dict(model.named_modules())
    seen: dict[str, tuple[int, int, bool]] = {}  # name -> input numel, output numel, input needs grad

    def record(name):
        def hook(module, inputs, output) -> None:  # returns None: the output stays as it is
            seen.setdefault(name, (inputs[0].numel(), output.numel(), inputs[0].requires_grad))
        return hook

    hooks = [modules[layer.name].register_forward_hook(record(layer.name)) for layer in layers]
    try:
        with FlopCounterMode(display=False) as counter:
            output = model(example)
            output.float().sum().backward()
    finally:
        for hook in hooks:
            hook.remove()
    batch = example.shape[0]
    collectives: list[Collective] = []
    split_flops = sharded = 0
    for layer in layers:
        module = modules[layer.name]
        numel_in, numel_out, input_grad = seen[layer.name]
        positions = numel_out // module.out_features  # rows of the matmul: tokens x batch
        # forward and weight gradient, plus the input gradient when autograd computes it
        split_flops += 2 * module.in_features * module.out_features * positions * (3 if input_grad else 2)
        in_bytes, out_bytes = 4 * numel_in // batch, 4 * numel_out // batch
        if layer.style == "rowwise":
            collectives.append(Collective(layer.name, "allreduce", "forward", out_bytes))
        if layer.style == "gather":
            collectives.append(Collective(layer.name, "allgather", "forward", out_bytes))
        if layer.style in ("colwise", "gather") and input_grad:
            collectives.append(Collective(layer.name, "allreduce", "backward", in_bytes))
        sharded += module.weight.numel()
        if module.bias is not None and layer.style != "rowwise":  # RowwiseParallel keeps the bias whole
            sharded += module.bias.numel()
    total = sum(p.numel() for p in model.parameters())
    share = split_flops / counter.get_total_flops() if counter.get_total_flops() else 0.0
    sizes = tuple((modules[layer.name].in_features, modules[layer.name].out_features) for layer in layers)
    return DenseSplit(tuple(layers), tuple(collectives), sharded, total - sharded, min(share, 1.0), sizes)


# -- the formulas -----------------------------------------------------------------------------------
def ring_allgather_seconds(nbytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Ring all-gather of a tensor of `nbytes` in all (each worker holds 1/W): W-1 steps of nbytes/W."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return (workers - 1) / workers * nbytes / bandwidth_bytes_per_s + (workers - 1) * latency_s


def tp_comm_seconds(collectives, per_worker_batch: int, tensor_parallel: int, network: Network) -> float:
    """One step's activation collectives among the T ranks of a group, each of b x bytes-per-sample."""
    seconds = 0.0
    for c in collectives:
        collective = ring_allreduce_seconds if c.op == "allreduce" else ring_allgather_seconds
        seconds += collective(per_worker_batch * c.bytes_per_sample, tensor_parallel,
                              network.bandwidth_bytes_per_s, network.latency_s)
    return seconds


def tp_compute_seconds(compute_s: float, dense_share: float, tensor_parallel: int) -> float:
    """A rank's compute: the split share s divided among T ranks, the rest replicated."""
    return compute_s * (1.0 - dense_share + dense_share / tensor_parallel)


def tensor_parallel_options(value: str, max_workers: int) -> list[int]:
    """T values to compare: `auto` -> 1, 2, 4, 8 (AUTO_MAX_TENSOR_PARALLEL); a power of 2 T -> 1 and T."""
    if value == "auto":
        return [t for t in (1, 2, 4, 8) if t <= min(AUTO_MAX_TENSOR_PARALLEL, max_workers)]
    try:
        t = int(value)
    except ValueError:
        t = 0
    if t < 1 or t & (t - 1):
        raise ValueError(f"plan.tensor_parallel must be auto or a power of 2 (1, 2, 4, ...), got {value!r}")
    if t > max_workers:
        raise ValueError(f"plan.tensor_parallel={t} exceeds plan.max_workers={max_workers}: T ranks are T GPUs")
    return sorted({1, t})


@dataclass(frozen=True)
class SplitRow:
    workers: int  # W GPUs
    tensor_parallel: int  # T ranks per group
    data_parallel: int  # DP = W / T workers
    global_batch: int  # b x DP
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float
    step_s: float
    epoch_s: float
    speedup: float  # epoch on 1 GPU / this epoch
    beyond_critical: bool  # b x DP > critical batch
    beyond_dataset: bool  # b x DP > N
    recommended: bool = False


def split_rows(
    compute: Compute,
    split: DenseSplit,
    network: Network,
    workers: list[int],
    tensor_parallel: list[int],
    train_samples: int,
    overlap: float = 0.0,
    critical_batch: float | None = None,
) -> list[SplitRow]:
    """Per W: DP-only and every DP x T split that T divides (and that the model allows), with the
    recommended split of each W marked (`recommend`)."""
    b = compute.per_worker_batch
    base_epoch = epoch_seconds(compute.slowest_of(1), train_samples, b)
    rows: list[SplitRow] = []
    for w in workers:
        group = []
        for t in tensor_parallel:
            if t > w or w % t or why_not(list(split.layers), t):
                continue
            dp = w // t
            slowest = compute.slowest_of(w)
            dp_comm = ring_allreduce_seconds(gradient_bytes(split.local_params(t)), dp,
                                             network.bandwidth_bytes_per_s, network.latency_s)
            if t == 1:  # lbt plan's data-parallel step, DDP's overlap and all
                compute_s, tp_comm = slowest, 0.0
                step = step_seconds(slowest, dp_comm, overlap, compute.backward_s)
            else:
                compute_s = tp_compute_seconds(slowest, split.dense_share, t)
                tp_comm = tp_comm_seconds(split.collectives, b, t, network)
                step = compute_s + tp_comm + dp_comm
            epoch = epoch_seconds(step, train_samples, b * dp)
            group.append(SplitRow(w, t, dp, b * dp, compute_s, tp_comm, dp_comm, step, epoch, base_epoch / epoch,
                                  beyond_critical=critical_batch is not None and b * dp > critical_batch,
                                  beyond_dataset=b * dp > train_samples))
        best = recommend(group, critical_batch)
        rows += [replace(r, recommended=r is best) for r in group]
    return rows


def recommend(group: list[SplitRow], critical_batch: float | None) -> SplitRow | None:
    """The fastest epoch among one W's splits whose global batch stays at or below the critical batch
    (all of them without one); when every split exceeds it, the fastest of the smallest global batch.
    A split whose global batch exceeds N (less than one step per epoch: its epoch time means nothing) is
    chosen only when every split of that W does, and then the smallest global batch."""
    if not group:
        return None
    candidates = [r for r in group if not r.beyond_dataset] or group
    within = [r for r in candidates if critical_batch is None or r.global_batch <= critical_batch]
    if not within or all(r.beyond_dataset for r in within):
        smallest = min(r.global_batch for r in candidates)
        within = [r for r in candidates if r.global_batch == smallest]
    return min(within, key=lambda r: r.epoch_s)


