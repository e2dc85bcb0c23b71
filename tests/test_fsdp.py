"""Sharded data parallelism (dist.shard=fsdp, lbt/parallel/fsdp.py): which modules are gathered as blocks,
what is refused, and exactness: a sharded run takes the steps of DDP and of the simulated workers, resumes
bitwise from its sharded checkpoint, and resumes on another number of processes."""

import json

import pytest
import torch
from conftest import FAST, final_params, interrupted, relative_diff, train, train_on_processes
from test_cli_errors import run_main
from torch import nn

from lbt.cost.data_parallel import fsdp_bytes_sent, ring_bytes_sent
from lbt.cost.memory import ModelMemory, fewest_gpus
from lbt.errors import ConfigError
from lbt.models.cnn1d import CNN1d
from lbt.models.gpt import GPT
from lbt.models.mlp import MLP
from lbt.models.transformer1d import Transformer1d
from lbt.optim.factory import refuse_split_layers
from lbt.parallel.fsdp import check_shardable, shard_units

MLP_RUN = ["model=mlp", "model.hidden=32", "data.num_train=1280", "trainer.per_worker_batch=64",
           "dist.world_size=4"]  # global batch 256: 5 steps an epoch
OPTIMS = {"sgd": ["optim=sgd", "optim.lr=0.1"], "adamw": ["optim=adamw", "optim.lr=0.01"],
          "lars": ["optim=lars", "optim.lr=0.5"], "lamb": ["optim=lamb", "optim.lr=0.01"]}
# dp 2 x tp 2 on 4 processes: two data-parallel workers, each a pair of ranks that split the blocks' layers.
HYBRID = ["model=transformer1d", "model.dim=16", "model.depth=2", "model.heads=2", "optim=sgd", "optim.lr=0.1",
          "data.num_train=1280", "trainer.global_batch=128", "trainer.epochs=1"]


def names(units):
    return [name for name, _ in units]


def test_declared_blocks_are_gathered_one_at_a_time_and_the_fallback_takes_parameter_holding_children():
    assert names(shard_units(Transformer1d(depth=3))) == ["blocks.0", "blocks.1", "blocks.2"]
    assert names(shard_units(MLP(hidden=8, num_layers=2))) == ["1", "3", "5"]  # the Linears; Flatten and ReLU hold none
    assert names(shard_units(CNN1d(channels=8, num_layers=2))) == ["0", "1", "3", "4", "8"]  # convs, norms, head
    # GPT's token embedding is its head too: tied weights stay with the root, outside every block
    gpt = GPT(input_shape=(16,), num_classes=32, n_layer=2, n_head=2, n_embd=16)
    assert names(shard_units(gpt)) == ["blocks.0", "blocks.1"]
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10), nn.Linear(10, 10))
    tied[1].weight = tied[0].weight
    assert names(shard_units(tied)) == ["2"]


def test_a_model_with_nothing_to_gather_by_blocks_or_a_whole_tensor_optimizer_is_one_line():
    with pytest.raises(ConfigError, match="cannot shard Linear: it has 0 child modules holding parameters"):
        check_shardable(nn.Linear(4, 2), "Linear")
    with pytest.raises(ConfigError, match="cannot shard MLP"):
        check_shardable(MLP(num_layers=0), "MLP")  # one Linear under the root
    with pytest.raises(ConfigError, match="it has 1 blocks .its `shard_blocks`."):
        check_shardable(Transformer1d(depth=1), "Transformer1d")

    class Muon(torch.optim.SGD):
        pass

    refuse_split_layers(torch.optim.AdamW, True)
    refuse_split_layers("lbt.optim.LARS", True)
    with pytest.raises(ConfigError, match="optimizer_class=Muon with layers split .*needs each weight whole"):
        refuse_split_layers(Muon, True)


def test_sharding_settings_it_cannot_run_are_one_line(tmp_path, capsys):
    for overrides, expected in [
        (["dist.shard=zero3"], "dist.shard"),
        (["dist.shard=fsdp", "dist.fuse_workers=true"], "dist.fuse_workers=true with dist.shard=fsdp"),
        (["dist.shard=fsdp", "dist.procs=2", "technique=[comm_compression]"],
         "technique.comm_compression with dist.shard=fsdp: it reads or changes the gradient DDP sends"),
        (["dist.shard=fsdp", "dist.procs=2", "strategy=local_sgd"],
         "strategy=local_sgd with dist.shard=fsdp: it replaces the synchronous step"),
        (["dist.shard=fsdp", "dist.procs=2", "optim=muon"], "optim.optimizer_class=MuonAdamW with layers split"),
    ]:
        code, err = run_main(["train", *FAST, *overrides, f"hydra.run.dir={tmp_path / 'x'}"], capsys)
        assert code == 2 and err.count("\n") == 1 and expected in err, err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Sharded and DDP runs on 2 and 4 processes under each optimizer, a sharded one killed after epoch 1 and
    resumed on 4 and on 2, the hybrid 2 x 2 mesh; and the simulated runs they must equal."""
    root = tmp_path_factory.mktemp("fsdp")
    lamb2 = MLP_RUN + OPTIMS["lamb"] + ["trainer.epochs=2", "dist.shard=fsdp"]
    one_epoch = {name: MLP_RUN + optim + ["trainer.epochs=1"] for name, optim in OPTIMS.items()}
    train_on_processes(4, [
        *[(root / f"{layout}4_{name}", FAST + run + ["dist.procs=4", f"dist.shard={shard}"])
          for name, run in one_epoch.items() for layout, shard in (("fsdp", "fsdp"), ("ddp", "none"))],
        (root / "four", FAST + lamb2 + ["dist.procs=4"]),
        ("copy", root / "four", root / "resumed4"),
        (root / "resumed4", FAST + lamb2 + ["dist.procs=4", "trainer.resume=auto"]),
        ("copy", root / "four", root / "resumed2"),
        ("copy", root / "four", root / "resumed1"),
        (root / "hybrid", FAST + HYBRID + ["dist.procs=4", "dist.world_size=4", "dist.tensor_parallel=2",
                                           "dist.shard=fsdp"]),
    ])
    train_on_processes(2, [
        *[(root / f"{layout}2_{name}", FAST + run + ["dist.procs=2", f"dist.shard={shard}"])
          for name, run in one_epoch.items() for layout, shard in (("fsdp", "fsdp"), ("ddp", "none"))],
        (root / "resumed2", FAST + lamb2 + ["dist.procs=2", "trainer.resume=auto"]),
    ])
    # On one process, dist.shard=fsdp shards nothing: the sharded checkpoint loads whole there, not refused.
    train(root / "resumed1", lamb2 + ["dist.procs=1", "trainer.resume=auto"])
    for name, run in one_epoch.items():
        train(root / f"sim_{name}", run + ["dist.procs=1"])
    train(root / "sim_lamb2", lamb2[:-1] + ["dist.procs=1"])
    train(root / "sim_hybrid", HYBRID + ["dist.procs=1", "dist.world_size=2"])
    return root


@pytest.mark.slow
@pytest.mark.parametrize("procs", [2, 4])
@pytest.mark.parametrize("optim", list(OPTIMS))
def test_a_sharded_run_takes_the_steps_of_ddp_and_of_the_simulated_workers(runs, optim, procs):
    """W=4 on 2 or 4 sharded processes = DDP on as many = W=4 simulated on one process: the reduce-scatter
    averages what DDP's allreduce does, and LARS's and LAMB's trust ratios take norms over whole tensors."""
    sharded = final_params(runs / f"fsdp{procs}_{optim}")
    assert relative_diff(final_params(runs / f"sim_{optim}"), sharded) < 1e-5
    assert relative_diff(final_params(runs / f"ddp{procs}_{optim}"), sharded) < 1e-5
    sent = {layout: json.loads((runs / f"{layout}{procs}_{optim}" / "result.json").read_text())["bytes_sent"]
            for layout in ("ddp", "fsdp")}
    assert sent["fsdp"] == pytest.approx(1.5 * sent["ddp"])  # two all-gathers and a reduce-scatter


@pytest.mark.slow
def test_sharded_over_two_epochs_and_on_a_two_by_two_mesh(runs):
    assert relative_diff(final_params(runs / "sim_lamb2"), final_params(runs / "four")) < 1e-5
    assert relative_diff(final_params(runs / "sim_hybrid"), final_params(runs / "hybrid")) < 1e-5


@pytest.mark.slow
def test_a_sharded_checkpoint_resumes_bitwise_and_on_fewer_processes_one_included(runs):
    shards = sorted(p.name for p in (runs / "four" / "checkpoint").glob("step_*/shards/*"))
    assert shards == [".metadata", *(f"__{r}_0.distcp" for r in range(4))]  # each rank wrote its own shards
    assert torch.equal(final_params(runs / "four"), final_params(runs / "resumed4"))
    assert relative_diff(final_params(runs / "four"), final_params(runs / "resumed2")) < 1e-5
    assert relative_diff(final_params(runs / "four"), final_params(runs / "resumed1")) < 1e-5
    exported = torch.load(runs / "four" / "final_model.pt", weights_only=True)
    assert all(type(t) is torch.Tensor for t in exported.values())  # an ordinary state dict, whole tensors
    assert exported["1.weight"].shape == (32, 40)


@pytest.mark.slow
def test_a_replicated_checkpoint_is_not_resumed_sharded(tmp_path, capsys):
    train(tmp_path / "ddp", MLP_RUN[:-1] + ["trainer.epochs=2", "dist.procs=1"])
    run_dir = interrupted(tmp_path / "ddp", tmp_path)
    code, err = run_main(["train", *FAST, *MLP_RUN[:-1], "trainer.epochs=2", "dist.shard=fsdp",
                          "trainer.resume=auto", f"hydra.run.dir={run_dir}"], capsys)
    assert code == 2 and "written by a replicated (dist.shard=none) run" in err and err.count("\n") == 1, err


def test_memory_per_gpu_and_traffic_formulas():
    memory = ModelMemory(params=1_000, largest_block=100, optimizer_slots=2)
    assert memory.per_rank(1) == 16_000  # 4 bytes x (parameter, gradient, two AdamW tensors)
    assert memory.replicated(1) == 16_000 and memory.replicated(8) == 20_000  # DDP's buckets from 2 GPUs on
    assert memory.per_rank(4) == 16_000 / 4 + 4 * 4 * 100
    assert fewest_gpus(memory, 16_000, [1, 2, 4]) == (1, "none")
    assert fewest_gpus(memory, 6_000, [1, 2, 4, 8]) == (4, "fsdp")  # 8,000 + 1,600 at 2; 4,000 + 1,600 at 4
    assert fewest_gpus(memory, 1_000, [1, 2, 4]) is None
    assert fsdp_bytes_sent(4e6, 4) == pytest.approx(1.5 * ring_bytes_sent(4e6, 4))


def test_plan_names_the_fewest_gpus_a_model_trains_on_sharded(tmp_path, capsys):
    from test_cli_errors import run_main_io

    args = ["plan", "model=transformer1d", "plan.gpu=h100", "plan.shard=fsdp", "plan.max_workers=16",
            f"plan.out={tmp_path / 'plan.png'}"]
    code, out, err = run_main_io([*args, "plan.gpu_memory_gb=0.00075"], capsys)  # 1.1 MB whole, 0.8 at 4, 0.7 at 8
    assert code == 0, err
    assert "gather+scatter ms" in out and "replicated (DDP, its buckets too)" in out
    assert "trains on: at least 8 GPUs, sharded (dist.shard=fsdp" in out, out
    code, out, err = run_main_io([*args, "plan.compression=fp16"], capsys)
    assert code == 2 and "plan.shard=fsdp plans sharded data parallelism" in err and err.count("\n") == 1
