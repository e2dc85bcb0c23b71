"""Every command's `--help` starts with the same usage line, and the commands that build a run show their own
settings with the run's under `--cfg job`."""

import pytest
import yaml
from test_cli_errors import run_main_io

from lbt.apps.cli import COMMANDS


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_has_help_that_starts_with_its_usage_line(command, capfd):
    code, out, err = run_main_io([command, "--help"], capfd)
    assert code == 0 and not err, err
    assert out.startswith(f"usage: lbt {command} "), out[:200]


def test_plan_cfg_job_prints_its_settings_with_the_model_and_data_it_plans(capfd, tmp_path, monkeypatch):
    """`lbt plan --cfg job` shows the plan's settings (plan.network, ...: every one, defaults too) and the model,
    the data and the per-worker batch it would profile, as lbt train's config holds them, and measures nothing."""
    from lbt.apps.plan.settings import PlanSettings

    monkeypatch.chdir(tmp_path)
    code, out, err = run_main_io(["plan", "model=mlp", "trainer.per_worker_batch=32", "plan.network=1gbe",
                                  "model.hidden=64", "plan.critical_batch=512", "--cfg", "job"], capfd)
    assert code == 0 and not err, err
    shown = yaml.safe_load(out)
    assert shown["plan"] == {**vars(PlanSettings()), "network": "1gbe", "critical_batch": 512.0}
    assert shown["trainer"] == {"per_worker_batch": 32}
    assert shown["model"] == {"_target_": "lbt.models.MLP", "hidden": 64, "num_layers": 2}
    assert shown["data"]["_target_"] == "lbt.data.build_mnist1d"
    assert list(tmp_path.iterdir()) == []  # no plot, no profile
    code, _, err = run_main_io(["plan", "--cfg", "hydra"], capfd)
    assert code == 2 and err.strip() == ("lbt: error: lbt plan --cfg takes job (the plan's settings and the model "
                                         "and data it plans)")


def test_train_reads_hydras_own_flags_with_lbts_one_line_errors(capfd):
    """`lbt train` parses its flags with Hydra's own parser: a value Hydra refuses or a flag it has not is one
    line, and --version names lbt with the Hydra it runs on."""
    import hydra

    import lbt

    code, out, err = run_main_io(["train", "--version"], capfd)
    assert code == 0 and out.strip() == f"lbt {lbt.__version__} (Hydra {hydra.__version__})", (out, err)
    code, _, err = run_main_io(["train", "--cfg", "nope"], capfd)
    assert code == 2 and err.strip().startswith("lbt: error: lbt train: argument --cfg/-c: invalid choice: 'nope'")
    code, _, err = run_main_io(["train", "model=mlp", "--frobnicate"], capfd)
    assert code == 2 and err.strip() == "lbt: error: lbt train: unrecognized arguments: --frobnicate"
