"""AdamW's scaling rules and batch-size warmup from the noise scale: the arithmetic by hand, then runs."""

from __future__ import annotations

import math

import pytest
from conftest import FAST, compose_config, final_params, relative_diff, train

from lbt.engine import make_spec
from lbt.errors import ConfigError
from lbt.spec.batching import BatchLayout
from lbt.spec.lr import (
    Schedule,
    adam_sqrt_moments,
    adam_sqrt_out_of_range,
    optimizer_settings,
    timescale_weight_decay,
)
from lbt.techniques.batch_ramp import AutoBatchRamp, auto_ramp_batch


# --- Malladi et al. 2022, the square-root rule --------------------------------------------------
def test_sqrt_rule_moves_one_minus_beta_by_kappa_and_eps_by_one_over_sqrt_kappa():
    (beta1, beta2), eps = adam_sqrt_moments(4, (0.9, 0.999), 1e-8)
    assert beta1 == pytest.approx(0.6) and beta2 == pytest.approx(0.996) and eps == pytest.approx(5e-9)


def test_sqrt_rule_scaling_down_brings_betas_closer_to_one():
    (beta1, beta2), eps = adam_sqrt_moments(0.25, (0.9, 0.999), 1e-8)
    assert beta1 == pytest.approx(0.975) and beta2 == pytest.approx(0.99975) and eps == pytest.approx(2e-8)


def test_sqrt_rule_past_its_range_clamps_the_beta_to_zero_and_says_so():
    (beta1, beta2), _ = adam_sqrt_moments(16, (0.9, 0.999), 1e-8)
    assert beta1 == 0.0 and beta2 == pytest.approx(0.984)
    s = schedule(scaling="adam_sqrt", betas=(0.9, 0.999), eps=1e-8)
    assert "beta1=0.9" in adam_sqrt_out_of_range(s, 64 * 16)
    assert adam_sqrt_out_of_range(s, 64 * 8) is None  # 8 x 0.1 < 1


def test_timescale_weight_decay_keeps_batch_over_lr_times_wd():
    # batch x16, LR x4 (sqrt): wd x4 keeps B / (lr wd N)
    factor = timescale_weight_decay(16, 4)
    assert factor == 4 and 16 / (4 * factor) == 1


def schedule(**changes) -> Schedule:
    values = dict(base_lr=1e-3, global_batch=1024, base_batch=64, scaling="adam_sqrt", warmup_samples=0,
                  warmup_start=None, warmup_mode="linear", decay="constant", total_samples=10**6,
                  betas=(0.99, 0.999), eps=1e-8)
    return Schedule(**{**values, **changes})


def test_optimizer_settings_at_the_configured_and_at_another_batch():
    s = schedule(weight_decay_scaling="timescale")
    at_1024 = optimizer_settings(0, s)
    assert at_1024["lr"] == pytest.approx(4e-3)  # sqrt(16)
    assert at_1024["betas"] == pytest.approx((0.84, 0.984)) and at_1024["eps"] == pytest.approx(2.5e-9)
    assert at_1024["weight_decay_factor"] == pytest.approx(4)
    at_256 = optimizer_settings(0, s, global_batch=256)  # an automatic ramp's current batch
    assert at_256["lr"] == pytest.approx(2e-3) and at_256["betas"] == pytest.approx((0.96, 0.996))
    assert set(optimizer_settings(0, schedule(scaling="linear", betas=None, eps=None))) == {"lr"}


def test_adam_sqrt_needs_an_optimizer_with_betas():
    config, recipe = compose_config(FAST + ["schedule.scaling=adam_sqrt"])  # SGD: no betas
    with pytest.raises(ConfigError, match="schedule.scaling=adam_sqrt scales Adam's betas"):
        make_spec(config, recipe)
    config, recipe = compose_config(FAST + ["optim=adamw", "schedule.scaling=adam_sqrt", "optim.betas=[0.9,1.5]"])
    with pytest.raises(ConfigError, match="optim.betas must be"):
        make_spec(config, recipe)


# --- batch-size warmup: the decision ------------------------------------------------------------
@pytest.mark.parametrize("batch, b_simple, threshold, cap, expected", [
    (256, 2000, 1.0, 10**6, 2048),  # 256 -> 512 -> 1024 -> 2048; 2000 < 2048: stop
    (256, 2000, 2.0, 10**6, 1024),  # ends in [B_simple / threshold, 2 B_simple / threshold)
    (256, 2000, 1.0, 1000, 512),  # never past the cap
    (256, 200, 1.0, 10**6, 256),  # the noise scale is below the batch: keep it
    (256, float("nan"), 1.0, 10**6, 256),  # nothing measured yet
    (256, -50.0, 1.0, 10**6, 256),  # a negative estimate (noise) grows nothing
])
def test_auto_ramp_batch(batch, b_simple, threshold, cap, expected):
    assert auto_ramp_batch(batch, b_simple, threshold, 2, cap) == expected


def test_auto_ramp_replans_the_epochs_after_the_one_just_ended():
    ramp = AutoBatchRamp(factor=2, max_global_batch=512, grow="world_size")
    ramp.estimator.grad_sq, ramp.estimator.trace, ramp.estimator.weight = 1.0, 300.0, 1.0  # B_simple = 300
    layouts = [BatchLayout(2, 1, 32, 64)] * 4
    assert ramp.epoch_layouts(layouts, 6400) == layouts  # before training: nothing measured, nothing decided
    relaid = ramp.epoch_layouts(layouts, 6400, after_epoch=0, samples_seen=6400)
    assert relaid[0] == layouts[0]
    assert all(p == BatchLayout(16, 1, 32, 512) for p in relaid[1:])  # 64 -> ... -> 512 (300 < 512)
    assert ramp.changes == [[6400, 1, 512, 300.0]]
    assert ramp.epoch_layouts(relaid, 6400, after_epoch=3, samples_seen=9999) == relaid  # after the last epoch


def test_auto_ramp_needs_two_workers():
    with pytest.raises(ConfigError, match="dist.world_size >= 2"):
        AutoBatchRamp().check_layout(BatchLayout(1, 1, 64, 64))


# --- runs ---------------------------------------------------------------------------------------
RAMP = ["model=mlp", "optim=adamw", "schedule=constant", "schedule.scaling=adam_sqrt", "optim.betas=[0.99,0.999]",
        "dist.world_size=2", "trainer.per_worker_batch=16", "trainer.epochs=3", "technique=[batch_ramp]",
        "technique.batch_ramp.mode=auto", "technique.batch_ramp.threshold=0.01",
        "technique.batch_ramp.max_global_batch=128", "technique.batch_ramp.grow=world_size"]


@pytest.mark.slow
def test_an_auto_ramp_run_grows_the_batch_and_the_lr_follows(tmp_path):
    result = train(tmp_path, RAMP)
    changes = result["technique_curves"]["batch_ramp/global_batch"]
    assert len(changes) == 1 and changes[0][1] == 128  # at an epoch's end: 32 -> 128, the cap
    ramped_from = round(changes[0][0] / 512)  # samples seen at the decision: whole epochs of 512
    assert ramped_from in (1, 2)
    assert result["steps"] == ramped_from * 512 // 32 + (3 - ramped_from) * 512 // 128
    assert result["samples_seen"] == 512 * 3
    assert math.isfinite(result["final_test_loss"])
    log = (tmp_path / "train.log").read_text()
    assert f"global batch 32 -> 128 from epoch {ramped_from + 1}" in log
    # The LR follows adam_sqrt at the batch reached: base 1e-3 x sqrt(128 / 64) in the last epoch.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path))
    events.Reload()
    lrs = {int(e.value): [] for e in events.Scalars("train/global_batch")}
    for batch, lr in zip(events.Scalars("train/global_batch"), events.Scalars("train/lr")):
        lrs[int(batch.value)].append(lr.value)
    assert set(lrs) == {32, 128}
    assert max(lrs[32]) == pytest.approx(1e-3 * math.sqrt(0.5), rel=1e-6)
    assert lrs[128][-1] == pytest.approx(1e-3 * math.sqrt(2), rel=1e-6)


TINY_TRANSFORMER = ["model=transformer1d", "model.dim=16", "model.heads=2", "model.depth=1"]


def test_transformer_simulated_workers_equal_one_worker_at_the_same_global_batch(tmp_path):
    # No BatchNorm: two workers of 16 are one worker of 32, but for the order of the samples in the pass
    # (worker-major), i.e. float summation order, which Adam's normalised steps carry to ~3e-5 in 12 steps.
    common = TINY_TRANSFORMER + ["optim=adamw", "trainer.max_steps=12", "trainer.evals=0"]
    train(tmp_path / "one", common + ["trainer.global_batch=32"])
    train(tmp_path / "two", common + ["dist.world_size=2", "trainer.per_worker_batch=16"])
    assert relative_diff(final_params(tmp_path / "one"), final_params(tmp_path / "two")) < 2e-4
