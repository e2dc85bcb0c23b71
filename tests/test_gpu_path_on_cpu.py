"""The GPU path on a CPU: mixed precision (bf16 end to end, fp16's loss scaler), torch.compile,
channels_last, device-resident data and the stall-free step timer (lbt/engine/precision.py, lbt/data/batches.py,
lbt/metrics/timing.py)."""

import importlib
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config, final_params, relative_diff, train
from torch import nn

from lbt.data.base import DataSplits, InMemoryDataset
from lbt.data.batches import StepBatches, eval_batches
from lbt.engine import make_spec, run
from lbt.engine.precision import Precision
from lbt.errors import ConfigError
from lbt.metrics import timing
from lbt.spec.batching import BatchLayout
from lbt.techniques.base import Technique

# 6 steps of global batch 64 per epoch on a small BatchNorm-free MLP.
MLP = ["model=mlp", "model.hidden=32", "data.num_train=384", "data.num_test=64", "trainer.epochs=1",
       "trainer.global_batch=64", "optim.lr=0.05", "trainer.evals=0"]


# -- bf16 ------------------------------------------------------------------------------------------------
class StopAt(Technique):
    """Asks the run to stop (as a scheduler's SIGTERM would) after `step` steps."""

    name = "stop_at"

    def __init__(self, step: int):
        self.step = step

    def after_backward(self, model, progress) -> None:
        if progress.step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_resumes_exactly(precision, tmp_path):
    """Stopped mid-epoch by SIGTERM and resumed: bitwise the run trained straight (fp16: with its scaler)."""
    overrides = [*MLP, "trainer.epochs=2", "trainer.log_every=2", "dist.world_size=2", f"trainer.precision={precision}"]
    straight = train(tmp_path / "straight", overrides)
    config, recipe = compose_config(FAST + overrides)
    assert run(make_spec(config, recipe), tmp_path / "resumed", techniques=[StopAt(7)]).stopped
    saved = torch.load(next((tmp_path / "resumed" / "checkpoint").glob("step_*/rank0.pt")), weights_only=True)
    if precision == "fp16":
        assert saved["precision"]["scaler"]["scale"] == 65536.0 and saved["precision"]["skipped_steps"] == 0
    resumed = train(tmp_path / "resumed", overrides + ["trainer.resume=auto"])
    assert torch.equal(final_params(tmp_path / "straight"), final_params(tmp_path / "resumed"))
    assert straight["final_train_loss"] == resumed["final_train_loss"]
    assert straight["technique_metrics"] == resumed["technique_metrics"]


# -- fp16's loss scaler ----------------------------------------------------------------------------------
def fp16_step(precision: Precision, model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """One step as lbt/engine/step.py takes it; returns the gradients techniques would see."""
    optimizer.zero_grad(set_to_none=True)
    inputs, labels = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)), torch.arange(8) % 3
    with precision.autocast():
        loss = nn.functional.cross_entropy(model(inputs), labels)
    precision.backward(loss)
    precision.unscale(optimizer)
    grads = [p.grad.clone() for p in model.parameters()]
    precision.step(optimizer)
    return grads


def tiny_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_fp16_techniques_and_the_optimizer_see_unscaled_gradients():
    model, optimizer = tiny_model()
    grads = fp16_step(Precision("fp16", "cpu"), model, optimizer)
    reference_model, reference_optimizer = tiny_model()
    reference = fp16_step(Precision("fp32", "cpu"), reference_model, reference_optimizer)
    for g, r in zip(grads, reference):
        assert relative_diff(r.flatten(), g.flatten()) < 1e-2  # fp16 rounding, not a factor of 65536


def test_fp16_overflow_skips_the_step_and_the_scaler_state_round_trips():
    model, optimizer = tiny_model()
    precision = Precision("fp16", "cpu")
    precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**80)  # overflows fp16 gradients
    before = [p.detach().clone() for p in model.parameters()]
    fp16_step(precision, model, optimizer)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # skipped
    assert precision.metrics() == {"amp/skipped_steps": 1.0, "amp/scale": 2.0**79}
    fp16_step(precision, model, optimizer)
    state = precision.state_dict()
    restored = Precision("fp16", "cpu")
    restored.load_state_dict(state)
    assert restored.state_dict() == state and restored.scaler.get_scale() == precision.scaler.get_scale()
    assert Precision("bf16", "cpu").state_dict() == {} and Precision().metrics() == {}


def test_new_trainer_values_are_checked_in_one_line():
    config, _ = compose_config(FAST)
    for key, value, message in (("precision", "fp8", "trainer.precision must be one of fp32, bf16, fp16"),
                                ("loader_workers", -1, "trainer.loader_workers must be an integer from 0")):
        with pytest.raises(ConfigError, match=message):
            make_spec({**config, "trainer": {**config["trainer"], key: value}})


# -- torch.compile and channels_last -------------------------------------------------------------------
@pytest.mark.slow
def test_compiled_model_trains_as_the_eager_one(tmp_path, monkeypatch):
    tiny = ["model=mlp", "model.hidden=16", "model.num_layers=1", "data.num_train=256", "data.num_test=64",
            "trainer.epochs=1", "trainer.global_batch=64", "trainer.evals=0"]
    import torch._inductor.config
    from torch._dynamo.utils import counters

    # Compile in this process: a pool of compile workers costs more than it saves for a tiny model.
    monkeypatch.setattr(torch._inductor.config, "compile_threads", 1)
    counters.clear()
    compiled = train(tmp_path / "compiled", tiny + ["trainer.compile=true"])
    assert counters["stats"]["unique_graphs"] >= 1  # dynamo did capture the forward
    train(tmp_path / "eager", tiny)
    assert compiled["steps"] == 4
    assert relative_diff(final_params(tmp_path / "eager"), final_params(tmp_path / "compiled")) < 1e-5


def test_channels_last_is_refused_for_data_that_is_not_images(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.channels_last=true is for 2-D convolutional models.*\(40,\)"):
        train(tmp_path, ["model=mlp", "trainer.channels_last=true"])


@pytest.mark.slow
def test_channels_last_trains_as_the_default_layout(tmp_path):
    images = ["model=resnet20", "model.width=4", "data.input_shape=[3,8,8]", "data.num_train=64",
              "data.num_test=16", "trainer.epochs=1", "trainer.global_batch=16", "trainer.evals=0"]
    train(tmp_path / "last", images + ["trainer.channels_last=true"])
    train(tmp_path / "default", images)
    assert relative_diff(final_params(tmp_path / "default"), final_params(tmp_path / "last")) < 1e-4


# -- data on the device ----------------------------------------------------------------------------------
def test_in_memory_data_is_gathered_on_its_device():
    """On the meta device every tensor exists in shape only: a batch that went through the host fails."""
    x, y = torch.randn(100, 3, 4, 4), torch.arange(100)
    splits = DataSplits(InMemoryDataset(x, y), None, InMemoryDataset(x[:10], y[:10]), 10, (3, 4, 4))
    on_meta = splits.to(torch.device("meta"))
    assert on_meta.train.x.is_meta and on_meta.test.y.is_meta and splits.train.x.device.type == "cpu"
    plan = BatchLayout(world_size=2, procs=1, per_worker_batch=8, global_batch=16)
    batches = StepBatches(on_meta.train, plan, 0, 0, torch.device("meta"), memory_format=torch.channels_last)
    steps = list(batches.epoch(0))
    assert len(steps) == 6 and all(x.is_meta and x.shape == (16, 3, 4, 4) for x, _ in steps)
    assert steps[0][0].is_contiguous(memory_format=torch.channels_last)
    assert [len(y) for _, y in eval_batches(on_meta.test, 0, 1, 4, torch.device("meta"))] == [4, 4, 2]


@pytest.mark.slow
def test_loader_workers_give_the_same_batches_and_persist_across_epochs():
    data = torch.utils.data.TensorDataset(torch.arange(64.0).unsqueeze(1), torch.arange(64))  # read sample by sample
    plan = BatchLayout(world_size=2, procs=1, per_worker_batch=4, global_batch=8)
    plain = StepBatches(data, plan, 0, 0, torch.device("cpu"))
    workers = StepBatches(data, plan, 0, 0, torch.device("cpu"), num_workers=1)
    for epoch in range(2):
        expected = [y.tolist() for _, y in plain.epoch(epoch, 1)]
        assert [y.tolist() for _, y in workers.epoch(epoch, 1)] == expected and len(expected) == 7
        if epoch == 0:
            loader = workers.loader()
    assert workers.loader() is loader and loader.persistent_workers


# -- step timing ---------------------------------------------------------------------------------------
class FakeClock:
    """time.perf_counter that moves only when told (sleep)."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now

    @classmethod
    def sleep(cls, seconds: float) -> None:
        cls.now += seconds


class FakeCudaEvent:
    """torch.cuda.Event's timing interface on the fake clock; counts synchronisations."""

    syncs = 0

    def __init__(self, enable_timing: bool = False):
        self.time = None

    def record(self) -> None:
        self.time = FakeClock.now

    def synchronize(self) -> None:
        FakeCudaEvent.syncs += 1

    def elapsed_time(self, end) -> float:
        return (end.time - self.time) * 1000


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_step_timer_splits_steps_and_reads_cuda_events_only_when_asked(device, monkeypatch):
    monkeypatch.setattr(timing, "time", FakeClock)
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    FakeCudaEvent.syncs = 0
    timer = timing.StepTimer(torch.device(device))
    for _ in range(3):
        timer.phase("data")
        FakeClock.sleep(0.002)
        timer.phase("compute")
        FakeClock.sleep(0.004)
        timer.phase("optimizer")
        FakeClock.sleep(0.001)
        timer.end_step()
        FakeClock.sleep(0.1)  # logging, evaluation: no phase
    timer.phase("data")
    FakeClock.sleep(0.1)
    timer.drop()  # the wait that ended the epoch does not count
    assert FakeCudaEvent.syncs == 0
    means = timer.window_means()
    assert FakeCudaEvent.syncs == (1 if device == "cuda" else 0)  # CUDA: read once, at the log step
    assert means == pytest.approx({"perf/data_s": 0.002, "perf/compute_s": 0.004, "perf/optimizer_s": 0.001})
    assert timer.run_means() == pytest.approx({"data_s": 0.002, "compute_s": 0.004, "optimizer_s": 0.001})


# -- bench/gpu.py ----------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only message")
def test_gpu_bench_says_there_is_no_gpu_and_exits_0(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    gpu = importlib.import_module("gpu")
    assert gpu.main([]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "bench/gpu.py: no CUDA GPU on this machine; nothing measured (it compares lbt with a plain loop on a GPU)"]


def _gpu_bench(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    return importlib.import_module("gpu")


def test_gpu_bench_all_says_no_cuda_in_one_line_and_exits_0(capsys, monkeypatch):
    gpu = _gpu_bench(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--all"]) == 0
    assert capsys.readouterr().out.splitlines() == ["no_cuda"]


def test_gpu_bench_names_lbts_gpu_preset_from_the_device_name(monkeypatch):
    gpu = _gpu_bench(monkeypatch)
    assert gpu.gpu_preset("NVIDIA H200") == "h200"
    assert gpu.gpu_preset("NVIDIA A100-SXM4-80GB") == "a100" and gpu.gpu_preset("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu.gpu_preset("NVIDIA L4") == "l4" and gpu.gpu_preset("NVIDIA L40S") == "l40s"
    assert gpu.gpu_preset("AMD Instinct MI300X") == "mi300x" and gpu.gpu_preset("NVIDIA GeForce RTX 4090") is None


def test_gpu_bench_reads_the_suites_counts_finished_or_cut(monkeypatch):
    gpu = _gpu_bench(monkeypatch)
    finished = ("........F.s [ 50%]\n....E [100%]\n=== short test summary info ===\n"
                "FAILED tests/test_a.py::test_one - AssertionError\nERROR tests/test_b.py::test_two\n"
                "= 12 passed, 1 failed, 1 skipped, 1 error in 3.21s =\n")
    assert gpu.suite_counts(finished) == (12, 2, ["tests/test_a.py::test_one", "tests/test_b.py::test_two"])
    assert gpu.suite_counts("bringing up nodes...\n..F..E.s [ 40%]\n...F") == (8, 3, [])
