"""Gradient compression in DDP's allreduce through torch's DDP communication hooks.

kind: fp16 / bf16 halve the bytes of each allreduce (gradients cast, summed,
cast back; torch `default_hooks`); powersgd sends a rank-r approximation of
each gradient matrix, with error feedback (Vogels, Karimireddy, Jaggi 2019,
"PowerSGD"; torch `powerSGD_hook`), after `start_powersgd_iter` plain steps.

Real workers (one per process) compress through DDP's hook. Simulated workers
of one process compress as their GPUs would: each worker's gradient is cast to
the wire's 16-bit type and the sum taken in that type (`SimulatedAllreduce`),
so a simulated run agrees with a real one within 16-bit rounding. What cannot
be simulated is refused in one line (`check_layout`): PowerSGD across simulated
workers (its per-worker error feedback and warm start), and simulated workers
in several processes. With one worker in all there is no allreduce to compress.

On gloo (CPU), fp16, bf16 and powersgd all work (tests/test_techniques_model.py); powersgd only on a
machine without CUDA (`check_powersgd_device`), and only while DDP has one gradient bucket (under ~1 MB
of gradients): with several, gloo's collectives mismatch or hang, in plain torch DDP too. torch's
batched_powerSGD_hook fails on gloo; lbt does not offer it.

PowerSGD keeps state between steps: each rank's error feedback (what its
compressed gradients left out, its own), the warm-start P and Q, the step count
and the RNG drawing fresh Qs, all per DDP gradient bucket. Checkpoints keep it
in every rank's own file, with each bucket's parameters. A fresh DDP wrapper
reduces all gradients as one bucket in its first step and rebuilds its buckets
in backward order afterwards (find_unused_parameters=False), so the
first step of a resumed run reduces the gradients through stand-in buckets
laid out as the checkpointed ones; later steps already are.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lbt.errors import ConfigError
from lbt.metrics.text_log import note
from lbt.rng import numpy_rng_state, numpy_rng_tuple
from lbt.spec.batching import BatchLayout
from lbt.spec.validate import integer, one_of
from lbt.techniques.base import CommHook, Technique

KINDS = ("fp16", "bf16", "powersgd")
FP32_BYTES = 4


def compressed_bytes(shape: tuple[int, ...], kind: str, rank: int = 1, min_compression_rate: float = 2.0) -> int:
    """Bytes one fp32 gradient of `shape` puts into the allreduce with compression `kind`.

    fp32 (kind "none"): 4 per element; fp16/bf16: 2. powersgd, once it
    compresses, views the gradient as an (n, m) matrix, n = shape[0], and sends
    P (n x r) and Q (m x r) in fp32: 4 * r * (n + m) bytes; like torch's hook
    it sends a tensor uncompressed (4 * n * m) unless r * (n + m) *
    min_compression_rate < n * m, which excludes biases and BN vectors.
    """
    numel = math.prod(shape)
    if kind == "none":
        return FP32_BYTES * numel
    if kind in ("fp16", "bf16"):
        return 2 * numel
    if kind != "powersgd":
        raise ValueError(f"unknown compression kind {kind!r}")
    n = shape[0] if shape else 1
    m = numel // n
    r = min(n, m, rank)
    if r * (n + m) * min_compression_rate < n * m:
        return FP32_BYTES * r * (n + m)
    return FP32_BYTES * numel


def check_powersgd_device(device: torch.device | None) -> None:
    """powerSGD_hook's decompress calls torch.cuda.synchronize(<the gradients' device>) whenever CUDA is present,
    which fails on CPU gradients (seen on an H200 machine, torch 2.11): refused in one line instead."""
    if device is not None and device.type == "cpu" and torch.cuda.is_available():
        raise ConfigError("technique.comm_compression.kind=powersgd with CPU gradients on a machine with CUDA: "
                          "torch's powerSGD_hook then synchronizes a CUDA device on CPU tensors and fails; "
                          "train on the GPUs (trainer.device=auto) or use kind=fp16/bf16")


class SimulatedAllreduce:
    """The fp16/bf16-compressed allreduce among the simulated workers of one process.

    torch's fp16_compress_hook casts each worker's gradient to 16 bits, sums the
    casts in 16 bits across workers and casts the mean back to fp32; here the
    trainer hands over each worker's gradient in turn (`send`), and `receive`
    puts the 16-bit sum back as the step's gradient.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    def send(self, model: nn.Module, sent: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Add this worker's gradient (the model's .grad, then cleared) to the 16-bit sum so far."""
        wire = []
        for p in model.parameters():
            if p.grad is not None:
                wire.append(p.grad.to(self.dtype))
                p.grad = None
        return wire if sent is None else [total.add_(part) for total, part in zip(sent, wire)]

    def receive(self, model: nn.Module, sent: list[torch.Tensor]) -> None:
        for p, total in zip([p for p in model.parameters() if p.requires_grad], sent):
            p.grad = total.to(p.dtype)


class CommCompression(Technique):
    """Register a DDP communication hook compressing the gradient allreduce."""

    name = "comm_compression"
    order = 50

    def __init__(self, kind: str = "fp16", powersgd_rank: int = 1, start_powersgd_iter: int = 2):
        one_of("technique.comm_compression.kind", kind, KINDS)
        integer("technique.comm_compression.powersgd_rank", powersgd_rank)
        # torch's PowerSGDState refuses < 2 with error feedback / warm start (its defaults).
        integer("technique.comm_compression.start_powersgd_iter", start_powersgd_iter, 2)
        self.kind, self.powersgd_rank, self.start_powersgd_iter = kind, powersgd_rank, start_powersgd_iter
        self.bytes_ratio: float | None = None  # fp32 bytes / compressed bytes per step, once registered
        dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16}
        self.simulated_comm = SimulatedAllreduce(dtypes[kind]) if kind in dtypes else None
        self.powersgd_state: powerSGD_hook.PowerSGDState | None = None  # created with the hook
        self.device: torch.device | None = None  # of the gradients, where the state's tensors live
        self.param_index: dict[int, int] = {}  # id of a parameter -> its index among the model's parameters
        self.layouts: dict[int, list[int]] = {}  # DDP bucket index -> its parameters' indices, in order
        self.resumed_layouts: dict[int, list[int]] | None = None  # the checkpoint's, until DDP's buckets match

    def check_layout(self, layout: BatchLayout) -> None:
        key = f"technique.comm_compression.kind={self.kind}"
        if layout.world_size == 1:
            note(f"{key}: one worker in all, so there is no allreduce to compress")
        elif layout.workers_per_proc > 1 and self.kind == "powersgd":
            raise ConfigError(f"{key}: PowerSGD's per-worker error feedback is not simulated across the "
                              f"{layout.workers_per_proc} simulated workers of a process; run one process per "
                              "worker (dist.procs=dist.world_size) or use fp16/bf16")
        elif layout.workers_per_proc > 1 and layout.procs > 1:
            raise ConfigError(f"{key}: compression is simulated with all workers in one process (dist.procs=1) "
                              "or run for real with one process per worker (dist.procs=dist.world_size)")

    def comm_hook(self, inner: CommHook, ddp_model: nn.Module) -> CommHook:
        # Replaces the allreduce: the compressed hooks reduce the bucket themselves.
        # Called only with real processes (with one, nothing is allreduced).
        module = ddp_model.module
        assert isinstance(module, nn.Module)
        params = [p for p in module.parameters() if p.requires_grad]
        shapes = [tuple(p.shape) for p in params]
        self.device = params[0].device if params else None
        if self.kind == "powersgd":
            check_powersgd_device(self.device)
        sent = sum(compressed_bytes(s, self.kind, self.powersgd_rank) for s in shapes)
        self.bytes_ratio = sum(compressed_bytes(s, "none") for s in shapes) / max(sent, 1)
        # Process group None: the default one, as for lbt's plain allreduce.
        if self.kind == "fp16":
            return partial(default_hooks.fp16_compress_hook, None)  # type: ignore[arg-type]
        if self.kind == "bf16":
            return partial(default_hooks.bf16_compress_hook, None)  # type: ignore[arg-type]
        self.powersgd_state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=self.powersgd_rank,
            start_powerSGD_iter=self.start_powersgd_iter,
        )
        self.param_index = {id(p): i for i, p in enumerate(params)}
        return self._powersgd

    def _powersgd(self, bucket) -> torch.futures.Future:
        layout = [self.param_index[id(p)] for p in bucket.parameters()]
        if self.resumed_layouts is not None:
            if self.resumed_layouts.get(bucket.index()) != layout:
                return self._powersgd_as_checkpointed(bucket, layout)
            self.resumed_layouts = None  # DDP's buckets are the checkpointed ones now
        self.layouts[bucket.index()] = layout
        assert self.powersgd_state is not None  # made with the hook
        return powerSGD_hook.powerSGD_hook(self.powersgd_state, bucket)

    def _powersgd_as_checkpointed(self, bucket, layout: list[int]) -> torch.futures.Future:
        """The first step after a resume: reduce `bucket` (every gradient, as DDP's first step
        has it) as the buckets whose PowerSGD state the checkpoint holds, one after another."""
        saved, state = self.resumed_layouts, self.powersgd_state
        assert saved is not None and state is not None  # a resume's first step, after the hook was made
        if sorted(layout) != sorted(i for indices in saved.values() for i in indices):
            raise RuntimeError(f"PowerSGD resume: DDP bucket {bucket.index()} holds parameters {layout}, "
                               f"the checkpoint's buckets {saved}")
        grads = dict(zip(layout, bucket.gradients()))
        for index in sorted(saved):
            stand_in = _Bucket(index, index == max(saved), [grads[i] for i in saved[index]])
            reduced = powerSGD_hook.powerSGD_hook(state, stand_in).wait()  # type: ignore[arg-type]
            for i, grad in zip(saved[index], stand_in.views(reduced)):
                grads[i].copy_(grad)
            self.layouts[index] = saved[index]
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    def state_dict(self) -> dict:
        """This rank's PowerSGD state, as copies (the hook updates its tensors in place) and plain values."""
        state = self.powersgd_state
        if state is None:  # fp16/bf16 keep nothing; one process has no hook
            return {}
        return {
            "iter": state.iter,
            "error": _copies(state.error_dict),
            "p_memory": _copies(state.p_memory_dict),
            "q_memory": _copies(state.q_memory_dict),
            "rng": numpy_rng_state(state.rng.get_state()),
            "numel_before": state.total_numel_before_compression,
            "numel_after": state.total_numel_after_compression,
            "next_stats_report": state.next_stats_report,
            "layouts": {index: list(layout) for index, layout in self.layouts.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        # The trainer registers the hook (creating the state) before it loads a checkpoint;
        # without a PowerSGD hook (fp16/bf16 now) there is nothing to restore.
        target = self.powersgd_state
        if not state or target is None:
            return
        target.iter = state["iter"]
        target.error_dict = _copies(state["error"], self.device)
        target.p_memory_dict = _copies(state["p_memory"], self.device)
        target.q_memory_dict = _copies(state["q_memory"], self.device)
        target.rng.set_state(numpy_rng_tuple(state["rng"]))
        target.total_numel_before_compression = state["numel_before"]
        target.total_numel_after_compression = state["numel_after"]
        target.next_stats_report = state["next_stats_report"]
        self.resumed_layouts = dict(state["layouts"]) or None

    def describe(self) -> str:
        what = self.kind
        if self.kind == "powersgd":
            what = f"PowerSGD rank {self.powersgd_rank} after {self.start_powersgd_iter} steps"
        ratio = "" if self.bytes_ratio is None else f", {self.bytes_ratio:.1f}x fewer bytes"
        return f"allreduce compressed with {what}{ratio}"


def _copies(tensors: dict[int, torch.Tensor], device: torch.device | None = None) -> dict[int, torch.Tensor]:
    return {index: t.detach().to(device, copy=True) for index, t in tensors.items()}


class _Bucket:
    """A stand-in for DDP's GradBucket holding copies of `grads`: what torch's PowerSGD hook reads."""

    def __init__(self, index: int, last: bool, grads: list[torch.Tensor]):
        self._index, self._last = index, last
        self._shapes = [g.shape for g in grads]
        self._buffer = torch.cat([g.reshape(-1) for g in grads])
        self._gradients = self.views(self._buffer)

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        sizes = [math.prod(shape) for shape in self._shapes]
        return [part.view(shape) for part, shape in zip(buffer.split(sizes), self._shapes)]

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._last

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients
