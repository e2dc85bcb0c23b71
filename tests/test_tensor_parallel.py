"""Hybrid data x tensor parallelism (lbt/tensor_parallel.py): which layers split, the batch arithmetic,
and exactness: DP x T on P = DP x T processes takes the steps DP data-parallel workers take."""

import json

import pytest
import torch
from conftest import FAST, lbt_cli
from torch import nn

from lbt.errors import ConfigError
from lbt.models.cnn1d import CNN1d
from lbt.models.mlp import MLP
from lbt.models.resnet20 import ResNet20
from lbt.models.transformer1d import SelfAttention, Transformer1d
from lbt.parallel.tensor_parallel import Split, check_splittable, dense_splits
from lbt.spec.batching import auto_tensor_parallel, batch_layout

STEPS = ["data.num_train=1280", "trainer.epochs=1", "optim.lr=0.05"]  # 1280 / 64 = 20 steps


def test_mlp_splits_megatron_pairs_and_keeps_an_unpaired_head_whole():
    assert dense_splits(MLP(hidden=32, num_layers=2)) == [Split("1", "colwise", 32), Split("3", "rowwise", 32)]
    # four Linears: two pairs, the head is the second pair's rowwise half
    assert [s.style for s in dense_splits(MLP(hidden=32, num_layers=3))] == ["colwise", "rowwise"] * 2


def test_a_lone_linear_is_split_with_its_output_gathered():
    assert dense_splits(CNN1d(channels=16)) == [Split("11", "gather", 10)]  # conv part replicated
    assert dense_splits(MLP(num_layers=0)) == [Split("1", "gather", 10)]
    assert dense_splits(ResNet20()) == [Split("fc", "gather", 10)]


def test_a_pair_broken_by_a_non_elementwise_module_is_not_split():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.Linear(8, 4))
    assert dense_splits(model) == [Split("2", "colwise", 8), Split("3", "rowwise", 8)]
    assert dense_splits(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Dropout(0.1), nn.Linear(8, 4))) == \
        [Split("0", "colwise", 8), Split("3", "rowwise", 8)]


def test_transformer_blocks_split_attention_by_heads_and_their_mlp():
    splits = dense_splits(Transformer1d(dim=16, depth=2, heads=2, mlp_ratio=2))
    assert [(s.name, s.style, s.width, s.unit) for s in splits] == [
        ("blocks.0.attn.qkv", "colwise", 2, "heads"), ("blocks.0.attn.out", "rowwise", 2, "heads"),
        ("blocks.0.mlp.0", "colwise", 32, "features"), ("blocks.0.mlp.3", "rowwise", 32, "features"),
        ("blocks.1.attn.qkv", "colwise", 2, "heads"), ("blocks.1.attn.out", "rowwise", 2, "heads"),
        ("blocks.1.mlp.0", "colwise", 32, "features"), ("blocks.1.mlp.3", "rowwise", 32, "features")]
    # torch's own encoder layer: its MLP splits, its packed attention stays whole
    assert dense_splits(nn.TransformerEncoderLayer(8, 2, 16)) == [Split("linear1", "colwise", 16),
                                                                 Split("linear2", "rowwise", 16)]
    with pytest.raises(ConfigError,
                       match="the 2 heads of layer blocks.0.attn.qkv .colwise split. do not divide among 4"):
        check_splittable(splits, 4, "Transformer1d")


@pytest.mark.parametrize("causal", [False, True])
def test_self_attention_is_torchs_multi_head_attention_with_heads_laid_out_one_by_one(causal):
    """SelfAttention's qkv rows, head by head (q, k, v of head 0, then of head 1, ...), moved to
    nn.MultiheadAttention's layout (all queries, all keys, all values) give the same output."""
    torch.manual_seed(0)
    dim, heads, length = 12, 3, 5
    ours, torchs = SelfAttention(dim, heads), nn.MultiheadAttention(dim, heads, batch_first=True)
    order = torch.arange(3 * dim).view(heads, 3, dim // heads).transpose(0, 1).flatten()  # torch's row -> ours
    with torch.no_grad():
        torchs.in_proj_weight.copy_(ours.qkv.weight[order])
        torchs.in_proj_bias.copy_(ours.qkv.bias.uniform_(-1, 1)[order])
        torchs.out_proj.load_state_dict(ours.out.state_dict())
    x = torch.randn(2, length, dim)
    mask = nn.Transformer.generate_square_subsequent_mask(length) if causal else None
    expected, _ = torchs(x, x, x, attn_mask=mask, need_weights=False)
    assert torch.allclose(ours(x, causal), expected, atol=1e-6)


def test_nothing_to_split_or_a_width_t_does_not_divide_is_one_line():
    with pytest.raises(ConfigError, match="no dense layer to split"):
        check_splittable(dense_splits(nn.Sequential(nn.Conv1d(1, 4, 3), nn.Flatten())), 2, "Net")
    with pytest.raises(ConfigError, match="width 10 of layer 11 .gather split. is not divisible by 4"):
        check_splittable(dense_splits(CNN1d(channels=16)), 4, "CNN1d")


def test_batch_arithmetic_counts_data_parallel_workers():
    plan = batch_layout(8, 4, 16, None, tensor_parallel=2)
    assert (plan.world_size, plan.procs, plan.gpus, plan.global_batch) == (4, 2, 8, 64)
    assert "world_size=8 GPUs = DP 4 x TP 2 (procs=4: 2 group(s) of 2, each simulating 2 workers)" \
        in plan.describe(6400)
    assert batch_layout(8, 4, None, 64, tensor_parallel=2).per_worker_batch == 16
    with pytest.raises(ConfigError, match="dist.tensor_parallel=4 does not divide dist.procs=2"):
        batch_layout(4, 2, 16, None, tensor_parallel=4)
    with pytest.raises(ConfigError, match="4 data-parallel workers"):
        batch_layout(8, 4, None, 66, tensor_parallel=2)


def test_auto_splits_the_gpus_past_the_batch_cap():
    # b=64: up to 16 GPUs the global batch stays within 1,024; 64 GPUs = DP 16 x TP 4
    assert [auto_tensor_parallel(w, 64, 1024) for w in (1, 16, 32, 64, 128)] == [1, 1, 2, 4, 8]
    with pytest.raises(ConfigError, match="needs dist.max_global_batch"):
        auto_tensor_parallel(4, 64, None)
    with pytest.raises(ConfigError, match="T=4, which does not divide dist.world_size=3"):
        auto_tensor_parallel(3, 64, 64)


def _job(job_dir: str, gpus: int, acc: float, t: int = 1, seed: int = 0) -> dict:
    """A finished run's result.json as the report reads it (b = 64 per worker)."""
    return {"job_dir": job_dir, "recipe": "lamb", "overrides": [f"dist.world_size={gpus}", f"trainer.seed={seed}"],
            "world_size": gpus, "tensor_parallel": t, "data_parallel": gpus // t, "per_worker_batch": 64,
            "global_batch": 64 * gpus // t, "eval_split": "val", "final_val_acc": acc, "best_val_acc": acc,
            "final_val_loss": 1 - acc, "best_val_loss": 1 - acc, "test_acc": acc, "test_loss": 1 - acc,
            "steps": 10, "samples_per_sec": 1.0, "val_history": [], "seed": seed}


def test_report_scores_the_hybrid_past_the_cap_from_runs_and_from_exactness(tmp_path):
    """Cap 256 (4 workers of 64): 8 GPUs = 4 x TP 2 was run (seed 0), 16 GPUs = 4 x TP 4 follows from the
    4-worker data-parallel runs (seeds 0, 1); the data-parallel runs at 8 and 16 GPUs lost accuracy."""
    from lbt.apps.report import write_report

    jobs = [_job("0", 1, 0.99), _job("1", 4, 0.98), _job("2", 4, 0.96, seed=1), _job("3", 8, 0.90),
            _job("4", 16, 0.80), _job("5", 8, 0.98, t=2)]
    for job in jobs:
        (tmp_path / job["job_dir"]).mkdir()
        (tmp_path / job["job_dir"] / "result.json").write_text(json.dumps({k: v for k, v in job.items()
                                                                          if k != "job_dir"}))
    summary = write_report(tmp_path, tolerance=0.05, hybrid_cap=256)
    points = {p["gpus"]: p for p in summary["hybrid"]}
    assert sorted(points) == [8, 16]
    assert (points[8]["tensor_parallel"], points[8]["source"]) == \
        (2, "run (seed 0: 98.00%, its data-parallel run 98.00%)")
    assert (points[16]["tensor_parallel"], points[16]["source"]) == (4, "exactness: the 4-worker data-parallel run")
    # the point at batch 256 is one experiment: the hybrid run repeats seed 0's data-parallel run, not a third seed
    assert points[16]["acc"] == pytest.approx((0.98 + 0.96) / 2) and points[16]["seeds"] == 2
    assert points[16]["data_parallel_only"] == pytest.approx(0.80)
    report = (tmp_path / "report.md").read_text()
    assert "## More GPUs without a bigger batch" in report and "| lamb | 16 | 4 x 4 | 256 (256) |" in report
    assert (tmp_path / "accuracy_vs_gpus.png").stat().st_size > 0


@pytest.mark.slow
def test_a_sweep_job_under_the_joblib_launcher_starts_its_processes(tmp_path):
    """`lbt study`'s launcher (joblib's loky workers) runs a job of 2 tensor-parallel processes; the
    workers must not inherit loky's start method, which they cannot restore."""
    sweep = tmp_path / "sweep"
    run = lbt_cli(["train", "-m", "hydra/launcher=local_parallel", *FAST, "model=mlp", "dist.procs=2",
                   "dist.tensor_parallel=2", "trainer.max_steps=2", f"hydra.sweep.dir={sweep}"], tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    assert json.loads((sweep / "0" / "result.json").read_text())["tensor_parallel"] == 2


def test_report_marks_a_split_the_model_cannot_take(tmp_path):
    """cnn1d's only split layer is its 10-class head: T=2 splits it, T=4 cannot (the run would be refused),
    so the 16-GPU point at cap 256 is marked impossible and given no score."""
    from lbt.apps.report import write_report

    config = {"model": {"_target_": "lbt.models.CNN1d", "channels": 16},
              "data": {"_target_": "lbt.data.build_synthetic", "num_train": 64, "num_test": 16}}
    jobs = [_job("0", 1, 0.99), _job("1", 4, 0.98), _job("3", 8, 0.90), _job("4", 16, 0.80)]
    for job in jobs:
        folder = tmp_path / job.pop("job_dir")
        folder.mkdir()
        (folder / "result.json").write_text(json.dumps({**job, "config": config}))
    summary = write_report(tmp_path, tolerance=0.05, hybrid_cap=256)
    points = {p["gpus"]: p for p in summary["hybrid"]}
    assert points[8]["tensor_parallel"] == 2 and "impossible" not in points[8]
    assert points[16]["impossible"] == "width 10 of layer 11 (gather split) is not divisible by 4"
    assert "| 16 | 4 x 4 | 256 (256) | - | - | not possible: width 10" in (tmp_path / "report.md").read_text()
