"""Techniques and recipes in the loop: every one trains, and the LR follows the pure functions."""

import math
from pathlib import Path

import pytest
import torch
from conftest import train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lbt.errors import ConfigError
from lbt.spec.batching import BatchLayout, make_budget
from lbt.spec.lr import ScheduleSpec, build_schedule, lr_at
from lbt.spec.run import from_node
from lbt.techniques.batch_ramp import BatchRamp, ramp_growth

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
TECHNIQUES = sorted(p.stem for p in (REPO / "conf" / "technique").glob("*.yaml"))
STRATEGIES = sorted(p.stem for p in (REPO / "conf" / "strategy").glob("*.yaml"))
TWO_STEPS = ["trainer.max_steps=2", "trainer.epochs=1", "trainer.log_every=1"]


def test_there_are_recipes_and_techniques():
    assert {"baseline", "linear_scaling", "goyal2017", "lars", "lamb", "smith2017_ramp", "akiba2017"} <= set(RECIPES)
    assert {"batch_ramp", "ghost_bn", "gns", "zero_init_residual", "bn_epoch_average"} <= set(TECHNIQUES)
    assert set(STRATEGIES) == {"gradient_delay", "local_sgd"}


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("model", ["cnn1d", "mlp"])
def test_every_recipe_trains_two_steps(recipe, model, tmp_path):
    result = train(tmp_path, [f"recipe={recipe}", f"model={model}", "dist.world_size=2", *TWO_STEPS])
    assert result["steps"] == 2 and result["recipe"] == recipe
    assert math.isfinite(result["final_train_loss"])


def test_goyal2017_on_a_residual_network(tmp_path):
    result = train(tmp_path, ["recipe=goyal2017", "model=resnet20", "data.input_shape=[3,8,8]", "dist.world_size=2",
                              "trainer.per_worker_batch=8", *TWO_STEPS])
    assert any("zero" in t.lower() or "residual" in t.lower() for t in result["techniques"])


@pytest.mark.parametrize("technique", TECHNIQUES)
def test_every_technique_trains_two_steps_alone(technique, tmp_path):
    overrides = [f"technique=[{technique}]", "dist.world_size=2", *TWO_STEPS]
    if technique == "sync_bn":
        # torch's SyncBatchNorm runs on CUDA only: on this CPU machine it is a clear config error
        with pytest.raises(ConfigError, match="CUDA"):
            train(tmp_path, overrides)
        return
    result = train(tmp_path, overrides)
    assert result["steps"] == 2 and math.isfinite(result["final_train_loss"])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_two_steps(strategy, tmp_path):
    result = train(tmp_path, [f"strategy={strategy}", "dist.world_size=2", *TWO_STEPS])
    assert result["steps"] == 2 and math.isfinite(result["final_train_loss"])
    assert len(result["techniques"]) == 1  # the strategy, as result.json lists it


def test_train_lr_curve_is_lr_at(tmp_path, capsys):
    # 512 samples, global batch 128: 4 steps/epoch, 3 epochs; warmup 1 epoch; poly decay after it
    result = train(tmp_path, ["model=mlp", "dist.world_size=4", "trainer.per_worker_batch=32", "trainer.epochs=3",
                              "trainer.log_every=1", "optim.lr=0.05", "schedule=poly", "schedule.scaling=linear",
                              "schedule.base_batch=32", "schedule.warmup_epochs=1"])
    printed = capsys.readouterr().out
    assert "global_batch=128" in printed and "lr: peak 0.2 at sample 512 (step 4)" in printed
    logged = scalars(tmp_path, "train/lr")
    assert [step for step, _ in logged] == list(range(1, 13))
    layout = BatchLayout(4, 1, 32, 128)
    node = from_node(ScheduleSpec, result["config"]["schedule"], "schedule")
    schedule = build_schedule(node, 0.05, 128, make_budget([layout] * 3, 512, None))
    for step, value in logged:
        seen = (step - 1) * 128  # the LR of a step is set from the samples seen before it
        assert value == pytest.approx(lr_at(seen, schedule), rel=1e-6)
    assert max(value for _, value in logged) == pytest.approx(0.2)
    assert result["steps"] == 12 and result["peak_lr"] == pytest.approx(0.2) and result["peak_lr_samples"] == 512


def test_goyal2017_reaches_the_peak_it_configures(tmp_path, capsys):
    """goyal2017 at world_size 16: the logged maximum of train/lr is optim.lr x 16, printed at start."""
    result = train(tmp_path, ["recipe=goyal2017", "model=mlp", "dist.world_size=16", "data.num_train=4096",
                              "trainer.epochs=7", "optim.lr=0.1", "schedule.warmup_epochs=5"])
    assert "lr: peak 1.6 at sample 20,480 (step 20)" in capsys.readouterr().out  # 5 epochs x 4 steps x 1,024
    # TensorBoard keeps float32: exactly the float32 nearest to 1.6
    assert max(value for _, value in scalars(tmp_path, "train/lr")) == float(torch.tensor(0.1 * 16))
    assert result["peak_lr"] == 0.1 * 16


def test_lars_is_an_optimizer_built_once(tmp_path, monkeypatch):
    built = []
    original = torch.optim.Optimizer.__init__

    def counting(self, *args, **kwargs):
        built.append(type(self).__name__)
        original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Optimizer, "__init__", counting)
    result = train(tmp_path, ["recipe=lars", "model=cnn1d", "dist.world_size=2", *TWO_STEPS])
    assert built == ["LARS"] and result["config"]["optim"]["optimizer_class"] == "lbt.optim.LARS"
    built.clear()
    train(tmp_path / "sgd", ["optim.no_bn_weight_decay=true", *TWO_STEPS])
    assert built == ["SGD"]


def test_batch_ramp_growth_at_each_milestone():
    assert [ramp_growth(e, [3, 6, 8], 2, 8) for e in range(10)] == [
        (1, 0)] * 3 + [(2, 0)] * 3 + [(4, 0)] * 2 + [(8, 0)] * 2
    # capped at 4x: the third milestone decays the LR instead
    assert ramp_growth(8, [3, 6, 8], 2, 4) == (4, 1)
    ramp = BatchRamp(milestones=[1, 2], factor=2, max_global_batch=256, grow="world_size")
    base = BatchLayout(world_size=2, procs=1, per_worker_batch=32, global_batch=64)
    layouts = ramp.epoch_layouts([base] * 4, num_train=10_000)
    assert [p.global_batch for p in layouts] == [64, 128, 256, 256]
    assert [p.world_size for p in layouts] == [2, 4, 8, 8] and all(p.per_worker_batch == 32 for p in layouts)
    assert all(p.lr_factor == 1 for p in layouts)
    assert ramp.epoch_layouts(layouts, 10_000, after_epoch=0) == layouts  # decided before training, not after


def test_batch_ramp_caps_at_the_training_set_and_divides_the_lr_instead(capfd):
    ramp = BatchRamp(milestones=[1, 2, 3], factor=2, max_global_batch=8192)
    layouts = ramp.epoch_layouts([BatchLayout(2, 1, 64, 128)] * 5, num_train=512)
    assert [p.global_batch for p in layouts] == [128, 256, 512, 512, 512]
    assert [p.lr_factor for p in layouts] == [1, 1, 1, 0.5, 0.5]
    note = "lbt: note: technique.batch_ramp: the global batch stops growing at the 512 samples"
    assert note in capfd.readouterr().err


def test_smith2017_ramp_runs_on_a_small_dataset(tmp_path):
    result = train(tmp_path, ["recipe=smith2017_ramp", "dist.world_size=2", "trainer.max_steps=2"])
    assert result["steps"] == 2 and math.isfinite(result["final_train_loss"])


def test_batch_ramp_run_grows_the_logged_global_batch(tmp_path):
    result = train(tmp_path, ["model=mlp", "technique=[batch_ramp]", "technique.batch_ramp.milestones=[1]",
                              "trainer.epochs=2", "trainer.log_every=1", "trainer.global_batch=64"])
    batches = [value for _, value in scalars(tmp_path, "train/global_batch")]
    assert batches == [64] * 8 + [128] * 4
    assert result["samples_seen"] == 8 * 64 + 4 * 128


def scalars(run_dir, tag: str) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]
