"""`lbt plan`: the cost model's formulas on hand-computed cases, and the command end to end."""

from __future__ import annotations

import pytest

from lbt.apps.plan.cli import plan_main
from lbt.apps.plan.compute import compute_from_result
from lbt.cost.data_parallel import (
    NETWORKS,
    Compute,
    Network,
    epoch_seconds,
    expected_max,
    gradient_bytes,
    ring_allreduce_seconds,
    scaling_rows,
    step_seconds,
    worker_counts,
)
from lbt.data import DataShape
from lbt.engine.build import data_shape
from lbt.spec.result import RunResult, write_result
from lbt.spec.targets import target_of


def test_ring_allreduce_one_worker_costs_nothing():
    assert ring_allreduce_seconds(1e9, 1, 1e9, 1e-3) == 0.0


def test_ring_allreduce_two_workers():
    # 2(W-1)/W = 1: each worker sends the whole buffer once; 2 messages of latency.
    assert ring_allreduce_seconds(1e9, 2, 1e9, 1e-6) == pytest.approx(1.0 + 2e-6)


def test_ring_allreduce_four_workers():
    # 2 x 3/4 x 8 MB / 1 GB/s = 12 ms, plus 2 x 3 x 10 us = 60 us.
    assert ring_allreduce_seconds(8e6, 4, 1e9, 1e-5) == pytest.approx(0.01206)


def test_ring_allreduce_bandwidth_term_saturates_at_twice_the_bytes():
    big = ring_allreduce_seconds(1e6, 1024, 1e6, 0.0)
    assert big == pytest.approx(2 * 1023 / 1024)
    assert big < 2.0


def test_ring_allreduce_rejects_zero_workers():
    with pytest.raises(ValueError):
        ring_allreduce_seconds(1.0, 0, 1.0, 0.0)


def test_step_without_overlap_adds_communication():
    assert step_seconds(0.3, 0.1) == pytest.approx(0.4)


def test_step_overlap_hides_at_most_the_overlapped_backward():
    # 25% of a 0.2 s backward = 50 ms hidden of the 100 ms allreduce.
    assert step_seconds(0.3, 0.1, overlap=0.25, backward_s=0.2) == pytest.approx(0.35)
    # Full overlap hides all of an allreduce shorter than the backward ...
    assert step_seconds(0.3, 0.1, overlap=1.0, backward_s=0.2) == pytest.approx(0.3)
    # ... but never more than the backward itself (default backward: 2/3 of compute = 0.2).
    assert step_seconds(0.3, 0.5, overlap=1.0) == pytest.approx(0.6)


def test_step_rejects_overlap_outside_unit_interval():
    with pytest.raises(ValueError):
        step_seconds(0.3, 0.1, overlap=1.5)


def test_epoch_is_steps_times_step_time():
    assert epoch_seconds(0.4, 60000, 4096) == pytest.approx(60000 / 4096 * 0.4)
    assert epoch_seconds(0.01, 60000, 64) == pytest.approx(9.375)


def test_gradient_bytes_fp32_and_compressed():
    assert gradient_bytes(1000) == 4000
    assert gradient_bytes(1000, "fp16") == 2000
    assert gradient_bytes(1000, "bf16") == 2000
    with pytest.raises(ValueError):
        gradient_bytes(1000, "int8")


def test_worker_counts_are_powers_of_two_then_the_maximum():
    assert worker_counts(1024) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
    assert worker_counts(48) == [1, 2, 4, 8, 16, 32, 48]
    assert worker_counts(1) == [1]


def test_network_presets_cover_the_usual_fabrics():
    assert {"nvlink", "ib-fdr", "100g", "25gbe", "10gbe", "1gbe"} <= set(NETWORKS)
    assert NETWORKS["1gbe"].bandwidth_bytes_per_s == pytest.approx(125e6)
    speeds = [NETWORKS[n].bandwidth_gbps for n in ("nvlink", "100g", "ib-fdr", "25gbe", "10gbe", "1gbe")]
    assert speeds == sorted(speeds, reverse=True)


def test_network_presets_of_current_fabrics_with_their_sources():
    # NVLink 4 (H100), InfiniBand HDR and NDR, 100 and 400 Gigabit Ethernet: per-direction data rates
    current = {"nvlink4": 3600.0, "ib-ndr": 400.0, "400gbe": 400.0, "ib-hdr": 200.0, "100gbe": 100.0}
    assert {name: NETWORKS[name].bandwidth_gbps for name in current} == current
    for name in current:
        assert NETWORKS[name].latency_us > 0 and len(NETWORKS[name].source) > 40  # a stated source
    assert "NVLink 4" in NETWORKS["nvlink4"].source and "802.3bs" in NETWORKS["400gbe"].source
    speeds = [n.bandwidth_gbps for n in NETWORKS.values()]  # --help lists them fastest first
    assert speeds == sorted(speeds, reverse=True)


def test_plan_takes_the_new_network_presets(tmp_path, capsys):
    for name in ("ib-hdr", "ib-ndr", "nvlink4", "100gbe", "400gbe"):
        assert plan_main(["model=mlp", "plan.step_ms=2", f"plan.network={name}", "plan.max_workers=4",
                          f"plan.out={tmp_path / f'{name}.png'}"]) == 0
        assert f"network: {name}, {NETWORKS[name].bandwidth_gbps:g} Gb/s" in capsys.readouterr().out


def test_scaling_rows_hand_computed_with_a_slow_network():
    # 10 ms of compute at b=100, 25M parameters = 100 MB of fp32 gradient over 1 Gb/s (125 MB/s), no latency.
    compute = Compute(0.004, 0.006, 0.0, per_worker_batch=100, num_params=25_000_000, source="test")
    net = Network("test", 1.0, 0.0, "test")
    rows = scaling_rows(compute, net, [1, 2, 4], train_samples=1000, critical_batch=250)
    one, two, four = rows
    assert one.epoch_s == pytest.approx(10 * 0.01) and one.speedup == pytest.approx(1.0)
    # W=2: allreduce = 1 x 100 MB / 125 MB/s = 0.8 s; 5 steps of 0.81 s.
    assert two.allreduce_s == pytest.approx(0.8)
    assert two.epoch_s == pytest.approx(5 * 0.81)
    assert two.speedup == pytest.approx(0.1 / 4.05)
    assert two.efficiency == pytest.approx(two.speedup / 2)
    assert two.slower and not one.slower
    # W=4: allreduce = 1.5 x 0.8 = 1.2 s; 2.5 steps of 1.21 s: faster than W=2 again.
    assert four.epoch_s == pytest.approx(2.5 * 1.21)
    assert not four.slower
    assert [r.beyond_critical for r in rows] == [False, False, True]
    assert [r.global_batch for r in rows] == [100, 200, 400]


def test_scaling_rows_compression_and_overlap():
    compute = Compute(0.01, 0.02, 0.0, per_worker_batch=64, num_params=1_000_000, source="test")
    net = Network("test", 8.0, 0.0, "test")  # 1 GB/s
    plain, = scaling_rows(compute, net, [2], 64_000)[0:1]
    half, = scaling_rows(compute, net, [2], 64_000, compression="fp16")[0:1]
    assert plain.allreduce_s == pytest.approx(4e-3) and half.allreduce_s == pytest.approx(2e-3)
    hidden, = scaling_rows(compute, net, [2], 64_000, overlap=0.1)[0:1]
    # 10% of the 20 ms backward = 2 ms hidden of the 4 ms allreduce.
    assert hidden.step_s == pytest.approx(0.03 + 0.002)


def test_expected_max_by_hand():
    # Two equally likely step times, 10 and 20 ms: one worker 15 ms on average; the slower of
    # two is 20 ms unless both draw 10 ms (probability 1/4): 0.25 x 10 + 0.75 x 20 = 17.5 ms.
    assert expected_max([0.02, 0.01], 1) == pytest.approx(0.015)
    assert expected_max([0.01, 0.02], 2) == pytest.approx(0.0175)
    # Slowest of 4: 20 ms unless all four draw 10 ms (1/16).
    assert expected_max([0.01, 0.02], 4) == pytest.approx(0.01 / 16 + 0.02 * 15 / 16)
    assert expected_max([0.005] * 7, 64) == pytest.approx(0.005)  # no spread, no straggler cost
    with pytest.raises(ValueError):
        expected_max([], 2)


def test_scaling_rows_wait_for_the_slowest_worker():
    samples = (0.01, 0.01, 0.01, 0.03)  # a step in four takes three times as long
    compute = Compute(0.004, 0.006, 0.0, per_worker_batch=10, num_params=1, source="test", step_samples=samples)
    one, two = scaling_rows(compute, Network("test", 1e6, 0.0, "test"), [1, 2], train_samples=1000)
    assert one.compute_s == pytest.approx(0.015)  # the mean: what samples/s measures
    # The slower of two: 30 ms unless neither draws it (9/16): 9/16 x 10 + 7/16 x 30 = 18.75 ms.
    assert two.compute_s == pytest.approx(0.01875) and two.step_s == pytest.approx(0.01875, rel=1e-4)
    assert two.speedup == pytest.approx(2 * 0.015 / 0.01875, rel=1e-4)


def test_compute_from_result(tmp_path):
    config = {"model": {"_target_": "lbt.models.MLP", "hidden": 128, "num_layers": 2},
              "data": {"_target_": "lbt.data.build_synthetic", "num_train": 512, "input_shape": [40],
                       "num_classes": 10}}
    path = write_result(tmp_path, RunResult(samples_per_sec=6400.0, per_worker_batch=64, world_size=4, procs=1,
                                            global_batch=256, final_acc=0.9, final_loss=0.3, config=config))
    compute, model, shape = compute_from_result(path)
    # step = 256 samples / 6400 samples/s = 40 ms for 4 simulated workers: 10 ms each.
    assert compute.total_s == pytest.approx(0.01)
    assert compute.per_worker_batch == 64
    assert compute.num_params == 40 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10
    assert shape.num_train == 512 and model.target == "lbt.models.MLP"


def test_plan_main_prints_the_table_and_writes_the_png(tmp_path, capsys):
    out = tmp_path / "plan.png"
    code = plan_main(["model=mlp", "plan.repeats=3", "trainer.per_worker_batch=32", "plan.max_workers=64",
                      "plan.network=1gbe", "plan.critical_batch=512", f"plan.out={out}"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "global batch" in printed and "efficiency" in printed
    assert "B > B_crit" in printed
    for w in (1, 2, 4, 8, 16, 32, 64):
        assert any(line.split()[:1] == [str(w)] for line in printed.splitlines())
    assert str(out.resolve()) in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_main_critical_batch_from_a_study(tmp_path, capsys):
    from test_plan_inputs import study_of

    study = study_of(tmp_path / "study")  # lars keeps global batch 256 (8 GPUs), baseline 64 (2 GPUs)
    code = plan_main(["model=mlp", "plan.step_ms=5", "plan.max_workers=16", f"plan.from_study={study}",
                      f"plan.out={tmp_path / 'p.png'}"])
    assert code == 0
    assert "largest safe W at b=32: 8 (global batch 256)" in capsys.readouterr().out


def test_plan_main_custom_network_and_usage_errors(tmp_path, capsys):
    code = plan_main(["model=mlp", "plan.repeats=3", "plan.max_workers=2", "plan.bandwidth_gbps=40",
                      "plan.latency_us=3", f"plan.out={tmp_path / 'p.png'}"])
    assert code == 0
    assert "custom, 40 Gb/s, 3 us" in capsys.readouterr().out
    assert plan_main(["model=mlp", "plan.overlap=2", f"plan.out={tmp_path / 'q.png'}"]) == 2
    assert capsys.readouterr().err == "lbt: error: plan.overlap must be a number in [0, 1], got 2.0\n"
    assert plan_main([f"plan.from_study={tmp_path / 'missing'}", f"plan.out={tmp_path / 'r.png'}"]) == 2
    capsys.readouterr()
    assert plan_main(["plan.network=carrier-pigeon"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lbt: error: plan.network must be one of nvlink4, ")
    assert err.endswith("got 'carrier-pigeon'\n")


# -- the command line: lbt train's overrides for the run, plan.KEY=VALUE for the plan's own settings --------------
def test_a_plan_setting_is_a_hydra_override_that_changes_the_table(tmp_path, capsys):
    def allreduce_ms(network: str) -> float:
        assert plan_main(["model=mlp", "plan.step_ms=2", "plan.max_workers=2", f"plan.network={network}",
                          f"plan.out={tmp_path / 'p.png'}"]) == 0
        rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("2 ")]
        return float(rows[0][3])  # W=2's allreduce column

    assert allreduce_ms("1gbe") > 10 * allreduce_ms("25gbe") > 0  # 22,000 parameters over 1 vs 25 Gb/s


def test_a_mistyped_plan_setting_gets_did_you_mean(capsys):
    assert plan_main(["model=mlp", "plan.netwrok=10gbe"]) == 2
    assert capsys.readouterr().err == "lbt: error: plan.netwrok: no such key in plan; did you mean plan.network?\n"
    assert plan_main(["plan.max_workers=many"]) == 2  # a value of the wrong type: Hydra's line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plan.max_workers=many" in err and "Integer" in err
    assert plan_main(["trainer.per_worker_bach=8"]) == 2  # the run's keys are lbt train's, mistyped as there
    assert "did you mean trainer.per_worker_batch?" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--network", "25gbe"], "--network is now plan.network=VALUE"),
    (["--from-result=runs/x/result.json"], "--from-result is now plan.from_result=VALUE"),
    (["-N", "1000"], "-N is now plan.train_samples=N"),
    (["--model", "mlp"],
     "--model is now model=NAME (your own class: model=custom model._target_=package.module.Class)"),
    (["--per-worker-batch", "128"], "--per-worker-batch is now trainer.per_worker_batch=N"),
    (["-b", "128"], "-b is now trainer.per_worker_batch=N"),
    (["--input-shape", "40"], "--input-shape is now data.input_shape=[DIMS]"),
    (["network=25gbe"], "network=25gbe is now plan.network=25gbe"),
    (["per_worker_batch=128"], "per_worker_batch=128 is now trainer.per_worker_batch=128"),
    (["num_classes=2"], "num_classes=2 is now data.num_classes=2"),
])
def test_an_old_option_names_its_new_key(args, says, capsys):
    assert plan_main(["model=mlp", *args]) == 2
    assert capsys.readouterr().err == f"lbt: error: {says} (lbt plan takes Hydra overrides)\n"


def test_keys_a_plan_does_not_read_are_refused(capsys):
    assert plan_main(["--frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("lbt: error: lbt plan takes Hydra overrides (model=NAME, ")
    assert plan_main(["model=mlp", "dist.shard=fsdp"]) == 2  # lbt train's key, which the plan would ignore
    assert capsys.readouterr().err == (
        "lbt: error: dist.shard=fsdp: lbt plan reads the model, the data and trainer.per_worker_batch of lbt train's "
        "config, nothing else of it; did you mean plan.shard=fsdp?\n")
    assert plan_main(["plan.from_result=runs/x/result.json", "model=mlp"]) == 2
    assert "plan.from_result plans the model and data of its run" in capsys.readouterr().err


def test_plan_modes_are_the_presets_of_lbt_cost():
    from typing import get_args

    from lbt.apps.plan.settings import GpuName, NetworkName, OptimizerName, Precision
    from lbt.cost.gpu import GPUS, PRECISIONS
    from lbt.cost.memory import OPTIMIZER_SLOTS

    assert get_args(NetworkName) == tuple(NETWORKS)  # the help lists them in this order, fastest first
    assert get_args(GpuName) == tuple(GPUS) and get_args(Precision) == PRECISIONS
    assert get_args(OptimizerName) == tuple(OPTIMIZER_SLOTS)


def test_models_and_data_come_from_conf():
    from lbt.apps.compose import conf_dir
    from lbt.apps.plan.compute import config_names

    assert config_names("model") == sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))
    assert {"cnn1d", "mlp", "resnet20", "torchvision"} <= set(config_names("model"))
    assert {"mnist1d", "cifar10", "synthetic", "imagefolder"} <= set(config_names("data"))
    # Without loading the data: MNIST-1D's defaults are 60,000 train samples of 40 values; CIFAR-10's folder is absent.
    assert data_shape(target_of({"_target_": "lbt.data.build_mnist1d"}, "data")) == DataShape((40,), 10, 60000)
    cifar = target_of({"_target_": "lbt.data.build_cifar10", "root": "/nowhere", "val_fraction": 0.1}, "data")
    assert data_shape(cifar) == \
        DataShape((3, 32, 32), 10, 45000)


def test_data_shape_agrees_with_the_built_data():
    from lbt.data import build_synthetic

    node = {"_target_": "lbt.data.build_synthetic", "num_train": 300, "input_shape": [3, 8, 8], "num_classes": 7,
            "val_fraction": 0.25}
    built = build_synthetic(**{k: v for k, v in node.items() if k != "_target_"})
    assert data_shape(target_of(node, "data")) == DataShape(tuple(built.input_shape), built.num_classes,
                                                            len(built.train))


def test_plan_profiles_a_model_on_the_data_it_names(tmp_path, capsys):
    assert plan_main(["model=resnet20", "data=cifar10", "trainer.per_worker_batch=4", "plan.repeats=2",
                      "plan.max_workers=2", f"plan.out={tmp_path / 'r.png'}"]) == 0
    assert "input (3, 32, 32)" in capsys.readouterr().out
    # ResNet-20 on MNIST-1D's 1-D samples: one line, not a traceback
    assert plan_main(["model=resnet20", "trainer.per_worker_batch=4", f"plan.out={tmp_path / 's.png'}"]) == 2
    assert "resnet20 cannot take inputs of shape (40,)" in capsys.readouterr().err
