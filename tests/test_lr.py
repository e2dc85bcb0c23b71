"""The LR schedule (lbt/spec/lr.py) and the step budget it is measured on (lbt/spec/batching.py), against
hand-computed values."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbt.errors import ConfigError
from lbt.spec.batching import BatchLayout, Budget, make_budget
from lbt.spec.lr import Schedule, ScheduleSpec, build_schedule, lr_at, peak, scaling_factor
from lbt.spec.run import from_node


def schedule(**overrides) -> Schedule:
    values = dict(base_lr=0.1, global_batch=1024, base_batch=64, scaling="linear", warmup_samples=1000,
                  warmup_start=None, warmup_mode="linear", decay="cosine", total_samples=11000)
    return Schedule(**{**values, **overrides})


def budget(global_batch: int, epochs: int, num_train: int, max_steps: int | None = None) -> Budget:
    layout = BatchLayout(world_size=1, procs=1, per_worker_batch=global_batch, global_batch=global_batch)
    return make_budget([layout] * epochs, num_train, max_steps)


# --- scaling -----------------------------------------------------------------

@pytest.mark.parametrize("rule, expected", [("none", 1.0), ("linear", 16.0), ("sqrt", 4.0)])
def test_scaling_rules_at_4096_over_256(rule, expected):
    assert scaling_factor(4096, 256, rule) == pytest.approx(expected)


def test_scaling_below_base_batch_shrinks_lr():
    assert scaling_factor(64, 256, "linear") == pytest.approx(0.25)
    assert scaling_factor(64, 256, "sqrt") == pytest.approx(0.5)


# --- lr_at -------------------------------------------------------------------

def test_warmup_goes_from_the_unscaled_base_lr_to_the_peak():
    s = schedule()  # peak = 0.1 x 1024 / 64 = 1.6
    assert lr_at(0, s) == pytest.approx(0.1)
    assert lr_at(500, s) == pytest.approx(0.1 + (1.6 - 0.1) / 2)
    assert lr_at(1000, s) == pytest.approx(1.6)  # the step that ends warmup runs at the peak
    assert lr_at(0, schedule(warmup_start=0.5)) == pytest.approx(0.8)


def test_constant_warmup_holds_then_jumps():
    s = schedule(warmup_mode="constant", decay="constant")
    assert lr_at(0, s) == lr_at(999, s) == pytest.approx(0.1)
    assert lr_at(1000, s) == pytest.approx(1.6)


def test_decay_starts_where_warmup_ends():
    s = schedule()  # cosine over samples 1000..11000
    assert lr_at(6000, s) == pytest.approx(0.8)  # halfway through the decay
    assert lr_at(11000, s) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(20000, s) == pytest.approx(0.0, abs=1e-12)  # clamped past the end
    poly = schedule(decay="poly", power=2.0, final_factor=0.2)
    assert lr_at(6000, poly) == pytest.approx(1.6 * (0.2 + 0.8 * 0.25))
    assert lr_at(6000, schedule(decay="constant")) == pytest.approx(1.6)


def test_a_branch_holds_its_start_lr_or_cools_down_from_it_linearly():
    follow = schedule()
    held = schedule(branch_lr="hold", branch_from=6000, branch_samples=2000)
    assert lr_at(5000, held) == lr_at(5000, follow)  # before the branch: the base run's schedule
    assert lr_at(6000, held) == lr_at(9000, held) == pytest.approx(0.8)  # no decay after it
    cool = schedule(branch_lr="cooldown", branch_from=6000, branch_samples=2000)
    assert [lr_at(t, cool) for t in (6000, 7000, 8000, 9000)] == pytest.approx([0.8, 0.4, 0.0, 0.0])
    # The rewarm to a larger batch's LR still applies over the branch's first samples.
    rewarm = schedule(branch_lr="hold", branch_from=6000, branch_samples=2000, rewarm_from=6000,
                      rewarm_samples=400, rewarm_start=0.5)
    assert lr_at(6000, rewarm) == pytest.approx(0.4) and lr_at(6400, rewarm) == pytest.approx(0.8)


def test_no_warmup_starts_at_the_peak():
    s = schedule(warmup_samples=0, decay="poly", power=1.0, total_samples=1000)
    assert lr_at(0, s) == pytest.approx(1.6)
    assert lr_at(500, s) == pytest.approx(0.8)


def test_drops_apply_from_their_sample_on():
    s = schedule(decay="constant", drops=((3000, 0.1), (6000, 0.5)))
    assert lr_at(2999, s) == pytest.approx(1.6)
    assert lr_at(3000, s) == pytest.approx(0.16)
    assert lr_at(6000, s) == pytest.approx(0.08)


@given(a=st.floats(0, 12000), b=st.floats(0, 12000), decay=st.sampled_from(["cosine", "poly", "constant"]),
       final=st.floats(0, 1), start=st.one_of(st.none(), st.floats(0.01, 1)))
def test_lr_rises_to_the_peak_then_never_rises_again(a, b, decay, final, start):
    s = schedule(decay=decay, final_factor=final, warmup_start=start)
    top, at = peak(s, budget(1000, 11, 1000))
    lo, hi = sorted((a, b))
    assert lr_at(lo, s) <= top + 1e-12 and lr_at(hi, s) <= top + 1e-12
    if hi < at:
        assert lr_at(lo, s) <= lr_at(hi, s) + 1e-12
    if lo >= at:
        assert lr_at(hi, s) <= lr_at(lo, s) + 1e-12


# --- the budget: epochs of the steps actually taken ---------------------------

def test_epochs_are_epochs_of_the_steps_taken():
    b = budget(8192, 10, 60000)  # 7 steps of 8,192 per epoch: 57,344 samples, not 60,000
    assert b.steps == (7,) * 10 and b.total_samples == 70 * 8192
    assert b.samples_at(4) == 4 * 7 * 8192
    assert b.samples_at(0.5) == 4 * 8192  # 3.5 steps, rounded up to a step boundary
    assert b.samples_at(0.3) == 3 * 8192  # 2.1 steps -> 3; float noise never adds a step
    assert b.step_boundary(8192 * 2.5) == (3, 3 * 8192)
    assert b.samples_at(50) == b.total_samples


def test_max_steps_cuts_the_budget():
    b = budget(100, 5, 1000, max_steps=23)
    assert b.steps == (10, 10, 3, 0, 0) and b.total_steps == 23 and b.total_samples == 2300
    assert b.last_step_samples == 2200


def test_a_batch_larger_than_the_training_set_is_refused():
    with pytest.raises(ConfigError, match="larger than the training set"):
        budget(2048, 1, 1000)


# --- build_schedule: the config node ------------------------------------------

NODE = dict(scaling="linear", base_batch=64, warmup_epochs=2, warmup_samples=None, warmup_start=None,
            warmup_mode="linear", decay="cosine", final_factor=0.0, power=2.0, milestones=[], gamma=0.1)


def spec(**changes) -> ScheduleSpec:
    """The `schedule` node with `changes`, checked as a run's spec checks it (lbt/spec/run.py)."""
    return from_node(ScheduleSpec, {**NODE, **changes}, "schedule").check()


def test_build_schedule_puts_the_peak_on_a_step_boundary():
    b = budget(1024, 10, 6000)  # 5 steps per epoch
    s = build_schedule(spec(), 0.1, 1024, b)
    assert s.warmup_samples == 10 * 1024 and s.total_samples == 50 * 1024
    assert peak(s, b) == (pytest.approx(1.6), 10 * 1024)
    assert build_schedule(spec(warmup_epochs=0, warmup_samples=2500), 0.1, 1024, b).warmup_samples == 3072


def test_warmup_longer_than_the_run_peaks_at_its_last_step():
    b = budget(1024, 2, 6000)
    s = build_schedule(spec(warmup_epochs=5), 0.1, 1024, b)
    top, at = peak(s, b)
    assert at == 9 * 1024 and top == pytest.approx(0.1 + 1.5 * 9 / 10)


def test_step_milestones_and_ramp_divisions_become_drops():
    layout = BatchLayout(1, 1, 100, 100)
    b = make_budget([layout, layout, layout.grown(2, "per_worker_batch"), layout.grown(2, "per_worker_batch", 0.5)],
                    1000, None)
    s = build_schedule(spec(warmup_epochs=0, decay="step", milestones=[1]), 0.1, 100, b)
    assert s.drops == ((1000, 0.1), (3000, 0.5))  # epochs take 1,000 samples each: 10 x 100, then 5 x 200


@pytest.mark.parametrize("change, message", [
    ({"scaling": "lnear"}, "schedule.scaling must be one of none, linear, sqrt, adam_sqrt, got 'lnear'"),
    ({"decay": "lnear"}, "schedule.decay must be one of constant, cosine, poly, step, linear, 1-sqrt"),
    ({"warmup_mode": "cosine"}, "schedule.warmup_mode must be one of linear, constant"),
    ({"base_batch": 0}, "schedule.base_batch must be a positive integer"),
    ({"warmup_epochs": -1}, "schedule.warmup_epochs must be a non-negative number"),
    ({"warmup_samples": 100}, "give warmup_epochs or warmup_samples, not both"),
    ({"warmup_start": 1.5}, r"schedule.warmup_start must be a number in \(0, 1\]"),
    ({"final_factor": 2}, r"schedule.final_factor must be a number in \[0, 1\]"),
    ({"decay": "step", "milestones": [1]}, "before warmup ends"),
])
def test_bad_schedule_values_are_one_line_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(spec(**change), 0.1, 1024, budget(1024, 10, 6000))


def test_scaling_factor_is_exact_for_the_acceptance_case():
    # goyal2017 at world_size 16 x per_worker_batch 64: peak = optim.lr x 16
    assert math.isclose(0.1 * scaling_factor(1024, 64, "linear"), 0.1 * 16)
