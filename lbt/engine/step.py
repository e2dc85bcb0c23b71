"""One optimizer step of synchronous data-parallel SGD over this process's simulated workers.

`world_size` W workers run on `procs` P processes, k = W/P workers each. The k workers run in passes
of g workers (lbt/engine/passes.py: workers_per_pass; g = k fuses them all, g = 1 is one pass per
worker), BatchNorm statistics per worker chunk of a pass:

    for each pass i (k/g of them, one after another):
        loss_i = mean loss over its g x per_worker_batch samples  # BN sees b samples, as on a GPU
        (loss_i x g/k).backward()    # under no_sync() except for the last pass
    DDP averages the summed gradients over the P processes
    -> gradient = mean over W workers = mean over the global batch
    techniques' and the strategy's after_backward (measurements, delay, clipping); optimizer.step()

With tensor parallelism (lbt/parallel/tensor_parallel.py) each "process" above is a group of T
processes that read the same samples and split the dense layers; the gradients are averaged over the
groups after the passes, without DDP. Forward and loss run under trainer.precision's autocast; with
fp16 the gradients are unscaled before the techniques and the optimizer read them (precision.py).
The step strategy (lbt/engine/strategies/) may run this step once per worker instead (local SGD).
"""

from __future__ import annotations

import inspect
import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from lbt.cost.data_parallel import BYTES_PER_FP32, fsdp_bytes_sent, ring_bytes_sent
from lbt.engine.passes import BufferMean, per_worker_batchnorm, set_per_worker_batch, workers_per_pass
from lbt.engine.precision import Precision, compile_forward
from lbt.engine.strategies.base import StepStrategy
from lbt.metrics.timing import StepTimer
from lbt.nn import GhostBatchNorm
from lbt.parallel.fsdp import replica_parameter_count
from lbt.parallel.process_group import DistContext
from lbt.parallel.tensor_parallel import DataParallelGradients, local_parameter_count
from lbt.spec.batching import BatchLayout
from lbt.techniques.base import Progress, Technique


@dataclass
class LoopState:
    """Where the loop is: all of it goes into checkpoints."""

    step: int = 0
    samples_seen: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    epoch_loss_sum: float = 0.0  # the epoch's step losses so far, summed over steps and processes
    epoch_loss_count: int = 0  # steps x processes in that sum
    allreduces: int = 0  # model-sized allreduces so far (RunResult.allreduces)
    bytes_sent: float = 0.0
    initial_loss: float = math.nan  # the first step's loss: divergence is a multiple of it
    high_windows: int = 0  # log windows in a row whose loss exceeded that multiple


@dataclass
class RunControl:
    """Why the loop ends before its budget, decided while it runs; the result records it once the run ends."""

    stop_asked: bool = False  # a signal or stop file, seen by every process together at a log step
    at_target: bool = False  # the last evaluation reached trainer.stop_at_val_*
    why_diverged: str = ""  # not empty: the run diverged, and why

    @property
    def diverged(self) -> bool:
        return bool(self.why_diverged)


def wrap_ddp(model: nn.Module) -> DistributedDataParallel:
    # Buffers stay per process during training (no broadcast from rank 0 at each
    # forward) and are averaged at evaluation; newer torch names this forward_sync_buffers.
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return DistributedDataParallel(model, forward_sync_buffers=False)
    return DistributedDataParallel(model, broadcast_buffers=False)


def register_comm_hook(ddp: DistributedDataParallel, strategy: StepStrategy, techniques: list[Technique],
                       timer: StepTimer | None = None) -> None:
    """DDP's one communication hook: the strategy's allreduce, wrapped by each technique in order, then timed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # None: the default process group (torch's annotation says a ProcessGroup; the hook takes None for it).
    hook = strategy.comm_hook(partial(allreduce_hook, None), ddp)  # type: ignore[arg-type]
    for technique in techniques:
        hook = technique.comm_hook(hook, ddp)
    if timer is not None:
        hook = timer.timed(hook)

    def lbt_comm_hook(state, bucket):  # DDP checks the annotation: none, or GradBucket
        return hook(bucket)

    ddp.register_comm_hook(None, lbt_comm_hook)


class StepRunner:
    """Runs the steps of one process: its passes, the gradient average, the techniques, the optimizer."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 techniques: list[Technique], strategy: StepStrategy, ctx: DistContext, precision: Precision,
                 fuse_workers: bool | str, compile_model: bool, timer: StepTimer):
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.techniques, self.strategy, self.ctx, self.precision = techniques, strategy, ctx, precision
        self.fuse_workers, self.timer = fuse_workers, timer
        self.has_batchnorm = any(isinstance(m, _BatchNorm) for m in model.modules())
        self.worker_norms: list[GhostBatchNorm] = []
        # A technique that stands in for the allreduce between simulated workers (gradient compression),
        # once `prepare` sees simulated workers.
        self.compression = next((t.simulated_comm for t in techniques if t.simulated_comm is not None), None)
        self.simulated_comm: Any = None
        self.prepared = False
        self.measurements = [t for t in techniques if t.worker_gradient_every]
        # Tensor parallelism: gradients averaged over the data-parallel ranks without DDP, after the passes.
        self.dp_gradients = DataParallelGradients(model, ctx.mesh["dp"].get_group(), ctx.dp_procs) \
            if ctx.tensor_parallel > 1 and not ctx.sharded else None
        self.ddp: DistributedDataParallel | None = None
        # Sharded (lbt/parallel/fsdp.py): FSDP's reduce-scatter averages the gradients over the data-parallel ranks.
        if ctx.distributed and self.dp_gradients is None and not ctx.sharded:
            self.ddp = wrap_ddp(model)
            register_comm_hook(self.ddp, strategy, techniques, timer)
        # The training forward: DDP's (or the model's), compiled when asked; evaluation and measurements run eager.
        trained: nn.Module = self.ddp or model
        self.forward: Callable[[torch.Tensor], torch.Tensor] = \
            compile_forward(trained, ctx.device, techniques) if compile_model else trained
        self.buffer_mean = BufferMean(model)
        self.after_backward: list[Technique | StepStrategy] = sorted([*techniques, strategy], key=lambda t: t.order)
        # A GPU's part under tensor parallelism (a sharded rank holds 1/D of it and moves all of it).
        self.gradient_bytes = BYTES_PER_FP32 * (replica_parameter_count(model) if ctx.sharded
                                                else local_parameter_count(model))
        self.bytes_sent = fsdp_bytes_sent if ctx.sharded else ring_bytes_sent

    def workers_per_pass(self, layout: BatchLayout) -> int:
        """How many of this layout's simulated workers of a process share a forward/backward pass."""
        if self.simulated_comm or self.ctx.sharded:  # each worker's gradient as its GPU would send it; a sharded
            return 1                                  # model's BatchNorm cannot be made per-worker after sharding
        return workers_per_pass(self.fuse_workers, layout.workers_per_proc, layout.per_worker_batch,
                                self.has_batchnorm, self.ctx.device.type)

    def prepare(self, layouts: tuple[BatchLayout, ...], current: BatchLayout) -> None:
        """Per-worker BatchNorm statistics once some epoch runs several workers in one pass (a pass of one
        worker through them is plain BatchNorm), at the current layout's per-worker batch."""
        if not self.prepared:  # decided by the run's first layouts
            self.prepared = True
            if any(layout.workers_per_proc > 1 for layout in layouts):
                self.simulated_comm = self.compression
        if not self.worker_norms and any(self.workers_per_pass(layout) > 1 for layout in layouts):
            self.worker_norms = per_worker_batchnorm(self.model, layouts[0].per_worker_batch)
        set_per_worker_batch(self.worker_norms, current.per_worker_batch)

    def step(self, state: LoopState, layout: BatchLayout, inputs: torch.Tensor, labels: torch.Tensor,
             samples_per_epoch: int, count_correct: bool = False) -> tuple[torch.Tensor, int]:
        """One optimizer step as the strategy runs it; returns this process's mean loss (a detached 0-d
        tensor) and, when `count_correct`, its number of correct predictions (else 0)."""
        def synchronous(x: torch.Tensor, y: torch.Tensor, of: BatchLayout) -> tuple[torch.Tensor, int]:
            def progress() -> Progress:  # after the backward: fp16's scale exists from the first scaled loss on
                return Progress(state.samples_seen, state.step, state.epoch, of.global_batch, samples_per_epoch,
                                self.precision.grad_scale)
            return self.synchronous_step(x, y, of, progress, count_correct)

        loss, correct = self.strategy.run_step(state.step, synchronous, inputs, labels, layout)
        if layout.world_size > 1:
            allreduces = self.strategy.allreduces_at(state.step)
            state.allreduces += allreduces
            state.bytes_sent += allreduces * self.bytes_sent(self.gradient_bytes, layout.world_size)
        return loss, correct

    def synchronous_step(self, inputs: torch.Tensor, labels: torch.Tensor, layout: BatchLayout,
                         progress: Callable[[], Progress], count_correct: bool) -> tuple[torch.Tensor, int]:
        """One synchronous SGD step over this process's virtual workers (the module docstring)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.measure_first_worker(inputs, labels, layout, progress().step)
        loss, correct = self.passes(inputs, labels, layout, count_correct)
        if self.dp_gradients is not None:
            self.timer.phase("comm")
            self.dp_gradients.average()
        # What a DDP hook saw is still scaled (fp16): the measurement that reads it divides by grad_scale.
        where = progress()
        self.precision.unscale(self.optimizer)  # fp16: true gradients from here on (clipping, trust ratios)
        for hook in self.after_backward:
            hook.after_backward(self.model, where)
        self.timer.phase("optimizer")
        self.precision.step(self.optimizer)
        return loss, correct

    def passes(self, inputs: torch.Tensor, labels: torch.Tensor, layout: BatchLayout,
               count_correct: bool) -> tuple[torch.Tensor, int]:
        """Forward and backward over the process's workers in passes; the gradient is their mean's."""
        workers, group = layout.workers_per_proc, self.workers_per_pass(layout)
        chunks = workers // group  # passes of `group` workers each (one worker per pass: the sequential path)
        passes = list(zip(inputs.chunk(chunks), labels.chunk(chunks))) if chunks > 1 else [(inputs, labels)]
        share = group / workers if chunks > 1 else 1.0
        if len(passes) > 1 and self.buffer_mean.active:
            self.buffer_mean.begin_step()
        loss_sum: torch.Tensor | None = None
        correct, sent = 0, None
        for i, (x, y) in enumerate(passes):
            last = i == len(passes) - 1
            # no_sync: earlier passes only accumulate gradients locally; the last backward lets DDP
            # allreduce the sum (or FSDP reduce-scatter it), once per step.
            if self.ctx.sharded:
                self.model.set_requires_gradient_sync(last)  # type: ignore[operator]  # FSDP's no_sync
            with nullcontext() if last or self.ddp is None else self.ddp.no_sync():
                with self.precision.autocast():
                    logits = self.forward(x)
                    loss = self.loss_fn(logits, y)
                # Each pass's mean loss weighs by its share of the k local workers; DDP's division by P
                # completes the mean over W workers.
                self.precision.backward(loss if share == 1 else loss * share)
            if self.simulated_comm:
                sent = self.simulated_comm.send(self.model, sent)  # what this worker's GPU would put on the wire
            if len(passes) > 1 and self.buffer_mean.active:
                self.buffer_mean.after_pass(share, last)
            weighted = loss.detach() if share == 1 else loss.detach() * share
            loss_sum = weighted if loss_sum is None else loss_sum + weighted
            if count_correct:
                correct += int((logits.argmax(1) == y).sum())
        if self.simulated_comm:
            self.simulated_comm.receive(self.model, sent)
        assert loss_sum is not None
        return loss_sum, correct

    def measure_first_worker(self, inputs: torch.Tensor, labels: torch.Tensor, layout: BatchLayout, step: int) -> None:
        """Worker 0's gradient on its own, for measurements (the gradient noise scale), at the steps they ask.

        Computed beside the step, not as part of it: a measurement never changes the run it measures,
        so .grad and the BatchNorm buffers are left as they were.
        """
        wanted = [t for t in self.measurements if step % (t.worker_gradient_every or 1) == 0]
        if layout.workers_per_proc == 1 or not wanted:
            return
        self.timer.phase("measure")  # its own phase: what a measurement costs shows in step_seconds
        b = layout.per_worker_batch
        params = [p for p in self.model.parameters() if p.requires_grad]
        buffers = [buffer.detach().clone() for buffer in self.model.buffers()]
        with self.precision.autocast():
            loss = self.loss_fn(self.model(inputs[:b]), labels[:b])
        grads = self.precision.unscaled(torch.autograd.grad(self.precision.scale(loss), params))
        for buffer, saved in zip(self.model.buffers(), buffers):
            buffer.copy_(saved)
        for technique in wanted:
            technique.on_worker_gradient(grads, b, layout.workers_per_proc)
        self.timer.phase("compute")
