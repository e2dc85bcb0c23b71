"""What a run does that a user would not guess is said up front: warnings at start, honest progress bars."""

import pytest
from conftest import FAST, train


def test_a_warmup_longer_than_the_run_is_warned_about(tmp_path, capsys):
    """goyal2017 warms up over 2.8 epochs; a 1-epoch run never reaches its scaled peak LR."""
    train(tmp_path, ["recipe=goyal2017", "trainer.epochs=1", "dist.world_size=4", "trainer.max_steps=3"])
    err = capsys.readouterr().err
    assert "lbt: warning: the warmup" in err and "never reaching its scaled peak 0.48" in err  # 0.12 x 4


def test_no_warning_when_the_warmup_ends_in_time(tmp_path, capsys):
    train(tmp_path, ["recipe=goyal2017", "trainer.epochs=6", "schedule.warmup_epochs=1", "dist.world_size=4"])
    assert "warning" not in capsys.readouterr().err


def test_a_batch_ramp_beside_a_decaying_schedule_is_warned_about(tmp_path, capsys):
    train(tmp_path, ["technique=[batch_ramp]", "trainer.epochs=2", "technique.batch_ramp.milestones=[1]"])
    assert "replaces the LR decay" in capsys.readouterr().err
    train(tmp_path / "constant", ["technique=[batch_ramp]", "schedule=constant", "trainer.epochs=2",
                                  "technique.batch_ramp.milestones=[1]"])
    assert "replaces the LR decay" not in capsys.readouterr().err


@pytest.mark.parametrize("max_steps, totals", [(5, [5]), (None, [8, 8])])
def test_the_progress_bar_counts_the_steps_the_run_takes(tmp_path, monkeypatch, max_steps, totals):
    """With trainer.max_steps the bar ends at 100%, over the epochs the run takes, not the full budget."""
    import tqdm

    bars = []

    class Recording(tqdm.tqdm):
        def __init__(self, *args, **kwargs):
            bars.append(kwargs)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm, "tqdm", Recording)
    steps = [] if max_steps is None else [f"trainer.max_steps={max_steps}"]
    train(tmp_path, ["trainer.progress=true", "trainer.epochs=2", *steps])
    assert [b["total"] for b in bars] == totals
    assert [b["desc"] for b in bars] == [f"epoch {e + 1}/{len(totals)}" for e in range(len(totals))]


@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2])
def test_train_log_holds_the_epoch_lines_and_the_closing_line(tmp_path, procs, capfd, monkeypatch):
    """A background or cluster run has a text log: the lines the console shows, timestamped, once each
    (`lbt train` in this process: the command's logging is Hydra's, set up by the same call)."""
    from test_cli_errors import run_main_io

    monkeypatch.chdir(tmp_path)
    code, out, err = run_main_io(["train", *FAST, f"dist.procs={procs}", "dist.world_size=2", "trainer.epochs=2",
                                  f"hydra.run.dir={tmp_path}"], capfd)
    assert code == 0, err
    log = (tmp_path / "train.log").read_text()
    epoch_lines = [line for line in log.splitlines() if " epoch 2/2 step " in line]
    assert len(epoch_lines) == 1 and "train_loss=" in epoch_lines[0]
    assert log.count("done: test_acc=") == 1 and "world_size=2" in log
    assert epoch_lines[0][:4].isdigit()  # timestamped
    # The console shows the same lines, untimestamped.
    assert "epoch 2/2 step" in out and "done: test_acc=" in out


def test_a_quiet_studys_jobs_keep_their_train_log(tmp_path):
    """`lbt study` silences Hydra's logging (hydra/job_logging=disabled), whose dictConfig disables every logger
    already made, lbt's own among them: each job's train.log still fills (the basic launcher: jobs in this
    process, as the joblib launcher's workers run them)."""
    from lbt.apps.cli import main

    main(["study", "recipe=baseline", *FAST, "model=mlp", "data.num_train=256", "trainer.epochs=1",
          "trainer.per_worker_batch=32", "dist.world_size=1,2", "extra_sweeps={}", "hydra/launcher=basic",
          f"hydra.sweep.dir={tmp_path}"])
    logs = sorted(tmp_path.glob("*/train.log"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert " epoch 1/1 step " in text and "done: test_acc=" in text, (log, text)
