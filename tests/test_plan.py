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
        assert plan_main(["--model", "mlp", "--step-ms", "2", "--network", name, "--max-workers", "4",
                          "--out", str(tmp_path / f"{name}.png")]) == 0
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
    code = plan_main(["--model", "mlp", "--repeats", "3", "--per-worker-batch", "32", "--max-workers", "64",
                      "--network", "1gbe", "--critical-batch", "512", "--out", str(out)])
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
    code = plan_main(["--model", "mlp", "--step-ms", "5", "--max-workers", "16", "--from-study", str(study), "--out",
                      str(tmp_path / "p.png")])
    assert code == 0
    assert "largest safe W at b=32: 8 (global batch 256)" in capsys.readouterr().out


def test_plan_main_custom_network_and_usage_errors(tmp_path, capsys):
    code = plan_main(["--model", "mlp", "--repeats", "3", "--max-workers", "2", "--bandwidth-gbps", "40",
                      "--latency-us", "3", "--out", str(tmp_path / "p.png")])
    assert code == 0
    assert "custom, 40 Gb/s, 3 us" in capsys.readouterr().out
    assert plan_main(["--model", "mlp", "--overlap", "2", "--out", str(tmp_path / "q.png")]) == 2
    assert "--overlap" in capsys.readouterr().err
    assert plan_main(["--from-study", str(tmp_path / "missing"), "--out", str(tmp_path / "r.png")]) == 2
    capsys.readouterr()
    assert plan_main(["--network", "carrier-pigeon"]) == 2
    # argparse's mistakes too: one `lbt: error:` line, no usage block
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("lbt: error: argument --network: invalid choice: 'carrier-pigeon'")


def test_plan_takes_hydra_style_key_values_like_lbt_train(tmp_path, capsys):
    from lbt.apps.plan.cli import config_overrides, hydra_style

    assert hydra_style(["model=resnet20", "per_worker_batch=128", "--network", "1gbe"]) == \
        ["--model", "resnet20", "--per-worker-batch", "128", "--network", "1gbe"]
    # lbt train's overrides of the model and data are composed, not turned into options (--model-name)
    assert config_overrides(["--model", "timm", "model.name=resnet50", "b=8", "+model.img_size=32"]) == \
        (["--model", "timm", "b=8"], ["model.name=resnet50", "+model.img_size=32"])
    with pytest.raises(ValueError, match="per_worker_batch"):
        config_overrides(["trainer.per_worker_batch=8"])  # plan's own option, never silently ignored
    out = tmp_path / "kv.png"
    code = plan_main(["model=mlp", "repeats=3", "max_workers=4", "network=1gbe", f"out={out}"])
    assert code == 0 and out.exists()
    assert "1gbe" in capsys.readouterr().out
    assert plan_main(["model=resnet9000"]) == 2


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
    assert plan_main(["model=resnet20", "data=cifar10", "per_worker_batch=4", "repeats=2", "max_workers=2",
                      f"out={tmp_path / 'r.png'}"]) == 0
    assert "input (3, 32, 32)" in capsys.readouterr().out
    # ResNet-20 on MNIST-1D's 1-D samples: one line, not a traceback
    assert plan_main(["model=resnet20", "per_worker_batch=4", f"out={tmp_path / 's.png'}"]) == 2
    assert "resnet20 cannot take inputs of shape (40,)" in capsys.readouterr().err
