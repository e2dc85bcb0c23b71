"""Gradient compression in DDP's allreduce through torch's DDP communication hooks.

kind: fp16 / bf16 halve the bytes of each allreduce (gradients cast, summed,
cast back; torch `default_hooks`); powersgd sends a rank-r approximation of
each gradient matrix, with error feedback (Vogels, Karimireddy, Jaggi 2019,
"PowerSGD"; torch `powerSGD_hook`), after `start_powersgd_iter` plain steps.

Compression acts only on the allreduce between processes: the simulated
workers inside a process are summed exactly, so with compression a run's
result depends on dist.procs, not only on dist.world_size. With one process
there is no allreduce and no DDP wrapper, and the technique does nothing.

gloo on CPU (torch 2.14.1, 2 processes, DDP on a small MLP, 3 steps,
tests/test_techniques_model.py pins it): fp16, bf16 and powersgd all work;
fp16/bf16 give the fp32 mean rounded to 16 bits. (torch's
batched_powerSGD_hook fails there with an AssertionError; lbt does not offer it.)
"""

from __future__ import annotations

import math
from functools import partial

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from lbt.errors import ConfigError
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


class CommCompression(Technique):
    """Register a DDP communication hook compressing the gradient allreduce."""

    name = "comm_compression"
    order = 50

    def __init__(self, kind: str = "fp16", powersgd_rank: int = 1, start_powersgd_iter: int = 2):
        if kind not in KINDS:
            raise ConfigError(f"technique.comm_compression.kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if not isinstance(powersgd_rank, int) or powersgd_rank < 1:
            raise ConfigError(
                f"technique.comm_compression.powersgd_rank must be a positive integer, got {powersgd_rank!r}"
            )
        # torch's PowerSGDState refuses < 2 with error feedback / warm start (its defaults).
        if not isinstance(start_powersgd_iter, int) or start_powersgd_iter < 2:
            raise ConfigError(
                f"technique.comm_compression.start_powersgd_iter must be an integer >= 2, got {start_powersgd_iter!r}"
            )
        self.kind, self.powersgd_rank, self.start_powersgd_iter = kind, powersgd_rank, start_powersgd_iter
        self.bytes_ratio: float | None = None  # fp32 bytes / compressed bytes per step, once registered

    def comm_hook(self, inner: CommHook, ddp_model: nn.Module) -> CommHook:
        # Replaces the allreduce: the compressed hooks reduce the bucket themselves.
        # Called only with real processes (with one, nothing is allreduced).
        shapes = [tuple(p.shape) for p in ddp_model.module.parameters() if p.requires_grad]
        sent = sum(compressed_bytes(s, self.kind, self.powersgd_rank) for s in shapes)
        self.bytes_ratio = sum(compressed_bytes(s, "none") for s in shapes) / max(sent, 1)
        # Process group None: the default one, as for lbt's plain allreduce.
        if self.kind == "fp16":
            return partial(default_hooks.fp16_compress_hook, None)
        if self.kind == "bf16":
            return partial(default_hooks.bf16_compress_hook, None)
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=self.powersgd_rank,
            start_powerSGD_iter=self.start_powersgd_iter,
        )
        return partial(powerSGD_hook.powerSGD_hook, state)

    def describe(self) -> str:
        what = self.kind
        if self.kind == "powersgd":
            what = f"PowerSGD rank {self.powersgd_rank} after {self.start_powersgd_iter} steps"
        ratio = "" if self.bytes_ratio is None else f", {self.bytes_ratio:.1f}x fewer bytes"
        return f"allreduce compressed with {what}{ratio}"
