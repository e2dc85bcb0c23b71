"""Model, loss and communication techniques: each pure function alone, then each hook on a tiny model."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lbt.errors import ConfigError
from lbt.models import MLP, CNN1d, ResNet20
from lbt.nn import GhostBatchNorm
from lbt.techniques.base import Progress
from lbt.techniques.comm_compression import KINDS, CommCompression, compressed_bytes
from lbt.techniques.ghost_bn import GhostBN
from lbt.techniques.grad_clip import GradClip, clip_coefficient
from lbt.techniques.label_smoothing import LabelSmoothing, smooth_labels
from lbt.techniques.sync_bn import SyncBN, runs_on_cuda
from lbt.techniques.zero_init_residual import ZeroInitResidual, last_bn_of_residual_blocks

SMALL_IMAGE = (3, 8, 8)


def _bn_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


# -- zero_init_residual -------------------------------------------------------------------------------------


def test_last_bn_of_resnet20_blocks_is_each_bn2():
    model = ResNet20(input_shape=SMALL_IMAGE, num_classes=10)
    assert last_bn_of_residual_blocks(model) == [block.bn2 for block in model.blocks]
    assert len(model.blocks) == 9


def test_zero_init_residual_makes_each_block_its_shortcut():
    model = ResNet20(input_shape=SMALL_IMAGE, num_classes=10)
    technique = ZeroInitResidual()
    assert technique.on_model(model) is model
    for block in model.blocks:
        assert torch.all(block.bn2.weight == 0) and torch.all(block.bn1.weight == 1)
    assert "9 residual blocks" in technique.describe()
    # gamma = beta = 0: the residual branch adds nothing, in training mode too.
    block, x = model.blocks[3], torch.randn(4, 16, 8, 8)  # the first stride-2, channel-doubling block
    torch.testing.assert_close(block(x), F.relu(block.shortcut(x)))


@pytest.mark.parametrize("build", [lambda: CNN1d(input_shape=(40,)), lambda: MLP(input_shape=(40,))])
def test_zero_init_residual_leaves_models_without_blocks_alone(build):
    model = build()
    before = copy.deepcopy(model.state_dict())
    technique = ZeroInitResidual()
    technique.on_model(model)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    assert "no residual blocks" in technique.describe()


@pytest.mark.parametrize("block_name, last_bn", [("BasicBlock", "bn2"), ("Bottleneck", "bn3")])
def test_zero_init_residual_matches_torchvision_own_option(block_name, last_bn):
    from torchvision.models import resnet

    def build(zero_init_residual: bool) -> nn.Module:
        torch.manual_seed(0)
        block = getattr(resnet, block_name)
        return resnet.ResNet(block, [1, 1, 1, 1], num_classes=10, zero_init_residual=zero_init_residual)

    ours, theirs = build(False), build(True)
    layers = last_bn_of_residual_blocks(ours)
    assert layers == [getattr(m, last_bn) for m in ours.modules() if type(m).__name__ == block_name]
    assert len(layers) == 4
    ZeroInitResidual().on_model(ours)
    for (key, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b), key


def test_zero_init_residual_finds_blocks_after_ghost_bn():
    model = GhostBN(virtual_batch=2).on_model(ResNet20(input_shape=SMALL_IMAGE, num_classes=10))
    ZeroInitResidual().on_model(model)
    assert all(isinstance(b.bn2, GhostBatchNorm) and torch.all(b.bn2.weight == 0) for b in model.blocks)


# -- label_smoothing ----------------------------------------------------------------------------------------


def test_smooth_labels_by_hand():
    soft = smooth_labels(torch.tensor([2, 0]), num_classes=4, eps=0.2)
    torch.testing.assert_close(soft, torch.tensor([[0.05, 0.05, 0.85, 0.05], [0.85, 0.05, 0.05, 0.05]]))
    # Probability targets are smoothed the same way, and rows still sum to 1.
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(smooth_labels(probs, 4, 0.2), torch.tensor([[0.45, 0.45, 0.05, 0.05]]))
    assert torch.equal(smooth_labels(torch.tensor([1]), 3, 0.0), torch.tensor([[0.0, 1.0, 0.0]]))


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_torch_label_smoothing_is_cross_entropy_against_smooth_labels(eps):
    torch.manual_seed(0)
    logits, targets = torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 5, (16,))
    soft = smooth_labels(targets, 5, eps)
    by_hand = -(soft * logits.log_softmax(1)).sum(1).mean()
    torch.testing.assert_close(nn.CrossEntropyLoss(label_smoothing=eps)(logits, targets), by_hand)
    torch.testing.assert_close(F.cross_entropy(logits, soft), by_hand)


def test_label_smoothing_hook_returns_smoothed_cross_entropy():
    loss_fn = LabelSmoothing(eps=0.2).on_loss(nn.CrossEntropyLoss())
    assert isinstance(loss_fn, nn.CrossEntropyLoss) and loss_fn.label_smoothing == 0.2
    model = CNN1d(input_shape=(40,), num_classes=10)
    x, y = torch.randn(8, 40), torch.randint(0, 10, (8,))
    logits = model(x)
    torch.testing.assert_close(loss_fn(logits, y), F.cross_entropy(logits, smooth_labels(y, 10, 0.2)))
    with pytest.raises(ConfigError, match="cross-entropy"):
        LabelSmoothing().on_loss(nn.MSELoss())
    with pytest.raises(ConfigError, match=r"eps must be a number in \[0, 1\)"):
        LabelSmoothing(eps=1.0)


# -- ghost_bn (the layer itself: tests/test_batchnorm.py) ---------------------------------------------------


def test_ghost_bn_hook_swaps_every_batchnorm_keeping_tensors_and_state_dict():
    model = CNN1d(input_shape=(40,), num_classes=10)
    model.train()(torch.randn(16, 40))  # non-trivial running stats
    reference = copy.deepcopy(model)
    params = list(model.parameters())
    technique = GhostBN(virtual_batch=4)
    model = technique.on_model(model)
    ghosts = _bn_layers(model)
    assert len(ghosts) == 3 and all(isinstance(m, GhostBatchNorm) and m.virtual_batch == 4 for m in ghosts)
    assert all(a is b for a, b in zip(model.parameters(), params))  # an optimizer built before stays valid
    assert "3 BN layers" in technique.describe()
    assert list(model.state_dict()) == list(reference.state_dict())
    model.load_state_dict(reference.state_dict())
    reference.load_state_dict(model.state_dict())
    x = torch.randn(16, 40)
    torch.testing.assert_close(model.eval()(x), reference.eval()(x))
    # Training: 16 samples in ghost batches of 4 differ from whole-batch BN.
    assert not torch.allclose(model.train()(x), reference.train()(x))


def test_ghost_bn_trains_resnet20():
    model = GhostBN(virtual_batch=4).on_model(ResNet20(input_shape=SMALL_IMAGE, num_classes=10))
    assert len(_bn_layers(model)) == 19 and all(isinstance(m, GhostBatchNorm) for m in _bn_layers(model))
    loss = F.cross_entropy(model(torch.randn(8, *SMALL_IMAGE)), torch.randint(0, 10, (8,)))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ConfigError, match="positive integer"):
        GhostBN(virtual_batch=0)


# -- sync_bn ------------------------------------------------------------------------------------------------


def test_runs_on_cuda():
    assert runs_on_cuda("auto", True) and runs_on_cuda("cuda", True) and runs_on_cuda("cuda:1", True)
    assert not runs_on_cuda("auto", False) and not runs_on_cuda("cpu", True) and not runs_on_cuda("cuda", False)


def test_sync_bn_on_cpu_is_a_one_line_config_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError) as error:
        SyncBN(device="auto").on_model(CNN1d(input_shape=(40,)))
    message = str(error.value)
    assert "\n" not in message and "CUDA" in message and "per_worker_batch" in message and "ghost_bn" in message
    with pytest.raises(ConfigError):
        SyncBN(device="cpu").on_model(CNN1d(input_shape=(40,)))


def test_sync_bn_converts_batchnorm_when_the_run_is_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the conversion itself is device-agnostic
    model = CNN1d(input_shape=(40,))
    weights = [m.weight for m in _bn_layers(model)]
    technique = SyncBN(device="cuda")
    model = technique.on_model(model)
    layers = _bn_layers(model)
    assert len(layers) == 3 and all(type(m) is nn.SyncBatchNorm for m in layers)
    assert all(m.weight is w for m, w in zip(layers, weights))
    assert "3 layers" in technique.describe()


# -- grad_clip ----------------------------------------------------------------------------------------------


def test_clip_coefficient_by_hand():
    assert clip_coefficient(torch.tensor(2.0, dtype=torch.float64), 1.0).item() == pytest.approx(1.0 / 2.000001,
                                                                                                 rel=1e-12)
    assert clip_coefficient(10.0, 5.0).item() == pytest.approx(0.5, rel=1e-6)
    assert clip_coefficient(0.5, 1.0).item() == 1.0
    assert clip_coefficient(0.0, 1.0).item() == 1.0


def _progress() -> Progress:
    return Progress(samples_seen=0, step=0, epoch=0, global_batch=8, samples_per_epoch=8)


@pytest.mark.parametrize("max_norm", [0.01, 1e6])
def test_grad_clip_scales_gradients_as_clip_coefficient_says(max_norm):
    torch.manual_seed(0)
    model = CNN1d(input_shape=(40,), num_classes=10)
    F.cross_entropy(model(torch.randn(8, 40)), torch.randint(0, 10, (8,))).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    total = torch.cat([g.flatten() for g in grads]).norm().item()
    technique = GradClip(max_norm=max_norm)
    technique.after_backward(model, _progress())
    coefficient = clip_coefficient(total, max_norm)
    assert (coefficient < 1) == (max_norm < total)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, g * coefficient)
    assert technique.last_norm.item() == pytest.approx(total, rel=1e-5)
    # the same gradients as torch's own clipping
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
    clipped = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    technique.after_backward(model, _progress())
    assert all(torch.equal(p.grad, c) for p, c in zip(model.parameters(), clipped))
    with pytest.raises(ConfigError, match="positive"):
        GradClip(max_norm=0)


# -- comm_compression ---------------------------------------------------------------------------------------


def test_compressed_bytes_by_hand():
    # A (16, 32) weight: 512 elements.
    assert compressed_bytes((16, 32), "none") == 2048
    assert compressed_bytes((16, 32), "fp16") == compressed_bytes((16, 32), "bf16") == 1024
    assert compressed_bytes((16, 32), "powersgd", rank=1) == 4 * 1 * (16 + 32)  # 192
    assert compressed_bytes((16, 32), "powersgd", rank=4) == 4 * 4 * 48  # 768: 384 * 2 < 512
    assert compressed_bytes((16, 32), "powersgd", rank=8) == 2048  # 384 * 2 >= 512: sent as is
    # A conv weight (64, 16, 3, 3) is a (64, 144) matrix; a bias is never compressed.
    assert compressed_bytes((64, 16, 3, 3), "powersgd", rank=2) == 4 * 2 * (64 + 144)
    assert compressed_bytes((16,), "powersgd") == 64
    with pytest.raises(ValueError):
        compressed_bytes((4,), "int8")


def test_comm_compression_config_errors_and_single_process_no_op():
    with pytest.raises(ConfigError, match="kind must be one of fp16, bf16, powersgd"):
        CommCompression(kind="int8")
    with pytest.raises(ConfigError, match="start_powersgd_iter must be an integer >= 2"):
        CommCompression(kind="powersgd", start_powersgd_iter=1)
    with pytest.raises(ConfigError, match="powersgd_rank"):
        CommCompression(kind="powersgd", powersgd_rank=0)
    technique = CommCompression("powersgd")  # procs == 1: no DDP wrapper, the hook is never asked for
    assert technique.bytes_ratio is None and "PowerSGD rank 1" in technique.describe()


# powersgd on CPU gradients is refused where CUDA is present (torch's hook fails there; test below).
CPU_KINDS = ("none",) + tuple(k for k in KINDS if k != "powersgd" or not torch.cuda.is_available())


def _comm_hook_worker(rank: int, store_port: int, out_dir: str) -> None:
    """Each kind on a fresh DDP MLP for 3 steps; saves local and allreduced gradients and final parameters."""
    from torch.nn.parallel import DistributedDataParallel

    from lbt.engine.step import register_comm_hook
    from lbt.engine.strategies.base import StepStrategy
    from lbt.parallel.process_group import init_process_group

    torch.set_num_threads(1)
    init_process_group("gloo", rank, 2, 30.0, store_port)
    results = {}
    for kind in CPU_KINDS:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        local = copy.deepcopy(model)
        ddp = DistributedDataParallel(model)
        technique = CommCompression(kind) if kind != "none" else None
        register_comm_hook(ddp, StepStrategy(), [technique] if technique else [])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        steps = []
        for step in range(3):  # powersgd: 2 plain allreduces, then compressed ones
            generator = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 16, generator=generator), torch.randint(0, 4, (8,), generator=generator)
            local.load_state_dict(model.state_dict())
            local.zero_grad()
            F.cross_entropy(local(x), y).backward()
            optimizer.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            steps.append({"local": [p.grad.clone() for p in local.parameters()],
                          "reduced": [p.grad.clone() for p in model.parameters()]})
            optimizer.step()
        results[kind] = {"steps": steps, "params": [p.detach().clone() for p in model.parameters()],
                         "ratio": technique.bytes_ratio if technique else None}
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    # Both ranks tear down together, hooks released first: in one full suite run rank 0 aborted in
    # gloo at the end ("terminate called without an active exception") after rank 1 had closed its side.
    del ddp, technique
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_comm_hooks_on_gloo_with_two_processes(tmp_path):
    from lbt.parallel.launcher import launch_local

    launch_local(_comm_hook_worker, (str(tmp_path),), 2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for kind in CPU_KINDS:
        for a, b in zip(ranks[0][kind]["params"], ranks[1][kind]["params"]):
            assert torch.equal(a, b), f"{kind}: the ranks' parameters diverged"
    for kind, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        assert ranks[0][kind]["ratio"] == 2.0
        for step in range(3):
            local = [ranks[r][kind]["steps"][step]["local"] for r in range(2)]
            for i, reduced in enumerate(ranks[0][kind]["steps"][step]["reduced"]):
                # The hook: cast, divide by world size, sum in 16 bits, cast back.
                expected = (local[0][i].to(dtype) / 2 + local[1][i].to(dtype) / 2).float()
                torch.testing.assert_close(reduced, expected, rtol=0, atol=0)
    if "powersgd" not in CPU_KINDS:
        return
    powersgd = ranks[0]["powersgd"]["steps"]
    local = [ranks[r]["powersgd"]["steps"] for r in range(2)]
    for step in range(3):
        mean = [(a + b) / 2 for a, b in zip(local[0][step]["local"], local[1][step]["local"])]
        weight = powersgd[step]["reduced"][0]  # (32, 16): compressed once PowerSGD starts
        if step < 2:
            torch.testing.assert_close(weight, mean[0])
        else:
            assert torch.linalg.matrix_rank(weight).item() == 1
            assert not torch.allclose(weight, mean[0])
            torch.testing.assert_close(powersgd[step]["reduced"][1], mean[1])  # a bias goes uncompressed
    assert ranks[0]["powersgd"]["ratio"] > 5


def test_powersgd_on_cpu_gradients_beside_cuda_is_refused(monkeypatch):
    """torch's powerSGD_hook synchronizes the gradients' device whenever CUDA is present and fails on CPU ones
    (seen on an H200 machine): the hook is refused with one line; without CUDA, or with fp16, it is given."""
    from types import SimpleNamespace

    ddp = SimpleNamespace(module=nn.Linear(16, 4))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert callable(CommCompression("powersgd").comm_hook(None, ddp))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="kind=powersgd with CPU gradients on a machine with CUDA"):
        CommCompression("powersgd").comm_hook(None, ddp)
    assert callable(CommCompression("fp16").comm_hook(None, ddp))
