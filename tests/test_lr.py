"""LR factors against hand-computed values."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lbt.lr import decay_factor, scaling_factor, warmup_factor


# --- scaling -----------------------------------------------------------------

@pytest.mark.parametrize(
    "rule, expected", [("none", 1.0), ("linear", 16.0), ("sqrt", 4.0)]
)
def test_scaling_rules_at_4096_over_256(rule, expected):
    assert scaling_factor(4096, 256, rule) == pytest.approx(expected)


def test_scaling_below_base_batch_shrinks_lr():
    assert scaling_factor(64, 256, "linear") == pytest.approx(0.25)
    assert scaling_factor(64, 256, "sqrt") == pytest.approx(0.5)


def test_scaling_rejects_unknown_rule_and_bad_batches():
    with pytest.raises(ValueError, match="scaling rule 'lnear'.*none, linear, sqrt"):
        scaling_factor(512, 256, "lnear")
    with pytest.raises(ValueError, match="must be positive"):
        scaling_factor(0, 256, "linear")
    with pytest.raises(ValueError, match="must be positive"):
        scaling_factor(512, -1, "none")


# --- warmup ------------------------------------------------------------------

def test_linear_warmup_start_mid_end_after():
    # Goyal: k = 8, start at 1/k of the scaled LR, i.e. at the base LR.
    assert warmup_factor(0, 1000, 1 / 8) == pytest.approx(0.125)
    assert warmup_factor(500, 1000, 1 / 8) == pytest.approx(0.125 + 0.875 * 0.5)
    assert warmup_factor(250, 1000, 0.0) == pytest.approx(0.25)
    assert warmup_factor(1000, 1000, 1 / 8) == 1.0
    assert warmup_factor(5000, 1000, 1 / 8) == 1.0


def test_constant_warmup_holds_then_jumps():
    assert warmup_factor(0, 1000, 0.1, "constant") == pytest.approx(0.1)
    assert warmup_factor(999, 1000, 0.1, "constant") == pytest.approx(0.1)
    assert warmup_factor(1000, 1000, 0.1, "constant") == 1.0


def test_no_warmup():
    assert warmup_factor(0, 0, 0.1) == 1.0
    assert warmup_factor(0, 0, 0.1, "constant") == 1.0


def test_warmup_rejects_bad_input():
    with pytest.raises(ValueError, match="warmup mode 'cosine'"):
        warmup_factor(0, 100, 0.1, "cosine")
    with pytest.raises(ValueError, match="warmup_samples"):
        warmup_factor(0, -1, 0.1)


# --- decay -------------------------------------------------------------------

def test_constant_decay():
    assert decay_factor(0, 100, "constant") == 1.0
    assert decay_factor(100, 100, "constant") == 1.0


def test_cosine_start_mid_end():
    assert decay_factor(0, 100, "cosine") == pytest.approx(1.0)
    assert decay_factor(50, 100, "cosine") == pytest.approx(0.5)
    assert decay_factor(25, 100, "cosine") == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert decay_factor(100, 100, "cosine") == pytest.approx(0.0, abs=1e-12)
    assert decay_factor(150, 100, "cosine") == pytest.approx(0.0, abs=1e-12)  # clamped past the end


def test_cosine_with_final_factor():
    assert decay_factor(50, 100, "cosine", final_factor=0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert decay_factor(100, 100, "cosine", final_factor=0.1) == pytest.approx(0.1)


def test_poly_start_mid_end():
    assert decay_factor(0, 100, "poly") == pytest.approx(1.0)
    assert decay_factor(50, 100, "poly") == pytest.approx(0.25)  # (1 - 0.5) ** 2
    assert decay_factor(50, 100, "poly", power=1.0) == pytest.approx(0.5)
    assert decay_factor(100, 100, "poly") == pytest.approx(0.0)
    assert decay_factor(50, 100, "poly", final_factor=0.2) == pytest.approx(0.2 + 0.8 * 0.25)


def test_step_milestones():
    kw = dict(milestones_samples=[30, 60, 80], gamma=0.1)
    assert decay_factor(0, 90, "step", **kw) == 1.0
    assert decay_factor(29.9, 90, "step", **kw) == 1.0
    assert decay_factor(30, 90, "step", **kw) == pytest.approx(0.1)  # applies from the milestone on
    assert decay_factor(70, 90, "step", **kw) == pytest.approx(0.01)
    assert decay_factor(90, 90, "step", **kw) == pytest.approx(0.001)
    # unsorted milestones and no milestones
    unsorted = decay_factor(70, 90, "step", milestones_samples=[80, 30, 60], gamma=0.5)
    assert unsorted == pytest.approx(0.25)
    assert decay_factor(70, 90, "step") == 1.0


def test_start_samples_delays_the_decay():
    # Decay over samples 20..100: flat during warmup, midpoint at 60.
    assert decay_factor(0, 100, "cosine", start_samples=20) == pytest.approx(1.0)
    assert decay_factor(20, 100, "cosine", start_samples=20) == pytest.approx(1.0)
    assert decay_factor(60, 100, "cosine", start_samples=20) == pytest.approx(0.5)
    assert decay_factor(60, 100, "poly", start_samples=20) == pytest.approx(0.25)
    assert decay_factor(100, 100, "poly", start_samples=20) == pytest.approx(0.0)


def test_decay_rejects_bad_input():
    with pytest.raises(ValueError, match="decay schedule 'linear'.*constant, cosine, poly, step"):
        decay_factor(0, 100, "linear")
    with pytest.raises(ValueError, match="must exceed start_samples"):
        decay_factor(0, 100, "cosine", start_samples=100)
    with pytest.raises(ValueError, match="must exceed start_samples"):
        decay_factor(0, 0, "poly")


@given(
    a=st.floats(0, 2000), b=st.floats(0, 2000),
    schedule=st.sampled_from(["cosine", "poly"]), final=st.floats(0, 1),
)
def test_decay_is_bounded_and_non_increasing(a, b, schedule, final):
    lo, hi = sorted((a, b))
    f_lo = decay_factor(lo, 1000, schedule, final_factor=final, start_samples=100)
    f_hi = decay_factor(hi, 1000, schedule, final_factor=final, start_samples=100)
    assert final - 1e-12 <= f_hi <= f_lo + 1e-12 <= 1 + 1e-12


@given(a=st.floats(0, 2000), b=st.floats(0, 2000), start=st.floats(0, 1))
def test_warmup_is_bounded_and_non_decreasing(a, b, start):
    lo, hi = sorted((a, b))
    assert start - 1e-12 <= warmup_factor(lo, 1000, start) <= warmup_factor(hi, 1000, start) <= 1.0
