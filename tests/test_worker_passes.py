"""How simulated workers are passed through the model (dist.fuse_workers, lbt/engine/passes.py): fused (one pass,
per-worker BatchNorm chunks), sequential (one pass per worker), or auto's passes of about 256 samples. Each path
trains the same run; BatchNorm's epoch average survives the fused layers. Real processes against simulated
workers: tests/test_real_equals_simulated.py."""

import pytest
from conftest import final_params, relative_diff, train

STEPS = ["data.num_train=1280", "trainer.epochs=1", "optim.lr=0.05"]  # 1280 / 64 = 20 steps
W4 = ["dist.world_size=4", "trainer.global_batch=64"]


@pytest.mark.slow
def test_bn_epoch_average_is_the_same_fused_and_sequential(tmp_path):
    """akiba2017 swaps BN's moving average for the epoch's plain average; fused
    simulation replaces BN layers with per-worker ones, which must keep it."""
    common = ["model=cnn1d", "recipe=akiba2017", "data.num_train=640", "trainer.epochs=2",
              "dist.world_size=4", "trainer.global_batch=64"]
    fused = train(tmp_path / "fused", common + ["dist.fuse_workers=true"])
    sequential = train(tmp_path / "seq", common + ["dist.fuse_workers=false"])
    assert relative_diff(final_params(tmp_path / "fused"), final_params(tmp_path / "seq")) < 1e-5
    assert fused["final_test_loss"] == pytest.approx(sequential["final_test_loss"], rel=1e-4)
    assert fused["final_test_acc"] == pytest.approx(sequential["final_test_acc"], abs=1e-9)


def test_auto_passes_hold_about_256_samples_of_a_batchnorm_model_on_cpu():
    from lbt.engine.passes import PASS_SAMPLES, workers_per_pass

    assert PASS_SAMPLES == 256
    assert workers_per_pass("auto", 16, 256, True, "cpu") == 1  # big workers: one pass each
    assert workers_per_pass("auto", 128, 32, True, "cpu") == 8  # 32-sample workers: 8 per pass of 256
    assert workers_per_pass("auto", 6, 64, True, "cpu") == 3  # 4 would fit; 3 is the largest divisor of 6 that does
    assert workers_per_pass("auto", 2, 16, True, "cpu") == 2  # all of them fit in one pass
    assert workers_per_pass("auto", 16, 256, False, "cpu") == 16  # no BatchNorm: nothing to copy, one pass
    assert workers_per_pass("auto", 16, 256, True, "cuda") == 16
    assert workers_per_pass(True, 16, 256, True, "cpu") == 16 and workers_per_pass(False, 16, 8, False, "cpu") == 1


@pytest.mark.parametrize("per_worker_batch, same_as", [(256, "false"), (16, "true")])
def test_auto_takes_the_path_its_rule_names(tmp_path, per_worker_batch, same_as):
    """cnn1d (BatchNorm), 2 simulated workers: auto is bitwise the sequential run at b=256, the fused one at b=16."""
    common = ["model=cnn1d", "model.channels=8", f"data.num_train={4 * 2 * per_worker_batch}", "trainer.epochs=1",
              "dist.world_size=2", f"trainer.per_worker_batch={per_worker_batch}", "trainer.evals=0"]
    train(tmp_path / "auto", common + ["dist.fuse_workers=auto"])
    train(tmp_path / "chosen", common + [f"dist.fuse_workers={same_as}"])
    train(tmp_path / "other", common + [f"dist.fuse_workers={'true' if same_as == 'false' else 'false'}"])
    auto, chosen = final_params(tmp_path / "auto"), final_params(tmp_path / "chosen")
    assert auto.equal(chosen)
    assert not auto.equal(final_params(tmp_path / "other"))  # the two paths' float sums differ: the check can fail


def test_passes_of_a_few_workers_are_exact_too(tmp_path):
    """8 workers of b=64 under auto run as 2 passes of 4 (per-worker BN chunks in each): the same
    parameters as one fused pass and as 8 passes, within float tolerance, and bitwise neither."""
    common = ["model=cnn1d", "model.channels=8", "data.num_train=2048", "trainer.epochs=1", "dist.world_size=8",
              "trainer.per_worker_batch=64", "trainer.evals=0"]
    paths = {}
    for fuse in ("auto", "true", "false"):
        train(tmp_path / fuse, common + [f"dist.fuse_workers={fuse}"])
        paths[fuse] = final_params(tmp_path / fuse)
    assert relative_diff(paths["auto"], paths["true"]) < 1e-5 and relative_diff(paths["auto"], paths["false"]) < 1e-5
    assert not paths["auto"].equal(paths["true"]) and not paths["auto"].equal(paths["false"])
