"""The training loop: fit() -> train_epoch() -> train_step(), and evaluate().

One optimizer step of synchronous data-parallel SGD over `world_size` W
workers, run by `procs` P processes that each simulate k = W/P workers.
Fused (default, see lbt/fused.py): one forward/backward over the k*b samples
with BatchNorm statistics per worker chunk. Sequential (dist.fuse_workers=false):

    for each local worker i (k of them, one after another):
        loss_i = mean loss over its per_worker_batch samples  # BN sees b samples, as on a GPU
        (loss_i / k).backward()    # under no_sync() except for the last worker
    DDP averages the summed gradients over the P processes
    -> gradient = mean over W workers = mean over the global batch
    techniques' after_backward (clipping, measurements); optimizer.step()

Techniques hook in at the points listed in lbt/techniques/base.py.
"""

from __future__ import annotations

import inspect
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lbt.config import BatchPlan
from lbt.data.batches import StepBatches, eval_batches
from lbt.dist import BufferMean, DistContext, all_reduce_sum, average_buffers
from lbt.fused import per_worker_batchnorm, set_per_worker_batch
from lbt.metrics.tensorboard import RunLogger
from lbt.techniques.base import Progress, Technique, learning_rate


@dataclass
class Result:
    """What a run reports; result.json holds it with the resolved config."""

    final_val_acc: float = float("nan")
    best_val_acc: float = float("nan")
    final_val_loss: float = float("nan")
    final_train_loss: float = float("nan")
    test_acc: float | None = None
    test_loss: float | None = None
    steps: int = 0
    samples_seen: int = 0
    train_seconds: float = 0.0
    wall_seconds: float = 0.0
    samples_per_sec: float = 0.0
    diverged: bool = False
    # (step, samples seen, global batch, val acc) after each epoch: steps-to-target comes from it
    val_history: list[list[float]] = field(default_factory=list)
    technique_metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LoopSettings:
    total_steps: int
    total_samples: int
    seed: int = 0
    log_every: int = 10
    progress: bool = True
    eval_batch: int = 1024
    fuse_workers: bool = True


def _wrap_ddp(model: nn.Module) -> DistributedDataParallel:
    # Buffers stay per process during training (no broadcast from rank 0 at each
    # forward) and are averaged at evaluation; newer torch names this forward_sync_buffers.
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return DistributedDataParallel(model, forward_sync_buffers=False)
    return DistributedDataParallel(model, broadcast_buffers=False)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable,
        techniques: list[Technique],
        base_lr: float,
        epoch_plans: list[BatchPlan],
        ctx: DistContext,
        datasets: tuple,  # (train, val, test or None)
        settings: LoopSettings,
        logger: RunLogger | None = None,
    ):
        self.model = model
        self.worker_norms = []
        if settings.fuse_workers and any(p.world_size > ctx.procs for p in epoch_plans):
            self.worker_norms = per_worker_batchnorm(model, epoch_plans[0].per_worker_batch)
        self.ddp = model
        if ctx.distributed:
            self.ddp = _wrap_ddp(model)
            for technique in techniques:
                technique.on_ddp(self.ddp)
        self.optimizer, self.loss_fn = optimizer, loss_fn
        self.techniques, self.base_lr = techniques, base_lr
        self.epoch_plans, self.ctx = epoch_plans, ctx
        self.train_set, self.val_set, self.test_set = datasets
        self.settings = settings
        self.log = logger or RunLogger(None)
        self.show_progress = settings.progress and ctx.is_main
        self.buffer_mean = BufferMean(model)
        self.wants_worker_gradient = any(t.wants_worker_gradient for t in techniques)
        self.step = 0
        self.samples_seen = 0

    # -- the loop -------------------------------------------------------------
    def fit(self) -> Result:
        result = Result()
        started = time.perf_counter()
        for epoch, plan in enumerate(self.epoch_plans):
            if self.step >= self.settings.total_steps:
                break
            epoch_start = time.perf_counter()
            train_loss = self.train_epoch(epoch, plan)
            result.train_seconds += time.perf_counter() - epoch_start
            result.final_train_loss = train_loss
            if not math.isfinite(train_loss):
                result.diverged = True
                self._say(f"epoch {epoch + 1}: train loss is {train_loss}; the run diverged, stopping early")
                break
            val_loss, val_acc = self.evaluate(self.val_set)
            result.final_val_loss, result.final_val_acc = val_loss, val_acc
            result.val_history.append([self.step, self.samples_seen, plan.global_batch, val_acc])
            self.log.scalars({"val/loss": val_loss, "val/acc": val_acc}, self.step, self.samples_seen)
            self._say(
                f"epoch {epoch + 1}/{len(self.epoch_plans)} step {self.step} train_loss={train_loss:.4f} "
                f"val_loss={val_loss:.4f} val_acc={val_acc:.4f}"
            )
        if self.test_set is not None and not result.diverged:
            result.test_loss, result.test_acc = self.evaluate(self.test_set)
        result.best_val_acc = max((h[3] for h in result.val_history), default=float("nan"))
        result.steps, result.samples_seen = self.step, self.samples_seen
        result.wall_seconds = time.perf_counter() - started
        result.samples_per_sec = self.samples_seen / max(result.train_seconds, 1e-9)
        result.technique_metrics = self.technique_metrics()
        return result

    def train_epoch(self, epoch: int, plan: BatchPlan) -> float:
        """Train one epoch at `plan`'s batch sizes; return its mean loss over all workers."""
        self.model.train()
        for technique in self.techniques:
            technique.on_epoch_start(epoch, self.model)
        set_per_worker_batch(self.worker_norms, plan.per_worker_batch)
        workers_per_proc = plan.world_size // self.ctx.procs
        batches = StepBatches(
            self.train_set, plan.world_size, plan.per_worker_batch, self.ctx.rank * workers_per_proc,
            workers_per_proc, self.settings.seed, self.ctx.device,
        )
        steps = min(batches.steps_per_epoch, self.settings.total_steps - self.step)
        bar = self._bar(epoch, steps)
        epoch_loss = torch.zeros(2, dtype=torch.float64)  # [sum of step losses, steps] over all processes
        window = torch.zeros(2, dtype=torch.float64)
        window_start = time.perf_counter()
        for i, (inputs, labels) in enumerate(batches.epoch(epoch)):
            if i == steps:
                break
            progress = self.progress(epoch, plan)
            lr = self.set_lr(progress)
            loss, correct = self.train_step(inputs, labels, workers_per_proc, progress)
            self.step += 1
            self.samples_seen += plan.global_batch
            window += torch.tensor([loss, 1.0], dtype=torch.float64)
            if self.step % self.settings.log_every == 0 or i == steps - 1:
                local_steps = window[1].item()
                # Summed over processes at a cadence every rank agrees on, so all
                # of them see the same loss and stop together if it is NaN.
                all_reduce_sum(window, self.ctx)
                mean_loss = window[0].item() / window[1].item()
                samples_per_sec = local_steps * plan.global_batch / (time.perf_counter() - window_start)
                self.log.scalars(
                    {"train/loss": mean_loss, "train/lr": lr, "train/global_batch": plan.global_batch,
                     "perf/samples_per_sec": samples_per_sec, **self.technique_metrics()},
                    self.step, self.samples_seen,
                )
                epoch_loss += window
                window.zero_()
                window_start = time.perf_counter()
                if bar is not None:
                    local_acc = correct / (plan.per_worker_batch * workers_per_proc)
                    bar.set_postfix(loss=f"{mean_loss:.4f}", acc=f"{local_acc:.3f}", sps=f"{samples_per_sec:,.0f}")
                if not math.isfinite(mean_loss):
                    break
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        return epoch_loss[0].item() / max(epoch_loss[1].item(), 1.0)

    def progress(self, epoch: int, plan: BatchPlan) -> Progress:
        return Progress(
            samples_seen=self.samples_seen, step=self.step, epoch=epoch, global_batch=plan.global_batch,
            base_global_batch=self.epoch_plans[0].global_batch, samples_per_epoch=len(self.train_set),
            total_samples=self.settings.total_samples,
        )

    def set_lr(self, progress: Progress) -> float:
        # LR is a function of samples seen, never of a hidden step counter.
        lr, _ = learning_rate(self.base_lr, self.techniques, progress)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor, workers: int, progress: Progress):
        """One synchronous SGD step over this process's `workers` virtual workers.

        Returns this process's mean loss and its number of correct predictions.
        """
        self.optimizer.zero_grad(set_to_none=True)
        if workers > 1 and self.wants_worker_gradient:
            # The first worker alone (its BN statistics and gradient its own),
            # so a technique can read one worker's gradient, then the others.
            b = len(labels) // workers
            passes = [(inputs[:b], labels[:b], 1), (inputs[b:], labels[b:], workers - 1)]
        elif workers > 1 and not self.worker_norms:
            passes = [(x, y, 1) for x, y in zip(inputs.chunk(workers), labels.chunk(workers))]
        else:
            passes = [(inputs, labels, workers)]  # one worker, or fused workers
        split_buffers = len(passes) > 1 and self.buffer_mean.active
        if split_buffers:
            self.buffer_mean.begin_step()
        loss_sum, correct = 0.0, 0
        for i, (pass_inputs, pass_labels, pass_workers) in enumerate(passes):
            last = i == len(passes) - 1
            share = pass_workers / workers
            # no_sync: earlier passes only accumulate gradients locally; the
            # last backward lets DDP allreduce the sum, once per step.
            sync = nullcontext() if last or not self.ctx.distributed else self.ddp.no_sync()
            with sync:
                logits = self.ddp(pass_inputs)
                loss = self.loss_fn(logits, pass_labels)
                # Each pass's mean loss weighs by its share of the k local
                # workers; DDP's division by P completes the mean over W workers.
                (loss * share).backward()
            if split_buffers:
                self.buffer_mean.after_pass(share, last)
            if i == 0 and len(passes) > 1 and self.wants_worker_gradient:
                for technique in self.techniques:
                    technique.on_worker_gradient(self.model, len(pass_labels), workers)
            loss_sum += loss.item() * share
            correct += int((logits.argmax(1) == pass_labels).sum())
        for technique in self.techniques:
            technique.after_backward(self.model, progress)
        self.optimizer.step()
        return loss_sum, correct

    def technique_metrics(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for technique in self.techniques:
            metrics.update(technique.metrics())
        return metrics

    @torch.no_grad()
    def evaluate(self, dataset) -> tuple[float, float]:
        """Loss and top-1 accuracy over a whole dataset, shared out over processes."""
        average_buffers(self.model, self.ctx)
        for technique in self.techniques:
            technique.before_eval(self.model)
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        batches = eval_batches(dataset, self.ctx.rank, self.ctx.procs, self.settings.eval_batch, self.ctx.device)
        for inputs, labels in batches:
            logits = self.model(inputs)
            totals[0] += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            totals[1] += (logits.argmax(1) == labels).sum().item()
            totals[2] += len(labels)
        all_reduce_sum(totals, self.ctx)
        self.model.train()
        return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()

    # -- output ---------------------------------------------------------------
    def _bar(self, epoch: int, steps: int):
        if not self.show_progress:
            return None
        from tqdm import tqdm

        return tqdm(total=steps, desc=f"epoch {epoch + 1}/{len(self.epoch_plans)}", unit="step", leave=False,
                    dynamic_ncols=True)

    def _say(self, line: str) -> None:
        if self.ctx.is_main:
            print(line, flush=True)
