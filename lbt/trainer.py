"""The training loop: fit() -> train_step() / evaluate().

One optimizer step of synchronous data-parallel SGD over `world_size` W
workers, run by `procs` P processes that each simulate k = W/P workers:

    for each local worker i (k of them, one after another):
        loss_i = mean loss over its per_worker_batch samples  # BN sees b samples, as on a GPU
        (loss_i / k).backward()    # under no_sync() except for the last worker
    DDP averages the summed gradients over the P processes
    -> gradient = mean over W workers = mean over the global batch
    optimizer.step()
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
from lbt.data.batches import StepBatches, WorkerBatches, eval_batches
from lbt.dist import BufferMean, DistContext, all_reduce_sum, average_buffers
from lbt.metrics.tensorboard import RunLogger


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
    val_acc_history: list[float] = field(default_factory=list)


def _wrap_ddp(model: nn.Module) -> DistributedDataParallel:
    # Buffers stay per process during training (no broadcast from rank 0 at each
    # forward); newer torch names this forward_sync_buffers.
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return DistributedDataParallel(model, forward_sync_buffers=False)
    return DistributedDataParallel(model, broadcast_buffers=False)


class Trainer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_at: Callable[[int], float],
        plan: BatchPlan,
        ctx: DistContext,
        train_batches: StepBatches,
        val_set,
        test_set=None,
        logger: RunLogger | None = None,
        epochs: int = 1,
        total_steps: int | None = None,
        log_every: int = 10,
        progress: bool = True,
        loss_fn: nn.Module | None = None,
    ):
        self.model = model.to(ctx.device)
        # broadcast_buffers=False: each process keeps its own BN running stats and
        # they are averaged at evaluation (average_buffers), exactly like the
        # simulated workers of one process (BufferMean).
        self.ddp = _wrap_ddp(model) if ctx.distributed else model
        self.optimizer = optimizer
        self.lr_at = lr_at  # samples seen -> learning rate
        self.plan = plan
        self.ctx = ctx
        self.train_batches = train_batches
        self.val_set, self.test_set = val_set, test_set
        self.log = logger or RunLogger(None)
        self.epochs = epochs
        self.total_steps = total_steps or epochs * train_batches.steps_per_epoch
        self.log_every = log_every
        self.progress = progress and ctx.is_main
        self.loss_fn = loss_fn or nn.CrossEntropyLoss()
        self.buffer_mean = BufferMean(model)
        self.step = 0
        self.samples_seen = 0

    # -- the loop -------------------------------------------------------------
    def fit(self) -> Result:
        result = Result()
        started = time.perf_counter()
        for epoch in range(self.epochs):
            if self.step >= self.total_steps:
                break
            epoch_start = time.perf_counter()
            train_loss, diverged = self.train_epoch(epoch)
            result.train_seconds += time.perf_counter() - epoch_start
            result.final_train_loss = train_loss
            if diverged:
                result.diverged = True
                self._say(f"epoch {epoch + 1}: loss is {train_loss}; the run diverged, stopping early")
                break
            val_loss, val_acc = self.evaluate(self.val_set)
            result.final_val_loss, result.final_val_acc = val_loss, val_acc
            result.val_acc_history.append(val_acc)
            self.log.scalars({"val/loss": val_loss, "val/acc": val_acc}, self.step, self.samples_seen)
            self._say(
                f"epoch {epoch + 1}/{self.epochs} step {self.step} train_loss={train_loss:.4f} "
                f"val_loss={val_loss:.4f} val_acc={val_acc:.4f}"
            )
        if self.test_set is not None and not result.diverged:
            result.test_loss, result.test_acc = self.evaluate(self.test_set)
        result.best_val_acc = max(result.val_acc_history, default=float("nan"))
        result.steps, result.samples_seen = self.step, self.samples_seen
        result.wall_seconds = time.perf_counter() - started
        result.samples_per_sec = self.samples_seen / max(result.train_seconds, 1e-9)
        return result

    def train_epoch(self, epoch: int) -> tuple[float, bool]:
        """Train one epoch; return its mean train loss (over all workers) and whether it diverged."""
        self.model.train()
        steps_left = min(self.train_batches.steps_per_epoch, self.total_steps - self.step)
        bar = self._bar(epoch, steps_left)
        epoch_loss = torch.zeros(2)  # [sum of per-step mean losses, steps], summed over processes at the end
        window = torch.zeros(2)
        window_start = time.perf_counter()
        for i, worker_batches in enumerate(self.train_batches.epoch(epoch)):
            if i == steps_left:
                break
            lr = self.set_lr()
            loss, correct = self.train_step(worker_batches)
            self.step += 1
            self.samples_seen += self.plan.global_batch
            window += torch.tensor([loss, 1.0])
            if self.step % self.log_every == 0 or i == steps_left - 1:
                # The loss is summed over processes at a cadence every rank agrees
                # on, so all of them see the same value and stop together on NaN.
                steps_in_window = window[1].item()
                all_reduce_sum(window, self.ctx)  # [loss sum, steps] summed over processes
                mean_loss = window[0].item() / window[1].item()
                samples_per_sec = steps_in_window * self.plan.global_batch / (time.perf_counter() - window_start)
                self.log.scalars(
                    {"train/loss": mean_loss, "train/lr": lr, "train/global_batch": self.plan.global_batch,
                     "perf/samples_per_sec": samples_per_sec},
                    self.step, self.samples_seen,
                )
                epoch_loss += window
                window.zero_()
                window_start = time.perf_counter()
                if bar is not None:
                    local_acc = correct / (self.plan.per_worker_batch * self.ctx.workers_per_proc)
                    bar.set_postfix(loss=f"{mean_loss:.4f}", acc=f"{local_acc:.3f}", sps=f"{samples_per_sec:,.0f}")
                if not math.isfinite(mean_loss):
                    break
            if bar is not None:
                bar.update()
        if bar is not None:
            bar.close()
        mean = epoch_loss[0].item() / max(epoch_loss[1].item(), 1.0)
        return mean, not math.isfinite(mean)

    def set_lr(self) -> float:
        # LR is a function of samples seen, never of a hidden step counter.
        lr = self.lr_at(self.samples_seen)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def train_step(self, worker_batches: WorkerBatches) -> tuple[float, int]:
        """One synchronous SGD step over this process's virtual workers."""
        workers = len(worker_batches)
        self.optimizer.zero_grad(set_to_none=True)
        if workers > 1 and self.buffer_mean.active:
            self.buffer_mean.begin_step()
        loss_sum, correct = 0.0, 0
        for i, (inputs, labels) in enumerate(worker_batches):
            last = i == workers - 1
            # no_sync: the first k-1 workers only accumulate gradients locally;
            # the last backward lets DDP allreduce the sum once per step.
            sync = nullcontext() if last or not self.ctx.distributed else self.ddp.no_sync()
            with sync:
                logits = self.ddp(inputs)
                loss = self.loss_fn(logits, labels)
                # 1/k: the k local workers' mean losses average to the process's
                # share; DDP's division by P completes the mean over W workers.
                (loss / workers).backward()
            if workers > 1 and self.buffer_mean.active:
                self.buffer_mean.after_worker(last, workers)
            loss_sum += loss.item()
            correct += int((logits.argmax(1) == labels).sum())
        self.optimizer.step()
        return loss_sum / workers, correct

    @torch.no_grad()
    def evaluate(self, dataset) -> tuple[float, float]:
        """Loss and top-1 accuracy over a whole dataset, shared out over processes."""
        average_buffers(self.model, self.ctx)
        self.model.eval()
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
        for inputs, labels in eval_batches(dataset, self.ctx.rank, self.ctx.procs, 1024, self.ctx.device):
            logits = self.model(inputs)
            totals[0] += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            totals[1] += (logits.argmax(1) == labels).sum().item()
            totals[2] += len(labels)
        all_reduce_sum(totals, self.ctx)
        self.model.train()
        return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()

    # -- output ---------------------------------------------------------------
    def _bar(self, epoch: int, steps: int):
        if not self.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=steps, desc=f"epoch {epoch + 1}/{self.epochs}", unit="step", leave=False, dynamic_ncols=True)

    def _say(self, line: str) -> None:
        if self.ctx.is_main:
            print(line, flush=True)
