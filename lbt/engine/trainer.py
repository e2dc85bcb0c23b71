"""The training loop: fit() -> train_epoch() -> one step (lbt/engine/step.py), and evaluate().

    while steps are left:                      # fit
        for each step of the epoch:            # train_epoch
            write the LR of samples seen into the optimizer (lbt/spec/lr.py)
            step = strategy's step over this process's workers (lbt/engine/step.py)
            every log_every steps: log train/* summed over processes (all ranks agree to stop there)
            at evaluation steps: evaluate the held-out split
        end of epoch: evaluate, let techniques re-lay the next epochs (batch ramp), checkpoint
    test split once; the run's totals in the RunResult

Techniques hook in at the points listed in lbt/techniques/base.py; the step strategy at those in
lbt/engine/strategies/base.py.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

import torch

from lbt.data.batches import StepBatches
from lbt.engine.build import Parts
from lbt.engine.checkpoint import (
    Checkpointer,
    checkpointed_result,
    load_buffers,
    load_model_and_optimizer,
    own_buffers,
    restored_result,
    shard_state,
    weights_state,
)
from lbt.engine.evaluate import AveragedWeights, evaluate
from lbt.engine.precision import Precision, memory_format
from lbt.engine.step import LoopState, RunControl, StepRunner
from lbt.metrics.tensorboard import RunLogger
from lbt.metrics.text_log import say_once
from lbt.metrics.timing import StepTimer
from lbt.metrics.window import TrainWindow, diverging
from lbt.parallel.process_group import DistContext, average_buffers
from lbt.rng import rng_state, set_rng_state
from lbt.spec.batching import BatchLayout, Budget
from lbt.spec.lr import optimizer_settings, peak
from lbt.spec.objective import ACC, LOSS, metric_named
from lbt.spec.result import EvalPoint, RunResult
from lbt.stop import stop_asked

LR_LIMIT = float(torch.finfo(torch.float32).max)  # an LR torch can still turn into a float32 step


@dataclass(frozen=True)
class LoopSettings:
    seed: int = 0
    log_every: int = 10
    progress: bool = True
    eval_batch: int = 1024
    evals: int = 20  # evaluations spaced log-uniformly in samples seen, besides those at epoch ends
    fuse_workers: bool | str = "auto"  # see lbt/engine/passes.py: workers_per_pass
    checkpoint_every: int = 0  # epochs; 0 = only when stopped by a signal
    compile: bool = False  # torch.compile the training forward
    channels_last: bool = False  # inputs (and the model, lbt/engine/build.py) in channels_last layout
    loader_workers: int = 0  # DataLoader worker processes, for datasets read sample by sample
    snapshot_samples: tuple[int, ...] = ()  # samples seen at which `snapshot` is called (lbt probe's base run)
    diverge_factor: float | None = 10.0  # a train loss above this x the first step's ... (None: only non-finite)
    diverge_log_steps: int = 3  # ... for this many log steps in a row ends the run as diverged
    stop_at_val: tuple[str, float] | None = None  # (acc | loss, target): end at the evaluation that reaches it


def evaluation_steps(budget: Budget, evals: int) -> frozenset[int]:
    """Steps (counted as done) after which to evaluate: every epoch's end, and `evals` points
    log-spaced in samples seen from the first step to the end, so steps-to-target is resolved at
    every batch size (at batch 64 an epoch is ~840 steps; at 8,192 the run is 60)."""
    ends, done = set(), 0
    for steps in budget.steps:
        done += steps
        if steps:
            ends.add(done)
    first, total = budget.layouts[0].global_batch, budget.total_samples
    spaced = (first * (total / first) ** (i / max(evals - 1, 1)) for i in range(evals)) if evals else ()
    return frozenset(ends | {budget.step_boundary(samples)[0] for samples in spaced} - {0})


class Trainer:
    on_step: Callable[[int], None] | None  # told each finished step (the local launcher's record of progress)
    snapshot: Callable[[], None] | None  # called at settings.snapshot_samples (lbt/engine/branch.py)
    diverge_above: float  # a train loss above this ends the run as diverged (a probe branch's limit)

    def __init__(self, parts: Parts, ctx: DistContext, settings: LoopSettings, logger: RunLogger | None = None,
                 checkpointer: Checkpointer | None = None, precision: Precision | None = None):
        self.parts, self.ctx, self.settings = parts, ctx, settings
        self.model, self.techniques, self.strategy = parts.model, parts.techniques, parts.strategy
        self.budget, self.schedule, self.data = parts.budget, parts.schedule, parts.data
        self.precision = precision or Precision("fp32", ctx.device.type)
        self.log, self.checkpointer = logger or RunLogger(None), checkpointer
        self.timer = StepTimer(ctx.device)
        self.runner = StepRunner(parts.model, parts.optimizer, parts.loss_fn, parts.techniques, parts.strategy, ctx,
                                 self.precision, settings.fuse_workers, settings.compile, self.timer)
        self.runner.prepare(self.budget.layouts, self.budget.layouts[0])
        self.memory_format = memory_format(settings.channels_last)
        self.averaged = AveragedWeights(parts, ctx, self.precision, self.memory_format)  # schedule-free's x
        self.step_batches: dict[BatchLayout, StepBatches] = {}  # one per batch layout: its DataLoader lives on
        self.lr_follows_batch = any(t.lr_follows_batch for t in parts.techniques)
        # Log every log_every steps, at each epoch's end, and at the step that takes the peak LR.
        self.window = TrainWindow(settings.log_every, self.budget.step_boundary(peak(self.schedule, self.budget)[1])[0])
        # The held-out split evaluated while training: val, or test when there is no validation split.
        has_val = parts.data.val is not None
        self.eval_split, self.eval_set = ("val", parts.data.val) if has_val else ("test", parts.data.test)
        self.eval_steps = evaluation_steps(self.budget, settings.evals)
        self.state, self.control, self.result = LoopState(), RunControl(), RunResult(eval_split=self.eval_split)
        self.on_step, self.snapshot, self.diverge_above = None, None, math.inf

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.parts.optimizer

    def set_budget(self, budget: Budget) -> None:
        """Continue under other batch layouts for the epochs to come (an automatic batch ramp decided them):
        the LR decay ends with the new last step, evaluations are spaced over the new steps."""
        self.budget = budget
        self.schedule = replace(self.schedule, total_samples=budget.total_samples)
        self.eval_steps = evaluation_steps(budget, self.settings.evals)

    # -- the loop -------------------------------------------------------------
    def fit(self) -> RunResult:
        """Epochs until the budget is spent, the loss diverges or a signal asks to stop."""
        started, s, control = time.perf_counter(), self.state, self.control
        while s.step < self.budget.total_steps:
            epoch_start, evaluating = time.perf_counter(), self.result.eval_seconds
            train_loss = self.result.final_train_loss = self.train_epoch()
            # Training time only: the evaluations inside the epoch count in eval_seconds.
            self.result.train_seconds += time.perf_counter() - epoch_start - (self.result.eval_seconds - evaluating)
            # A stop asked for at an epoch's last step waits for its evaluation; at the run's last, for its end.
            # An epoch left at a target (an evaluation inside it reached it) is not evaluated again.
            whole = s.step_in_epoch >= self.budget.steps[s.epoch]
            if (whole or not (control.stop_asked or control.at_target)) and not self.end_epoch(train_loss):
                break
            if control.at_target:
                self.say(target_line(self.settings.stop_at_val, s))
                break
            if control.stop_asked and s.step < self.budget.total_steps:
                self.save_checkpoint()
                self.say(f"stopped at step {s.step} (epoch {s.epoch + 1}, step {s.step_in_epoch} of it); "
                         "checkpoint saved: continue with trainer.resume=auto in the same run folder")
                self.result.stopped = True
                return self.result
            control.stop_asked = False  # asked at the run's last step: the run ends as it would have
        self.finish(started)
        return self.result

    def train_epoch(self) -> float:
        """Train (the rest of) the current epoch; return its mean loss over all workers."""
        s, layout = self.state, self.budget.layouts[self.state.epoch]
        steps = self.budget.steps[s.epoch]
        self.model.train()
        if s.step_in_epoch == 0:
            for technique in self.techniques:
                technique.on_epoch_start(s.epoch, self.model)
        self.runner.prepare(self.budget.layouts, layout)
        bar = progress_bar(self, steps)  # the steps this epoch takes (max_steps may cut it)
        self.window.start()
        self.timer.phase("data")
        for inputs, labels in self.batches(layout).epoch(s.epoch, s.step_in_epoch, steps):
            self.timer.phase("compute")  # the wait for the step's batch ends here
            lr = self.set_lr(layout)
            if not lr < LR_LIMIT:  # torch cannot apply it to float32 weights: the run has diverged
                self.diverge(f"the LR at step {s.step} is {lr:.3g}, beyond float32")
                break
            log_now = self.window.should_log(s.step, last_of_epoch=s.step_in_epoch == steps - 1)
            loss, correct = self.runner.step(s, layout, inputs, labels, self.data.num_train,
                                             count_correct=log_now and bar is not None)
            self.timer.end_step()
            s.step, s.step_in_epoch = s.step + 1, s.step_in_epoch + 1
            s.samples_seen += layout.global_batch
            if self.on_step is not None:
                self.on_step(s.step)
            self.window.add(loss)
            leave = log_now and self.log_window(layout, lr, correct / labels.numel(), bar, steps)
            if s.step in self.eval_steps and s.step_in_epoch < steps:  # an epoch's end evaluates in end_epoch
                self.validate(layout)  # a loss that is not finite is a divergence
                leave = leave or self.control.diverged or self.control.at_target
            if self.snapshot is not None and s.samples_seen in self.settings.snapshot_samples:
                self.snapshot()
            if leave:
                break
            if bar is not None:
                bar.update()
            self.timer.phase("data")
        self.timer.drop()  # the wait that found no more batches
        if bar is not None:
            bar.close()
        return s.epoch_loss_sum / max(s.epoch_loss_count, 1)

    def batches(self, layout: BatchLayout) -> StepBatches:
        if layout not in self.step_batches:
            self.step_batches[layout] = StepBatches(self.data.train, layout, self.ctx.dp_rank, self.settings.seed,
                                                    self.ctx.device, self.settings.loader_workers, self.memory_format)
        return self.step_batches[layout]

    def log_window(self, layout: BatchLayout, lr: float, local_acc: float, bar: Any, steps: int) -> bool:
        """Log train/* over the window of steps since the last log; True when the epoch must end now."""
        s = self.state
        # Summed over processes at a cadence every rank agrees on, so all of them
        # see the same loss (and stop request) and act together.
        window = self.window.close(stop_asked() is not None, self.ctx, layout.global_batch)
        self.log.scalars({"train/loss": window.mean_loss, "train/lr": lr, "train/global_batch": layout.global_batch,
                          "perf/samples_per_sec": window.samples_per_sec, **self.timer.window_means(),
                          **self.precision.metrics(), **self.technique_metrics()}, s.step, s.samples_seen)
        s.epoch_loss_sum += window.loss_sum
        s.epoch_loss_count += window.loss_count
        if bar is not None:
            bar.set_postfix(loss=f"{window.mean_loss:.4f}", acc=f"{local_acc:.3f}",
                            sps=f"{window.samples_per_sec:,.0f}")
        if math.isnan(s.initial_loss):
            s.initial_loss = window.first_loss
        s.high_windows = diverging(window.mean_loss, s.initial_loss, s.high_windows, self.settings.diverge_factor)
        if not math.isfinite(window.mean_loss) or s.high_windows >= self.settings.diverge_log_steps \
                or window.mean_loss > self.diverge_above:
            self.diverge(f"the train loss at step {s.step} is {window.mean_loss:.4g} (the first step's: "
                         f"{s.initial_loss:.4g})")
            return True
        self.control.stop_asked = window.stop
        return window.stop and s.step_in_epoch < steps

    def end_epoch(self, train_loss: float) -> bool:
        """Evaluate, log and maybe checkpoint after an epoch; False when the run diverged."""
        s, control, split = self.state, self.control, self.eval_split
        if not math.isfinite(train_loss) and not control.diverged:
            self.diverge(f"the epoch's train loss is {train_loss}")
        point = None if control.diverged else self.validate(self.budget.layouts[s.epoch])
        if point is None or control.diverged:
            self.say(f"epoch {s.epoch + 1}: {control.why_diverged}; the run diverged, stopping early")
            return False
        self.say(f"epoch {s.epoch + 1}/{len(self.budget.layouts)} step {s.step} train_loss={train_loss:.4f} "
                 f"{split}_loss={point.loss:.4f} {split}_acc={point.acc:.4f}")
        layouts = list(self.budget.layouts)
        for technique in self.techniques:
            layouts = technique.epoch_layouts(layouts, self.data.num_train, s.epoch, s.samples_seen)
        if tuple(layouts) != self.budget.layouts:
            self.set_budget(self.budget.relaid(layouts, self.data.num_train))
        s.epoch, s.step_in_epoch, s.epoch_loss_sum, s.epoch_loss_count = s.epoch + 1, 0, 0.0, 0
        every = self.settings.checkpoint_every
        if every and s.epoch % every == 0 and s.step < self.budget.total_steps:
            self.save_checkpoint()
        return True

    def validate(self, layout: BatchLayout) -> EvalPoint:
        """Evaluate the held-out split now; record, log and hand the point to the techniques."""
        s, result, split = self.state, self.result, self.eval_split
        started = time.perf_counter()
        result.final_loss, result.final_acc = self.evaluate(self.eval_set)
        result.eval_seconds += time.perf_counter() - started
        point = EvalPoint(s.step, s.samples_seen, layout.global_batch, result.final_acc, result.final_loss)
        result.history.append(point)
        if not math.isfinite(point.loss):
            self.diverge(f"the {split} loss at step {s.step} is {point.loss}")
        self.control.at_target = reached(self.settings.stop_at_val, point)
        self.log.scalars({f"{split}/loss": point.loss, f"{split}/acc": point.acc}, s.step, s.samples_seen)
        for technique in self.techniques:
            technique.after_eval(point)
        return point

    def finish(self, started: float) -> None:
        """The test split once, at the end (already done when it is the split evaluated); the run's totals."""
        result, s = self.result, self.state
        self.strategy.on_train_end(self.model)
        self.averaged.keep()  # the test split and the saved model score schedule-free's averaged weights
        if self.eval_split == "test":
            result.test_loss, result.test_acc = result.final_loss, result.final_acc
        elif self.data.test is not None and not self.control.diverged:
            result.test_loss, result.test_acc = self.evaluate(self.data.test)
            self.log.scalars({"test/loss": result.test_loss, "test/acc": result.test_acc}, s.step, s.samples_seen)
        add_totals(result, s, self.control, time.perf_counter() - started)
        result.technique_metrics = {**self.precision.metrics(), **self.technique_metrics()}
        result.technique_curves = {k: v for t in self.techniques for k, v in t.curves().items()}
        result.step_seconds = self.timer.run_means()

    def set_lr(self, layout: BatchLayout) -> float:
        """Write the step's LR (and the batch-dependent Adam settings) into every parameter group: a function
        of samples seen (lbt/spec/lr.py), following the current batch under an automatic batch ramp."""
        batch = layout.global_batch if self.lr_follows_batch else None
        return write_settings(self.optimizer, optimizer_settings(self.state.samples_seen, self.schedule, batch))

    def diverge(self, why: str) -> None:
        self.control.why_diverged = why

    def technique_metrics(self) -> dict[str, float]:
        return {key: value for t in self.techniques for key, value in t.metrics().items()}

    def evaluate(self, dataset: Any) -> tuple[float, float]:
        """Loss and top-1 accuracy over a whole dataset (the model the strategy has evaluations score)."""
        average_buffers(self.model, self.ctx)  # BN running statistics: the mean over every worker
        with self.strategy.evaluated(self.model), self.averaged():  # then the model back in train mode
            return evaluate(self.model, dataset, self.ctx, self.precision, self.settings.eval_batch,
                            self.settings.loader_workers, self.memory_format)

    # -- output ---------------------------------------------------------------
    def say(self, line: str) -> None:
        say_once(line)

    # -- checkpoints ----------------------------------------------------------
    def save_checkpoint(self) -> None:
        if self.checkpointer is None:
            return
        # The batch layouts too: an automatic batch ramp decided them during the run.
        main = {**weights_state(self.model, self.optimizer, self.ctx), "loop": asdict(self.state),
                "result": checkpointed_result(self.result), "layouts": [asdict(p) for p in self.budget.layouts],
                "precision": self.precision.state_dict()}
        # Every rank's own: its BN statistics, RNG states and technique state (PowerSGD's error feedback).
        own = {"buffers": own_buffers(self.model), "rng": rng_state(),
               "techniques": {t.name: t.state_dict() for t in self.techniques}, "strategy": self.strategy.state_dict()}
        # Logged events first: once the checkpoint is the latest, a resume from it does not log its step
        # again, so a kill between the two must not lose what the step logged (its evaluation).
        self.log.flush()
        self.checkpointer.save(self.state.step, main, own, shard_state(self.model, self.optimizer, self.ctx))

    def load_checkpoint(self, main: dict, own: dict) -> None:
        load_model_and_optimizer(self.model, self.optimizer, main, self.ctx)
        load_buffers(self.model, own["buffers"])  # this rank's own BN statistics
        self.precision.load_state_dict(main.get("precision", {}))  # fp16's loss scale and skipped steps
        self.state = LoopState(**main["loop"])
        # Batch layouts an automatic ramp decided (on this run's processes: a sharded run resumes on another
        # number of them); a run extended on resume (more epochs) keeps the last.
        decided = [replace(BatchLayout(**layout), procs=self.parts.layout.procs) for layout in main["layouts"]]
        if decided and decided != list(self.budget.layouts[:len(decided)]):
            laid = (decided + [decided[-1]] * len(self.budget.layouts))[:len(self.budget.layouts)]
            self.set_budget(self.budget.relaid(laid, self.data.num_train))
        self.result = restored_result(main["result"])
        for technique in self.techniques:
            technique.load_state_dict(own["techniques"].get(technique.name, {}))
        self.strategy.load_state_dict(own["strategy"])
        set_rng_state(own["rng"])


def add_totals(result: RunResult, s: LoopState, control: RunControl, wall_seconds: float) -> None:
    """The run's totals at its end: how it ended, best held-out values, steps, samples, communication, speed."""
    result.diverged, result.ended_at_target = control.diverged, control.at_target
    result.best_acc = ACC.best(p.acc for p in result.history)
    result.best_loss = LOSS.best(p.loss for p in result.history)
    result.allreduces, result.bytes_sent = s.allreduces, s.bytes_sent
    result.steps, result.samples_seen = s.step, s.samples_seen
    result.wall_seconds = wall_seconds
    result.samples_per_sec = s.samples_seen / max(result.train_seconds, 1e-9)


def reached(stop_at_val: tuple[str, float] | None, point: EvalPoint) -> bool:
    """Whether an evaluation reached trainer.stop_at_val_acc (at or above it) or _loss (at or below); never one
    whose loss is not finite (the run diverged)."""
    if stop_at_val is None or not math.isfinite(point.loss):
        return False
    name, target = stop_at_val
    return metric_named(name, "trainer.stop_at_val").reached(getattr(point, name), target)


def target_line(stop_at_val: tuple[str, float] | None, s: LoopState) -> str:
    """The line a run ending at its target says."""
    name, target = stop_at_val or ("", 0.0)
    epoch = s.epoch + 1 if s.step_in_epoch else s.epoch  # an epoch's end has moved on to the next
    return f"val_{name} reached trainer.stop_at_val_{name}={target:g} at step {s.step} (epoch {epoch}): the run ends"


def progress_bar(trainer: Trainer, steps: int) -> Any:
    """A tqdm bar over the `steps` the current epoch takes, on the main process when asked for."""
    if not (trainer.settings.progress and trainer.ctx.is_main):
        return None
    from tqdm import tqdm

    if not hasattr(tqdm, "_lock"):
        # tqdm's default lock holds a multiprocessing semaphore, which a worker process that ends with
        # os._exit (lbt.engine.worker.exit_worker) leaves to the resource tracker's "leaked" warning.
        tqdm.set_lock(threading.RLock())
    epochs = sum(1 for n in trainer.budget.steps if n)  # the epochs that take a step (max_steps may end early)
    # disable=None: no bar when stderr is not a terminal (a log file got thousands of carriage-return frames).
    return tqdm(total=steps, initial=trainer.state.step_in_epoch, desc=f"epoch {trainer.state.epoch + 1}/{epochs}",
                unit="step", leave=False, dynamic_ncols=True, disable=None)


def write_settings(optimizer: torch.optim.Optimizer, settings: dict[str, Any]) -> float:
    """Put the step's optimizer settings in every parameter group (never a hidden step counter); its LR."""
    factor = settings.pop("weight_decay_factor", None)
    for group in optimizer.param_groups:
        group.update(settings)
        if factor is not None:  # each group's own decay (0 for excluded bias/norm parameters) x factor
            group["weight_decay"] = group.setdefault("base_weight_decay", group["weight_decay"]) * factor
    return float(settings["lr"])
