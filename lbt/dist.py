"""Processes, process groups and virtual workers.

lbt never moves bytes itself: processes are started by `torch.multiprocessing`
(or by torchrun), they meet through a `TCPStore` on 127.0.0.1, and gradients
travel through `torch.distributed` + `DistributedDataParallel`.

A run models `world_size` W workers on `procs` P processes. Process `rank` owns
the virtual workers `rank*k ... rank*k + k - 1` (k = W/P) and runs their forward
passes one after another; see `Trainer.train_step` for how their gradients are
combined.
"""

from __future__ import annotations

import datetime
import hashlib
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for_sentinels
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HOST = "127.0.0.1"


@dataclass(frozen=True)
class DistContext:
    rank: int  # this process among the P processes
    procs: int  # P
    local_rank: int
    world_size: int  # W, the workers (GPUs) the run models
    device: torch.device
    tensor_parallel: int = 1  # T: consecutive ranks in groups of T split the model (lbt/tensor_parallel.py)
    mesh: object = None  # with T > 1, the ("dp", "tp") DeviceMesh

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
        from lbt.errors import ConfigError

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
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), procs,
                              is_master=rank == 0 and not agent_serves, timeout=timeout)
        store = dist.PrefixStore(f"lbt/attempt_{elastic_restarts()}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=procs, timeout=timeout)
    elif store_port is None:
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=procs, timeout=timeout)
    else:
        store = dist.TCPStore(HOST, store_port, procs, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=procs, timeout=timeout)


class WorkerDied(RuntimeError):
    """A worker process of a locally launched job exited abnormally.

    `rank` and `how` name the worker that brought the job down; rank None: a
    config error the worker already printed (never worth a restart).
    """

    def __init__(self, message: str, rank: int | None = None, how: str | None = None):
        super().__init__(message)
        self.rank, self.how = rank, how

    @property
    def restartable(self) -> bool:
        return self.rank is not None


def step_board(procs: int):
    """One shared integer per process, each worker's last finished step: read after a worker dies
    (a SIGKILLed process can say nothing), so a restart can record where it happened."""
    return mp.get_context("spawn").RawArray("q", procs)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def launch_local(fn: Callable, args: tuple, procs: int) -> None:
    """Start `procs` processes running fn(rank, store_port, *args) and watch them.

    The parent owns the rendezvous store (port chosen by the OS, so no port can
    be "in use"). If any process fails, the rest are stopped within seconds and
    WorkerDied names the rank that caused it (see `_cause`).
    """
    store = dist.TCPStore(HOST, 0, procs + 1, is_master=True, wait_for_workers=False)
    if mp.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        # A job of a sweep run by Hydra's joblib launcher (loky workers) carries loky's start method, which
        # the spawned workers would try to restore and cannot ("cannot find context for 'loky'").
        mp.set_start_method("spawn", force=True)
    context = mp.start_processes(fn, args=(store.port, *args), nprocs=procs, join=False, start_method="spawn")
    processes = context.processes

    def forward(signum, frame):
        # Preemption reaches the launcher: the workers checkpoint and stop together.
        for p in processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        failed = _watch(processes)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not failed:
        return
    _stop_all(processes, failed, procs)


def _watch(processes: list) -> list[int]:
    """Wait until all processes ended well, or one failed; return the failed ranks."""
    pending = {p.sentinel: rank for rank, p in enumerate(processes)}
    failed: list[int] = []
    while pending and not failed:
        for sentinel in wait_for_sentinels(list(pending)):
            rank = pending.pop(sentinel)
            processes[rank].join()
            if processes[rank].exitcode != 0:
                failed.append(rank)
    return failed


def _stop_all(processes: list, failed: list[int], procs: int) -> None:
    # Give the peers a moment to notice on their own, so the report can tell the
    # rank that died from the ranks that merely lost their peer.
    deadline = time.monotonic() + 3.0
    for p in processes:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    codes = {rank: p.exitcode for rank, p in enumerate(processes)}
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
    cause = _cause(codes, failed)
    if codes[cause] == 2:
        # A config error inside the worker: it already printed its one line.
        raise WorkerDied("")
    how = _exit_reason(codes[cause])
    raise WorkerDied(f"worker rank {cause} failed ({how}); stopped the other {procs - 1} worker(s)", cause, how)


def _cause(codes: dict[int, int | None], failed: list[int]) -> int:
    """The rank whose death brought the job down.

    A peer that loses its partner mid-collective either raises (an exit code)
    or, inside gloo's C++ threads, aborts ("terminate called without an active
    exception", SIGABRT), and it may do so in the same instant the real cause
    dies. So a rank killed by any other signal (OOM killer, SIGKILL, SIGSEGV)
    is the cause first, then a rank that exited with an error, then SIGABRT;
    ties go to the rank seen failing first.
    """
    def kind(code: int) -> int:
        if code < 0:
            return 2 if -code == signal.SIGABRT else 0
        return 1

    seen_later = [rank for rank, code in codes.items() if code not in (None, 0) and rank not in failed]
    dead = failed + seen_later  # in the order they were seen; min() keeps the first of equal kinds
    return min(dead, key=lambda rank: kind(codes[rank]))


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of (seed, epoch): a hash of both, so every pair orders the data independently.

    (seed + epoch, DistributedSampler's own rule, would make seed 1's epoch e seed 0's epoch e+1:
    runs with different seeds would share data orders and understate the spread between seeds.)
    """
    digest = hashlib.sha256(f"lbt-shuffle:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def shard_indices(num_samples: int, world_size: int, seed: int, epoch: int) -> torch.Tensor:
    """Sample order of one epoch, as a (world_size, samples_per_worker) table.

    Row v is exactly what `DistributedSampler(num_replicas=W, rank=v,
    shuffle=True, seed=epoch_seed(seed, epoch), drop_last=True)` yields at its
    epoch 0 (a test pins this), built once for all workers. Because worker v
    holds perm[v::W], the b-sample slices of step s over all workers cover
    perm[s*B:(s+1)*B]: the data of a step depends on the global batch B only,
    not on how it is split into workers.
    """
    generator = torch.Generator()
    generator.manual_seed(epoch_seed(seed, epoch))
    perm = torch.randperm(num_samples, generator=generator)
    per_worker = num_samples // world_size
    return perm[: per_worker * world_size].view(per_worker, world_size).t()


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


class BufferMean:
    """Per-step mean of the buffers over the virtual workers of one process.

    Simulated workers share one module, so without care worker 2's BN update
    would compound worker 1's. Each worker starts from the step's buffers; the
    process keeps the mean of their floating buffers (running stats) and the
    counters as one worker left them (num_batches_tracked moves by one per
    step, as on a real worker), matching real workers whose running stats are
    averaged (see `average_buffers`).
    """

    def __init__(self, model: torch.nn.Module):
        self.buffers = list(model.buffers())
        self.start: list[torch.Tensor] = []
        self.total: list[torch.Tensor | None] = []

    @property
    def active(self) -> bool:
        return bool(self.buffers)

    def begin_step(self) -> None:
        self.start = [b.detach().clone() for b in self.buffers]
        self.total = [torch.zeros_like(b) if b.is_floating_point() else None for b in self.buffers]

    def after_pass(self, weight: float, last: bool) -> None:
        """After a forward over a share `weight` of the process's workers."""
        for buffer, start, total in zip(self.buffers, self.start, self.total):
            if total is not None:
                total.add_(buffer, alpha=weight)
                if last:
                    buffer.copy_(total)
            if not last:
                buffer.copy_(start)


@contextmanager
def process_group(backend: str, rank: int, procs: int, timeout_s: float, store_port: int | None):
    if procs == 1:
        yield
        return
    init_process_group(backend, rank, procs, timeout_s, store_port)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def note(message: str) -> None:
    """A `lbt: note:` line on stderr, from rank 0 only (every rank reaches the same conclusions)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        from lbt.metrics.text_log import say

        say(f"lbt: note: {message}", stderr=True)


def flush_std() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
