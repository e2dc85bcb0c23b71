"""What a run writes: TensorBoard events readable by TensorBoard, and result.json."""

import json
import math

import pytest
import torch
from conftest import FAST, compose_config, names_val, train
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2

from lbt.engine import make_spec
from lbt.engine.build import build_data, build_model
from lbt.engine.evaluate import evaluate
from lbt.engine.precision import Precision
from lbt.parallel.process_group import DistContext


def test_tensorboard_and_result_json(tmp_path):
    # 640 samples, 128 held out for validation: 512 to train on, 8 steps of 64 per epoch
    result = train(tmp_path, ["model=mlp", "trainer.epochs=3", "dist.world_size=2", "trainer.per_worker_batch=32",
                              "trainer.log_every=2", "data.num_train=640", "data.val_fraction=0.2",
                              "trainer.evals=0"])
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    by_samples = EventAccumulator(str(tmp_path / "by_samples"))
    by_samples.Reload()
    for tag in ("train/loss", "train/lr", "train/global_batch", "val/loss", "val/acc", "perf/samples_per_sec"):
        assert tag in tags and tag in by_samples.Tags()["scalars"]
    val_acc = events.Scalars("val/acc")
    assert [e.step for e in val_acc] == [8, 16, 24]  # 512 samples / 64 per step = 8 steps per epoch
    assert [e.step for e in by_samples.Scalars("val/acc")] == [512, 1024, 1536]
    assert val_acc[-1].value == result["final_val_acc"]
    assert all(e.value == 64 for e in events.Scalars("train/global_batch"))
    # cosine decay from optim.lr (0.1, the peak without warmup) towards 0, logged with each step
    lrs = [e.value for e in events.Scalars("train/lr")]
    assert lrs[0] == pytest.approx(0.1) and lrs == sorted(lrs, reverse=True) and lrs[-1] < 0.01
    # TensorBoard's HParams table: one row with the run's settings and its accuracy
    hparams = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(hparams["_hparams_/session_start_info"]).session_start_info
    assert set(start.hparams) == {"world_size", "per_worker_batch", "global_batch", "recipe", "lr", "peak_lr",
                                  "peak_lr_samples", "seed", "model", "data", "optim", "schedule", "techniques"}
    # Runs that differ only in optimizer, schedule or techniques must not look identical there.
    assert start.hparams["optim"].string_value == "SGD" and start.hparams["techniques"].string_value == "none"
    assert "cosine decay" in start.hparams["schedule"].string_value
    assert {"hparam/final_val_acc", "hparam/best_val_acc", "hparam/test_acc"} <= tags
    assert start.hparams["global_batch"].number_value == 64 and start.hparams["recipe"].string_value == "baseline"
    assert events.Scalars("hparam/final_val_acc")[-1].value == pytest.approx(result["final_val_acc"])

    on_disk = json.loads((tmp_path / "result.json").read_text())
    assert on_disk == json.loads(json.dumps(result))
    for key in ("world_size", "procs", "per_worker_batch", "global_batch", "final_val_acc", "best_val_acc",
                "final_val_loss", "final_train_loss", "steps", "samples_seen", "wall_seconds", "samples_per_sec",
                "diverged", "peak_lr", "peak_lr_samples", "config"):
        assert key in on_disk
    assert on_disk["eval_split"] == "val" and len(on_disk["val_history"]) == 3 and on_disk["test_acc"] is not None
    assert on_disk["global_batch"] == 64 and on_disk["steps"] == 24 and on_disk["samples_seen"] == 24 * 64
    assert on_disk["diverged"] is False and math.isfinite(on_disk["final_train_loss"])
    assert on_disk["best_val_acc"] >= on_disk["final_val_acc"] > 0.2  # 10 classes: chance is 0.1
    assert on_disk["config"]["dist"]["world_size"] == 2


def test_same_seed_same_result(tmp_path):
    a = train(tmp_path / "a", ["model=cnn1d", "trainer.epochs=1", "dist.world_size=2"])
    b = train(tmp_path / "b", ["model=cnn1d", "trainer.epochs=1", "dist.world_size=2"])
    assert a["final_train_loss"] == b["final_train_loss"] and a["test_history"] == b["test_history"]


def test_diverged_run_is_recorded_and_exits_cleanly(tmp_path):
    result = train(tmp_path, ["model=mlp", "optim.lr=1e6", "schedule=constant", "trainer.epochs=5",
                              "trainer.log_every=1"])
    assert result["diverged"] is True
    assert result["steps"] < 5 * 8


@pytest.mark.slow
def test_evaluations_are_log_spaced_besides_epoch_ends(tmp_path):
    result = train(tmp_path, ["model=mlp", "trainer.epochs=3", "data.num_train=1280", "trainer.evals=8"])
    steps = [p["step"] for p in result["test_history"]]  # no validation split: test, named test
    assert {20, 40, 60} <= set(steps) and steps == sorted(set(steps)) and len(steps) >= 8
    assert steps[0] == 1  # the first point sits after the first step, then they spread out geometrically


def test_without_a_validation_split_nothing_is_named_val(tmp_path):
    result = train(tmp_path, ["model=mlp", "trainer.epochs=2", "data.val_fraction=0"])
    assert result["eval_split"] == "test" and result["final_test_acc"] == result["test_acc"]
    assert not [k for k in result if names_val(k)]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert not [t for t in events.Tags()["scalars"] if names_val(t)]
    assert len(events.Scalars("test/acc")) == len(result["test_history"])


def test_validation_split_keeps_test_for_the_end(tmp_path):
    overrides = ["model=mlp", "trainer.epochs=1", "data.val_fraction=0.25"]
    result = train(tmp_path, overrides)
    assert result["test_acc"] is not None and result["test_loss"] is not None and "test/acc" not in result
    # test_acc is the saved final model scored on the test split (not on val, not a copy of another field).
    config, recipe = compose_config(FAST + overrides)
    spec = make_spec(config, recipe)
    data = build_data(spec.data)
    model = build_model(spec.model, data.input_shape, data.num_classes)
    model.load_state_dict(torch.load(tmp_path / "final_model.pt", weights_only=True))
    cpu = DistContext(0, 1, 0, 1, torch.device("cpu"))
    loss, acc = evaluate(model, data.test, cpu, Precision())
    assert acc == result["test_acc"] and loss == pytest.approx(result["test_loss"], rel=1e-6)
    assert evaluate(model, data.val, cpu, Precision())[1] == result["final_val_acc"]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.value for e in events.Scalars("test/acc")] == [pytest.approx(result["test_acc"])]
    assert result["samples_seen"] == (384 // 64) * 64  # 512 - 128 held out


def test_the_noise_scale_pass_is_timed_as_its_own_phase(tmp_path):
    """Simulated workers: the measurement's extra pass shows as measure_s (its cost), a phase of its own.

    How long it takes against compute_s is a timing, measured by bench/ scripts, not asserted here: on a
    loaded machine a step of this tiny model is noise."""
    result = train(tmp_path, ["model=mlp", "trainer.epochs=1", "dist.world_size=4", "measure=[gns]",
                              "technique.gns.every=2"])
    assert set(result["step_seconds"]) == {"data_s", "compute_s", "measure_s", "optimizer_s"}
    assert result["step_seconds"]["measure_s"] > 0 and result["step_seconds"]["compute_s"] > 0


def test_no_progress_bar_frames_when_stderr_is_not_a_terminal(tmp_path, capfd):
    """With the output going to a file, the bar wrote thousands of carriage-return frames into it: tqdm's
    convention (disable=None) is no bar off a terminal."""
    from conftest import train

    train(tmp_path, ["model=mlp", "trainer.max_steps=8", "trainer.log_every=1", "trainer.progress=true"])
    out, err = capfd.readouterr()
    assert "\r" not in out + err and "done:" in out
