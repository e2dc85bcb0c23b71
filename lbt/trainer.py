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
from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lbt.config import BatchPlan
from lbt.data.batches import StepBatches, eval_batches
from lbt.dist import BufferMean, DistContext, all_reduce_sum, average_buffers
from lbt.fused import per_worker_batchnorm, set_per_worker_batch
from lbt.metrics.tensorboard import RunLogger
from lbt.metrics.timing import StepTimer
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
    stopped: bool = False  # by SIGTERM/SIGINT, after a checkpoint; resume with trainer.resume=auto
    # (step, samples seen, global batch, val acc) after each epoch: steps-to-target comes from it
    val_history: list[list[float]] = field(default_factory=list)
    technique_metrics: dict[str, float] = field(default_factory=dict)
    # mean seconds per step: data, compute (forward+backward), comm (allreduce span), optimizer
    step_seconds: dict[str, float] = field(default_factory=dict)


@dataclass
class LoopSettings:
    total_steps: int
    total_samples: int
    seed: int = 0
    log_every: int = 10
    progress: bool = True
    eval_batch: int = 1024
    fuse_workers: bool = True
    checkpoint_every: int = 0  # epochs; 0 = only when stopped by a signal


def register_comm_hook(ddp: DistributedDataParallel, techniques: list[Technique], timer: StepTimer | None = None):
    """DDP's one communication hook: the allreduce, wrapped by each technique in order, then timed."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    hook = partial(allreduce_hook, None)  # None: the default process group
    for technique in techniques:
        hook = technique.comm_hook(hook, ddp)
    if timer is not None:
        hook = timer.timed(hook)

    def lbt_comm_hook(state, bucket):
        return hook(bucket)

    ddp.register_comm_hook(None, lbt_comm_hook)


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
        checkpointer=None,
    ):
        self.model = model
        self.worker_norms = []
        if settings.fuse_workers and any(p.world_size > ctx.procs for p in epoch_plans):
            self.worker_norms = per_worker_batchnorm(model, epoch_plans[0].per_worker_batch)
        self.ddp = model
        self.timer = StepTimer()
        if ctx.distributed:
            self.ddp = _wrap_ddp(model)
            register_comm_hook(self.ddp, techniques, self.timer)
        self.optimizer, self.loss_fn = optimizer, loss_fn
        self.techniques, self.base_lr = techniques, base_lr
        self.epoch_plans, self.ctx = epoch_plans, ctx
        self.train_set, self.val_set, self.test_set = datasets
        self.settings = settings
        self.log = logger or RunLogger(None)
        self.show_progress = settings.progress and ctx.is_main
        self.buffer_mean = BufferMean(model)
        self.wants_worker_gradient = any(t.wants_worker_gradient for t in techniques)
        self.checkpointer = checkpointer
        # Where the loop is; all of it goes into checkpoints.
        self.step = 0
        self.samples_seen = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.epoch_loss = torch.zeros(2, dtype=torch.float64)  # [sum of step losses, steps] over all processes
        self.result = Result()
        self.stop_requested = False

    # -- the loop -------------------------------------------------------------
    def fit(self) -> Result:
        result = self.result
        started = time.perf_counter()
        for epoch in range(self.epoch, len(self.epoch_plans)):
            if self.step >= self.settings.total_steps:
                break
            self.epoch, plan = epoch, self.epoch_plans[epoch]
            epoch_start = time.perf_counter()
            train_loss = self.train_epoch(epoch, plan)
            result.train_seconds += time.perf_counter() - epoch_start
            if result.stopped:
                self.save_checkpoint()
                self._say(f"stopped at step {self.step} (epoch {epoch + 1}, step {self.step_in_epoch} of it); "
                          "checkpoint saved: continue with trainer.resume=auto in the same run folder")
                return result
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
            self.epoch, self.step_in_epoch = epoch + 1, 0
            self.epoch_loss.zero_()
            every = self.settings.checkpoint_every
            if every and self.epoch % every == 0 and self.epoch < len(self.epoch_plans):
                self.save_checkpoint()
        if self.test_set is not None and not result.diverged:
            result.test_loss, result.test_acc = self.evaluate(self.test_set)
            self.log.scalars({"test/loss": result.test_loss, "test/acc": result.test_acc}, self.step,
                             self.samples_seen)
        result.best_val_acc = max((h[3] for h in result.val_history), default=float("nan"))
        result.steps, result.samples_seen = self.step, self.samples_seen
        result.wall_seconds = time.perf_counter() - started
        result.samples_per_sec = self.samples_seen / max(result.train_seconds, 1e-9)
        result.technique_metrics = self.technique_metrics()
        result.step_seconds = self.timer.run_means()
        return result

    def train_epoch(self, epoch: int, plan: BatchPlan) -> float:
        """Train (the rest of) one epoch at `plan`'s batch sizes; return its mean loss over all workers."""
        self.model.train()
        if self.step_in_epoch == 0:
            for technique in self.techniques:
                technique.on_epoch_start(epoch, self.model)
        set_per_worker_batch(self.worker_norms, plan.per_worker_batch)
        workers_per_proc = plan.world_size // self.ctx.procs
        batches = StepBatches(
            self.train_set, plan.world_size, plan.per_worker_batch, self.ctx.rank * workers_per_proc,
            workers_per_proc, self.settings.seed, self.ctx.device,
        )
        steps = min(batches.steps_per_epoch - self.step_in_epoch, self.settings.total_steps - self.step)
        bar = self._bar(epoch, batches.steps_per_epoch, self.step_in_epoch)
        # The window's losses stay on the device until a log step: reading a
        # loss every step would make the host wait for the device every step.
        window_losses: list[torch.Tensor] = []
        window_start = data_start = time.perf_counter()
        for i, (inputs, labels) in enumerate(batches.epoch(epoch, self.step_in_epoch)):
            if i == steps:
                break
            self.timer.add("data", time.perf_counter() - data_start)
            progress = self.progress(epoch, plan)
            lr = self.set_lr(progress)
            log_now = (self.step + 1) % self.settings.log_every == 0 or i == steps - 1
            loss, correct = self.train_step(inputs, labels, workers_per_proc, progress,
                                            count_correct=log_now and bar is not None)
            self.timer.end_step()
            self.step += 1
            self.step_in_epoch += 1
            self.samples_seen += plan.global_batch
            window_losses.append(loss)
            if log_now:
                window_steps = len(window_losses)
                window = torch.tensor([torch.stack(window_losses).sum().item(), window_steps,
                                       float(self.stop_requested)], dtype=torch.float64)
                # Summed over processes at a cadence every rank agrees on, so all
                # of them see the same loss (and stop request) and act together.
                all_reduce_sum(window, self.ctx)
                mean_loss = window[0].item() / window[1].item()
                samples_per_sec = window_steps * plan.global_batch / (time.perf_counter() - window_start)
                self.log.scalars(
                    {"train/loss": mean_loss, "train/lr": lr, "train/global_batch": plan.global_batch,
                     "perf/samples_per_sec": samples_per_sec, **self.timer.window_means(),
                     **self.technique_metrics()},
                    self.step, self.samples_seen,
                )
                self.epoch_loss += window[:2]
                stop = window[2].item() > 0
                window_losses.clear()
                window_start = time.perf_counter()
                if bar is not None:
                    local_acc = correct / (plan.per_worker_batch * workers_per_proc)
                    bar.set_postfix(loss=f"{mean_loss:.4f}", acc=f"{local_acc:.3f}", sps=f"{samples_per_sec:,.0f}")
                if not math.isfinite(mean_loss):
                    break
                if stop and i < steps - 1:
                    self.result.stopped = True
                    break
            if bar is not None:
                bar.update()
            data_start = time.perf_counter()
        if bar is not None:
            bar.close()
        return self.epoch_loss[0].item() / max(self.epoch_loss[1].item(), 1.0)

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

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor, workers: int, progress: Progress,
                   count_correct: bool = False) -> tuple[torch.Tensor, int]:
        """One synchronous SGD step over this process's `workers` virtual workers.

        Returns this process's mean loss (a detached 0-d tensor) and, when
        `count_correct`, its number of correct predictions (else 0).
        """
        self.optimizer.zero_grad(set_to_none=True)
        compute_start = time.perf_counter()
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
        loss_sum, correct = None, 0
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
                (loss if share == 1 else loss * share).backward()
            if split_buffers:
                self.buffer_mean.after_pass(share, last)
            if i == 0 and len(passes) > 1 and self.wants_worker_gradient:
                for technique in self.techniques:
                    technique.on_worker_gradient(self.model, len(pass_labels), workers)
            weighted = loss.detach() if share == 1 else loss.detach() * share
            loss_sum = weighted if loss_sum is None else loss_sum + weighted
            if count_correct:
                correct += int((logits.argmax(1) == pass_labels).sum())
        for technique in self.techniques:
            technique.after_backward(self.model, progress)
        optimizer_start = time.perf_counter()
        self.timer.add("compute", optimizer_start - compute_start)
        self.optimizer.step()
        self.timer.add("optimizer", time.perf_counter() - optimizer_start)
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
    def _bar(self, epoch: int, steps: int, done: int):
        if not self.show_progress:
            return None
        from tqdm import tqdm

        return tqdm(total=steps, initial=done, desc=f"epoch {epoch + 1}/{len(self.epoch_plans)}", unit="step",
                    leave=False, dynamic_ncols=True)

    # -- checkpoints ----------------------------------------------------------
    def save_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        from lbt.checkpoint import rng_state

        loop = {"step": self.step, "samples_seen": self.samples_seen, "epoch": self.epoch,
                "step_in_epoch": self.step_in_epoch, "epoch_loss": self.epoch_loss.clone(),
                "result": {k: v for k, v in vars(self.result).items() if k not in ("stopped", "step_seconds")}}
        main = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "loop": loop,
                "techniques": {t.name: t.state_dict() for t in self.techniques}}
        own = {"buffers": {k: v.detach().clone() for k, v in self.model.named_buffers()}, "rng": rng_state()}
        self.checkpointer.save(self.step, main, own)
        self.log.flush()

    def load_checkpoint(self, main: dict, own: dict) -> None:
        from lbt.checkpoint import set_rng_state

        self.model.load_state_dict(main["model"])
        buffers = dict(self.model.named_buffers())
        for name, value in own["buffers"].items():  # this rank's own BN statistics
            buffers[name].copy_(value)
        self.optimizer.load_state_dict(main["optimizer"])
        loop = main["loop"]
        self.step, self.samples_seen = loop["step"], loop["samples_seen"]
        self.epoch, self.step_in_epoch = loop["epoch"], loop["step_in_epoch"]
        self.epoch_loss = loop["epoch_loss"].clone()
        for key, value in loop["result"].items():
            setattr(self.result, key, value)
        for technique in self.techniques:
            technique.load_state_dict(main["techniques"].get(technique.name, {}))
        set_rng_state(own["rng"])

    def _say(self, line: str) -> None:
        if self.ctx.is_main:
            print(line, flush=True)
