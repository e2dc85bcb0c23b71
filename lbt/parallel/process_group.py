"""The processes of a run and their process group.

lbt never moves bytes itself: processes are started by lbt's launcher (lbt/parallel/launcher.py)
or by torchrun, they meet through a `TCPStore` on 127.0.0.1, and gradients travel through
`torch.distributed` + `DistributedDataParallel`.

A run models `world_size` W workers on `procs` P processes. Process `rank` owns the virtual
workers `rank*k ... rank*k + k - 1` (k = W/P); lbt/engine/step.py runs them.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lbt.errors import ConfigError

HOST = "127.0.0.1"


@dataclass(frozen=True)
class DistContext:
    rank: int  # this process among the P processes
    procs: int  # P
    local_rank: int
    world_size: int  # W, the workers (GPUs) the run models
    device: torch.device
    tensor_parallel: int = 1  # T: consecutive ranks in groups of T split the model (parallel/tensor_parallel.py)
    mesh: Any = None  # with T > 1 or sharding, the ("dp", "tp") DeviceMesh
    sharded: bool = False  # dist.shard=fsdp over more than one data-parallel rank (lbt/parallel/fsdp.py)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel group: the T ranks of a group read the same samples."""
        return self.rank // self.tensor_parallel

    @property
    def dp_procs(self) -> int:
        return self.procs // self.tensor_parallel

    @property
    def distributed(self) -> bool:
        return self.procs > 1


def torchrun_env() -> dict | None:
    """RANK/WORLD_SIZE/LOCAL_RANK when started by torchrun (or any env:// launcher)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return {
        "rank": int(os.environ["RANK"]),
        "procs": int(os.environ["WORLD_SIZE"]),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        "local_procs": int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])),
    }


def elastic_restarts() -> int:
    """How many times torchrun's agent (--max-restarts) has restarted this job's workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))


def default_procs() -> int:
    env = torchrun_env()
    if env is not None:
        return env["procs"]
    return max(1, torch.cuda.device_count())


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is available")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def pick_backend(requested: str, device: torch.device) -> str:
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    backend: str, rank: int, procs: int, timeout_s: float, store_port: int | None
) -> None:
    """Join the job's process group: through the launcher's TCPStore, or env:// under torchrun."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store_port is None and elastic_restarts():
        # torchrun's agent keeps serving one store across --max-restarts: the keys of the attempt that
        # failed (rank 0's old gloo address) would be read again, so each attempt uses keys of its own.
        agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store: dist.Store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), procs,
                              is_master=rank == 0 and not agent_serves, timeout=timeout)
        store = dist.PrefixStore(f"lbt/attempt_{elastic_restarts()}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=procs, timeout=timeout)
    elif store_port is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=procs, timeout=timeout)
    else:
        store = dist.TCPStore(HOST, store_port, procs, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=procs, timeout=timeout)


def all_reduce_sum(tensor: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def average_buffers(model: torch.nn.Module, ctx: DistContext) -> None:
    """Average floating-point buffers (BatchNorm running stats) over processes.

    BN's running-stat update is linear in the batch statistics, so the average
    of the workers' running stats equals the running stats of the averaged
    batch statistics: the same number whether workers are real or simulated.
    """
    if not ctx.distributed:
        return
    for buffer in model.buffers():
        if buffer.is_floating_point():
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
            buffer.div_(ctx.procs)


@contextmanager
def process_group(backend: str, rank: int, procs: int, timeout_s: float, store_port: int | None) -> Iterator[None]:
    if procs == 1:
        yield
        return
    init_process_group(backend, rank, procs, timeout_s, store_port)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def flush_std() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
