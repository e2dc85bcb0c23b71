"""The Trainer on its own: a RunSpec built in the test (no Hydra, no subprocess), parts built in this process.

What the loop promises: the LR of every step is lr_at(samples seen), evaluations land where
evaluation_steps says, techniques' hooks fire at their points in order, the step strategy runs every
step, and a checkpoint taken mid-run and loaded into a new trainer continues bitwise.
"""

from __future__ import annotations

import torch

from lbt.engine.build import build_parts
from lbt.engine.checkpoint import Checkpointer
from lbt.engine.strategies.base import StepStrategy
from lbt.engine.trainer import LoopSettings, Trainer, evaluation_steps
from lbt.parallel.process_group import DistContext
from lbt.spec import build_spec
from lbt.spec.lr import lr_at
from lbt.techniques.base import Technique

CONFIG = {
    "model": {"_target_": "lbt.models.MLP", "hidden": 16, "num_layers": 1},
    "data": {"_target_": "lbt.data.build_synthetic", "num_train": 256, "num_test": 64, "input_shape": [8],
             "num_classes": 3, "val_fraction": 0.25},
    "optim": {"_target_": "lbt.optim.create_optimizer", "_partial_": True, "optimizer_class": "torch.optim.SGD",
              "lr": 0.05, "momentum": 0.9},
    "schedule": {"scaling": "linear", "base_batch": 16, "warmup_epochs": 1, "decay": "cosine"},
    "dist": {"world_size": 4},
    "trainer": {"per_worker_batch": 8, "epochs": 3, "progress": False, "evals": 3, "log_every": 2, "device": "cpu"},
}
CPU = DistContext(rank=0, procs=1, local_rank=0, world_size=4, device=torch.device("cpu"))


class Recorder(Technique):
    """Writes down which hook fired at which step, and the LR each step ran at."""

    name = "recorder"

    def __init__(self):
        self.events: list[tuple[str, int]] = []
        self.lrs: list[float] = []
        self.optimizer = None

    def on_epoch_start(self, epoch, model):
        self.events.append(("epoch", epoch))

    def after_backward(self, model, progress):
        self.events.append(("backward", progress.step))
        self.lrs.append(self.optimizer.param_groups[0]["lr"])

    def after_eval(self, point):
        self.events.append(("eval", point.step))


class CountingStrategy(StepStrategy):
    name = "counting"

    def __init__(self):
        self.steps: list[int] = []

    def run_step(self, step, synchronous_step, inputs, labels, layout):
        self.steps.append(step)
        return synchronous_step(inputs, labels, layout)


def trainer(run_dir=None, epochs: int = 3, techniques=(), stop_at_val=None, **trainer_changes) -> Trainer:
    config = {**CONFIG, "trainer": {**CONFIG["trainer"], "epochs": epochs, **trainer_changes}}
    spec = build_spec(config)
    parts = build_parts(spec, CPU, list(techniques))
    for technique in techniques:
        if isinstance(technique, Recorder):
            technique.optimizer = parts.optimizer
    checkpointer = Checkpointer(run_dir, 0, 1) if run_dir is not None else None
    settings = LoopSettings(log_every=spec.trainer.log_every, progress=False, evals=spec.trainer.evals,
                            checkpoint_every=0, stop_at_val=stop_at_val)
    return Trainer(parts, CPU, settings, checkpointer=checkpointer)


def test_every_step_runs_at_the_lr_of_the_samples_seen_before_it():
    recorder = Recorder()
    t = trainer(techniques=[recorder])
    result = t.fit()
    # 192 training samples (a quarter held out), global batch 32: 6 steps per epoch, 3 epochs.
    assert result.steps == 18 and result.samples_seen == 18 * 32
    assert recorder.lrs == [lr_at(step * 32, t.schedule) for step in range(18)]
    assert max(recorder.lrs) == lr_at(6 * 32, t.schedule) == 0.05 * 32 / 16  # the peak, when warmup ends


def test_hooks_fire_in_order_and_evaluations_land_where_planned():
    recorder = Recorder()
    t = trainer(techniques=[recorder])
    t.fit()
    events = recorder.events
    assert [e for e in events if e[0] == "epoch"] == [("epoch", 0), ("epoch", 1), ("epoch", 2)]
    assert [step for kind, step in events if kind == "backward"] == list(range(18))
    evaluated = [step for kind, step in events if kind == "eval"]
    assert evaluated == sorted(evaluation_steps(t.budget, 3)) and {6, 12, 18} <= set(evaluated)
    assert [p.step for p in t.result.history] == evaluated
    # An epoch starts before its first step's backward, and its evaluation comes after its last one.
    assert events.index(("epoch", 1)) < events.index(("backward", 6)) and events.index(("eval", 6)) > events.index(
        ("backward", 5))


def test_the_step_strategy_runs_every_step():
    strategy = CountingStrategy()
    t = trainer(epochs=1)
    t.strategy = t.runner.strategy = strategy
    t.fit()
    assert strategy.steps == list(range(6))


def test_a_checkpoint_loaded_into_a_new_trainer_continues_bitwise(tmp_path):
    straight = trainer(epochs=2)
    straight.fit()
    first = trainer(tmp_path, epochs=2)
    first.budget = first.budget.relaid(list(first.budget.layouts[:1]), 192)  # stop after epoch 1 ...
    first.fit()
    first.budget = straight.budget
    first.save_checkpoint()  # ... and checkpoint there, as a preempted run would
    resumed = trainer(tmp_path, epochs=2)
    resumed.load_checkpoint(*Checkpointer(tmp_path, 0, 1).load_latest())
    assert resumed.state.step == 6
    resumed.fit()
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)
    assert resumed.result.steps == straight.result.steps == 12
    assert resumed.result.final_acc == straight.result.final_acc


def first_reaching(history, ends: bool):
    """An evaluation that is the first to reach its own accuracy, inside an epoch (ends=False) or at an epoch's
    end (True: steps 6, 12, 18), and not the last: (its index, its accuracy)."""
    for k, point in enumerate(history[:-1]):
        if (point.step % 6 == 0) == ends and all(p.acc < point.acc for p in history[:k]):
            return k, point.acc
    raise AssertionError(f"no such evaluation in {[(p.step, p.acc) for p in history]}")


def test_a_run_stopped_at_its_target_is_the_whole_run_up_to_that_evaluation():
    """trainer.stop_at_val_acc ends the run at the first evaluation that reaches it, inside an epoch or at its
    end: what it measured up to there is the whole run's, bit for bit (the LR schedule still spans the budget)."""
    whole = trainer()
    whole.fit()
    for ends in (False, True):
        k, target = first_reaching(whole.result.history, ends)
        recorder = Recorder()
        result = trainer(techniques=[recorder], stop_at_val=("acc", target)).fit()
        assert result.ended_at_target and not whole.result.ended_at_target
        assert result.history == whole.result.history[:k + 1]
        assert result.steps == result.history[-1].step < whole.result.steps
        assert recorder.lrs == [lr_at(step * 32, whole.schedule) for step in range(result.steps)]
        assert result.test_acc is not None and result.final_acc == target
