"""Exact simulation (DESIGN "Exact simulation of W workers on P processes").

After 20 steps at global batch 64:
- BN-free mlp: W=4 on 4 real processes (P=4 x k=1), W=4 on 2 processes of 2
  simulated workers each (P=2 x k=2), W=4 simulated on 1 process (P=1 x k=4),
  and W=1 with per_worker_batch 64 give the same parameters;
- cnn1d with BatchNorm: the three W=4 layouts agree, and differ from W=1,
  because each worker normalises over its own 16 samples.
Simulation is checked both fused (one pass, per-worker BN chunks) and sequential.
"""

import pytest
from conftest import final_params, initial_params, relative_diff, train

STEPS = ["data.num_train=1280", "trainer.epochs=1", "optim.lr=0.05"]  # 1280 / 64 = 20 steps
W4 = ["dist.world_size=4", "trainer.global_batch=64"]


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """layouts(model, fuse): final parameters and results of P=4 x k=1, P=2 x k=2, P=1 x k=4 (all W=4), and
    W=1. The runs that do not simulate (P=4 and W=1) are trained once per model for both `fuse` values."""
    unsimulated: dict[str, tuple] = {}

    def runs(model: str, fuse: bool) -> tuple[list, tuple]:
        common = [f"model={model}", *STEPS]
        root = tmp_path_factory.mktemp(f"{model}-{fuse}")
        if model not in unsimulated:
            shared = tmp_path_factory.mktemp(model)
            real = train(shared / "real", common + W4 + ["dist.procs=4"])
            single = train(shared / "single", common + ["dist.world_size=1", "trainer.per_worker_batch=64"])
            unsimulated[model] = (real, final_params(shared / "real"), single, final_params(shared / "single"))
        real, real_params, single, single_params = unsimulated[model]
        fuse_workers = f"dist.fuse_workers={str(fuse).lower()}"
        mixed = train(root / "mixed", common + W4 + ["dist.procs=2", fuse_workers])
        simulated = train(root / "sim", common + W4 + ["dist.procs=1", fuse_workers])
        results = (real, mixed, simulated, single)
        for result in results:
            assert result["steps"] == 20 and result["global_batch"] == 64
        assert (real["procs"], mixed["procs"], simulated["procs"]) == (4, 2, 1)
        return [real_params, final_params(root / "mixed"), final_params(root / "sim"), single_params], results

    return runs


@pytest.mark.slow
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "sequential"])
def test_bn_free_model_is_identical_across_layouts(layouts, fuse):
    (real, mixed, simulated, single), results = layouts("mlp", fuse)
    assert relative_diff(real, simulated) < 1e-5
    assert relative_diff(real, single) < 1e-5
    assert relative_diff(simulated, single) < 1e-5
    assert relative_diff(mixed, real) < 1e-5
    assert relative_diff(mixed, simulated) < 1e-5
    # The runs really trained: the parameters moved from their (shared) initial values a
    # thousand times the tolerance above (5.4e-2 with torch 2.14).
    assert relative_diff(real, initial_params(["model=mlp", *STEPS])) > 1e-2
    assert results[0]["final_train_loss"] == pytest.approx(results[3]["final_train_loss"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "sequential"])
def test_batchnorm_model_real_equals_simulated_but_not_single_worker(layouts, fuse):
    (real, mixed, simulated, single), results = layouts("cnn1d", fuse)
    assert relative_diff(real, simulated) < 1e-5
    assert relative_diff(real, mixed) < 1e-5
    # per-worker BN statistics over 16 samples are not those over 64 samples
    assert relative_diff(real, single) > 1e-3
    # evaluation uses the workers' averaged running stats: the same in every W=4 layout
    for other in results[1:3]:
        assert results[0]["final_test_acc"] == pytest.approx(other["final_test_acc"], abs=1e-9)
        assert results[0]["final_test_loss"] == pytest.approx(other["final_test_loss"], rel=1e-4)


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


@pytest.mark.slow
def test_real_processes_stop_at_a_target_where_simulated_workers_do(tmp_path):
    """trainer.stop_at_val_acc reads the val split scored over every process (an allreduce), so a run's
    processes agree on the evaluation that ends it: W=2 on 2 processes ends where W=2 on 1 process does."""
    common = ["model=mlp", *STEPS, "data.val_fraction=0.25", "trainer.epochs=2", "dist.world_size=2",
              "trainer.global_batch=64"]
    whole = train(tmp_path / "whole", common + ["dist.procs=1"])
    history = whole["val_history"]
    # An evaluation before the last that is the first to reach its accuracy: the stop's.
    k = next(k for k, p in enumerate(history[:-1]) if k > 2 and all(q["acc"] < p["acc"] for q in history[:k]))
    stop = f"trainer.stop_at_val_acc={history[k]['acc']!r}"
    real = train(tmp_path / "real", common + ["dist.procs=2", stop])
    simulated = train(tmp_path / "sim", common + ["dist.procs=1", stop])
    assert real["ended_at_target"] and simulated["ended_at_target"]
    assert real["steps"] == simulated["steps"] == history[k]["step"] < whole["steps"]
    assert real["final_val_acc"] == pytest.approx(simulated["final_val_acc"]) == history[k]["acc"]
