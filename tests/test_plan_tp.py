"""`lbt plan plan.tensor_parallel=T`: the split rule, the hybrid step's formulas by hand, the command."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from lbt.apps.plan.cli import plan_main
from lbt.cost.data_parallel import Compute, Network, ring_allreduce_seconds, ring_bytes_sent
from lbt.cost.tensor_parallel import (
    Collective,
    DenseSplit,
    SplitRow,
    dense_split,
    recommend,
    ring_allgather_seconds,
    split_rows,
    tensor_parallel_options,
    tp_comm_seconds,
    tp_compute_seconds,
)
from lbt.models import MLP, CNN1d, Transformer1d
from lbt.parallel.tensor_parallel import Split, dense_splits, why_not
from lbt.spec.result import RunResult, write_result

# 1 byte/s and no latency: a communication time in seconds is the bytes each rank sends.
BYTES = Network("bytes", 8e-9, 0.0, "test")


def test_why_not_names_the_layer_t_does_not_divide():
    cnn = dense_splits(CNN1d())
    assert why_not(cnn, 1) is None and why_not(cnn, 2) is None
    assert why_not(cnn, 4) == "width 10 of layer 11 (gather split) is not divisible by 4"
    assert "no dense layer" in why_not([], 2)


# -- what a split sends ----------------------------------------------------------------------------
def test_dettmers_two_gpus_batch_128_a_quarter_of_the_bytes():
    # Dettmers (2014): data parallelism sends a 1000x500 layer's 500,000 weight gradients; the split
    # layer sends its 128 x 500 activations forward and their gradients backward: 128,000 numbers.
    # As a Megatron pair around a 1000x500 layer: forward allreduce of 500 outputs, backward allreduce
    # of the 500 inputs' gradient, per sample.
    pair = nn.Sequential(nn.Linear(500, 1000), nn.ReLU(), nn.Linear(1000, 500))
    split = dense_split(pair, torch.randn(2, 500, requires_grad=True))
    assert split.collectives == (Collective("0", "allreduce", "backward", 500 * 4),
                                 Collective("2", "allreduce", "forward", 500 * 4))
    tp_bytes = tp_comm_seconds(split.collectives, 128, 2, BYTES)  # each of 2 ranks sends each tensor once
    assert tp_bytes == pytest.approx(128 * 500 * 2 * 4)
    dp_bytes = ring_bytes_sent(1000 * 500 * 4, 2)
    assert tp_bytes / dp_bytes == pytest.approx(0.256)  # "about a quarter"
    # The lone 1000x500 layer, gathered: all-gather of 128 x 500 (each rank sends its half),
    # allreduce of the 128 x 1000 input gradient: 32,000 + 128,000 numbers, 0.32 of DP's 500,500.
    lone = dense_split(nn.Sequential(nn.Linear(1000, 500)), torch.randn(2, 1000, requires_grad=True))
    assert [(c.op, c.phase, c.bytes_per_sample) for c in lone.collectives] == \
        [("allgather", "forward", 500 * 4), ("allreduce", "backward", 1000 * 4)]
    lone_bytes = tp_comm_seconds(lone.collectives, 128, 2, BYTES)
    assert lone_bytes == pytest.approx((32_000 + 128_000) * 4)
    assert lone_bytes / ring_bytes_sent(500_500 * 4, 2) == pytest.approx(160_000 / 500_500)


def test_mlp_parameters_and_flop_share_by_hand():
    # Linear(40,8) 320+8 and Linear(8,8) 64 sharded (the rowwise bias, 8, stays whole); head 80+10 whole.
    split = dense_split(MLP(hidden=8, num_layers=2), torch.randn(3, 40))
    assert (split.sharded_params, split.replicated_params) == (392, 98)
    assert split.local_params(1) == 490 and split.local_params(2) == 98 + 196 and split.local_params(4) == 98 + 98
    # The data needs no gradient: no backward allreduce, only the pair's forward one (8 outputs).
    assert split.collectives == (Collective("3", "allreduce", "forward", 32),)
    # FLOPs per sample: first layer forward + weight gradient 2 x 2 x 320, second 3 x 2 x 64, head 3 x 2 x 80.
    assert split.dense_share == pytest.approx((1280 + 384) / (1280 + 384 + 480))


def test_transformer_collectives_count_every_token():
    model = Transformer1d(patch=4, dim=64, depth=2)  # 40 samples -> 10 tokens of 64
    split = dense_split(model, torch.randn(2, 40))
    # per block two pairs (attention's qkv/out by heads, the MLP), each one allreduce forward, one backward
    assert len(split.collectives) == 8
    assert {c.bytes_per_sample for c in split.collectives} == {10 * 64 * 4}
    assert 0.95 < split.dense_share < 1  # only the patch embedding and the head stay replicated


def test_dense_split_leaves_the_model_as_it_was():
    model = CNN1d().eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dense_split(model, torch.randn(2, 40))
    assert not model.training and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm statistics too


# -- the formulas ------------------------------------------------------------------------------------
def test_ring_allgather_is_half_an_allreduce():
    assert ring_allgather_seconds(8e6, 1, 1e9, 1e-5) == 0.0
    # 3/4 x 8 MB / 1 GB/s = 6 ms, plus 3 x 10 us.
    assert ring_allgather_seconds(8e6, 4, 1e9, 1e-5) == pytest.approx(0.00603)
    assert 2 * ring_allgather_seconds(8e6, 4, 1e9, 0.0) == pytest.approx(ring_allreduce_seconds(8e6, 4, 1e9, 0.0))


def test_tp_compute_divides_only_the_split_share():
    assert tp_compute_seconds(0.1, 0.75, 4) == pytest.approx(0.1 * (0.25 + 0.75 / 4))
    assert tp_compute_seconds(0.1, 0.0, 8) == pytest.approx(0.1)
    assert tp_compute_seconds(0.1, 1.0, 2) == pytest.approx(0.05)


def _split(dense_share=1.0, sharded=1_000_000, replicated=0, bytes_per_sample=400, width=1024):
    return DenseSplit((Split("0", "colwise", width), Split("2", "rowwise", width)),
                      (Collective("2", "allreduce", "forward", bytes_per_sample),), sharded, replicated, dense_share)


def test_split_rows_hand_computed():
    # 10 ms of compute at b=100, 1M parameters (4 MB of gradient), all in the split layers;
    # 1 Gb/s = 125 MB/s, no latency; N = 1000.
    compute = Compute(0.004, 0.006, 0.0, per_worker_batch=100, num_params=1_000_000, source="test")
    rows = split_rows(compute, _split(), Network("test", 1.0, 0.0, "test"), [1, 2], [1, 2], train_samples=1000)
    assert [(r.workers, r.data_parallel, r.tensor_parallel) for r in rows] == [(1, 1, 1), (2, 2, 1), (2, 1, 2)]
    one, dp, tp = rows
    assert one.epoch_s == pytest.approx(0.1) and one.recommended
    # 2 x 1: allreduce of 4 MB over 2 = 32 ms; 5 steps of 42 ms.
    assert dp.dp_comm_s == pytest.approx(0.032) and dp.global_batch == 200
    assert dp.epoch_s == pytest.approx(5 * 0.042)
    # 1 x 2: half the compute, 5 ms; an allreduce of 100 x 400 B over 2 ranks = 0.32 ms; no DP allreduce;
    # 10 steps of 5.32 ms.
    assert (tp.compute_s, tp.tp_comm_s, tp.dp_comm_s) == pytest.approx((0.005, 0.00032, 0.0))
    assert tp.global_batch == 100 and tp.epoch_s == pytest.approx(10 * 0.00532)
    assert tp.speedup == pytest.approx(0.1 / 0.0532)
    assert tp.recommended and not dp.recommended


def test_split_rows_dp_allreduce_carries_a_ranks_share_and_skips_impossible_t():
    compute = Compute(0.004, 0.006, 0.0, per_worker_batch=100, num_params=1_100_000, source="test")
    split = _split(sharded=1_000_000, replicated=100_000, width=6)  # 6 is divisible by 2, not by 4
    rows = split_rows(compute, split, Network("test", 1.0, 0.0, "test"), [4], [1, 2, 4], train_samples=10_000)
    assert [r.tensor_parallel for r in rows] == [1, 2]
    # 2 x 2: each rank holds 100k + 500k parameters = 2.4 MB, allreduced over 2 DP workers: 19.2 ms.
    assert rows[1].dp_comm_s == pytest.approx(2.4e6 / 125e6)


def _row(t: int, global_batch: int, epoch_s: float) -> SplitRow:
    return SplitRow(8, t, 8 // t, global_batch, 0, 0, 0, 0, epoch_s, 1.0, False, False)


def test_recommend_the_fastest_within_the_critical_batch():
    rows = [_row(1, 512, 1.0), _row(2, 256, 1.5), _row(4, 128, 2.0)]
    assert recommend(rows, None) is rows[0]
    assert recommend(rows, 300) is rows[1]
    assert recommend(rows, 256) is rows[1]  # at the critical batch is allowed
    assert recommend(rows, 100) is rows[2]  # none within: the smallest global batch
    assert recommend([], 100) is None


def test_recommend_never_a_split_whose_global_batch_exceeds_n():
    # 8 x 1 is the fastest, but its global batch 512 exceeds N (less than one step per epoch): 4 x 2 instead.
    rows = [replace(_row(1, 512, 1.0), beyond_dataset=True), _row(2, 256, 1.5), _row(4, 128, 2.0)]
    assert recommend(rows, None) is rows[1]
    assert recommend(rows, 1024) is rows[1]
    assert recommend(rows, 100) is rows[2]
    # every split past N: the smallest global batch, its epoch time meaningless, is what the table can show
    past = [replace(r, beyond_dataset=True) for r in rows]
    assert recommend(past, None) is past[2]


def test_plan_never_recommends_a_split_past_n(tmp_path, capsys):
    code = plan_main(["model=mlp", "plan.step_ms=5", "plan.tensor_parallel=2", "plan.max_workers=8",
                      "plan.train_samples=256", "plan.network=nvlink4", f"plan.out={tmp_path / 'n.png'}"])
    printed = capsys.readouterr().out
    assert code == 0
    table = [line.split() for line in printed.splitlines() if line[:2].strip().isdigit()]
    recommended = [cells for cells in table if "<- recommended" in " ".join(cells)]
    # W=8: 8 x 1 (global batch 512 > N=256) would be fastest; 4 x 2 (256) is recommended instead
    assert [int(cells[4].replace(",", "")) for cells in recommended] == [64, 128, 256, 256]
    assert "tensor parallelism recommended from W=8 on (fastest epoch and <= N)" in printed
    assert "exceeds N" not in printed.split("recommended split per W")[1]  # every W has a split within N


def test_tensor_parallel_options():
    assert tensor_parallel_options("auto", 1024) == [1, 2, 4, 8]
    assert tensor_parallel_options("auto", 4) == [1, 2, 4]
    assert tensor_parallel_options("4", 64) == [1, 4]
    assert tensor_parallel_options("1", 64) == [1]
    for bad in ("0", "3", "-2", "two", "1.5"):
        with pytest.raises(ValueError, match="power of 2"):
            tensor_parallel_options(bad, 64)
    with pytest.raises(ValueError, match="exceeds plan.max_workers"):
        tensor_parallel_options("16", 8)


# -- the command -------------------------------------------------------------------------------------
def test_plan_prints_the_split_table_and_writes_the_png(tmp_path, capsys):
    out = tmp_path / "tp.png"
    code = plan_main(["model=mlp", "plan.step_ms=20", "plan.tensor_parallel=auto", "plan.max_workers=64",
                      "plan.network=nvlink", "plan.critical_batch=1024", f"plan.out={out}"])
    printed = capsys.readouterr().out
    assert code == 0
    assert "DP x T" in printed and "TP comm ms" in printed
    table = [line.split() for line in printed.splitlines() if line[:3].strip().isdigit()]
    splits = {(int(cells[0]), cells[1], cells[3]) for cells in table}  # W, DP, T
    assert (8, "1", "8") in splits and (64, "8", "8") in splits and (64, "64", "1") in splits
    assert not any(w == 2 and t == "4" for w, _, t in splits)  # T <= W
    recommended = [cells for cells in table if "<- recommended" in " ".join(cells)]
    assert len(recommended) == 7  # one per W
    assert all(int(cells[4].replace(",", "")) <= 1024 for cells in recommended)  # global batch <= B_crit
    assert "recommended split per W" in printed
    assert str(out.resolve()) in printed and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_says_which_t_the_model_cannot_take(tmp_path, capsys):
    code = plan_main(["model=cnn1d", "plan.step_ms=5", "plan.tensor_parallel=auto", "plan.max_workers=8",
                      f"plan.out={tmp_path / 'c.png'}"])
    printed = capsys.readouterr().out
    assert code == 0
    # In plain words: which layer, what it is, how it would be split and why T GPUs cannot share it.
    assert "note: T=4 impossible for cnn1d: its layer 11 (Linear 64 -> 10) is split by its 10 outputs, which 4 GPUs " \
        "cannot share equally (left out of the table)" in printed
    assert "layer 11 (Linear 64 -> 10), split by its 10 outputs, gathered back after it" in printed
    assert "gather split" not in printed and "(gather)" not in printed and "width 10" not in printed
    splits = {line.split()[3] for line in printed.splitlines() if line[:2].strip().isdigit()}  # the T column
    assert splits == {"1", "2"}


def test_plan_tensor_parallel_from_a_result(tmp_path, capsys):
    config = {"model": {"_target_": "lbt.models.MLP", "hidden": 256, "num_layers": 2},
              "data": {"_target_": "lbt.data.build_synthetic", "num_train": 4096, "input_shape": [40],
                       "num_classes": 10}}
    path = write_result(tmp_path, RunResult(samples_per_sec=6400.0, per_worker_batch=64, world_size=1, procs=1,
                                            global_batch=64, final_acc=0.9, final_loss=0.3, config=config))
    assert plan_main([f"plan.from_result={path}", "plan.tensor_parallel=2", "plan.max_workers=4"]) == 0
    printed = capsys.readouterr().out
    assert "lbt.models.MLP's layer 1 (Linear 40 -> 256), split by its 256 outputs; layer 3 (Linear 256 -> 256), " \
        "split by its 256 inputs" in printed
    assert "(colwise)" not in printed and " 2 x 2 " in printed and "1 x 4" not in printed
    assert "N: 4,096 training samples per epoch" in printed  # the run's data, not a default
    assert (tmp_path / "plan.png").exists()


def test_plan_tensor_parallel_usage_errors(tmp_path, capsys):
    png = f"plan.out={tmp_path / 'e.png'}"
    assert plan_main(["model=mlp", "plan.step_ms=5", "plan.tensor_parallel=3", png]) == 2
    assert capsys.readouterr().err.strip() == \
        "lbt: error: plan.tensor_parallel must be auto or a power of 2 (1, 2, 4, ...), got '3'"
    assert plan_main(["model=mlp", "plan.step_ms=5", "plan.tensor_parallel=0", png]) == 2
    assert plan_main(["model=mlp", "plan.step_ms=5", "plan.tensor_parallel=auto", "plan.compression=fp16", png]) == 2
    assert "plan.compression and plan.delay do not apply" in capsys.readouterr().err
    assert plan_main(["model=mlp", "plan.step_ms=5", "plan.tensor_parallel=16", "plan.max_workers=8", png]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line, no traceback


# -- bench/plan_check_tp.py's pure parts ----------------------------------------------------------------
def test_plan_check_tp_predicts_with_lbt_plans_rows(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import plan_check_tp

    # The hand-computed 1 x 2 split above: 10 ms of compute, all split; 1 Gb/s, no latency.
    row = plan_check_tp.predicted_row([0.01] * 4, 1_000_000, _split(), procs=2, tensor_parallel=2,
                                      per_worker_batch=100, bandwidth_bytes_per_s=125e6, latency_s=0.0,
                                      train_samples=1000)
    assert (row.data_parallel, row.tensor_parallel) == (1, 2)
    assert (row.compute_s, row.tp_comm_s, row.dp_comm_s, row.step_s) == pytest.approx((0.005, 0.00032, 0, 0.00532))
    assert plan_check_tp.train_overrides(1024, 4, 2, 64, 300) == [
        "model=mlp", "model.hidden=1024", "data=mnist1d", "dist.world_size=4", "dist.procs=4",
        "dist.tensor_parallel=2", "trainer.per_worker_batch=64", "trainer.threads=1", "trainer.epochs=1",
        "trainer.max_steps=300"]
    assert plan_check_tp.error(0.009, 0.010) == pytest.approx(-0.1)
    table = plan_check_tp.format_table({(4, 2): {"compute": [0.005], "tp": [0.001], "dp": [0.002], "step": [0.008],
                                                 "measured": [0.010]},
                                        (2, 2): {"compute": [0.005], "tp": [0.001], "dp": [0.0], "step": [0.006],
                                                 "measured": []}})
    assert table[2] == "| 4 | 2 x 2 | 8.00 ms | 5.00 ms | 1.00 ms | 2.00 ms | 10.00 ms | -20.0% |"
    assert table[3].endswith("| n/a | n/a |")
    assert [p for p, t in plan_check_tp.SPLITS if t > 1] == [2, 4, 4]  # P=2: 1x2; P=4: 2x2 and 1x4
