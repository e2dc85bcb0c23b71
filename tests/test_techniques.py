"""Techniques and recipes in the loop: every one trains, and the LR follows the pure functions."""

import math
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import train
from lbt.config import BatchPlan
from lbt.errors import ConfigError
from lbt.lr import decay_factor, scaling_factor, warmup_factor
from lbt.techniques.base import Progress
from lbt.techniques.batch_ramp import BatchRamp, ramp_growth
from lbt.techniques.warmup import Warmup

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
TECHNIQUES = sorted(p.stem for p in (REPO / "conf" / "technique").glob("*.yaml"))
TWO_STEPS = ["trainer.max_steps=2", "trainer.epochs=1", "trainer.log_every=1"]


def test_there_are_recipes_and_techniques():
    assert {"baseline", "linear_scaling", "goyal2017", "lars", "lamb", "smith2017_ramp", "akiba2017"} <= set(RECIPES)
    assert {"lr_scaling", "warmup", "lars", "batch_ramp", "no_bn_weight_decay"} <= set(TECHNIQUES)


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


@pytest.mark.slow
def test_comm_compression_on_real_processes(tmp_path):
    result = train(tmp_path, ["technique=[comm_compression]", "technique.comm_compression.kind=fp16",
                              "model=mlp", "dist.world_size=2", "dist.procs=2", *TWO_STEPS])
    assert result["steps"] == 2 and math.isfinite(result["final_train_loss"])


def test_train_lr_curve_matches_the_pure_functions(tmp_path, capsys):
    # 512 samples, global batch 128: 4 steps/epoch, 3 epochs; warmup 1 epoch; poly decay
    result = train(tmp_path, ["model=mlp", "dist.world_size=4", "trainer.per_worker_batch=32", "trainer.epochs=3",
                              "trainer.log_every=1", "optim.lr=0.05", "schedule=poly",
                              "technique=[lr_scaling,warmup]", "technique.lr_scaling.base_batch=32",
                              "technique.warmup.epochs=1"])
    printed = capsys.readouterr().out
    assert "global_batch=128" in printed and "lr=0.2 (base 0.05 x 4" in printed
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("train/lr")]
    assert [step for step, _ in logged] == list(range(1, 13))
    total = 12 * 128
    for step, value in logged:
        seen = (step - 1) * 128  # the LR of a step is set from the samples seen before it
        expected = 0.05 * scaling_factor(128, 32, "linear") * warmup_factor(seen, 512, 1 / 4) * decay_factor(
            seen, total, "poly", power=2.0)
        assert value == pytest.approx(expected, rel=1e-6)
    assert result["steps"] == 12


def test_warmup_starts_from_the_unscaled_base_lr():
    warmup = Warmup(epochs=2)
    start = Progress(0, 0, 0, 256, 256, 1000, 10000)
    assert warmup.lr_factor(start, scale=8.0) == pytest.approx(1 / 8)
    middle = Progress(1000, 0, 1, 256, 256, 1000, 10000)
    assert warmup.lr_factor(middle, scale=8.0) == pytest.approx(1 / 8 + (1 - 1 / 8) / 2)
    assert warmup.lr_factor(Progress(2000, 0, 2, 256, 256, 1000, 10000), scale=8.0) == 1.0


def test_batch_ramp_growth_at_each_milestone():
    assert [ramp_growth(e, [3, 6, 8], 2, 8) for e in range(10)] == [
        (1, 0)] * 3 + [(2, 0)] * 3 + [(4, 0)] * 2 + [(8, 0)] * 2
    # capped at 4x: the third milestone decays the LR instead
    assert ramp_growth(8, [3, 6, 8], 2, 4) == (4, 1)
    ramp = BatchRamp(milestones=[1, 2], factor=2, max_global_batch=256, grow="world_size")
    base = BatchPlan(world_size=2, procs=1, per_worker_batch=32, global_batch=64)
    plans = [ramp.epoch_plan(e, base) for e in range(4)]
    assert [p.global_batch for p in plans] == [64, 128, 256, 256]
    assert [p.world_size for p in plans] == [2, 4, 8, 8] and all(p.per_worker_batch == 32 for p in plans)


def test_batch_ramp_run_grows_the_logged_global_batch(tmp_path):
    result = train(tmp_path, ["model=mlp", "technique=[batch_ramp]", "technique.batch_ramp.milestones=[1]",
                              "trainer.epochs=2", "trainer.log_every=1", "trainer.global_batch=64"])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    batches = [e.value for e in events.Scalars("train/global_batch")]
    assert batches == [64] * 8 + [128] * 4
    assert result["samples_seen"] == 8 * 64 + 4 * 128
