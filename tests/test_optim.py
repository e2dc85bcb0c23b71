"""LARS, LAMB and the shared parameter filter.

The optimizers are checked against an independent implementation, timm's
`Lars` and `Lamb` (a test-only dependency), on identical parameters and
gradients. Intentional differences from timm, and the settings that make the
two equivalent here:

LARS vs timm.optim.Lars
- Which tensors get a trust ratio: lbt adapts every group without
  `exclude_from_trust`; timm adapts groups with weight_decay != 0, or all
  groups with `always_adapt=True`. With lbt's filter the excluded group has
  weight_decay 0, so timm's default gives the same split; for weight_decay 0
  without exclusion, timm needs `always_adapt=True`.
- Same formula and placement otherwise: ratio = eta*||w|| / (||g|| + wd*||w|| + eps),
  1 if either norm is 0, applied to g + wd*w before momentum; LARC clipping
  (lbt `clip`, timm `trust_clip`) is min(ratio / lr, 1) in both.
- Momentum: timm starts the buffer as a copy of the first step, lbt as zeros
  updated once: the same value. timm's `dampening` must stay 0 (lbt has none);
  timm's momentum default is 0, lbt's 0.9, so tests pass it explicitly.

LAMB vs timm.optim.Lamb
- Trust-ratio split as for LARS (`always_adapt` when weight_decay is 0).
- Global grad-norm clipping: timm defaults to max_grad_norm=1.0, lbt to None,
  so tests pass it explicitly; both divide every gradient by
  max(global norm / max_grad_norm, 1) before the moments.
- Bias correction: always on in lbt, timm's `bias_correction=True` (default).
  timm folds the corrections into eps on its foreach path (eps * sqrt(1 - beta2^t)),
  which is algebraically identical; both paths are compared.
- timm's `trust_clip` is lbt's `trust_clip` (cap at 1); timm's
  `decoupled_decay` and `caution` stay off (lbt has neither).
- Step count: per group in timm, per parameter in lbt; equal when every
  parameter has a gradient at every step, as here.
"""


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lbt.errors import ConfigError
from lbt.optim import LAMB, LARS, is_excluded, lamb_trust_ratio, lars_trust_ratio, param_groups

# --- pure functions ------------------------------------------------------------

def test_lars_trust_ratio_hand_values():
    assert lars_trust_ratio(2.0, 1.0, 0.0, 0.001).item() == pytest.approx(0.002)
    # 0.001 * 2 / (1 + 0.5 * 2)
    assert lars_trust_ratio(2.0, 1.0, 0.5, 0.001).item() == pytest.approx(0.001)
    assert lars_trust_ratio(2.0, 1.0, 0.0, 0.001, eps=1.0).item() == pytest.approx(0.001)


def test_lars_trust_ratio_is_one_when_a_norm_is_zero():
    assert lars_trust_ratio(0.0, 1.0, 0.1, 0.001).item() == 1.0
    assert lars_trust_ratio(3.0, 0.0, 0.0, 0.001).item() == 1.0  # would be inf
    assert lars_trust_ratio(0.0, 0.0, 0.0, 0.001).item() == 1.0  # would be nan


def test_lars_trust_ratio_larc_clip():
    # ratio 0.002: divided by the global lr, capped at 1
    assert lars_trust_ratio(2.0, 1.0, 0.0, 0.001, clip_lr=0.01).item() == pytest.approx(0.2)
    assert lars_trust_ratio(2.0, 1.0, 0.0, 0.001, clip_lr=0.001).item() == 1.0


def test_lamb_trust_ratio_hand_values_and_guards():
    assert lamb_trust_ratio(3.0, 6.0).item() == pytest.approx(0.5)
    assert lamb_trust_ratio(6.0, 3.0).item() == pytest.approx(2.0)
    assert lamb_trust_ratio(6.0, 3.0, trust_clip=True).item() == 1.0
    assert lamb_trust_ratio(0.0, 3.0).item() == 1.0
    assert lamb_trust_ratio(3.0, 0.0).item() == 1.0
    assert lamb_trust_ratio(0.0, 0.0).item() == 1.0


# --- the shared filter ---------------------------------------------------------

class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.gn = nn.GroupNorm(2, 4)
        self.fc = nn.Linear(4, 4)
        self.ln = nn.LayerNorm(4)
        self.head = nn.Linear(4, 2, bias=False)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_is_excluded_bias_and_norm_only():
    net = _Net()
    excluded = {n for n, p in net.named_parameters() if is_excluded(n, p)}
    assert excluded == {
        "conv.bias", "bn.weight", "bn.bias", "gn.weight", "gn.bias",
        "fc.bias", "ln.weight", "ln.bias", "frozen.bias",
    }


def test_param_groups_split_decay_and_trust_together():
    net = _Net()
    groups = param_groups(net, weight_decay=5e-4, exclude_bias_and_norm=True)
    by_id = {id(p): n for n, p in net.named_parameters()}
    names = [{by_id[id(p)] for p in g["params"]} for g in groups]
    assert names == [
        {"conv.weight", "fc.weight", "head.weight"},
        {"conv.bias", "bn.weight", "bn.bias", "gn.weight", "gn.bias",
         "fc.bias", "ln.weight", "ln.bias"},
    ]
    settings = [(g["weight_decay"], g["exclude_from_trust"]) for g in groups]
    assert settings == [(5e-4, False), (0.0, True)]


def test_param_groups_without_exclusion_is_one_group():
    net = _Net()
    (group,) = param_groups(net, weight_decay=1e-4, exclude_bias_and_norm=False)
    trainable = [p for p in net.parameters() if p.requires_grad]
    assert len(group["params"]) == len(trainable) == 11
    assert group["weight_decay"] == 1e-4 and group["exclude_from_trust"] is False


# --- one step by hand ----------------------------------------------------------

def _single_param(values, grad):
    p = nn.Parameter(torch.tensor(values))
    p.grad = torch.tensor(grad)
    return p


def test_lars_one_step_by_hand():
    # ||w|| = 5, ||g|| = 1, eta = 0.1: ratio 0.5, so w -= 1.0 * 0.5 * g
    p = _single_param([3.0, 4.0], [0.6, 0.8])
    LARS([p], lr=1.0, momentum=0.0, trust_coefficient=0.1, eps=0.0).step()
    torch.testing.assert_close(p.data, torch.tensor([2.7, 3.6]))
    torch.testing.assert_close(p.grad, torch.tensor([0.6, 0.8]))  # gradient left untouched

    # excluded from trust: plain SGD
    q = _single_param([3.0, 4.0], [0.6, 0.8])
    excluded = [{"params": [q], "exclude_from_trust": True}]
    LARS(excluded, lr=1.0, momentum=0.0, trust_coefficient=0.1).step()
    torch.testing.assert_close(q.data, torch.tensor([2.4, 3.2]))


def test_lamb_one_step_by_hand():
    # Step 1 with bias correction: m_hat = g, v_hat = g^2, so u = sign(g) = [1, -1] (eps 0).
    # ratio = ||w|| / ||u|| = 5 / sqrt(2); w -= 0.1 * ratio * u
    p = _single_param([3.0, 4.0], [0.6, -0.8])
    LAMB([p], lr=0.1, eps=0.0, weight_decay=0.0).step()
    s = 0.5 / 2**0.5
    torch.testing.assert_close(p.data, torch.tensor([3.0 - s, 4.0 + s]))

    q = _single_param([3.0, 4.0], [0.6, -0.8])
    LAMB([{"params": [q], "exclude_from_trust": True}], lr=0.1, eps=0.0, weight_decay=0.0).step()
    torch.testing.assert_close(q.data, torch.tensor([2.9, 4.1]))


# --- agreement with timm -------------------------------------------------------

def _comparison_model():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv1d(2, 4, 3), nn.BatchNorm1d(4), nn.Flatten(),
        nn.Linear(8, 5), nn.LayerNorm(5), nn.Linear(5, 3),
    )
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5)  # norm gains away from their all-ones init
        model[5].weight.zero_()  # a zero-initialized layer exercises the ||w|| == 0 guard
    return model


def _gradients(model, steps, scale):
    """Fixed random gradients, with magnitudes spread over 1e-2..1e1 so the trust ratios differ."""
    gen = torch.Generator().manual_seed(1)
    params = list(model.parameters())
    per_param = [scale * 10 ** (3 * torch.rand((), generator=gen).item() - 2) for _ in params]
    grads = [
        [s * torch.randn(p.shape, generator=gen) for p, s in zip(params, per_param)]
        for _ in range(steps)
    ]
    grads[0][0].zero_()  # a zero gradient exercises the ||g|| == 0 guard
    return grads


def _train(model, optimizer, grads):
    for step_grads in grads:
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _assert_same_training(make_lbt, make_timm, weight_decay, exclude, grad_scale=1.0, steps=5):
    ours, theirs = _comparison_model(), _comparison_model()
    grads = _gradients(ours, steps, grad_scale)
    p_ours = _train(ours, make_lbt(param_groups(ours, weight_decay, exclude)), grads)
    p_theirs = _train(theirs, make_timm(param_groups(theirs, weight_decay, exclude)), grads)
    start = [p.detach() for p in _comparison_model().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(p_ours, start)), "the optimizer did not move"
    for a, b in zip(p_ours, p_theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    return p_ours


LARS_CASES = {
    # name: (lbt kwargs, timm kwargs, weight_decay, exclude_bias_and_norm)
    "momentum+wd": (dict(), dict(), 5e-4, True),
    "nesterov": (dict(nesterov=True), dict(nesterov=True), 5e-4, True),
    "larc-clip": (
        dict(clip=True, trust_coefficient=0.02), dict(trust_clip=True, trust_coeff=0.02), 5e-4, True
    ),
    "no-wd-no-exclusion": (dict(), dict(always_adapt=True), 0.0, False),
    "no-momentum": (dict(momentum=0.0), dict(momentum=0.0), 1e-4, True),
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("case", LARS_CASES)
def test_lars_matches_timm(case, foreach):
    from timm.optim import Lars as TimmLars  # here: timm (and the torchvision it loads) costs a second to import

    ours_kw, timm_kw, wd, exclude = LARS_CASES[case]
    common = dict(lr=0.5, momentum=0.9, weight_decay=wd, eps=1e-8)
    ours_kw = common | dict(trust_coefficient=1e-3) | ours_kw
    timm_kw = common | dict(trust_coeff=1e-3, foreach=foreach) | timm_kw
    _assert_same_training(
        lambda g: LARS(g, **ours_kw), lambda g: TimmLars(g, **timm_kw), wd, exclude
    )


def test_larc_clip_is_active_in_the_comparison():
    # Guards the "larc-clip" case above against testing a clip that never fires.
    def run(clip):
        model = _comparison_model()
        groups = param_groups(model, 5e-4, True)
        opt = LARS(groups, lr=0.5, weight_decay=5e-4, trust_coefficient=0.02, clip=clip)
        return _train(model, opt, _gradients(model, 5, 1.0))

    assert any(not torch.allclose(a, b) for a, b in zip(run(True), run(False)))


LAMB_CASES = {
    "default": (dict(), dict(), 0.01, True),
    "grad-clip": (dict(max_grad_norm=1.0), dict(max_grad_norm=1.0), 0.01, True),
    "trust-clip": (dict(trust_clip=True), dict(trust_clip=True), 0.01, True),
    "no-grad-averaging": (dict(grad_averaging=False), dict(grad_averaging=False), 0.01, True),
    "no-wd-no-exclusion": (dict(), dict(always_adapt=True), 0.0, False),
    "betas": (dict(betas=(0.8, 0.99)), dict(betas=(0.8, 0.99)), 0.1, True),
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("case", LAMB_CASES)
def test_lamb_matches_timm(case, foreach):
    from timm.optim import Lamb as TimmLamb

    ours_kw, timm_kw, wd, exclude = LAMB_CASES[case]
    ours_kw = dict(lr=0.01, weight_decay=wd) | ours_kw
    timm_kw = dict(lr=0.01, weight_decay=wd, max_grad_norm=None, foreach=foreach) | timm_kw
    # grad_scale 10: the global gradient norm is well above 1, so "grad-clip" really clips.
    _assert_same_training(
        lambda g: LAMB(g, **ours_kw), lambda g: TimmLamb(g, **timm_kw), wd, exclude, grad_scale=10.0
    )


# --- resume ----------------------------------------------------------------------

@pytest.mark.parametrize(
    "make_optimizer",
    [
        pytest.param(lambda g: LARS(g, lr=0.5, weight_decay=5e-4, nesterov=True), id="lars"),
        pytest.param(lambda g: LAMB(g, lr=0.01, max_grad_norm=1.0), id="lamb"),
    ],
)
def test_resume_from_state_dict_matches_uninterrupted_run(make_optimizer):
    model = _comparison_model()
    grads = _gradients(model, 5, 1.0)
    straight = _train(model, make_optimizer(param_groups(model, 5e-4, True)), grads)

    model = _comparison_model()
    first = make_optimizer(param_groups(model, 5e-4, True))
    _train(model, first, grads[:3])
    second = make_optimizer(param_groups(model, 5e-4, True))
    second.load_state_dict(first.state_dict())
    resumed = _train(model, second, grads[3:])
    for a, b in zip(straight, resumed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# --- they train ----------------------------------------------------------------

def _least_squares_losses(make_optimizer, steps=100):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen) + 0.5 + 0.01 * torch.randn(256, 1, generator=gen)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = make_optimizer(param_groups(model, 1e-4, exclude_bias_and_norm=True))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize(
    "make_optimizer",
    [
        # eta = 1 so that lr * eta * ||w||, the step length, makes progress in 100 steps.
        pytest.param(
            lambda g: LARS(g, lr=0.1, weight_decay=1e-4, trust_coefficient=1.0), id="lars"
        ),
        pytest.param(lambda g: LAMB(g, lr=0.05, weight_decay=1e-4), id="lamb"),
    ],
)
def test_reduces_least_squares_loss(make_optimizer):
    losses = _least_squares_losses(make_optimizer)
    assert losses[-1] < 0.05 * losses[0], losses[::10]


# -- the factory: groups first, the optimizer once -------------------------------------------------


@pytest.mark.parametrize("optimizer_class, options", [
    ("torch.optim.SGD", {"momentum": 0.9, "nesterov": True}),
    ("lbt.optim.LARS", {"momentum": 0.9, "nesterov": True, "trust_coefficient": 0.002}),
    ("lbt.optim.LAMB", {"betas": (0.9, 0.99)}),
])
def test_create_optimizer_splits_groups_with_one_filter(optimizer_class, options):
    from lbt.models import CNN1d
    from lbt.optim import create_optimizer

    model = CNN1d(input_shape=(40,))
    excluded = {id(p) for name, p in model.named_parameters() if name.endswith("bias") or ".bn" in name or p.ndim == 1}
    optimizer = create_optimizer(model, optimizer_class, lr=0.1, weight_decay=5e-4, no_bn_weight_decay=True, **options)
    assert type(optimizer).__name__ == optimizer_class.rsplit(".", 1)[1]
    decayed, not_decayed = optimizer.param_groups
    assert decayed["weight_decay"] == 5e-4 and not_decayed["weight_decay"] == 0.0
    assert {id(p) for p in not_decayed["params"]} == excluded  # every bias and BN parameter, nothing else
    assert not decayed["exclude_from_trust"] and not_decayed["exclude_from_trust"]
    assert all(optimizer.defaults[k] == v for k, v in options.items())
    # Without the flag: one group, every parameter decayed (and given a trust ratio by LARS/LAMB).
    single = create_optimizer(model, optimizer_class, lr=0.1, weight_decay=5e-4, **options)
    assert len(single.param_groups) == 1 and single.param_groups[0]["weight_decay"] == 5e-4


def test_create_optimizer_errors_are_one_line_config_errors():
    from lbt.models import MLP
    from lbt.optim import create_optimizer

    model = MLP(input_shape=(40,))
    with pytest.raises(ConfigError, match="optim.lr must be a positive number"):
        create_optimizer(model, "torch.optim.SGD", lr=0)
    with pytest.raises(ConfigError, match="optim.optimizer_class=torch.optim.Nope: cannot import it"):
        create_optimizer(model, "torch.optim.Nope", lr=0.1)
    with pytest.raises(ConfigError, match="optim: .*momentum"):
        create_optimizer(model, "torch.optim.SGD", lr=0.1, momentum=-1)

