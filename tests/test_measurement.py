"""A measurement never changes the run it measures; a simulated technique behaves as on real workers, or is refused."""

import pytest
import torch
from conftest import final_params, relative_diff, train

from lbt.errors import ConfigError
from lbt.spec.batching import BatchLayout
from lbt.techniques.comm_compression import CommCompression
from lbt.techniques.sync_bn import SyncBN

# cnn1d has BatchNorm: the layout of the passes over workers shows in its statistics.
RUN = ["model=cnn1d", "model.channels=16", "data.num_train=768", "trainer.epochs=2", "trainer.global_batch=128",
       "trainer.log_every=3"]
LAYOUTS = {
    "fused": ["dist.world_size=4"],
    "sequential": ["dist.world_size=4", "dist.fuse_workers=false"],
    "real": ["dist.world_size=2", "dist.procs=2"],
    "real+simulated": ["dist.world_size=4", "dist.procs=2"],
}


def params(run_dir) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "final_model.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_measuring_the_noise_scale_leaves_the_parameters_bitwise_alone(layout, tmp_path):
    plain = train(tmp_path / "plain", RUN + LAYOUTS[layout])
    measured = train(tmp_path / "gns", RUN + LAYOUTS[layout] + ["measure=[gns]"])
    assert "gns/b_simple" in measured["technique_metrics"]  # it did measure
    a, b = params(tmp_path / "plain"), params(tmp_path / "gns")
    assert not [k for k in a if not torch.equal(a[k], b[k])]
    assert plain["test_history"] == measured["test_history"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_simulated_compression_agrees_with_real_workers(kind, tmp_path):
    """Each simulated worker's gradient goes through the compression its GPU would apply."""
    run = ["model=mlp", "data.num_train=1024", "trainer.epochs=1", "trainer.global_batch=64", "optim.lr=0.05",
           "technique=[comm_compression]", f"technique.comm_compression.kind={kind}", "dist.world_size=2"]
    train(tmp_path / "real", run + ["dist.procs=2"])
    train(tmp_path / "simulated", run + ["dist.procs=1"])
    train(tmp_path / "uncompressed", [o for o in run if "comm_compression" not in o])
    real, simulated = final_params(tmp_path / "real"), final_params(tmp_path / "simulated")
    uncompressed = final_params(tmp_path / "uncompressed")
    rounding = {"fp16": 2**-11, "bf16": 2**-8}[kind]  # the 16-bit type's relative rounding
    gap = relative_diff(real, simulated)
    assert gap < 10 * rounding, gap  # 16 steps of 16-bit rounding, summed in a different order
    # not a no-op: compression moves both runs away from the uncompressed one, by far more than they differ
    # (here fp16: 3.5e-7 apart, 7.6e-6 from uncompressed; bf16: bitwise equal, 6.2e-5 from uncompressed)
    moved = relative_diff(uncompressed, simulated)
    assert moved > 1e-6 and moved > 5 * gap and relative_diff(uncompressed, real) > 1e-6


def test_what_cannot_be_simulated_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="PowerSGD's per-worker error feedback is not simulated"):
        CommCompression("powersgd").check_layout(BatchLayout(4, 1, 16, 64))
    with pytest.raises(ConfigError, match="dist.procs=1"):
        CommCompression("fp16").check_layout(BatchLayout(4, 2, 16, 64))
    CommCompression("powersgd").check_layout(BatchLayout(2, 2, 32, 64))  # real workers: DDP's hook
    CommCompression("fp16").check_layout(BatchLayout(4, 1, 16, 64))  # simulated per worker
    with pytest.raises(ConfigError, match="sync_bn pools BN statistics across processes"):
        SyncBN().check_layout(BatchLayout(4, 1, 16, 64))


def test_powersgd_with_simulated_workers_stops_the_run(tmp_path):
    with pytest.raises(ConfigError, match="PowerSGD"):
        train(tmp_path, ["technique=[comm_compression]", "technique.comm_compression.kind=powersgd",
                         "dist.world_size=2", "trainer.max_steps=1"])
