"""Gradient noise scale: the estimator recovers known values, and lbt's in-training
estimate matches the exact B_simple from per-example gradients."""

import math

import pytest
import torch
from conftest import train
from torch.func import functional_call, grad, vmap

from lbt.data.synthetic import build_synthetic
from lbt.models import MLP
from lbt.spec.batching import BatchLayout
from lbt.techniques.base import Progress
from lbt.techniques.gns import (
    GradientNoiseScale,
    NoiseScaleEstimator,
    finite_population_factor,
    measure_every,
    noise_scale_terms,
)


def test_finite_population_factor_by_hand():
    assert finite_population_factor(4, None) == 0.25
    assert finite_population_factor(4, 101) == pytest.approx(97 / (100 * 4))
    assert finite_population_factor(101, 101) == 0.0  # the whole population: no noise left


def test_noise_scale_terms_invert_the_expected_norms():
    grad_sq, trace, n = 2.0, 50.0, 1000
    small, big = 8, 128
    def expected(b: int) -> float:  # E|g_b|^2
        return grad_sq + finite_population_factor(b, n) * trace
    g2, tr = noise_scale_terms(expected(small), expected(big), small, big, n)
    assert g2 == pytest.approx(grad_sq) and tr == pytest.approx(trace)
    # without the finite-population correction: McCandlish et al.'s formulas
    g2, tr = noise_scale_terms(3.0, 2.5, 2, 8)
    assert g2 == pytest.approx((8 * 2.5 - 2 * 3.0) / 6) and tr == pytest.approx(0.5 / (1 / 2 - 1 / 8))


def test_estimator_recovers_known_mean_and_covariance():
    torch.manual_seed(0)
    dim, small, big = 50, 4, 64
    mean = torch.randn(dim) * 0.5  # |G|^2 ~ 12.5
    scales = torch.rand(dim) * 2  # S = diag(scales^2)
    true_grad_sq, true_trace = mean.pow(2).sum().item(), scales.pow(2).sum().item()
    estimator = NoiseScaleEstimator(decay=0.999)
    for _ in range(4000):
        per_sample = mean + torch.randn(big, dim) * scales  # infinite population
        g_small = per_sample[:small].mean(0)
        g_big = per_sample.mean(0)
        estimator.update(g_small.pow(2).sum().item(), g_big.pow(2).sum().item(), small, big)
    state = estimator.state()
    assert state["gns/grad_sq"] == pytest.approx(true_grad_sq, rel=0.1)
    assert state["gns/trace"] == pytest.approx(true_trace, rel=0.1)
    assert state["gns/b_simple"] == pytest.approx(true_trace / true_grad_sq, rel=0.1)


def exact_b_simple(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """B_simple = tr(S) / |G|^2 over the whole training set, from per-example gradients."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        logits = functional_call(model, p, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    per_example = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in per_example.values()], dim=1).double()
    mean = flat.mean(0)
    trace = (flat - mean).pow(2).sum(1).mean()  # population covariance (1/N), as the estimator assumes
    return (trace / mean.pow(2).sum()).item()


LAYOUTS = {
    "simulated": ["dist.world_size=4", "trainer.per_worker_batch=16"],
    # the extra pass every 4th step only
    "simulated, every 4th step": ["dist.world_size=4", "trainer.per_worker_batch=16", "technique.gns.every=4"],
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS.values()), ids=list(LAYOUTS))
def test_in_training_estimate_matches_per_example_gradients(tmp_path, layout):
    # N=256 training samples, global batch 64 = N/4; a negligible LR keeps the
    # parameters where the exact value is computed while the EMA averages many steps.
    num_train = 256
    result = train(tmp_path, [*layout, "model=mlp", f"data.num_train={num_train}",
                              "trainer.epochs=100", "optim.lr=1e-9", "optim.momentum=0", "optim.weight_decay=0",
                              "schedule=constant", "technique=[gns]", "technique.gns.ema_decay=0.99",
                              *([] if "technique.gns.every=4" in layout else ["technique.gns.every=1"])])
    estimate = result["technique_metrics"]["gns/b_simple"]
    data = build_synthetic(num_train=num_train)
    model = MLP(input_shape=data.input_shape, num_classes=data.num_classes)
    model.load_state_dict(torch.load(tmp_path / "final_model.pt", weights_only=True))
    exact = exact_b_simple(model, data.train.x, data.train.y)
    assert math.isfinite(estimate)
    assert estimate == pytest.approx(exact, rel=0.25)


def test_auto_measures_often_enough_to_cost_about_three_percent():
    # one worker per process: the DDP hook reads its gradient for free, every step
    assert measure_every("auto", 1) == 1
    # k simulated workers: the extra pass costs about 1.5/k of a step; every ceil(50/k) steps
    assert [measure_every("auto", k) for k in (2, 4, 16, 64, 128)] == [25, 13, 4, 1, 1]
    assert measure_every(3, 16) == 3


def test_every_nth_step_measures_and_averages_as_many_measurements():
    gns = GradientNoiseScale(ema_decay=0.9, every="auto")
    gns.check_layout(BatchLayout(world_size=16, procs=1, per_worker_batch=64, global_batch=1024))
    assert gns.worker_gradient_every == 4 and gns.estimator.decay == 0.9
    model = torch.nn.Linear(2, 1)
    model.weight.grad, model.bias.grad = torch.ones(1, 2), torch.ones(1)
    for step in range(5):  # the trainer hands over worker 0's gradient only where asked
        if step % gns.worker_gradient_every == 0:
            gns.on_worker_gradient([torch.full((1, 2), 2.0), torch.full((1,), 2.0)], 64, 16)
        gns.after_backward(model, Progress(step * 1024, step, 0, 1024, 60_000))
    assert gns.estimator.weight == pytest.approx(1 - 0.9 ** 2)  # two measurements: steps 0 and 4
