"""Optimizers and schedules past LARS/LAMB: Muon with AdamW, SOAP, schedule-free AdamW/SGD, WSD.

Muon's split and its step against torch's own classes; WSD's LR at its phase boundaries; schedule-free's
evaluation on the averaged weights (in the loop too); bad input as one line. Resume exactness is in
test_resume_matrix.py, real == simulated workers under Muon in test_real_equals_simulated.py.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import schedulefree
import torch
from conftest import FAST, compose_config, one_gloo_process
from test_cli_errors import run_main
from torch import nn

from lbt.engine import make_spec, run
from lbt.engine.evaluate import AveragedWeights, check_averaging
from lbt.engine.precision import Precision
from lbt.engine.strategies.base import StepStrategy
from lbt.engine.strategies.local_sgd import LocalSGD
from lbt.errors import ConfigError
from lbt.models.cnn1d import CNN1d
from lbt.models.mlp import MLP
from lbt.models.transformer1d import Transformer1d
from lbt.optim import MuonAdamW, create_optimizer, muon_split
from lbt.optim.factory import refuse_split_layers
from lbt.optim.muon import muon_lr
from lbt.spec.batching import BatchLayout, make_budget
from lbt.spec.lr import Schedule, ScheduleSpec, build_schedule, describe, lr_at
from lbt.techniques import Technique

# --- Muon: which tensor goes where ------------------------------------------------------------------


def muon_names(model: nn.Module) -> set[str]:
    return {name for name, muon in muon_split(model).items() if muon}


def test_muon_takes_the_hidden_convolutions_of_cnn1d_as_matrices():
    # 0: the first convolution reads the signal (AdamW, as the reference keeps the first conv);
    # 1, 4, 7: BatchNorm; 11: the head.
    assert muon_names(CNN1d(channels=8)) == {"3.weight", "6.weight"}


def test_muon_takes_the_hidden_linears_of_mlp():
    # 1: the input layer (after Flatten), 5: the head; biases go to AdamW.
    assert muon_names(MLP(hidden=16, num_layers=2)) == {"3.weight"}
    assert muon_names(MLP(hidden=16, num_layers=1)) == set()  # input layer and head only


def test_muon_takes_the_attention_and_mlp_matrices_of_transformer1d():
    model = Transformer1d(dim=16, depth=2, heads=2, mlp_ratio=2)
    expected = {f"blocks.{i}.{layer}.weight" for i in range(2) for layer in ("attn.qkv", "attn.out", "mlp.0", "mlp.3")}
    assert muon_names(model) == expected
    adamw = set(muon_split(model)) - expected  # the patch embedding, the position table, norms, biases, the head
    assert {"embed.weight", "position", "head.weight", "norm.weight", "blocks.0.attn.qkv.bias"} <= adamw


def test_muon_groups_keep_the_weight_decay_filter():
    opt = create_optimizer(Transformer1d(dim=16, depth=1, heads=2), MuonAdamW, lr=1e-3, weight_decay=0.1,
                           no_bn_weight_decay=True)
    shapes = [(g["use_muon"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]
    assert shapes == [(True, 0.1, 4), (False, 0.1, 3), (False, 0.0, 12)]  # embed, position, head weights decay


# --- Muon: the step is torch's ----------------------------------------------------------------------


def steps(model: nn.Module, optimizers: list, n: int, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(8, 40, generator=generator), torch.randint(0, 10, (8,), generator=generator)
        for o in optimizers:
            o.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for o in optimizers:
            o.step()


def test_muon_with_adamw_equals_torchs_muon_and_adamw_bit_for_bit():
    torch.manual_seed(0)
    ours = Transformer1d(dim=16, depth=1, heads=2)
    theirs = copy.deepcopy(ours)
    opt = create_optimizer(ours, MuonAdamW, lr=0.01, weight_decay=0.1, no_bn_weight_decay=True, ns_dtype="bfloat16")
    split = muon_split(theirs)
    named = list(theirs.named_parameters())
    reference = [torch.optim.Muon([p for n, p in named if split[n]], lr=0.01, weight_decay=0.1,
                                  adjust_lr_fn="match_rms_adamw"),
                 torch.optim.AdamW([{"params": [p for n, p in named if not split[n] and p.ndim >= 2]},
                                    {"params": [p for n, p in named if not split[n] and p.ndim < 2],
                                     "weight_decay": 0.0}], lr=0.01, weight_decay=0.1)]
    steps(ours, [opt], 3)
    steps(theirs, reference, 3)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))


def test_a_convolution_kernel_takes_muons_step_as_its_matrix():
    torch.manual_seed(0)
    model = CNN1d(channels=8)
    kernel = model[3].weight  # (8, 8, 5)
    matrix = nn.Parameter(kernel.detach().reshape(8, 40).clone())
    opt = create_optimizer(model, MuonAdamW, lr=0.01, weight_decay=0.1, ns_dtype="bfloat16")
    reference = torch.optim.Muon([matrix], lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    steps(model, [opt], 1)
    matrix.grad = kernel.grad.reshape(8, 40)
    reference.step()
    assert torch.equal(kernel.detach().reshape(8, 40), matrix.detach())


def test_muon_lr_adjustments_are_torchs():
    assert muon_lr(0.1, (256, 64), "original") == pytest.approx(0.2)  # sqrt(max(1, 4))
    assert muon_lr(0.1, (64, 256), None) == pytest.approx(0.1)
    assert muon_lr(0.1, (64, 256), "match_rms_adamw") == pytest.approx(0.1 * 0.2 * 16)
    assert muon_lr(0.1, (64, 256), "spectral_unclamped") == pytest.approx(0.05)


def test_muon_resumes_from_its_state_dict_bit_for_bit():
    torch.manual_seed(0)
    model = CNN1d(channels=8)
    opt = create_optimizer(model, MuonAdamW, lr=0.01, weight_decay=0.1, fused="auto")
    steps(model, [opt], 2)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    steps(model, [opt], 2, seed=1)
    straight = [p.detach().clone() for p in model.parameters()]
    assert len(saved[1]["state"]) == len(list(model.parameters()))  # Muon's buffers and AdamW's moments
    model.load_state_dict(saved[0])
    resumed = create_optimizer(model, MuonAdamW, lr=0.01, weight_decay=0.1, fused="auto")
    resumed.load_state_dict(saved[1])
    steps(model, [resumed], 2, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(straight, model.parameters()))


# --- WSD: the LR at its phase boundaries --------------------------------------------------------------


def wsd(**overrides) -> Schedule:
    values = dict(base_lr=0.1, global_batch=1024, base_batch=64, scaling="linear", warmup_samples=1000,
                  warmup_start=None, warmup_mode="linear", decay="linear", total_samples=11000, decay_fraction=0.2)
    return Schedule(**{**values, **overrides})  # peak 1.6; the decay runs over samples 8,800..11,000


def test_wsd_warms_up_holds_the_peak_then_decays_over_the_last_fraction():
    s = wsd()
    assert lr_at(0, s) == pytest.approx(0.1)
    assert lr_at(999, s) < 1.6
    assert lr_at(1000, s) == lr_at(5000, s) == lr_at(8800, s) == pytest.approx(1.6)  # stable until 80%
    assert lr_at(8801, s) < 1.6
    assert lr_at(9900, s) == pytest.approx(0.8)  # halfway through the decay
    assert lr_at(11000, s) == pytest.approx(0.0, abs=1e-12)
    sqrt = wsd(decay="1-sqrt", final_factor=0.1)
    assert lr_at(9900, sqrt) == pytest.approx(1.6 * (0.1 + 0.9 * (1 - math.sqrt(0.5))))
    assert lr_at(11000, sqrt) == pytest.approx(0.16)


def test_wsd_never_decays_before_the_warmup_ends():
    s = wsd(decay_fraction=1.0)  # all of the run after warmup: 1,000..11,000
    assert lr_at(1000, s) == pytest.approx(1.6) and lr_at(6000, s) == pytest.approx(0.8)
    late = wsd(warmup_samples=10000, decay_fraction=0.5)  # the decay would start at 5,500, in the warmup
    assert lr_at(10000, late) == pytest.approx(1.6) and lr_at(10500, late) == pytest.approx(0.8)


def test_a_decay_fraction_of_one_is_the_schedule_as_before():
    for decay in ("cosine", "poly"):
        before = Schedule(0.1, 1024, 64, "linear", 1000, None, "linear", decay, 11000)
        assert all(lr_at(x, before) == lr_at(x, wsd(decay=decay, decay_fraction=1.0)) for x in range(0, 12000, 250))


@pytest.mark.parametrize("fraction", [0, -0.1, 1.5])
def test_a_decay_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ConfigError, match=r"schedule.decay_fraction must be a number in \(0, 1\]"):
        ScheduleSpec(decay="linear", decay_fraction=fraction).check()


def test_describe_names_the_cooldown():
    budget = make_budget([BatchLayout(1, 1, 64, 64)] * 10, 6400, None)
    schedule = build_schedule(ScheduleSpec(decay="1-sqrt", decay_fraction=0.2, warmup_epochs=1), 0.1, 64, budget)
    assert "1-sqrt decay to 0 x peak over the last 20% of the run" in describe(schedule, budget)


# --- schedule-free: evaluation scores the averaged weights ---------------------------------------------


def schedule_free(model: nn.Module, cls=schedulefree.AdamWScheduleFree, **options):
    parts = SimpleNamespace(model=model, optimizer=cls(model.parameters(), lr=0.01, **options),
                            data=SimpleNamespace(train=None), layout=SimpleNamespace(per_worker_batch=8),
                            schedule=wsd(decay="constant"), strategy=StepStrategy())
    return parts, AveragedWeights(parts, SimpleNamespace(device=torch.device("cpu")), Precision("fp32", "cpu"))


def test_evaluation_scores_the_averaged_weights_and_gives_the_train_weights_back_bit_for_bit():
    torch.manual_seed(0)
    parts, averaged = schedule_free(MLP(hidden=16, num_layers=2))
    steps(parts.model, [parts.optimizer], 3)
    y = [p.detach().clone() for p in parts.model.parameters()]
    reference_model, reference = copy.deepcopy((parts.model, parts.optimizer))
    reference.eval()  # the package's own eval mode: x
    parts.model.eval()
    with averaged():
        scored = [p.detach().clone() for p in parts.model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(scored, reference_model.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(scored, y))
    assert parts.model.training and all(torch.equal(a, b) for a, b in zip(parts.model.parameters(), y))
    # The evaluation changed nothing: training goes on as if it had not happened.
    untouched_model, untouched = copy.deepcopy((parts.model, parts.optimizer))
    steps(parts.model, [parts.optimizer], 2, seed=1)
    steps(untouched_model, [untouched], 2, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(parts.model.parameters(), untouched_model.parameters()))
    averaged.keep()  # training over: the averaged weights for good
    reference_model, reference = copy.deepcopy((untouched_model, untouched))
    reference.eval()
    assert all(torch.equal(a, b) for a, b in zip(parts.model.parameters(), reference_model.parameters()))


def test_batchnorm_statistics_are_recomputed_at_the_averaged_weights_then_put_back():
    from lbt.data.base import InMemoryDataset

    torch.manual_seed(0)
    parts, averaged = schedule_free(CNN1d(channels=4), cls=schedulefree.SGDScheduleFree)
    parts.data.train = averaged.train_set = InMemoryDataset(torch.randn(32, 40), torch.zeros(32, dtype=torch.long))
    steps(parts.model, [parts.optimizer], 2)
    norm = parts.model[1]
    before = norm.running_mean.clone()
    with averaged():
        reference_model, reference = copy.deepcopy((parts.model, parts.optimizer))
        expected = nn.BatchNorm1d(4, momentum=None)
        with torch.no_grad():  # the averaged model's first convolution on the 32 samples, in 4 batches of 8
            for chunk in parts.data.train.x.split(8):
                expected(reference_model[0](chunk.unsqueeze(1)))
        assert torch.allclose(norm.running_mean, expected.running_mean, atol=1e-6)
    assert torch.equal(norm.running_mean, before)


def test_schedule_free_refuses_a_decaying_schedule_and_local_sgd():
    with pytest.raises(ConfigError, match="schedule-free.*not schedule.decay=cosine; use schedule=constant"):
        check_averaging("AdamWScheduleFree", wsd(decay="cosine"), StepStrategy())
    with pytest.raises(ConfigError, match="an LR that drops at milestones"):
        check_averaging("AdamWScheduleFree", wsd(decay="constant", drops=((5000, 0.1),)), StepStrategy())
    with pytest.raises(ConfigError, match="strategy=local_sgd with optim.optimizer_class=AdamWScheduleFree"):
        check_averaging("AdamWScheduleFree", wsd(decay="constant"), LocalSGD())
    check_averaging("AdamWScheduleFree", wsd(decay="constant"), StepStrategy())  # warmup, then constant: fine


class ScoredWeights(Technique):
    """Test-only: the parameters each evaluation scored (lbt.engine.trainer.evaluate wrapped) and those the
    model holds right after it."""

    name = "scored_weights"

    def __init__(self):
        self.scored, self.after = [], []

    def on_model(self, model):
        self.model = model
        return model

    def after_eval(self, point) -> None:
        self.after.append([p.detach().clone() for p in self.model.parameters()])


def test_the_loop_evaluates_and_saves_the_averaged_weights(tmp_path, monkeypatch):
    import lbt.engine.trainer as trainer

    recorder, evaluate = ScoredWeights(), trainer.evaluate

    def recorded(model, *args, **kwargs):
        recorder.scored.append([p.detach().clone() for p in model.parameters()])
        return evaluate(model, *args, **kwargs)

    monkeypatch.setattr(trainer, "evaluate", recorded)
    config, recipe = compose_config(FAST + ["recipe=schedulefree", "model=mlp", "trainer.max_steps=6",
                                            "trainer.epochs=2", "data.num_train=256", "trainer.evals=3"])
    run(make_spec(config, recipe), tmp_path, [recorder])
    # Each evaluation scored other weights than training holds right after it (y, restored), from the second
    # step on (after one step the average x, the iterate z and y coincide) ...
    assert len(recorder.after) >= 3
    for scored, after in list(zip(recorder.scored, recorder.after))[1:]:
        assert not all(torch.equal(a, b) for a, b in zip(scored, after))
    # ... and the saved model is the averaged one the last evaluation scored.
    saved = torch.load(tmp_path / "final_model.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(recorder.scored[-1], saved.values()))


# --- bad input: one line, exit 2 -------------------------------------------------------------------------

BAD = {
    "schedule_free_with_cosine": (["optim=schedulefree_adamw"], "needs the LR constant after the warmup"),
    "schedule_free_closure": (["optim=schedulefree_adamw", "schedule=constant",
                               "optim.optimizer_class=schedulefree.AdamWScheduleFreeClosure"],
                              "its step needs a closure"),
    "wsd_fraction_zero": (["schedule=wsd", "schedule.decay_fraction=0"], "schedule.decay_fraction must be"),
    "wsd_fraction_above_one": (["schedule=wsd", "schedule.decay_fraction=1.5"], "schedule.decay_fraction must be"),
    "torch_muon_on_a_bias": (["optim=adamw", "optim.optimizer_class=torch.optim.Muon", "model=mlp"],
                             "torch.optim.Muon cannot take parameter 1.bias of shape (128,)"),
    "muon_bad_value": (["optim=muon", "optim.ns_dtype=float16"], "ns_dtype must be auto, bfloat16 or float32"),
    # Refused before any process starts: Newton-Schulz needs each matrix whole, a tensor-parallel rank has half.
    "muon_tensor_parallel": (["optim=muon", "model=transformer1d", "dist.procs=2", "dist.world_size=2",
                              "dist.tensor_parallel=2"], "optim.optimizer_class=MuonAdamW with layers split"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_optimizer_input_is_one_line(name, tmp_path, capfd, monkeypatch):
    overrides, expected = BAD[name]
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["train", *FAST, *overrides, f"hydra.run.dir={tmp_path}"], capfd)
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("lbt: note:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lbt: error:"), err
    assert expected in lines[0], lines[0]


def test_optimizers_that_do_not_step_on_shards_refuse_split_layers():
    """Under tensor parallelism (or FSDP) the parameters are DTensor shards: Muon and SOAP are refused, and so
    is schedule-free, never run on shards."""
    from pytorch_optimizer import SOAP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    for cls in (MuonAdamW, SOAP, torch.optim.Muon, schedulefree.AdamWScheduleFree):
        with pytest.raises(ConfigError, match="with layers split across processes"):
            refuse_split_layers(cls, True)
        refuse_split_layers(cls, False)  # layers whole: fine
    refuse_split_layers(torch.optim.AdamW, True)  # element-wise: fine

    def check() -> None:
        model = MLP(hidden=8, num_layers=2)
        mesh = init_device_mesh("cpu", (1,))
        model[3].weight = nn.Parameter(distribute_tensor(model[3].weight.detach(), mesh, [Shard(0)]))
        with pytest.raises(ConfigError, match="optim.optimizer_class=MuonAdamW with layers split"):
            create_optimizer(model, MuonAdamW, lr=1e-3)

    with one_gloo_process():
        check()
