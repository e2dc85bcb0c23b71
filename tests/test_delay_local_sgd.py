"""Beyond lockstep SGD: delayed gradients and local SGD, simulated exactly and run for real.

- the delay line and torch's averaging schedule, as pure functions;
- simulated == real processes for both: tests/test_real_equals_simulated.py;
- local SGD with period 1 is synchronous SGD with momentum (averaging is linear);
- a SIGTERM mid-epoch then trainer.resume=auto ends bitwise equal to the straight run, with either technique;
- bad values and conflicting combinations are one-line config errors.
"""

from __future__ import annotations

import pytest
import torch
from conftest import final_params, initial_params, relative_diff, train

from lbt.engine.strategies.base import StepStrategy
from lbt.engine.strategies.gradient_delay import DelayLine, GradientDelay
from lbt.engine.strategies.local_sgd import LocalSGD, allreduces_at, averages_after
from lbt.errors import ConfigError
from lbt.spec.batching import BatchLayout
from lbt.techniques.batch_ramp import AutoBatchRamp

# 384 samples / global batch 64 = 6 steps of the BN-free mlp.
RUN = ["model=mlp", "data.num_train=384", "trainer.epochs=1", "trainer.global_batch=64", "optim.lr=0.05",
       "trainer.evals=0"]


# -- pure functions ----------------------------------------------------------------------------
def test_delay_line_returns_the_item_pushed_d_steps_before():
    line = DelayLine(2)
    assert [line.push(step) for step in range(6)] == [None, None, 0, 1, 2, 3]
    assert list(line.items) == [4, 5]  # the gradients a checkpoint keeps


def test_averaging_schedule_is_torchs_periodic_model_averager(monkeypatch):
    from torch.distributed.algorithms.model_averaging import averagers, utils

    averaged = []
    monkeypatch.setattr(utils, "average_parameters_or_parameter_groups", lambda params, group: averaged.append(1))
    for period, warmup in ((1, 0), (4, 0), (4, 3), (16, 5)):
        averager = averagers.PeriodicModelAverager.__new__(averagers.PeriodicModelAverager)
        averager.step, averager.period, averager.warmup_steps, averager.process_group = 0, period, warmup, "group"
        steps = []
        for _ in range(40):
            averaged.clear()
            averager.average_parameters([])
            steps.append(bool(averaged))
        assert steps == [averages_after(step, period, warmup) for step in range(40)], (period, warmup)
    # Warm-up steps allreduce the gradient; afterwards only the averages communicate.
    assert [allreduces_at(s, 4, 2) for s in range(8)] == [1, 1, 1, 0, 0, 0, 1, 0]


@pytest.mark.slow
def test_bad_values_and_conflicts_are_config_errors():
    for make in (lambda: GradientDelay(0), lambda: LocalSGD(period=0), lambda: LocalSGD(warmup_steps=-1)):
        with pytest.raises(ConfigError, match="must be"):
            make()
    with pytest.raises(ConfigError, match="strategy=local_sgd with technique.comm_compression"):
        train_config_error(["strategy=local_sgd", "technique=[comm_compression]"])
    with pytest.raises(ConfigError, match="dist.procs=1"):
        train_config_error(["strategy=local_sgd", "dist.world_size=4", "dist.procs=2"])
    # The automatic batch ramp measures the noise scale as measure=[gns] does: refused beside a real delay too.
    with pytest.raises(ConfigError, match="batch_ramp mode=auto"):
        GradientDelay(1).setup(BatchLayout(world_size=2, procs=2, per_worker_batch=32, global_batch=64),
                               [AutoBatchRamp()])


@pytest.mark.parametrize("overrides, line", [
    (["technique=[local_sgd]"], "technique=local_sgd: local_sgd is a step strategy; give strategy=local_sgd"),
    (["technique=[label_smoothing,gradient_delay]"],
     "technique=gradient_delay: gradient_delay is a step strategy; give strategy=gradient_delay"),
    (["technique.gradient_delay.delay=2"],
     "technique.gradient_delay.delay: gradient_delay is a step strategy; give strategy=gradient_delay "
     "strategy.delay=..."),
])
def test_a_strategy_given_as_a_technique_is_refused_naming_its_own_key(overrides, line):
    """Local SGD and gradient delay replace the step, so they are the `strategy` group's, not techniques:
    the technique spelling is one line naming the strategy key."""
    from lbt.apps.compose import compose

    with pytest.raises(ConfigError) as refused:
        compose(overrides)
    assert str(refused.value) == line


def test_a_strategy_is_its_own_group_and_builds_with_its_keys():
    from conftest import FAST, compose_config

    from lbt.engine import make_spec
    from lbt.engine.build import build_strategy

    config, recipe = compose_config(FAST + RUN + ["strategy=local_sgd", "strategy.period=3", "dist.world_size=4"])
    strategy = build_strategy(make_spec(config, recipe))
    assert isinstance(strategy, LocalSGD) and strategy.period == 3
    config, recipe = compose_config(FAST + RUN)
    assert "strategy" not in config and type(build_strategy(make_spec(config, recipe))) is StepStrategy


def train_config_error(overrides: list[str]) -> None:
    from conftest import FAST, compose_config

    from lbt.engine import make_spec
    from lbt.engine.build import build_parts
    from lbt.parallel.process_group import DistContext

    config, recipe = compose_config(FAST + RUN + overrides)
    spec = make_spec(config, recipe)
    build_parts(spec, DistContext(0, spec.procs, 0, spec.gpus, torch.device("cpu")))


# -- simulated == real ---------------------------------------------------------------------------
def test_local_sgd_with_period_1_is_synchronous_sgd(tmp_path):
    """Averaging the models after every step is linear in the updates: momentum SGD's synchronous run."""
    train(tmp_path / "local", RUN + ["strategy=local_sgd", "strategy.period=1", "dist.world_size=4"])
    train(tmp_path / "sync", RUN + ["dist.world_size=4"])
    assert relative_diff(final_params(tmp_path / "local"), final_params(tmp_path / "sync")) < 1e-5


def _params(overrides: list[str]) -> int:
    return initial_params(overrides).numel()


def test_plan_models_the_overlap_of_a_delayed_allreduce():
    from lbt.cost.data_parallel import Compute, Network, overlapped_step_seconds, scaling_rows

    assert overlapped_step_seconds(0.010, 0.004) == 0.010 and overlapped_step_seconds(0.010, 0.025) == 0.025
    compute = Compute(0.003, 0.006, 0.001, 64, 1_000_000, "given")
    network = Network("slow", 1.0, 0.0, "test")  # 4 MB of gradients over 1 Gb/s: 32 ms at W=2 (ring)
    sync, delayed = (scaling_rows(compute, network, [2], 60_000, delay=d)[0] for d in (0, 1))
    assert sync.step_s == pytest.approx(0.010 + sync.allreduce_s)
    assert delayed.step_s == pytest.approx(max(0.010, sync.allreduce_s))
    assert delayed.synchronous_step_s == pytest.approx(sync.step_s)


@pytest.mark.slow
def test_lbt_study_sweeps_delay_and_period_as_separate_curves(tmp_path):
    import json

    tiny = ["recipe=baseline", "data=synthetic", "model=mlp", "data.num_train=256", "trainer.epochs=1",
            "trainer.per_worker_batch=32", "dist.world_size=2", "extra_sweeps={}",
            "hydra/launcher=basic"]  # one process: no job start-up per run
    sweeps = {"delay": ["strategy=gradient_delay", "strategy.delay=1,2"],
              "local": ["strategy=local_sgd", "strategy.period=1,4"]}
    from lbt.apps.cli import main

    for name, sweep in sweeps.items():  # in this process, as `lbt study` runs it (no interpreter start-ups)
        main(["study", *tiny, *sweep, f"hydra.sweep.dir={tmp_path / 'study' / name}"])
    main(["report", str(tmp_path / "study")])
    rows = json.loads((tmp_path / "study" / "summary.json").read_text())["rows"]
    series = {r["recipe"]: r for r in rows}
    assert len(series) == 4, sorted(series)
    for value in ("strategy.delay=1", "strategy.delay=2", "strategy.period=1", "strategy.period=4"):
        assert [name for name in series if value in name], (value, sorted(series))
    # 4 steps: synchronous gradient allreduces, or averages after steps 0 (and 1, 2, 3 with period 1).
    assert {r["allreduces"] for name, r in series.items() if "period=4" in name} == {1}
    assert "allreduces" in (tmp_path / "study" / "report.md").read_text()
