"""Memory per GPU of data-parallel training, replicated (DDP) or sharded (FSDP2, dist.shard=fsdp): pure formulas.

    one GPU:     4 bytes x P x (1 + 1 + s)                         parameters, gradients, optimizer state
    replicated:  4 bytes x P x (1 + 1 + 1 + s)                     ... and DDP's gradient buckets
    sharded:     4 bytes x P x (1 + 1 + s) / D  +  4 x 4 bytes x P_block

P parameters in fp32, s the optimizer's fp32 state tensors per parameter (SGD with momentum and LARS 1,
AdamW and LAMB 2: torch's and lbt's implementations), D the ranks the model is sharded over. A sharded
rank also holds whole the block it computes. In backward, at the peak: its gathered parameters, their
unsharded gradients, the reduce-scatter's input (FSDP2 copies the gradients into one flat buffer before
it frees them: torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, foreach_reduce) and the next
block's parameters, gathered ahead (FSDP2's implicit backward prefetch): 4 x the largest block (P_block). DDP copies the
gradients into its allreduce buckets (one more gradient's worth; torch's `gradient_as_bucket_view`
docs: sharing them "can reduce peak memory usage ... equal to the total gradients size"); a single GPU
runs without DDP. Activations are
not in either figure: they grow with the per-worker batch and are the same under both layouts
(bench/memory.py measures them with the rest and compares).
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_FP32 = 4
# fp32 state tensors each optimizer keeps per parameter (torch.optim.SGD with momentum, AdamW; lbt's LARS, LAMB).
OPTIMIZER_SLOTS = {"sgd": 1, "lars": 1, "adamw": 2, "adam": 2, "lamb": 2}
GATHERED_BLOCKS = 4  # the block's parameters, its gradients, the reduce-scatter's copy of them, the next block


@dataclass(frozen=True)
class ModelMemory:
    params: int  # P
    largest_block: int  # P_block: parameters of the largest block a sharded run gathers at once
    optimizer_slots: int  # s

    @property
    def state_bytes(self) -> float:
        """Parameters, gradients and optimizer state of the whole model."""
        return BYTES_PER_FP32 * self.params * (2 + self.optimizer_slots)

    def per_rank(self, shards: int) -> float:
        """Bytes per GPU with the model sharded over `shards` ranks (1: whole, one GPU or DDP's share)."""
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        if shards == 1:
            return self.state_bytes
        return self.state_bytes / shards + GATHERED_BLOCKS * BYTES_PER_FP32 * self.largest_block

    def replicated(self, workers: int) -> float:
        """Bytes per GPU under DDP on `workers` GPUs: the whole state, and DDP's buckets from 2 GPUs on."""
        return self.state_bytes + (BYTES_PER_FP32 * self.params if workers > 1 else 0.0)


def fewest_gpus(memory: ModelMemory, gpu_bytes: float, counts: list[int]) -> tuple[int, str] | None:
    """The smallest GPU count in `counts` on which the model's training state fits `gpu_bytes` per GPU, and the
    layout it needs (replicated when that fits, else sharded); None when no count does."""
    if memory.per_rank(1) <= gpu_bytes:
        return 1, "none"  # one GPU holds it; more hold it replicated when memory.replicated(W) fits too
    for count in counts:
        if count > 1 and memory.per_rank(count) <= gpu_bytes:
            return count, "fsdp"
    return None
