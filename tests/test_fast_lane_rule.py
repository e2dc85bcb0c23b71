"""The fast lane's rule is enforced (tests/conftest.py): a test not marked slow that starts a process, or whose runs
take more than a few steps (in its body or in a fixture it uses, whichever test set the fixture up), fails;
marked slow, the same test passes. Checked on a suite of its own, run by pytest with this suite's conftest."""

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

INNER = '''
import subprocess
import sys

import pytest
from conftest import FAST_LANE_STEPS, train

# 256 samples at global batch 8: 32 steps an epoch
TINY = ["model=mlp", "model.hidden=8", "data.num_train=256", "data.num_test=32", "trainer.global_batch=8",
        "trainer.evals=0"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    train(tmp_path_factory.mktemp("run"), TINY + ["trainer.epochs=2"])  # 64 steps


def test_a_fixture_that_trains_too_long(trained):
    pass


def test_a_second_user_of_that_fixture(trained):
    pass


def test_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_trains_a_few_steps(tmp_path):
    assert FAST_LANE_STEPS >= 4
    train(tmp_path, TINY + ["trainer.max_steps=4"])


@pytest.mark.slow
def test_marked_slow_may_do_both(trained):
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


@pytest.mark.slow
def test_a_test_not_marked_slow_fails_when_it_trains_long_or_starts_a_process(pytester):
    pytester.makeconftest((Path(__file__).parent / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: starts a process or trains more than a few steps\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=2, failed=3)
    failed = {line.split("::")[1].split(" ")[0] for line in result.outlines if line.startswith("FAILED")}
    assert failed == {"test_a_fixture_that_trains_too_long", "test_a_second_user_of_that_fixture",
                      "test_starts_a_process"}
    text = result.stdout.str()
    assert "trained 64 steps (at most 32 in the fast lane) and started 0 processes" in text
    assert "trained 0 steps (at most 32 in the fast lane) and started 1 processes" in text
