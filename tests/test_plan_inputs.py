"""`lbt plan` tells the truth about its inputs: N from the run's or the data's real training set, no headline on
a row whose global batch exceeds N, your own data (`data=custom`), a warning when the compute is a CPU's, GPU
presets from published throughputs, and a critical batch from a study that agrees with the study's answer."""

from __future__ import annotations

import json

import pytest
import torch
from test_study import _job

from lbt.apps.plan.cli import plan_main
from lbt.apps.plan.compute import critical_batch_from_study, gpu_compute, model_and_data, step_flops
from lbt.apps.plan.output import summarize
from lbt.apps.report import write_report
from lbt.cost.data_parallel import Compute, Network, scaling_rows
from lbt.cost.gpu import GPUS, gpu_seconds
from lbt.engine.build import data_shape
from lbt.spec.result import RunResult, write_result

MLP = {"_target_": "lbt.models.MLP", "hidden": 16, "num_layers": 1}


def lines(text: str, start: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(start)]


def table(printed: str) -> dict[int, list[str]]:
    """The data-parallel table's rows by W."""
    return {int(line.split()[0]): line.split() for line in printed.splitlines() if line[:4].strip().isdigit()}


def own_data(tmp_path, monkeypatch, module: str, train: int) -> str:
    """A package of your own with a data function of `train` training samples (and 64 test)."""
    (tmp_path / module).mkdir()
    (tmp_path / module / "__init__.py").write_text(
        "import torch\n"
        "def data():\n"
        f"    x, y = torch.randn({train} + 64, 40), torch.randint(0, 2, ({train} + 64,))\n"
        "    t = torch.utils.data.TensorDataset\n"
        f"    return t(x[:{train}], y[:{train}]), t(x[{train}:], y[{train}:])\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{module}.data"


def custom_run(folder, dataset: str, val_fraction: float = 0.0, precision: str = "fp32") -> str:
    """A finished run's result.json on data=custom (24 steps of global batch 64 an epoch), as lbt train writes it."""
    config = {"model": MLP, "trainer": {"precision": precision},
              "data": {"_target_": "lbt.data.build_custom", "dataset": dataset, "num_classes": 2,
                       "input_shape": [40], "args": {}, "val_fraction": val_fraction, "val_seed": 0}}
    folder.mkdir(parents=True)
    return str(write_result(folder, RunResult(recipe="baseline", samples_per_sec=6400.0, per_worker_batch=64,
                                              world_size=1, procs=1, global_batch=64, steps_per_epoch=24,
                                              final_acc=0.9, final_loss=0.3, config=config)))


# -- N --------------------------------------------------------------------------------------------------
def test_from_result_takes_n_from_the_runs_own_training_set(tmp_path, monkeypatch, capsys):
    dataset = own_data(tmp_path, monkeypatch, "plan_data_1536", 1536)
    result = custom_run(tmp_path / "run", dataset)
    assert plan_main([f"plan.from_result={result}", "plan.network=1gbe", "plan.max_workers=64"]) == 0
    printed = capsys.readouterr().out
    assert lines(printed, "N: ") == ["N: 1,536 training samples per epoch (the training set of plan_data_1536.data, "
                                     "read here to count it)"]
    assert "60,000" not in printed and "54,000" not in printed
    rows = table(printed)
    assert "B > N" not in " ".join(rows[16]) and "B > N" in " ".join(rows[32])  # 2,048 > 1,536
    # an epoch is N / (b W) steps of the measured 10 ms: 24 steps at W=1
    assert rows[1][5:7] == ["0.24", "s"]


def test_n_counts_the_training_set_after_the_validation_split(tmp_path, monkeypatch, capsys):
    dataset = own_data(tmp_path, monkeypatch, "plan_data_val", 1536)
    result = custom_run(tmp_path / "run", dataset, val_fraction=0.25)
    assert plan_main([f"plan.from_result={result}", "plan.max_workers=2"]) == 0
    assert lines(capsys.readouterr().out, "N: ") == [
        "N: 1,152 training samples per epoch (the training set of plan_data_val.data, read here to count it, 384 "
        "more held out for validation)"]


def test_n_of_a_run_whose_data_cannot_be_read_here(tmp_path, capsys):
    """The data's package is not on this machine: the run's steps per epoch x its global batch, saying so."""
    result = custom_run(tmp_path / "run", "not_here_plan.data")
    assert plan_main([f"plan.from_result={result}", "plan.max_workers=2"]) == 0
    (n_line,) = lines(capsys.readouterr().out, "N: ")
    assert n_line.startswith("N: 1,536 training samples per epoch (the run's 24 steps per epoch x global batch 64; "
                             "not_here_plan.data could not be read here to count it: data.dataset=not_here_plan.data: "
                             "cannot import it")


# -- no headline past N -----------------------------------------------------------------------------------
def test_no_headline_on_a_row_whose_global_batch_exceeds_n(tmp_path, capsys):
    # A fast network and a short step: W=1024 has the shortest "epoch", but its global batch 65,536 exceeds
    # N = 4,096 (less than one step per epoch): the headline is W=64, the largest that fits.
    code = plan_main(["model=mlp", "plan.step_ms=1.5", "plan.network=nvlink4", "plan.train_samples=4096",
                      f"plan.out={tmp_path / 'p.png'}"])
    printed = capsys.readouterr().out
    assert code == 0
    rows = table(printed)
    assert "B > N" in " ".join(rows[1024]) and "B > N" in " ".join(rows[128]) and "B > N" not in " ".join(rows[64])
    (headline,) = lines(printed, "fastest epoch: ")
    assert headline.startswith("fastest epoch: W=64 ")
    assert "from W=128 on the global batch exceeds N (B > N: less than one step per epoch); those rows are never " \
        "chosen" in printed


def test_summary_lines_never_name_a_row_past_n():
    compute = Compute(0.001, 0.002, 0.0, per_worker_batch=100, num_params=10, source="test")
    net = Network("fast", 1e6, 0.0, "test")
    rows = scaling_rows(compute, net, [1, 2, 4, 8], train_samples=250, critical_batch=1000)
    summary = summarize(rows, 1000)
    assert summary == [
        "fastest epoch: W=2 (3.8 ms, 2.0x W=1, efficiency 100%)",  # W=4 and 8 are faster, but exceed N=250
        "from W=4 on the global batch exceeds N (B > N: less than one step per epoch); those rows are never chosen",
        "critical batch B_crit=1,000: not reached up to W=8"]
    assert summarize(scaling_rows(compute, net, [1, 2], train_samples=50), None) == [
        "no W fits the data: even one worker's batch b=100 exceeds N, the training samples per epoch "
        "(lower trainer.per_worker_batch)"]


# -- your own data --------------------------------------------------------------------------------------------
def test_data_custom_is_your_own_data(tmp_path, monkeypatch, capsys):
    dataset = own_data(tmp_path, monkeypatch, "plan_data_custom", 1000)
    code = plan_main(["model=mlp", "data=custom", f"data.dataset={dataset}", "data.input_shape=[40]",
                      "data.num_classes=2", "plan.step_ms=2", "plan.max_workers=4", f"plan.out={tmp_path / 'c.png'}"])
    printed = capsys.readouterr().out
    assert code == 0
    # data.val_fraction 0.1, as lbt train's data=custom: 900 samples per epoch
    assert lines(printed, "N: ") == ["N: 900 training samples per epoch (the training set of plan_data_custom.data, "
                                     "read here to count it, 100 more held out for validation)"]
    # conf/model/mlp.yaml (128 wide, 2 hidden layers) on 40 inputs and 2 classes, as it was told
    assert "mlp, 22,018 parameters" in printed


def test_data_custom_says_what_it_needs_in_one_line(tmp_path, monkeypatch, capsys):
    dataset = own_data(tmp_path, monkeypatch, "plan_data_short", 100)
    png = f"plan.out={tmp_path / 'e.png'}"
    for args, missing in ((["data=custom"], "data.dataset"),
                          (["data=custom", "data.input_shape=[40]", "data.num_classes=2"], "data.dataset"),
                          (["data=custom", f"data.dataset={dataset}"], "data.num_classes")):
        assert plan_main(["model=mlp", "plan.step_ms=2", *args, png]) == 2  # lbt train's line for a missing key
        err = capsys.readouterr().err
        assert err == f"lbt: error: {missing} has no default and must be given, e.g. {missing}=...\n"
    # the shape it gives is not its data's: the data's own line
    assert plan_main(["model=mlp", "plan.step_ms=2", "data=custom", f"data.dataset={dataset}", "data.input_shape=[3]",
                      "data.num_classes=2", png]) == 2
    assert capsys.readouterr().err == \
        "lbt: error: data.input_shape=[3] but plan_data_short.data's samples have shape [40]\n"
    assert plan_main(["model=mlp", f"data.dataset={dataset}", png]) == 2  # MNIST-1D has no data.dataset
    assert capsys.readouterr().err.startswith("lbt: error: data.dataset: no such key in data")


# -- where the compute was measured ----------------------------------------------------------------------------
def test_a_cpu_profile_says_it_is_not_a_gpus(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan_main(["model=mlp", "plan.repeats=2", "trainer.per_worker_batch=8", "plan.max_workers=2",
                      f"plan.out={tmp_path / 'p.png'}"]) == 0
    printed = capsys.readouterr().out
    assert lines(printed, "warning: ") == [
        "warning: no GPU here: compute was profiled on this CPU, so every step time below is this CPU's, not a "
        "GPU's; for a GPU give plan.gpu=NAME (a published throughput) or plan.step_ms measured on one"]
    assert "measured on this machine's CPU" in printed
    # a step time measured elsewhere is no CPU's: no warning
    assert plan_main(["model=mlp", "plan.step_ms=2", "plan.max_workers=2", f"plan.out={tmp_path / 'q.png'}"]) == 0
    assert not lines(capsys.readouterr().out, "warning: ")
    assert plan_main(["model=mlp", "plan.device=cuda", f"plan.out={tmp_path / 'r.png'}"]) == 2
    assert capsys.readouterr().err == "lbt: error: plan.device=cuda: torch sees no GPU on this machine\n"


# -- GPU presets ---------------------------------------------------------------------------------------------------
def test_step_flops_by_hand():
    # MLP 40 -> 128 -> 128 -> 10: forward 2 x (40x128 + 128x128 + 128x10) FLOPs per sample; backward the weight
    # gradients of all three and the input gradients of the last two (the data needs none).
    model, data = model_and_data("mlp", "mnist1d")
    forward, backward = step_flops(model, data_shape(data), 64, "mlp")
    assert forward == 64 * 2 * (5120 + 16384 + 1280)
    assert backward == 64 * (2 * (5120 + 16384 + 1280) + 2 * (16384 + 1280))


def test_gpu_preset_step_is_flops_over_the_published_peak_times_utilisation():
    model, data = model_and_data("mlp", "mnist1d")
    compute = gpu_compute(model, data_shape(data), 64, GPUS["a100"], "fp32", 0.4, "mlp")
    flops = 64 * (45_568 + 80_896)
    assert compute.total_s == pytest.approx(flops / (19.5e12 * 0.4))
    assert compute.backward_s / compute.forward_s == pytest.approx(80_896 / 45_568)
    assert "19.5 TFLOPS dense fp32 peak x 40% assumed utilisation" in compute.source
    assert gpu_seconds(1e12, GPUS["h100"], "bf16", 0.5) == pytest.approx(1 / (989.4 * 0.5))
    with pytest.raises(ValueError, match="no bf16 rate"):
        gpu_seconds(1.0, GPUS["v100"], "bf16", 0.4)
    assert {"a100", "h100", "h200", "v100", "l4"} <= set(GPUS)
    assert all("datasheet" in gpu.source for gpu in GPUS.values())


def test_plan_gpu_states_the_figures_it_used(tmp_path, capsys):
    code = plan_main(["model=resnet20", "data=cifar10", "plan.gpu=h100", "plan.precision=bf16",
                      "plan.utilization=0.3", "plan.network=ib-ndr", "trainer.per_worker_batch=256",
                      "plan.max_workers=8", f"plan.out={tmp_path / 'g.png'}"])
    printed = capsys.readouterr().out
    assert code == 0
    (compute,) = lines(printed, "compute: ")
    assert "predicted for NVIDIA H100 SXM: resnet20 at batch 256" in compute
    assert "989.4 TFLOPS dense bf16 peak x 30% assumed utilisation" in compute
    (gpu,) = lines(printed, "gpu: ")
    assert "NVIDIA H100 datasheet" in gpu and "utilisation assumed 30% (plan.utilization)" in gpu
    assert not any("this CPU" in line for line in lines(printed, "warning: "))
    # ResNet-20 is ~41 M multiply-adds a sample: ~3 x 82 MFLOPs a training sample, x 256 / (989.4 x 0.3) TFLOPS
    ms = float(compute.split()[1])
    assert ms == pytest.approx(256 * 3 * 82e6 / (989.4e12 * 0.3) * 1e3, rel=0.05)


def test_plan_gpu_from_a_result_takes_its_model_and_precision(tmp_path, monkeypatch, capsys):
    dataset = own_data(tmp_path, monkeypatch, "plan_data_gpu", 512)
    result = custom_run(tmp_path / "run", dataset, precision="bf16")
    assert plan_main([f"plan.from_result={result}", "plan.gpu=a100", "plan.max_workers=2"]) == 0
    printed = capsys.readouterr().out
    assert "312 TFLOPS dense bf16 peak" in printed and "N: 512 training samples" in printed
    assert lines(printed, "warning: ")[0].startswith("warning: a predicted step of ")  # launch-bound: a lower bound


def test_gpu_options_usage_errors(tmp_path, capsys):
    png = f"plan.out={tmp_path / 'e.png'}"
    for args, says in ((["plan.gpu=h100", "plan.step_ms=3"], "plan.gpu predicts the step time that plan.step_ms gives"),
                       (["plan.precision=bf16"], "plan.precision and plan.utilization go with plan.gpu=NAME"),
                       (["plan.gpu=v100", "plan.precision=bf16"], "NVIDIA V100 SXM2 has no bf16 rate"),
                       (["plan.gpu=h100", "plan.utilization=1.5"], "plan.utilization must be a number in (0, 1]"),
                       (["plan.gpu=b52"], "plan.gpu must be one of v100, a10, l4, l40s, a100, h100, h200, mi300x, "
                                          "null, got 'b52'")):
        assert plan_main(["model=mlp", *args, png]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("lbt: error: ") and says in err, err


# -- the study's critical batch -----------------------------------------------------------------------------------
STUDY = {("baseline", 1): [0.96, 0.98], ("baseline", 2): [0.95, 0.975], ("baseline", 4): [0.90, 0.93],
         ("lars", 1): [0.96, 0.98], ("lars", 2): [0.96, 0.978], ("lars", 4): [0.955, 0.976],
         ("lars", 8): [0.95, 0.975], ("lars", 16): [0.80, 0.85]}


def study_of(folder):
    """A finished study (b=32 per GPU) and its report: baseline holds to 2 GPUs (global batch 64), lars to 8 (256)."""
    for n, ((recipe, world_size), accs) in enumerate(STUDY.items()):
        _job(folder / str(n), recipe, world_size, 0, accs, b_simple=100.0, test=accs[-1])
    summary = write_report(folder)
    answer = {r["recipe"]: (r["world_size"], r["global_batch"]) for r in summary["gpu_answer"]["recipes"]}
    assert answer == {"baseline": (2, 64), "lars": (8, 256)} and summary["critical_batch"]["value"] == 256
    return folder


def test_from_study_takes_the_runs_recipe_answer(tmp_path, capsys):
    """A run's own recipe's answer, not the best recipe's: a baseline run planned with a study whose answer for
    baseline is 2 GPUs and whose best recipe (lars) goes to 8: the plan's largest safe W is baseline's 2."""
    study = study_of(tmp_path / "study")
    config = {"model": MLP, "data": {"_target_": "lbt.data.build_synthetic", "num_train": 4096, "input_shape": [40],
                                     "num_classes": 10}}
    (tmp_path / "run").mkdir()
    run = write_result(tmp_path / "run", RunResult(recipe="baseline", samples_per_sec=3200.0, per_worker_batch=32,
                                                   world_size=1, procs=1, global_batch=32, final_acc=0.9,
                                                   final_loss=0.3, config=config))
    assert plan_main([f"plan.from_result={run}", f"plan.from_study={study}", "plan.max_workers=16"]) == 0
    printed = capsys.readouterr().out
    assert lines(printed, "critical batch: ") == [
        "critical batch: B_crit=64 (the study's answer for baseline: up to 2 GPUs, global batch 64, the recipe of the "
        "plan.from_result run; its best recipe, lars: up to 8 GPUs, global batch 256 (plan.recipe=lars))"]
    assert "critical batch B_crit=64 (the study's answer for baseline): global batch exceeds it from W=4 on " \
        "(accuracy expected to suffer); largest safe W at b=32: 2 (global batch 64)" in printed


def test_from_study_alone_takes_its_answer_and_its_batch(tmp_path, capsys):
    study = study_of(tmp_path / "study")
    png = f"plan.out={tmp_path / 'p.png'}"
    assert plan_main(["model=mlp", "plan.step_ms=5", f"plan.from_study={study}", "plan.max_workers=16", png]) == 0
    printed = capsys.readouterr().out
    assert "compute: 5.000 ms per worker step at b=32 " in printed  # the study's per-GPU batch
    assert "B_crit=256 (the study's answer for lars: up to 8 GPUs, global batch 256, its best recipe)" in printed
    assert "largest safe W at b=32: 8 (global batch 256)" in printed
    assert plan_main(["model=mlp", "plan.step_ms=5", f"plan.from_study={study}", "plan.recipe=baseline",
                      "trainer.per_worker_batch=16", png]) == 0
    printed = capsys.readouterr().out
    assert "warning: the study ran 32 samples per GPU and this plan b=16: the same critical batch is reached at " \
        "another W than the study's 2 GPUs" in printed
    assert "largest safe W at b=16: 4 (global batch 64)" in printed
    assert plan_main(["model=mlp", "plan.step_ms=5", f"plan.from_study={study}", "plan.recipe=lamb", png]) == 2
    assert capsys.readouterr().err == f"lbt: error: plan.recipe=lamb: the study in {study} ran baseline, lars\n"
    assert plan_main(["model=mlp", "plan.step_ms=5", "plan.recipe=lars", png]) == 2


def test_from_study_without_an_answer_is_one_line(tmp_path, capsys):
    study = study_of(tmp_path / "study")
    summary = json.loads((study / "summary.json").read_text())
    (study / "summary.json").write_text(json.dumps({**summary, "answer_withheld": "the study is incomplete"}))
    with pytest.raises(ValueError, match="the study gives no answer .the study is incomplete."):
        critical_batch_from_study(study)
    # the diagnostics (fit, B_simple) are not the answer: a summary with only those gives no critical batch
    (study / "summary.json").write_text(json.dumps({"critical_batch": {"fit": None, "gns": 100.0}}))
    assert plan_main(["model=mlp", "plan.step_ms=5", f"plan.from_study={study}"]) == 2
    assert "holds no answer of the study" in capsys.readouterr().err


def test_numbers_out_of_range_are_one_line(tmp_path, capsys):
    """`plan.step_ms=1e308` (unchecked, an OverflowError), a per-worker batch of 10^20 (C++ frames from torch) and
    `plan.critical_batch=-1` (unchecked, accepted) are each one line."""
    png = f"plan.out={tmp_path / 'r.png'}"
    for args, says in ((["plan.step_ms=1e308"], "plan.step_ms must be a number in (0, 1e+07], got 1e+308"),
                       (["plan.step_ms=inf"], "plan.step_ms must be a number in (0, 1e+07], got inf"),
                       (["trainer.per_worker_batch=99999999999999999999"],
                        "trainer.per_worker_batch must be an integer from 1 to 16,777,216"),
                       (["plan.step_ms=2", "plan.critical_batch=-1"], "plan.critical_batch must be a positive number")):
        assert plan_main(["model=mlp", *args, png]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("lbt: error: ") and says in err, err


def test_a_plan_from_a_cpu_run_warns_and_counts_its_own_optimizers_state(tmp_path, capsys):
    """`lbt plan plan.from_result=...` of a CPU run warns that its step times are a CPU's (unwarned, it would recommend
    W=512, the CPU's timing jitter posing as straggler loss), and counts the SGD run's own state, not AdamW's."""
    from conftest import train

    train(tmp_path / "run", ["model=mlp", "trainer.epochs=1"])
    assert plan_main([f"plan.from_result={tmp_path / 'run' / 'result.json'}", "plan.max_workers=16"]) == 0
    out = capsys.readouterr().out
    assert f"warning: {tmp_path / 'run' / 'result.json'} was trained on a CPU: every step time below" in out
    assert "gradients and sgd's 1 state tensor per parameter" in out and "adamw" not in out
