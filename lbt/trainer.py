"""The training loop: fit() -> train_epoch() -> train_step(), and evaluate().

One optimizer step of synchronous data-parallel SGD over `world_size` W
workers, run by `procs` P processes that each simulate k = W/P workers.
The k workers run in passes of g workers each (lbt/fused.py: workers_per_pass; g = k
fuses them all, g = 1 is the sequential path of dist.fuse_workers=false), BatchNorm
statistics per worker chunk of a pass:

    for each pass i (k/g of them, one after another):
        loss_i = mean loss over its g x per_worker_batch samples  # BN sees b samples, as on a GPU
        (loss_i x g/k).backward()    # under no_sync() except for the last pass
    DDP averages the summed gradients over the P processes
    -> gradient = mean over W workers = mean over the global batch
    techniques' after_backward (delay, clipping, measurements); optimizer.step()

Local SGD between simulated workers (lbt/techniques/local_sgd.py) runs that
step once per worker instead, each on its own model and its b samples.

With tensor parallelism (lbt/tensor_parallel.py) each "process" above is a group of T
processes that read the same samples and split the dense layers; the gradients are
averaged over the groups after the passes, without DDP.

Forward and loss run under trainer.precision's autocast; with fp16 the
gradients are unscaled before the techniques and the optimizer read them
(lbt/accel.py).

Techniques hook in at the points listed in lbt/techniques/base.py.
"""

from __future__ import annotations

import inspect
import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Callable

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

from lbt.accel import Precision, compile_forward, memory_format
from lbt.checkpoint import rng_state, set_rng_state
from lbt.config import BatchPlan, Budget
from lbt.data import DataSplits
from lbt.data.batches import StepBatches, eval_batches
from lbt.dist import BufferMean, DistContext, all_reduce_sum, average_buffers
from lbt.fused import per_worker_batchnorm, set_per_worker_batch, workers_per_pass
from lbt.lr import Schedule, optimizer_settings, peak
from lbt.metrics.tensorboard import RunLogger
from lbt.metrics.text_log import say
from lbt.metrics.window import TrainWindow
from lbt.metrics.timing import StepTimer
from lbt.objective import ACC, LOSS
from lbt.plan import BYTES_PER_FP32, ring_bytes_sent
from lbt.techniques.base import Progress, Technique
from lbt.tensor_parallel import DataParallelGradients, full_tensors, load_full_state, local_parameter_count


@dataclass
class EvalPoint:
    """One evaluation of the held-out split during training (steps-to-target is read from these)."""

    step: int
    samples_seen: int
    global_batch: int
    acc: float
    loss: float


@dataclass
class Result:
    """What a run reports; result.json holds it (see `summary`) with the resolved config."""

    # The split evaluated during training: "val", or "test" when the run holds out no validation split.
    eval_split: str = "val"
    final_acc: float = float("nan")  # on eval_split
    best_acc: float = float("nan")
    final_loss: float = float("nan")
    best_loss: float = float("nan")
    final_train_loss: float = float("nan")
    test_acc: float | None = None  # the test split, once, at the end
    test_loss: float | None = None
    steps: int = 0
    samples_seen: int = 0
    train_seconds: float = 0.0
    eval_seconds: float = 0.0  # evaluating the held-out split during training (not in train_seconds)
    wall_seconds: float = 0.0
    samples_per_sec: float = 0.0
    diverged: bool = False
    stopped: bool = False  # by SIGTERM/SIGINT, after a checkpoint; resume with trainer.resume=auto
    history: list[EvalPoint] = field(default_factory=list)
    technique_metrics: dict[str, float] = field(default_factory=dict)
    technique_curves: dict[str, list[list[float]]] = field(default_factory=dict)  # name -> [[samples, value]]
    # mean seconds per step: data, compute (forward+backward), comm (allreduce span), optimizer
    step_seconds: dict[str, float] = field(default_factory=dict)
    # Model-sized allreduces (gradients, or local SGD's parameter averages) and the bytes each worker
    # sent for them (ring allreduce of fp32 values): what the run paid in communication.
    allreduces: int = 0
    bytes_sent: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> Result:
        return cls(**{**values, "history": [EvalPoint(**point) for point in values["history"]]})

    def summary(self) -> dict:
        """result.json's fields, each named after the split it was measured on: a val-named
        field never holds test data (final_val_acc, val_history; final_test_acc, test_history)."""
        values, split = self.to_dict(), self.eval_split
        for key in ("final_acc", "best_acc", "final_loss", "best_loss"):
            values[key.replace("_", f"_{split}_", 1)] = values.pop(key)
        values[f"{split}_history"] = values.pop("history")
        return values


@dataclass
class LoopState:
    """Where the loop is: all of it goes into checkpoints."""

    step: int = 0
    samples_seen: int = 0
    epoch: int = 0
    step_in_epoch: int = 0
    epoch_loss_sum: float = 0.0  # the epoch's step losses so far, summed over steps and processes
    epoch_loss_count: int = 0  # steps x processes in that sum
    allreduces: int = 0  # see Result.allreduces
    bytes_sent: float = 0.0


@dataclass
class LoopSettings:
    seed: int = 0
    log_every: int = 10
    progress: bool = True
    eval_batch: int = 1024
    evals: int = 20  # evaluations spaced log-uniformly in samples seen, besides those at epoch ends
    fuse_workers: bool | str = "auto"  # see lbt/fused.py: workers_per_pass
    checkpoint_every: int = 0  # epochs; 0 = only when stopped by a signal
    compile: bool = False  # torch.compile the training forward
    channels_last: bool = False  # inputs (and the model, lbt/train.py) in channels_last layout
    loader_workers: int = 0  # DataLoader worker processes, for datasets read sample by sample


def evaluation_steps(budget: Budget, evals: int) -> frozenset[int]:
    """Steps (counted as done) after which to evaluate: every epoch's end, and `evals` points
    log-spaced in samples seen from the first step to the end, so steps-to-target is resolved at
    every batch size (at batch 64 an epoch is ~940 steps; at 8,192 the run is 70)."""
    ends, done = set(), 0
    for steps in budget.steps:
        done += steps
        if steps:
            ends.add(done)
    first, total = budget.plans[0].global_batch, budget.total_samples
    spaced = (first * (total / first) ** (i / max(evals - 1, 1)) for i in range(evals)) if evals else ()
    return frozenset(ends | {budget.step_boundary(samples)[0] for samples in spaced} - {0})


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
    state: LoopState
    result: Result
    stop_requested: bool  # set by SIGTERM/SIGINT (lbt.train.stop_on_signals)
    on_step: Callable[[int], None] | None  # told each finished step (the local launcher's record of progress)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable,
                 techniques: list[Technique], schedule: Schedule, budget: Budget, data: DataSplits,
                 ctx: DistContext, settings: LoopSettings, logger: RunLogger | None = None, checkpointer=None,
                 precision: Precision | None = None):
        self.model, self.optimizer, self.loss_fn, self.techniques = model, optimizer, loss_fn, techniques
        self.precision = precision or Precision("fp32", ctx.device.type)
        self.schedule, self.budget, self.data, self.ctx, self.settings = schedule, budget, data, ctx, settings
        self.log = logger or RunLogger(None)
        self.checkpointer = checkpointer
        self.worker_norms = []
        # Fused: one pass over the process's workers (lbt/fused.py), a few, or one per worker (workers_per_pass).
        self.has_batchnorm = any(isinstance(m, _BatchNorm) for m in model.modules())
        # A technique that stands in for the allreduce between simulated workers (gradient compression).
        self.simulated_comm = next((t.simulated_comm for t in techniques if t.simulated_comm is not None), None) \
            if any(p.workers_per_proc > 1 for p in budget.plans) else None
        self.fuse_simulated_workers(budget)
        self.ddp, self.timer = model, StepTimer(ctx.device)
        # Tensor parallelism (lbt/tensor_parallel.py): gradients averaged over the data-parallel ranks
        # without DDP, after the step's passes.
        self.dp_gradients = DataParallelGradients(model, ctx.mesh["dp"].get_group(), ctx.dp_procs) \
            if ctx.tensor_parallel > 1 else None
        if ctx.distributed and self.dp_gradients is None:
            self.ddp = _wrap_ddp(model)
            register_comm_hook(self.ddp, techniques, self.timer)
        # The training forward: DDP's (or the model's), compiled when asked; evaluation and measurements run eager.
        self.forward = compile_forward(self.ddp, ctx.device, techniques) if settings.compile else self.ddp
        self.memory_format = memory_format(settings.channels_last)
        self.step_batches: dict[BatchPlan, StepBatches] = {}  # one per batch layout: its DataLoader lives on
        self.buffer_mean = BufferMean(model)
        self.lr_follows_batch = any(t.lr_follows_batch for t in techniques)
        # Log every log_every steps, at each epoch's end, and at the step that takes the peak LR.
        peak_step = budget.step_boundary(peak(schedule, budget)[1])[0]
        self.window = TrainWindow(settings.log_every, peak_step)
        # The held-out split evaluated while training: val, or test when there is no validation split.
        self.eval_split, self.eval_set = ("val", data.val) if data.val is not None else ("test", data.test)
        self.eval_steps = evaluation_steps(budget, settings.evals)
        self.gradient_bytes = BYTES_PER_FP32 * local_parameter_count(model)  # a GPU's part under tensor parallelism
        self.state, self.result, self.stop_requested = LoopState(), Result(self.eval_split), False
        self.on_step = None

    def workers_per_pass(self, plan: BatchPlan) -> int:
        """How many of this layout's simulated workers of a process share a forward/backward pass."""
        if self.simulated_comm:  # each worker's gradient goes through what its GPU would send
            return 1
        return workers_per_pass(self.settings.fuse_workers, plan.workers_per_proc, plan.per_worker_batch,
                                self.has_batchnorm, self.ctx.device.type)

    def fuse_simulated_workers(self, budget: Budget) -> None:
        """Per-worker BatchNorm statistics, once some epoch runs several workers per process in one pass
        (a pass of one worker through them is plain BatchNorm)."""
        if not self.worker_norms and any(self.workers_per_pass(p) > 1 for p in budget.plans):
            self.worker_norms = per_worker_batchnorm(self.model, budget.plans[0].per_worker_batch)

    def set_budget(self, budget: Budget) -> None:
        """Continue under other batch layouts for the epochs to come (an automatic batch ramp decided them):
        the LR decay ends with the new last step, evaluations are spaced over the new steps."""
        self.budget = budget
        self.schedule = replace(self.schedule, total_samples=budget.total_samples)
        self.eval_steps = evaluation_steps(budget, self.settings.evals)
        self.fuse_simulated_workers(budget)

    # -- the loop -------------------------------------------------------------
    def fit(self) -> Result:
        """Epochs until the budget is spent, the loss diverges or a signal asks to stop."""
        started = time.perf_counter()
        while self.state.step < self.budget.total_steps:
            epoch_start, evaluating = time.perf_counter(), self.result.eval_seconds
            train_loss = self.train_epoch()
            # Training time only: the evaluations inside the epoch count in eval_seconds.
            self.result.train_seconds += time.perf_counter() - epoch_start - (self.result.eval_seconds - evaluating)
            if self.result.stopped:
                self.save_checkpoint()
                s = self.state
                self.say(f"stopped at step {s.step} (epoch {s.epoch + 1}, step {s.step_in_epoch} of it); "
                         "checkpoint saved: continue with trainer.resume=auto in the same run folder")
                return self.result
            if not self.end_epoch(train_loss):
                break
        self.finish(started)
        return self.result

    def train_epoch(self) -> float:
        """Train (the rest of) the current epoch; return its mean loss over all workers."""
        s, plan = self.state, self.budget.plans[self.state.epoch]
        steps = self.budget.steps[s.epoch]
        self.model.train()
        if s.step_in_epoch == 0:
            for technique in self.techniques:
                technique.on_epoch_start(s.epoch, self.model)
        set_per_worker_batch(self.worker_norms, plan.per_worker_batch)
        batches = self.batches(plan)
        bar = self._bar(s.epoch, steps, s.step_in_epoch)  # the steps this epoch takes (max_steps may cut it)
        self.window.start()
        self.timer.phase("data")
        for inputs, labels in batches.epoch(s.epoch, s.step_in_epoch, steps):
            self.timer.phase("compute")  # the wait for the step's batch ends here
            lr = self.set_lr(plan)
            log_now = self.window.should_log(s.step, last_of_epoch=s.step_in_epoch == steps - 1)
            loss, correct = self.train_step(inputs, labels, plan, count_correct=log_now and bar is not None)
            self.timer.end_step()
            s.step, s.step_in_epoch = s.step + 1, s.step_in_epoch + 1
            s.samples_seen += plan.global_batch
            if self.on_step is not None:
                self.on_step(s.step)
            self.window.add(loss)
            leave = log_now and self.log_window(plan, lr, correct, labels.numel(), bar, steps)
            if s.step in self.eval_steps and s.step_in_epoch < steps:  # an epoch's end evaluates in end_epoch
                self.validate(plan)
            if leave:
                break
            if bar is not None:
                bar.update()
            self.timer.phase("data")
        self.timer.drop()  # the wait that found no more batches
        if bar is not None:
            bar.close()
        return s.epoch_loss_sum / max(s.epoch_loss_count, 1)

    def batches(self, plan: BatchPlan) -> StepBatches:
        if plan not in self.step_batches:
            self.step_batches[plan] = StepBatches(self.data.train, plan, self.ctx.dp_rank, self.settings.seed,
                                                  self.ctx.device, self.settings.loader_workers, self.memory_format)
        return self.step_batches[plan]

    def log_window(self, plan: BatchPlan, lr: float, correct: int, labels_per_step: int, bar, steps: int) -> bool:
        """Log train/* over the window of steps since the last log; True when the epoch must end now."""
        s = self.state
        # Summed over processes at a cadence every rank agrees on, so all of them
        # see the same loss (and stop request) and act together.
        window = self.window.close(self.stop_requested, self.ctx, plan.global_batch)
        self.log.scalars({"train/loss": window.mean_loss, "train/lr": lr, "train/global_batch": plan.global_batch,
                          "perf/samples_per_sec": window.samples_per_sec, **self.timer.window_means(),
                          **self.precision.metrics(), **self.technique_metrics()}, s.step, s.samples_seen)
        s.epoch_loss_sum += window.loss_sum
        s.epoch_loss_count += window.count
        if bar is not None:
            local_acc = correct / labels_per_step
            bar.set_postfix(loss=f"{window.mean_loss:.4f}", acc=f"{local_acc:.3f}",
                            sps=f"{window.samples_per_sec:,.0f}")
        if not math.isfinite(window.mean_loss):
            return True
        # A stop asked for in the epoch's last step waits for the evaluation.
        self.result.stopped = window.stop and s.step_in_epoch < steps
        return self.result.stopped

    def end_epoch(self, train_loss: float) -> bool:
        """Evaluate, log and maybe checkpoint after an epoch; False when the run diverged."""
        s, result, plan = self.state, self.result, self.budget.plans[self.state.epoch]
        result.final_train_loss = train_loss
        if not math.isfinite(train_loss):
            result.diverged = True
            self.say(f"epoch {s.epoch + 1}: train loss is {train_loss}; the run diverged, stopping early")
            return False
        point, split = self.validate(plan), self.eval_split
        self.say(f"epoch {s.epoch + 1}/{len(self.budget.plans)} step {s.step} train_loss={train_loss:.4f} "
                 f"{split}_loss={point.loss:.4f} {split}_acc={point.acc:.4f}")
        plans = list(self.budget.plans)
        for technique in self.techniques:
            plans = technique.replan(s.epoch, s.samples_seen, plans, len(self.data.train))
        if tuple(plans) != self.budget.plans:
            self.set_budget(self.budget.replanned(plans, len(self.data.train)))
        s.epoch, s.step_in_epoch, s.epoch_loss_sum, s.epoch_loss_count = s.epoch + 1, 0, 0.0, 0
        every = self.settings.checkpoint_every
        if every and s.epoch % every == 0 and s.step < self.budget.total_steps:
            self.save_checkpoint()
        return True

    def validate(self, plan: BatchPlan) -> EvalPoint:
        """Evaluate the held-out split now; record, log and hand the point to the techniques."""
        s, result, split = self.state, self.result, self.eval_split
        started = time.perf_counter()
        result.final_loss, result.final_acc = self.evaluate(self.eval_set)
        result.eval_seconds += time.perf_counter() - started
        point = EvalPoint(s.step, s.samples_seen, plan.global_batch, result.final_acc, result.final_loss)
        result.history.append(point)
        self.log.scalars({f"{split}/loss": point.loss, f"{split}/acc": point.acc}, s.step, s.samples_seen)
        for technique in self.techniques:
            technique.after_eval(point.step, point.samples_seen, point.acc, point.loss)
        return point

    def finish(self, started: float) -> None:
        """The test split once, at the end (already done when it is the split evaluated); the run's totals."""
        result, s = self.result, self.state
        for technique in self.techniques:
            technique.on_train_end(self.model)
        if self.eval_split == "test":
            result.test_loss, result.test_acc = result.final_loss, result.final_acc
        elif self.data.test is not None and not result.diverged:
            result.test_loss, result.test_acc = self.evaluate(self.data.test)
            self.log.scalars({"test/loss": result.test_loss, "test/acc": result.test_acc}, s.step, s.samples_seen)
        result.best_acc = ACC.best(p.acc for p in result.history)
        result.best_loss = LOSS.best(p.loss for p in result.history)
        result.allreduces, result.bytes_sent = s.allreduces, s.bytes_sent
        result.steps, result.samples_seen = s.step, s.samples_seen
        result.wall_seconds = time.perf_counter() - started
        result.samples_per_sec = s.samples_seen / max(result.train_seconds, 1e-9)
        result.technique_metrics = {**self.precision.metrics(), **self.technique_metrics()}
        result.technique_curves = {k: v for t in self.techniques for k, v in t.curves().items()}
        result.step_seconds = self.timer.run_means()

    def set_lr(self, plan: BatchPlan) -> float:
        """Write the step's LR (and the batch-dependent Adam settings) into every parameter group.

        A function of samples seen (lbt/lr.py), never of a hidden step counter. The scaling rule
        follows the configured batch, or the current one under an automatic batch ramp.
        """
        batch = plan.global_batch if self.lr_follows_batch else None
        settings = optimizer_settings(self.state.samples_seen, self.schedule, batch)
        factor = settings.pop("weight_decay_factor", None)
        for group in self.optimizer.param_groups:
            group.update(settings)
            if factor is not None:  # each group's own decay (0 for excluded bias/norm parameters) x factor
                group["weight_decay"] = group.setdefault("base_weight_decay", group["weight_decay"]) * factor
        return settings["lr"]

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor, plan: BatchPlan,
                   count_correct: bool = False) -> tuple[torch.Tensor, int]:
        """One optimizer step: synchronous, or each simulated worker on its own model (local SGD).

        Returns this process's mean loss (a detached 0-d tensor) and, when
        `count_correct`, its number of correct predictions (else 0).
        """
        s = self.state
        runner = next((t for t in self.techniques if t.runs_workers(s.step)), None)
        if runner is None:
            loss, correct = self.synchronous_step(inputs, labels, plan, count_correct)
        else:
            one = replace(plan, world_size=1, procs=1, global_batch=plan.per_worker_batch)
            loss, correct = runner.run_workers(
                s.step, lambda x, y: self.synchronous_step(x, y, one, count_correct), inputs, labels)
        if plan.world_size > 1:
            allreduces = next((n for t in self.techniques if (n := t.allreduces_at(s.step)) is not None), 1)
            s.allreduces += allreduces
            s.bytes_sent += allreduces * ring_bytes_sent(self.gradient_bytes, plan.world_size)
        return loss, correct

    def synchronous_step(self, inputs: torch.Tensor, labels: torch.Tensor, plan: BatchPlan,
                         count_correct: bool = False) -> tuple[torch.Tensor, int]:
        """One synchronous SGD step over this process's virtual workers.

        Returns this process's mean loss (a detached 0-d tensor) and, when
        `count_correct`, its number of correct predictions (else 0).
        """
        workers = plan.workers_per_proc
        self.optimizer.zero_grad(set_to_none=True)
        if workers > 1 and any(t.wants_worker_gradient(self.state.step) for t in self.techniques):
            self.timer.phase("measure")  # its own phase: what a measurement costs shows in step_seconds
            self.measure_first_worker(inputs[:plan.per_worker_batch], labels[:plan.per_worker_batch], workers)
            self.timer.phase("compute")
        group = self.workers_per_pass(plan)
        if group < workers:  # passes of `group` workers each (one worker per pass: the sequential path)
            passes = [(x, y, group) for x, y in zip(inputs.chunk(workers // group), labels.chunk(workers // group))]
        else:
            passes = [(inputs, labels, workers)]  # one worker, or all workers fused
        split_buffers = len(passes) > 1 and self.buffer_mean.active
        if split_buffers:
            self.buffer_mean.begin_step()
        loss_sum, correct, sent = None, 0, None
        for i, (pass_inputs, pass_labels, pass_workers) in enumerate(passes):
            last = i == len(passes) - 1
            share = pass_workers / workers
            # no_sync: earlier passes only accumulate gradients locally; the
            # last backward lets DDP allreduce the sum, once per step.
            sync = nullcontext() if last or self.ddp is self.model else self.ddp.no_sync()
            with sync:
                with self.precision.autocast():
                    logits = self.forward(pass_inputs)
                    loss = self.loss_fn(logits, pass_labels)
                # Each pass's mean loss weighs by its share of the k local
                # workers; DDP's division by P completes the mean over W workers.
                self.precision.backward(loss if share == 1 else loss * share)
            if self.simulated_comm:
                sent = self.simulated_comm.send(self.model, sent)  # what this worker's GPU would put on the wire
            if split_buffers:
                self.buffer_mean.after_pass(share, last)
            weighted = loss.detach() if share == 1 else loss.detach() * share
            loss_sum = weighted if loss_sum is None else loss_sum + weighted
            if count_correct:
                correct += int((logits.argmax(1) == pass_labels).sum())
        if self.simulated_comm:
            self.simulated_comm.receive(self.model, sent)
        if self.dp_gradients is not None:
            self.timer.phase("comm")
            self.dp_gradients.average()
        s = self.state
        # What a DDP hook saw is still scaled (fp16): the measurement that reads it divides by this.
        progress = Progress(s.samples_seen, s.step, s.epoch, plan.global_batch, len(self.data.train),
                            self.precision.grad_scale)
        # fp16: true gradients from here on, for clipping, measurements and LARS/LAMB's trust ratios.
        self.precision.unscale(self.optimizer)
        for technique in self.techniques:
            technique.after_backward(self.model, progress)
        self.timer.phase("optimizer")
        self.precision.step(self.optimizer)
        return loss_sum, correct

    def measure_first_worker(self, inputs: torch.Tensor, labels: torch.Tensor, workers: int) -> None:
        """Worker 0's gradient on its own, for measurements (the gradient noise scale).

        Computed beside the step, not as part of it: a measurement never changes the
        run it measures, so .grad and the BatchNorm buffers are left as they were.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        buffers = [b.detach().clone() for b in self.model.buffers()]
        with self.precision.autocast():
            loss = self.loss_fn(self.model(inputs), labels)
        grads = self.precision.unscaled(torch.autograd.grad(self.precision.scale(loss), params))
        for buffer, saved in zip(self.model.buffers(), buffers):
            buffer.copy_(saved)
        for technique in self.techniques:
            technique.on_worker_gradient(grads, len(labels), workers)

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
        # A tensor-parallel group's ranks evaluate the same samples: its totals count T times, in every ratio.
        batches = eval_batches(dataset, self.ctx.dp_rank, self.ctx.dp_procs, self.settings.eval_batch, self.ctx.device,
                               self.settings.loader_workers, self.memory_format)
        for inputs, labels in batches:
            with self.precision.autocast():
                logits = self.model(inputs)
            totals[0] += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            totals[1] += (logits.argmax(1) == labels).sum().item()
            totals[2] += labels.numel()  # samples, or tokens of a language model ((N, T) labels)
        all_reduce_sum(totals, self.ctx)
        for technique in self.techniques:
            technique.after_evaluate(self.model)
        self.model.train()
        return totals[0].item() / totals[2].item(), totals[1].item() / totals[2].item()

    # -- output ---------------------------------------------------------------
    def _bar(self, epoch: int, steps: int, done: int):
        if not (self.settings.progress and self.ctx.is_main):
            return None
        from tqdm import tqdm

        epochs = sum(1 for n in self.budget.steps if n)  # the epochs that take a step (max_steps may end early)
        return tqdm(total=steps, initial=done, desc=f"epoch {epoch + 1}/{epochs}", unit="step",
                    leave=False, dynamic_ncols=True)

    def say(self, line: str) -> None:
        if self.ctx.is_main:
            say(line)

    # -- checkpoints ----------------------------------------------------------
    def save_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        result = {k: v for k, v in self.result.to_dict().items() if k not in ("stopped", "step_seconds")}
        # The batch plans too: an automatic batch ramp decided them during the run.
        model_state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
        if self.ctx.tensor_parallel > 1:  # whole tensors, as one process would save them
            model_state, optimizer_state = full_tensors(model_state), full_tensors(optimizer_state)
        main = {"model": model_state, "optimizer": optimizer_state,
                "loop": asdict(self.state), "result": result, "plans": [asdict(p) for p in self.budget.plans],
                "precision": self.precision.state_dict()}
        # Every rank's own: its BN statistics, RNG states and technique state (PowerSGD's error feedback).
        own = {"buffers": {k: v.detach().clone() for k, v in self.model.named_buffers()}, "rng": rng_state(),
               "techniques": {t.name: t.state_dict() for t in self.techniques}}
        # Logged events first: once the checkpoint is the latest, a resume from it does not log its step
        # again, so a kill between the two must not lose what the step logged (its evaluation).
        self.log.flush()
        self.checkpointer.save(self.state.step, main, own)

    def load_checkpoint(self, main: dict, own: dict) -> None:
        if self.ctx.tensor_parallel > 1:
            load_full_state(self.model, self.optimizer, main["model"], main["optimizer"])
        else:
            self.model.load_state_dict(main["model"])
            self.optimizer.load_state_dict(main["optimizer"])
        buffers = dict(self.model.named_buffers())
        for name, value in own["buffers"].items():  # this rank's own BN statistics
            buffers[name].copy_(value)
        self.precision.load_state_dict(main.get("precision", {}))  # fp16's loss scale and skipped steps
        self.state = LoopState(**main["loop"])
        # Batch layouts an automatic ramp decided; a run extended on resume (more epochs) keeps the last.
        decided, planned = [BatchPlan(**plan) for plan in main.get("plans", ())], list(self.budget.plans)
        if decided and decided != planned[:len(decided)]:
            plans = (decided + [decided[-1]] * len(planned))[:len(planned)]
            self.set_budget(self.budget.replanned(plans, len(self.data.train)))
        self.result = Result.from_dict(main["result"])
        for technique in self.techniques:
            technique.load_state_dict(own["techniques"].get(technique.name, {}))
        set_rng_state(own["rng"])
