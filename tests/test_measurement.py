"""A measurement never changes the run it measures; a simulated technique behaves as on real workers, or is refused."""

import pytest
import torch
from conftest import train

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
