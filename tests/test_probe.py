"""lbt probe: snapshots and branches in the engine, and the command end to end (tiny synthetic workload)."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config, final_params, signal_after_line, train
from test_cli_errors import run_main, run_main_io
from test_techniques import scalars

BASE = ["model=mlp", "trainer.per_worker_batch=8", "trainer.epochs=4", "optim.lr=0.05"]  # 512 samples: 64 steps/epoch


def base_run(tmp_path: Path, snapshots: list[int]) -> Path:
    folder = tmp_path / "base"
    train(folder, [*BASE, f"trainer.snapshot_samples=[{','.join(map(str, snapshots))}]"])
    return folder


def branch(tmp_path: Path, base: Path, name: str, at: int, samples: int, extra: list[str]) -> Path:
    folder = tmp_path / name
    train(folder, [*BASE, f"trainer.branch_from={base}", f"trainer.branch_at={at}", f"trainer.branch_samples={samples}",
                   "trainer.evals=2", *extra])
    return folder


@pytest.mark.slow
def test_snapshots_do_not_change_the_run_and_a_k1_branch_continues_it_exactly(tmp_path):
    plain = tmp_path / "plain"
    train(plain, BASE)
    base = base_run(tmp_path, [256, 768])
    assert torch.equal(final_params(plain), final_params(base))  # a measurement never changes the run
    assert sorted(p.name for p in (base / "snapshots").glob("*.pt")) == ["samples_256.pt", "samples_768.pt"]
    k1 = branch(tmp_path, base, "k1", 256, 512, [])
    later = torch.load(base / "snapshots" / "samples_768.pt", weights_only=True)["model"]
    assert torch.equal(final_params(k1), torch.cat([v.flatten().double() for _, v in sorted(later.items())]))


@pytest.mark.slow
def test_a_branch_past_its_loss_limit_stops_as_diverged(tmp_path):
    base = base_run(tmp_path, [256])
    wild = branch(tmp_path, base, "wild", 256, 1024, ["dist.world_size=8", "optim.lr=500", "trainer.log_every=1"])
    result = json.loads((wild / "result.json").read_text())
    assert result["diverged"] and result["samples_seen"] < 256 + 1024


@pytest.mark.slow
def test_a_late_branch_counts_divergence_from_the_base_runs_first_loss_not_its_own(tmp_path):
    """Late in training a branch's first minibatch loss can be a tenth of an ordinary one; a rule counted
    from it (here 1.01x, three log steps in a row) stopped healthy branches as diverged."""
    base = base_run(tmp_path, [1536])
    late = branch(tmp_path, base, "late", 1536, 512, ["trainer.diverge_factor=1.01", "trainer.log_every=1"])
    result = json.loads((late / "result.json").read_text())
    assert not result["diverged"] and result["samples_seen"] == 1536 + 512
    first = torch.load(base / "snapshots" / "samples_1536.pt", weights_only=True)["loop"]["initial_loss"]
    assert f"(the first step's: {first:.4g})" not in (late / "train.log").read_text()
    # A held branch keeps the LR it starts at (after the rewarm: the same batch here, so from its first step).
    held = branch(tmp_path, base, "held", 1536, 256, ["trainer.branch_lr=hold", "trainer.log_every=1"])
    lrs = {value for _, value in scalars(held, "train/lr")}
    assert len(lrs) == 1 and lrs != {value for _, value in scalars(late, "train/lr")}


@pytest.mark.slow
def test_a_branch_off_the_step_grid_or_without_its_snapshot_is_one_line(tmp_path, capfd, monkeypatch):
    """`lbt train` in this process (the command's exit code and stderr; tests/test_cli_errors.py runs it as a
    process)."""
    monkeypatch.chdir(tmp_path)
    base = base_run(tmp_path, [24])
    code, err = run_main(["train", *BASE, "data=synthetic", "trainer.device=cpu", "trainer.progress=false",
                          f"trainer.branch_from={base}", "trainer.branch_at=24", "trainer.branch_samples=64",
                          "dist.world_size=4", f"hydra.run.dir={tmp_path / 'b'}"], capfd)
    assert code == 2 and err.strip().splitlines()[-1].startswith("lbt: error: trainer.branch_at=24")
    code, err = run_main(["train", *BASE, "data=synthetic", "trainer.progress=false", f"trainer.branch_from={base}",
                          "trainer.branch_at=40", "trainer.branch_samples=64", f"hydra.run.dir={tmp_path / 'c'}"],
                         capfd)
    assert code == 2 and "no snapshot" in err and "Traceback" not in err


PROBE = ["data=synthetic", "trainer.device=cpu", *BASE, "probe.max_factor=8", "probe.checkpoints=3", "probe.seeds=2"]
# Half of it, for the tests that stop a probe among its branches and continue it: rounds at 1x, 2x and 4x.
SHORT_PROBE = ["data=synthetic", "trainer.device=cpu", *[o for o in BASE if not o.startswith("trainer.epochs=")],
               "trainer.epochs=2", "probe.max_factor=4", "probe.checkpoints=2"]


def branch_stamps(folder: Path) -> dict[str, int]:
    return {p.parent.name: p.stat().st_mtime_ns for p in (folder / "branches").glob("*/result.json")}


@pytest.mark.slow
def test_probe_end_to_end_and_continued_without_training_a_branch_twice(tmp_path, capfd, monkeypatch):
    """In this process, as `lbt probe` runs it: the command's own process is in the stop tests below."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "probe"
    code, out, err = run_main_io(["probe", *PROBE, f"probe.dir={folder}"], capfd)
    assert code == 0, err[-2000:]
    first = out.splitlines()[0]
    assert first.startswith("probe: base run of 2,048 samples")  # what it costs, before anything ran
    assert "samples/s measured here" in out.splitlines()[1]
    for name in ("probe.json", "probe.md", "critical_batch_over_training.png", "branches.png"):
        assert (folder / name).stat().st_size > 0, name
    assert list((folder / "tb").glob("events.out.tfevents.*"))
    probe = json.loads((folder / "probe.json").read_text())
    assert len(probe["checkpoints"]) == 3
    for point in probe["checkpoints"]:
        seeds = sorted(b["seed"] for b in point["branches"] if b["factor"] == 1)
        assert seeds == [0, 1]  # two k=1 data orders: the noise floor
        held = point["local_critical"]["held"]
        assert held in (8, 16, 32, 64) and (point["local_critical"]["failed"] in (None, 2 * held))
        assert point["answer_alone"] in (8, 16, 32, 64)
    # A cooldown from each snapshot ends where a shorter run would: the budget curve, up to the base's end.
    curve = probe["budget_curve"]
    assert [s for s, _ in curve] == sorted(s for s, _ in curve) and len(curve) == 4 and curve[-1][0] == 2048
    assert {p.name for p in (folder / "branches").glob("cooldown_*")} == {
        f"cooldown_at{c['samples']}_w1_seed0" for c in probe["checkpoints"]}
    answer = probe["answer"]
    assert answer["largest_batch"] in (8, 16, 32, 64) and answer["gpus"] == answer["largest_batch"] // 8
    low, high = answer["interval"]
    assert low <= answer["largest_batch"] <= high
    assert 0 < probe["cost"]["share"] and probe["cost"]["samples"] >= 2048
    assert answer["sentence"] in (folder / "probe.md").read_text().splitlines()[0]

    # Interrupted: two branches lost their results (cut off before writing them) and probe.json is gone.
    stamps = branch_stamps(folder)
    lost = sorted(stamps)[:2]
    for name in lost:
        (folder / "branches" / name / "result.json").unlink()
    (folder / "probe.json").unlink()
    code, out, err = run_main_io(["probe", *PROBE, f"probe.dir={folder}"], capfd)
    assert code == 0, err[-2000:]
    after = branch_stamps(folder)
    assert sorted(after) == sorted(stamps)
    retrained = sorted(name for name in after if after[name] != stamps.get(name))
    assert retrained == lost  # the finished ones were read, not trained again or overwritten
    assert "base run ->" not in out  # the finished base run too
    assert json.loads((folder / "probe.json").read_text())["answer"] == answer

    # A snapshot lost with its branches: one line saying what to do, never an answer without them.
    at = probe["checkpoints"][0]["samples"]
    (folder / "base" / "snapshots" / f"samples_{at}.pt").unlink()
    for lost in (folder / "branches").glob(f"*_at{at}_*"):
        shutil.rmtree(lost)
    (folder / "probe.json").unlink()
    code, out, err = run_main_io(["probe", *PROBE, f"probe.dir={folder}"], capfd)
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith(f"lbt: error: no snapshot {folder / 'base' / 'snapshots'}"), err
    assert f"delete {folder / 'base'}" in lines[-1] and not (folder / "probe.json").exists()


def test_a_snapshot_damaged_or_cut_off_is_refused_by_its_checksum(tmp_path):
    from lbt.engine.checkpoint import checksum_path, load_snapshot, save_snapshot, snapshot_path
    from lbt.errors import ConfigError

    save_snapshot(tmp_path, 64, {"model": {"w": torch.arange(14.0)}})
    assert load_snapshot(tmp_path, 64)["model"]["w"].sum() == 91
    path = snapshot_path(tmp_path, 64)
    state = torch.load(path, weights_only=True)
    state["model"]["w"][::7] *= 2  # every 7th float doubled, the file otherwise whole
    torch.save(state, path)
    with pytest.raises(ConfigError, match="does not match its SHA-256: it is damaged"):
        load_snapshot(tmp_path, 64)
    checksum_path(path).unlink()
    with pytest.raises(ConfigError, match="has no checksum"):
        load_snapshot(tmp_path, 64)
    save_snapshot(tmp_path, 64, {"model": {"w": torch.arange(14.0)}})  # a resumed base run writes it again
    assert load_snapshot(tmp_path, 64)["model"]["w"].sum() == 91


@pytest.mark.slow
def test_a_probe_stopped_among_its_branches_exits_with_the_signals_code(tmp_path, capfd, monkeypatch):
    """Told to stop once its branches started: the signal's code (not a config mistake's exit 2) and the command
    that continues it; the same command then finishes the probe. SIGTERM here; Ctrl-C (SIGINT) stops the
    confirmed probe and the base run below, and one handler takes both (lbt/stop.py)."""
    args = ["probe", *SHORT_PROBE, f"probe.dir={tmp_path / 'probe'}"]
    code, _, err = signal_after_line(args, tmp_path, r"^probe: \d+ branch\(es\) at 2x", signal.SIGTERM)
    assert code == 143 and "Traceback" not in err, (code, err)
    said = f"lbt: probe stopped; finished runs are kept. Continue with: lbt {' '.join(args)}"
    assert err.strip().splitlines()[-1] == said
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main_io(args, capfd)  # continued in this process
    assert code == 0 and "probe finished" in out, err[-2000:]


@pytest.mark.slow
def test_a_confirmed_probe_stopped_in_its_full_runs_continues_to_the_same_answer(tmp_path, capfd, monkeypatch):
    """probe.confirm=true: full runs around the prediction. Ctrl-C among them, then the same command: it
    finishes; once more: every run is read, none trained again, the same measured answer."""
    folder = tmp_path / "probe"
    args = ["probe", *SHORT_PROBE, "probe.confirm=true", f"probe.dir={folder}"]
    code, _, err = signal_after_line(args, tmp_path, r"^probe: confirm: full run", signal.SIGINT)
    assert code == 130 and err.strip().splitlines()[-1].startswith("lbt: probe stopped"), (code, err)
    assert json.loads((folder / "probe.json").read_text())["answer"]  # the prediction stands meanwhile
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main_io(args, capfd)
    assert code == 0, err[-2000:]
    confirmed = json.loads((folder / "probe.json").read_text())["confirm"]
    assert confirmed["sentence"] in out and confirmed["full_runs"] >= 2  # the base batch's second seed, and more
    rows = {r["global_batch"]: r for r in confirmed["runs"]}
    answer = confirmed["largest_batch"]
    assert rows[answer]["holds"] and all(rows[b]["holds"] for b in rows if b < answer and len(rows[b]["values"]) == 2)
    assert confirmed["top"] or not rows[2 * answer]["holds"]
    stamps = {p.parent.name: p.stat().st_mtime_ns for p in (folder / "confirm").glob("*/result.json")}
    code, out, err = run_main_io(args, capfd)
    assert code == 0 and "full run(s) at" not in out, err[-2000:]
    assert {p.parent.name: p.stat().st_mtime_ns for p in (folder / "confirm").glob("*/result.json")} == stamps
    assert json.loads((folder / "probe.json").read_text())["confirm"]["largest_batch"] == answer


@pytest.mark.slow
def test_a_probe_stopped_in_its_base_run_says_the_probes_command(tmp_path):
    """The base run trains in the probe's process: stopped there, the line is the probe's and names the probe's
    command, not `lbt train`'s."""
    args = ["probe", *PROBE, f"probe.dir={tmp_path / 'probe'}"]
    code, _, err = signal_after_line(args, tmp_path, r"^epoch 1/", signal.SIGINT)
    assert code == 130 and "Traceback" not in err, (code, err)
    said = f"lbt: probe stopped; finished runs are kept. Continue with: lbt {' '.join(args)}"
    assert err.strip().splitlines()[-1] == said
    assert "trainer.resume=auto" not in err


@pytest.mark.slow
def test_a_sigterm_to_the_probe_alone_stops_the_branches_its_launcher_runs_elsewhere(tmp_path):
    """`kill PID` reaches the probe only, not the joblib workers that run its branches: they stop at their
    next step (the stop file), none of the round's branches finishes."""
    folder = tmp_path / "probe"
    args = ["probe", *SHORT_PROBE, f"probe.dir={folder}", "hydra/launcher=local_parallel"]
    code, _, err = signal_after_line(args, tmp_path, r"^probe: \d+ branch\(es\) at 1x", signal.SIGTERM)
    assert code == 143 and "Traceback" not in err, (code, err)
    started = list((folder / "branches").glob("hold_at*_w1_seed0"))
    assert started and not [b for b in started if (b / "result.json").is_file()]  # stopped, not finished
    assert not (folder / ".stop").exists()


@pytest.mark.parametrize("args, says", [
    (["probe.max_factor=3"], "probe.max_factor=3: give a power of two"),
    (["probe.checkpoints=0"], "probe.checkpoints"),
    (["probe.delta=0.9"], "runs past the budget"),
    (["probe.max_factor=128"], "exceeds the training set"),
    (["probe.maxfactor=4"], "did you mean probe.max_factor"),
    (["probe.metric=bleu"], "probe.metric=bleu"),
    (["probe.seeds=0"], "probe.seeds"),
    (["probe.cooldown=1.5"], "probe.cooldown"),
    (["probe.last=0.9", "probe.cooldown=0.5"], "probe.cooldown=0.5: the last snapshot's cooldown runs past"),
    (["probe.confirm=maybe"], "probe.confirm=maybe Value 'maybe' is not a valid bool"),  # as trainer.* say it
    (["probe.max_factor=many"], "probe.max_factor=many Value 'many' of type 'str' could not be converted to Integer"),
    (["probe.dir=runs/my probe"], "give a path of letters, digits"),  # before any folder or timing
    (["probe.dir=runs/a,b"], "give a path of letters, digits"),
    (["probe.dir=runs/prøbe"], "give a path of letters, digits"),
    (["hydra.run.dir=elsewhere"], "lbt probe writes every run of it under probe.dir"),  # the probe ignored it
])
def test_bad_probe_settings_are_one_line(tmp_path, args, says, capfd, monkeypatch):
    """In this process, as `lbt probe` runs it (test_a_probe_folder_of_another_probe... runs the command)."""
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["probe", *PROBE, f"probe.dir={tmp_path / 'p'}", *args], capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("lbt: error:"), err
    assert says in lines[0]
    assert not (tmp_path / "p").exists() and not (tmp_path / "runs").exists()  # refused before anything was written


def test_probe_cfg_job_prints_its_settings_with_the_base_runs_config_and_runs_nothing(tmp_path, capfd, monkeypatch):
    """`lbt probe --cfg job` shows probe.* (defaults and the given ones) above the config the base run trains,
    as `lbt train --cfg job` shows a run's; nothing is written."""
    import yaml

    monkeypatch.chdir(tmp_path)
    code, out, err = run_main_io(["probe", *PROBE, "probe.checkpoints=4", "--cfg", "job"], capfd)
    assert code == 0 and not err, err
    shown = yaml.safe_load(out)
    assert shown["probe"]["checkpoints"] == 4 and shown["probe"]["max_factor"] == 8 and shown["probe"]["evals"] == 8
    assert shown["model"]["_target_"] == "lbt.models.MLP" and shown["trainer"]["epochs"] == 4
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_probe_folder_of_another_probe_or_a_diverged_base_is_refused(tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "probe_command.json").write_text(json.dumps({"overrides": [], "settings": {"checkpoints": 9}}))
    code, err = run_main(["probe", *PROBE, f"probe.dir={folder}"], capfd)
    assert code == 2 and "holds another probe" in err and len(err.splitlines()) == 1
    code, err = run_main(["probe", *PROBE, "optim.lr=1e9", f"probe.dir={tmp_path / 'q'}"], capfd)
    assert code == 2 and err.strip().splitlines()[-1].startswith("lbt: error: the base run diverged")


# -- bench/probe_rules.py's pure parts ------------------------------------------------------------------
def _probe_json(helds: list[int], shortfalls: list[dict[str, float]]) -> dict:
    checkpoints = [{"samples": 1000 * (i + 1), "local_critical": {"held": held}, "shortfalls": {"1": 0.0, **falls}}
                   for i, (held, falls) in enumerate(zip(helds, shortfalls, strict=True))]
    return {"checkpoints": checkpoints}


def test_probe_rules_pairs_the_rules_branch_by_branch(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "bench"))
    import probe_rules

    # sqrt holds the larger batch at one checkpoint of two, linear at none: sqrt, whatever the shortfalls.
    sqrt = _probe_json([256, 512], [{"2": 0.5, "4": 2.0}, {"2": 0.1, "4": 0.3, "8": 3.0}])
    linear = _probe_json([128, 512], [{"2": 1.5, "4": 4.0, "8": None}, {"2": -0.4, "4": 0.2, "8": 0.5}])
    assert probe_rules.better_rule({"linear": linear, "sqrt": sqrt}) == "sqrt"
    # The same held batches: the smaller mean shortfall over the branches both ran decides (8x is sqrt's alone).
    # A diverged branch (None) is left out of the mean, as is one only some rules ran.
    tie = _probe_json([256, 512], [{"2": 0.4, "4": 2.0, "8": None}, {"2": 0.1, "4": 0.3}])
    assert probe_rules.better_rule({"sqrt": sqrt, "tie": tie}) == "tie"
    assert probe_rules.better_rule({"tie": tie, "sqrt": sqrt}) == "tie"
    rows = probe_rules.table({"sqrt": sqrt, "linear": linear})
    assert rows[0] == ("| samples seen | 2x sqrt | 2x linear | 4x sqrt | 4x linear | 8x sqrt | 8x linear | held sqrt "
                       "| held linear |")
    assert rows[2] == "| 1,000 | +0.50 | +1.50 | +2.00 | +4.00 | - | diverged | 256 | 128 |"
    assert rows[3] == "| 2,000 | +0.10 | -0.40 | +0.30 | +0.20 | +3.00 | +0.50 | 512 | 512 |"


def claim_probe(args: list[str]) -> None:
    """What `lbt probe ARGS` does to its folder before it trains: the probe's record written (or checked)."""
    from lbt.apps.probe.command import claim_folder, plan_probe
    from lbt.apps.probe.settings import split_args

    settings, overrides = split_args(args)
    claim_folder(Path(settings.dir), settings, overrides, plan_probe(settings, overrides)[0])


def test_a_second_probe_on_a_folder_in_use_is_one_line_naming_the_first(tmp_path, capfd, monkeypatch):
    """Two probes on one probe.dir: the second is one line naming the first, and never deletes the first's running
    branch folder under it. The folder's lock is held for the probe's whole life."""
    from lbt.paths import folder_lock

    monkeypatch.chdir(tmp_path)
    args = [*PROBE, f"probe.dir={tmp_path / 'probe'}"]
    claim_probe(args)  # the first probe, running
    with folder_lock(tmp_path / "probe"):
        code, err = run_main(["probe", *args], capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "is in use by pid" in lines[0], err
    assert not (tmp_path / "probe" / "base").exists()


def test_a_rerun_that_adds_a_setting_is_refused_naming_it(tmp_path, capfd, monkeypatch):
    """A rerun that adds `probe.tolerance=1` is one line naming it, not a TypeError (None against 1.0)."""
    monkeypatch.chdir(tmp_path)
    args = [*PROBE, f"probe.dir={tmp_path / 'probe'}"]
    claim_probe(args)
    code, err = run_main(["probe", *args, "probe.tolerance=1"], capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "it differs in probe.tolerance)" in lines[0], err


def test_a_probe_is_its_composed_config_less_what_cannot_change_a_result(tmp_path, capfd, monkeypatch):
    """Reordered overrides, an added trainer.threads=1 or hydra/launcher=local_parallel cannot change a result:
    they continue the probe (no "holds another probe (it differs in the overrides)"). A key that changes the
    result is refused by name, with both values."""
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "probe"
    claim_probe([*PROBE, f"probe.dir={folder}"])
    record = (folder / "probe_command.json").read_bytes()
    for same in ([*reversed(PROBE), f"probe.dir={folder}"], [*PROBE, "trainer.threads=1", f"probe.dir={folder}"],
                 [*PROBE, "hydra/launcher=local_parallel", f"probe.dir={folder}"]):
        claim_probe(same)
    assert (folder / "probe_command.json").read_bytes() == record  # how it started is kept as it was
    with pytest.raises(SystemExit) as refused:
        claim_probe([*PROBE, "optim.lr=0.02", f"probe.dir={folder}"])
    assert refused.value.code == 2
    assert "it differs in optim.lr (0.05 -> 0.02)" in capfd.readouterr().err


@pytest.mark.parametrize("folder", ["/dev/null", "/dev/null/probe", "/proc/self/probe"])
def test_a_probe_folder_that_cannot_be_made_is_one_line(folder, capfd, monkeypatch, tmp_path):
    """probe.dir=/dev/null or /proc/self/x is one line, not a FileExistsError or FileNotFoundError traceback."""
    monkeypatch.chdir(tmp_path)
    code, err = run_main(["probe", *PROBE, f"probe.dir={folder}"], capfd)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"lbt: error: probe.dir={folder}: cannot make"), err


@pytest.mark.slow
def test_a_damaged_base_result_says_to_delete_it(tmp_path, capfd, monkeypatch):
    """A base result.json cut short (a full disk) is refused with what fits a probe, not "start this one in another
    folder": deleting the file lets the same command resume the base run from its checkpoint."""
    monkeypatch.chdir(tmp_path)
    args = [*PROBE, f"probe.dir={tmp_path / 'probe'}"]
    claim_probe(args)
    (tmp_path / "probe" / "base").mkdir()
    (tmp_path / "probe" / "base" / "result.json").write_text('{"recipe": "baseline", "global_ba')
    code, err = run_main(["probe", *args], capfd)
    line = err.strip().splitlines()[-1]
    assert code == 2 and "not a readable lbt result.json" in line and "delete that file and the same command " \
        "resumes the base run" in line and "another folder" not in line, err


@pytest.mark.slow
def test_a_probe_takes_your_own_configs_with_config_dir(tmp_path, capfd, monkeypatch):
    """`lbt probe --config-dir DIR` builds the base run and every branch from DIR's configs, as docs/own-model.md
    teaches `--config-dir` for the runs a probe makes."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine" / "model").mkdir(parents=True)
    (tmp_path / "mine" / "model" / "narrow.yaml").write_text("_target_: lbt.models.MLP\nhidden: 24\nnum_layers: 2\n")
    folder = tmp_path / "probe"
    args = ["--config-dir", "mine", *SHORT_PROBE, "model=narrow", "probe.max_factor=2", "probe.cooldown=0",
            f"probe.dir={folder}"]
    code, out, err = run_main_io(["probe", *args], capfd)
    assert code == 0, err[-2000:]
    runs = [folder / "base", *sorted(p for p in (folder / "branches").iterdir() if p.is_dir())]
    assert len(runs) >= 3
    for run_dir in runs:  # the base run and every branch built the model of the user's own config
        assert json.loads((run_dir / "result.json").read_text())["config"]["model"]["hidden"] == 24, run_dir


def test_a_continued_probe_estimates_what_is_left(tmp_path):
    """On continue, the probe's estimate is of what is left: its finished runs are subtracted from the total."""
    from lbt.apps.probe.command import done_samples, plan_probe
    from lbt.apps.probe.settings import split_args
    from lbt.spec.result import RunResult, write_result

    settings, overrides = split_args([*PROBE, f"probe.dir={tmp_path}"])
    plan = plan_probe(settings, overrides)[1]
    assert done_samples(tmp_path, plan) == 0
    at = plan.checkpoints[0]
    for name in ("base", f"branches/hold_at{at}_w2_seed0", f"branches/cooldown_at{at}_w1_seed0"):
        (tmp_path / name).mkdir(parents=True)
        write_result(tmp_path / name, RunResult(recipe="baseline", world_size=1, per_worker_batch=8, global_batch=8,
                                                steps=8, samples_seen=64, final_acc=0.5, final_loss=1.0))
    (tmp_path / "branches" / f"hold_at{at}_w4_seed0").mkdir()  # started, not finished: still to train
    assert done_samples(tmp_path, plan) == plan.budget + plan.branch_samples + plan.cooldowns[0]


def test_the_timed_rate_leaves_out_the_first_steps(monkeypatch):
    """The probe's and study's time estimates came from 20 steps whose first ones pay for start-up: "about
    8.7 h at 103 samples/s" for a 21-minute probe. A first step of 1 s must not change the rate."""
    import time

    import lbt.apps.estimate as estimate
    from lbt.engine import make_spec

    spec = make_spec(*compose_config([*FAST, "model=mlp", "trainer.per_worker_batch=32"]))
    slow_start = estimate.StepClock.after_backward

    def first_step_slow(self, model, progress):
        if not self.times:
            time.sleep(1.0)
        slow_start(self, model, progress)

    monkeypatch.setattr(estimate.StepClock, "after_backward", first_step_slow)
    rate = estimate.timed_rate(spec)
    assert rate > 20 * 32 / 1.0 * 3  # the whole run's rate, 1 s of start-up in it, would be at most 640/s
