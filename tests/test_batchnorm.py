"""Per-worker BatchNorm (lbt/nn/batchnorm.py): a fused pass of W workers normalises each worker's chunk as that
worker's own BatchNorm does, bit for bit on CPU: the output, the input, weight and bias gradients, and the running
statistics (their mean over the workers, as lbt averages its workers' buffers). The technique that uses the layer
on its own (ghost_bn) is tested in tests/test_techniques_model.py."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lbt.errors import ConfigError
from lbt.nn import GhostBatchNorm, ghost_batch_norm
from lbt.nn.batchnorm import grouped_batch_norm

# name -> (BatchNorm class, per-worker shape (b, C, *), memory format)
LAYOUTS = {
    "NCHW": (nn.BatchNorm2d, (4, 6, 5, 3), torch.contiguous_format),
    "channels_last": (nn.BatchNorm2d, (4, 6, 5, 3), torch.channels_last),
    "NC": (nn.BatchNorm1d, (4, 5), torch.contiguous_format),
    "NCL": (nn.BatchNorm1d, (4, 3, 7), torch.contiguous_format),
}


def _batch(workers: int, layout: str, seed: int = 0) -> torch.Tensor:
    _, (b, *rest), memory_format = LAYOUTS[layout]
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(workers * b, *rest, generator=generator) * 3 + 1
    return x.contiguous(memory_format=memory_format) if x.dim() == 4 else x


def _trained_bn(layout: str, momentum: float | None) -> nn.Module:
    bn_class, (_, channels, *_), _ = LAYOUTS[layout]
    bn = bn_class(channels, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 1.5)
    return bn


def _each_worker(bn: nn.Module, x: torch.Tensor, grad_out: torch.Tensor, workers: int) -> dict[str, torch.Tensor]:
    """Each worker's own BN on its chunk, from the same buffers; the weight and bias gradients summed in worker
    order (the fused pass's loss is the sum over its workers), the running statistics averaged (BufferMean)."""
    outs, grads, own = [], [], []
    for chunk, grad_chunk in zip(x.split(len(x) // workers), grad_out.split(len(x) // workers)):
        worker, chunk = copy.deepcopy(bn), chunk.detach().requires_grad_()
        out = worker(chunk)
        out.backward(grad_chunk)
        outs.append(out)
        grads.append(chunk.grad)
        own.append(worker)
    return {"out": torch.cat(outs), "grad_x": torch.cat(grads),
            "grad_weight": functools.reduce(torch.add, [w.weight.grad for w in own]),
            "grad_bias": functools.reduce(torch.add, [w.bias.grad for w in own]),
            "running_mean": torch.stack([w.running_mean for w in own]).mean(0),
            "running_var": torch.stack([w.running_var for w in own]).mean(0),
            "num_batches_tracked": own[0].num_batches_tracked}


def _fused(ghost: GhostBatchNorm, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.detach().requires_grad_()
    ghost.weight.grad = ghost.bias.grad = None
    out = ghost(x)
    out.backward(grad_out)
    return {"out": out, "grad_x": x.grad, "grad_weight": ghost.weight.grad, "grad_bias": ghost.bias.grad,
            "running_mean": ghost.running_mean.clone(), "running_var": ghost.running_var.clone(),
            "num_batches_tracked": ghost.num_batches_tracked.clone()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("workers", [1, 2, 8])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_fused_batch_norm_is_each_workers_batch_norm_bit_for_bit(layout, workers, momentum):
    """Two steps (the running statistics compound; None is BN's cumulative average, 1/steps)."""
    bn = _trained_bn(layout, momentum)
    ghost = GhostBatchNorm.from_batchnorm(copy.deepcopy(bn), virtual_batch=LAYOUTS[layout][1][0])
    for step in range(2):
        x = _batch(workers, layout, seed=step)
        grad_out = torch.randn_like(x)  # keeps x's layout
        fused, expected = _fused(ghost, x, grad_out), _each_worker(bn, x, grad_out, workers)
        for name, value in expected.items():
            assert torch.equal(fused[name], value), f"step {step}: {name}"
        assert fused["out"].stride() == x.stride() and fused["grad_x"].stride() == x.stride()  # layout kept
        with torch.no_grad():  # every worker starts the next step from the averaged buffers, as in lbt
            bn.running_mean.copy_(expected["running_mean"])
            bn.running_var.copy_(expected["running_var"])
            bn.num_batches_tracked.copy_(expected["num_batches_tracked"])
    x = _batch(workers, layout, seed=2)
    assert torch.equal(ghost.eval()(x), bn.eval()(x))  # evaluation: plain BN on the running statistics


def test_running_statistics_take_one_step_towards_the_chunks_mean_statistics():
    """By hand, in float64: BN's update is linear, so the mean of the chunks' updated copies is one momentum step
    towards the mean of the chunks' statistics (unbiased variance per chunk, as BN keeps)."""
    x = torch.randn(6, 2, 7, dtype=torch.float64) * 3 + 1
    mean, var = torch.randn(2, dtype=torch.float64), torch.rand(2, dtype=torch.float64) + 0.5
    running_mean, running_var = mean.clone(), var.clone()
    ghost_batch_norm(x, 2, None, None, 1e-5, running_mean, running_var, momentum=0.1)
    chunks = x.split(2)
    torch.testing.assert_close(running_mean, 0.9 * mean + 0.1 * torch.stack([c.mean((0, 2)) for c in chunks]).mean(0))
    torch.testing.assert_close(running_var, 0.9 * var + 0.1 * torch.stack([c.var((0, 2)) for c in chunks]).mean(0))


def test_channels_last_output_stays_channels_last():
    """An NCHW output would cost the next convolution a layout change on the GPU."""
    x = _batch(8, "channels_last")
    out = ghost_batch_norm(x, 4, torch.randn(6), torch.randn(6), 1e-5, torch.zeros(6), torch.ones(6), 0.1)
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()


def test_functional_form_without_affine_or_running_statistics():
    x = _batch(8, "NCHW").requires_grad_()
    out = ghost_batch_norm(x, 4)
    out.backward(torch.ones_like(out))
    for chunk, out_chunk, grad_chunk in zip(x.detach().split(4), out.split(4), x.grad.split(4)):
        chunk = chunk.requires_grad_()
        expected = F.batch_norm(chunk, None, None, training=True)
        expected.backward(torch.ones_like(expected))
        assert torch.equal(out_chunk, expected) and torch.equal(grad_chunk, chunk.grad)


def test_a_strided_input_is_normalised_per_chunk_too():
    """Neither contiguous nor channels_last (here a transposed (N, C, L)): normalised as its contiguous copy."""
    x = torch.randn(7, 16, 3).permute(1, 2, 0)  # (16, 3, 7)
    assert not x.is_contiguous()
    out = ghost_batch_norm(x, 4)
    expected = torch.cat([F.batch_norm(chunk.contiguous(), None, None, training=True) for chunk in x.split(4)])
    assert torch.equal(out, expected)


@pytest.mark.parametrize("layout", ["NCHW", "channels_last"])
def test_bf16_autocast_matches_float32_workers_within_bf16_rounding(layout):
    """Under bf16 autocast a BN layer gets a bf16 input (from the convolution before it) beside float32
    parameters: the output is bf16 (kept channels_last), the statistics float32. Against each worker's float32 BN
    on the same values: within bf16's rounding (8 significant bits: 2e-2 relative and absolute on values of
    order 1-5; 1.5e-2 seen). Against each worker's BN under the same autocast: equal, on CPU."""
    bn = _trained_bn(layout, 0.1)
    ghost = GhostBatchNorm.from_batchnorm(copy.deepcopy(bn), virtual_batch=4)
    x = _batch(8, layout).to(torch.bfloat16)
    grad_out = torch.randn_like(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _fused(ghost, x, grad_out)
        same_autocast = _each_worker(copy.deepcopy(bn), x, grad_out, 8)
    expected = _each_worker(bn, x.float(), grad_out.float(), 8)
    assert fused["out"].dtype == torch.bfloat16 and fused["out"].stride() == x.stride()
    assert fused["running_mean"].dtype == torch.float32
    for name, value in expected.items():
        torch.testing.assert_close(fused[name].float(), value.float(), rtol=2e-2, atol=2e-2, msg=name)
        assert torch.equal(fused[name], same_autocast[name]), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_grouped_form_for_torch_compile_equals_the_per_chunk_kernels_up_to_rounding(layout):
    x = _batch(8, layout)
    channels = x.shape[1]
    weight, bias = torch.rand(channels) + 0.5, torch.randn(channels)
    stats = [torch.randn(channels), torch.rand(channels) + 0.5]
    per_chunk, grouped = [s.clone() for s in stats], [s.clone() for s in stats]
    expected = ghost_batch_norm(x, 4, weight, bias, 1e-5, *per_chunk, momentum=0.1)
    out = grouped_batch_norm(x, len(x) // 4, weight, bias, 1e-5, *grouped, momentum=0.1)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert out.stride() == x.stride()
    for a, b in zip(grouped, per_chunk):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_compiled_ghost_batch_norm_trains_like_the_eager_one():
    """torch.compile cannot trace the eager form's writes into views of one output; it traces the grouped form."""
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), GhostBatchNorm(6, virtual_batch=4), nn.ReLU())
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(compiled_model, backend="aot_eager")  # tracing only: no C++ build
    x = torch.randn(16, 3, 5, 5)
    for model in (eager, compiled):
        model(x).square().sum().backward()
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-5, atol=1e-5)
    for a, b in zip(compiled_model.state_dict().values(), eager.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled_model.parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_ghost_batch_norm_rejects_a_batch_it_does_not_divide():
    ghost = GhostBatchNorm(3, virtual_batch=4)
    with pytest.raises(ConfigError, match=r"virtual_batch=4 does not divide the batch of 6 samples"):
        ghost(torch.randn(6, 3))
    ghost.eval()(torch.randn(6, 3))  # evaluation uses running stats: any batch
