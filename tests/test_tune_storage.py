"""`lbt tune` on many workers: tune.storage (SQLite, a journal file, a real PostgreSQL server), tune.workers,
concurrent `lbt tune` commands on one tune.dir, and a worker that dies mid-trial (lbt/apps/tune/storage.py,
workers.py)."""

import glob
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest
from test_tune import TINY

from lbt.apps import cli
from lbt.apps.tune.command import tune
from lbt.apps.tune.storage import ENV, fail_stale, heartbeat, mark_mine, open_storage, redacted, storage_name
from lbt.errors import ConfigError

# Two cells of two trials, one tuned final each: every worker gets work, the report has a gap row.
GRID = [*TINY, "recipe=baseline", "dist.world_size=1,4", "tune.trials=2", "tune.seeds=1", "tune.untuned=false",
        "tune.pruner=none", "tune.heartbeat=1"]
SECRET = "s3cret-pw"


def trial_states(storage: str) -> dict[str, list[str]]:
    """Every cell's trial states, by trial number."""
    return {name: [t.state.name for t in optuna.load_study(study_name=name, storage=storage).trials]
            for name in optuna.get_all_study_names(storage)}


def comparable(summary: dict) -> str:
    """A summary without where it was written: what two tunes of the same grid must agree on."""
    shown = {k: v for k, v in summary.items() if k not in ("storage", "tune_dir")}
    return json.dumps(shown, indent=1).replace(summary["tune_dir"], "<dir>")


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory):
    """The grid tuned by one worker on SQLite: what every other storage and worker count must reproduce."""
    folder = tmp_path_factory.mktemp("one") / "tune"
    summary = tune([*GRID, f"tune.dir={folder}"])
    return summary, trial_states(f"sqlite:///{folder / 'optuna.db'}")


def check_same_as_one_worker(summary: dict, states: dict, one_worker) -> None:
    """The same trials per cell as one worker, none failed or run twice, and the report the same."""
    reference, reference_states = one_worker
    assert states == reference_states == {name: ["COMPLETE"] * 2 for name in reference_states}
    folder = Path(summary["tune_dir"])
    for name in states:
        trial_dirs = sorted(p.name for p in (folder / "trials" / name.replace(" ", ",")).iterdir())
        assert trial_dirs == ["0", "1"]  # each trial ran once, in its own folder
    assert comparable(summary) == comparable(reference)
    assert comparable(json.loads((folder / "tune_summary.json").read_text())) == comparable(reference)


def test_storage_names_hide_passwords(monkeypatch):
    assert redacted(f"postgresql://lbt:{SECRET}@db.example:5432/tune") == "postgresql://lbt:***@db.example:5432/tune"
    assert redacted("postgresql://lbt@db/tune") == "postgresql://lbt@db/tune" and redacted("journal") == "journal"
    monkeypatch.delenv(ENV, raising=False)
    assert storage_name(None) == "sqlite"
    monkeypatch.setenv(ENV, f"postgresql://lbt:{SECRET}@db/tune")
    assert storage_name(None).endswith("@db/tune") and storage_name("journal") == "journal"


@pytest.mark.parametrize("storage, expected", [
    ("bogus", "tune.storage must be sqlite, journal, journal:PATH or a database URL"),
    ("nosuchdb://host/db", "tune.storage=nosuchdb://host/db: cannot open the trials' storage"),
    # sysfs takes no new folder, from root or anyone: a path the journal cannot be written to
    ("journal:/sys/lbt/optuna.journal", "cannot write the journal file /sys/lbt/optuna.journal"),
])
def test_a_storage_that_cannot_be_opened_is_one_line(storage, expected, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["tune", *GRID, f"tune.storage={storage}", f"tune.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith("lbt: error: ") and expected in err


def test_an_unreachable_database_is_one_line_without_its_password(tmp_path, capsys, monkeypatch):
    pytest.importorskip("psycopg", reason="the PostgreSQL driver (pip install 'psycopg[binary]'; the dev extra)")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv(ENV, f"postgresql://lbt:{SECRET}@127.0.0.1:{port}/tune")
    with pytest.raises(SystemExit) as stop:
        cli.main(["tune", *GRID, f"tune.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and SECRET not in err
    assert err.startswith(f"lbt: error: tune.storage=postgresql://lbt:***@127.0.0.1:{port}/tune: cannot open")


@pytest.mark.slow  # it waits out a grace period
@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # this test asks Optuna itself, as lbt's claim does
def test_a_trial_is_failed_only_once_its_worker_stops_beating(tmp_path):
    """Two running trials per storage: one whose worker died (one heartbeat, then nothing) and one whose worker
    lives (its heartbeat thread runs). After the grace period only the dead one is failed, by another worker."""
    stores = [open_storage(name, tmp_path / name, 1) for name in ("sqlite", "journal")]
    studies = [optuna.create_study(storage=s.optuna, study_name="cell") for s in stores]
    dead, live = [], []
    for store, study in zip(stores, studies):
        dead.append(study.ask())
        mark_mine(store, dead[-1])
        live.append(study.ask())
        mark_mine(store, live[-1])
    with heartbeat(stores[0], live[0]._trial_id), heartbeat(stores[1], live[1]._trial_id):
        assert [fail_stale(s, study) for s, study in zip(stores, studies)] == [[], []]  # both fresh
        time.sleep(stores[0].grace + 1.5)
        assert [fail_stale(s, study) for s, study in zip(stores, studies)] == [[dead[0].number], [dead[1].number]]
    for study in studies:
        assert [t.state.name for t in study.trials] == ["FAIL", "RUNNING"]


def two_commands(args: list[str], cwd: Path) -> None:
    """Two `lbt tune` commands started at once: both end well, and exactly one writes the report."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "lbt", "tune", *args], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [proc.communicate(timeout=300) for proc in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err
        assert "Traceback" not in err and "already exists" not in err and "Cannot tell" not in err
    assert sum("(current: written by another worker" not in out for out, _ in outputs) == 1


@pytest.mark.slow
def test_two_tune_commands_on_one_fresh_folder_share_its_trials(tmp_path, one_worker):
    """Two `lbt tune` on one new tune.dir: the database is created once, each trial runs in one process, none is
    failed, the report is written once (the other process finds it current), and it is the one-worker report."""
    folder = tmp_path / "tune"
    two_commands([*GRID, f"tune.dir={folder}"], tmp_path)
    summary = json.loads((folder / "tune_summary.json").read_text())
    check_same_as_one_worker(summary, trial_states(f"sqlite:///{folder / 'optuna.db'}"), one_worker)


@pytest.mark.slow
def test_two_workers_on_a_journal_file(tmp_path, one_worker):
    """tune.workers=2: this process and one more, sharing a journal file."""
    folder = tmp_path / "tune"
    summary = tune([*GRID, "tune.storage=journal", "tune.workers=2", f"tune.dir={folder}"])
    journal = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(folder / "optuna.journal")))
    check_same_as_one_worker(summary, trial_states(journal), one_worker)
    assert summary["storage"] == str(folder / "optuna.journal")


@pytest.mark.slow
def test_a_worker_killed_mid_trial_is_retried_once_its_heartbeat_stops(tmp_path, capsys):
    """SIGKILL (no handler runs): its trial stays RUNNING until 3 heartbeats are missed; the next worker
    fails it and runs that slot again. The cell still gets exactly tune.trials counted trials."""
    folder = tmp_path / "tune"
    args = [*TINY, "recipe=baseline", "dist.world_size=1", "tune.trials=2", "tune.seeds=1", "tune.untuned=false",
            "tune.pruner=none", "tune.heartbeat=1", "trainer.epochs=4", f"tune.dir={folder}"]
    worker = subprocess.Popen([sys.executable, "-m", "lbt", "tune", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    trial = folder / "trials" / "recipe=baseline,dist.world_size=1" / "0"
    deadline = time.monotonic() + 120
    while not (trial / "train.log").is_file() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    storage = f"sqlite:///{folder / 'optuna.db'}"
    assert trial_states(storage) == {"recipe=baseline dist.world_size=1": ["RUNNING"]}
    summary = tune(args)
    assert "trial 0: its worker is gone (no heartbeat for 3 s); it is run again" in capsys.readouterr().out
    assert trial_states(storage) == {"recipe=baseline dist.world_size=1": ["FAIL", "COMPLETE", "COMPLETE"]}
    assert summary["cells"][0]["trials"] == {"counted": 2, "complete": 2, "pruned": 0, "diverged": 0, "failed": 1}


# A real PostgreSQL server, on a loopback port in a temporary folder (Debian's `postgresql` package; .ci/run
# installs it). PostgreSQL refuses to run as root: as root, the server runs as `nobody`.
def postgres_program(name: str) -> str | None:
    return shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))[-1:]), None)


@pytest.fixture(scope="module")
def postgres():
    """A URL with its password (SECRET) of a fresh server; stopped and removed after the module."""
    initdb, pg_ctl = postgres_program("initdb"), postgres_program("pg_ctl")
    if not (initdb and pg_ctl):  # a missing server fails: a skip would pass CI without the test it asks for
        if os.environ.get("LBT_SKIP_POSTGRES") == "1":
            pytest.skip("LBT_SKIP_POSTGRES=1: the PostgreSQL tests are skipped on purpose")
        pytest.fail("PostgreSQL is not installed: apt-get install postgresql (.ci/run does), or set "
                    "LBT_SKIP_POSTGRES=1 to skip these tests on purpose")
    import psycopg  # noqa: F401  (the dev extra's driver: its absence is a failure, not a skip)
    owner: dict = {}
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        owner = {"user": nobody.pw_uid, "group": nobody.pw_gid}
    folder = Path(tempfile.mkdtemp(prefix="lbt-postgres-"))
    (folder / "password").write_text(SECRET + "\n")
    for path in (folder, folder / "password"):
        if owner:
            os.chown(path, owner["user"], owner["group"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def postgres_run(*args: str) -> None:
        done = subprocess.run(args, cwd=folder, capture_output=True, text=True, timeout=60, **owner)
        assert done.returncode == 0, f"{' '.join(args)}: {done.stderr}"

    postgres_run(initdb, "-D", str(folder / "data"), "-U", "lbt", "-A", "scram-sha-256",
                 f"--pwfile={folder / 'password'}", "--no-sync", "-E", "UTF8")
    options = f"-p {port} -k {folder} -c listen_addresses=127.0.0.1 -c fsync=off"
    postgres_run(pg_ctl, "-D", str(folder / "data"), "-l", str(folder / "log"), "-o", options, "-w", "start")
    try:
        yield f"postgresql://lbt:{SECRET}@127.0.0.1:{port}/postgres"
    finally:
        postgres_run(pg_ctl, "-D", str(folder / "data"), "-m", "immediate", "-w", "stop")
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_two_tune_commands_on_a_postgresql_server(tmp_path, postgres, one_worker, monkeypatch):
    """The URL, password included, comes from $LBT_TUNE_STORAGE; no file of the tune holds the password."""
    monkeypatch.setenv(ENV, postgres)
    folder = tmp_path / "tune"
    two_commands([*GRID, f"tune.dir={folder}"], tmp_path)
    summary = json.loads((folder / "tune_summary.json").read_text())
    check_same_as_one_worker(summary, trial_states(postgres), one_worker)
    assert summary["storage"] == redacted(postgres) and "lbt:***@127.0.0.1" in summary["storage"]
    written = [p for p in folder.rglob("*") if p.is_file()]
    assert any(p.name == "result.json" for p in written)
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]


def test_open_storage_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(ConfigError, match="got 'mysql'"):
        open_storage("mysql", tmp_path, 1)


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
@pytest.mark.parametrize("name", ["sqlite", "journal"])
@pytest.mark.parametrize("dead", [0, 1, 2])
def test_a_dead_workers_trial_is_retried_at_its_own_slot_with_its_own_point(tmp_path, name, dead):
    """Start a tune twice on one tune.dir and `kill -9` the worker of a running trial: the survivor reruns it
    with its own slot's point, whichever slot died. A free slot counted, not read, would give it the next trial's
    point (lr 2.575, 2.575, 0.2485 instead of 0.2122, 2.575, 0.2485)."""
    retried_at_its_own_slot(open_storage(name, tmp_path / "tune", 10), tmp_path, dead)


@pytest.mark.slow  # the server's processes
@pytest.mark.filterwarnings("ignore:Heartbeat of storage")
def test_a_dead_workers_trial_is_retried_at_its_own_slot_on_postgresql(tmp_path, postgres):
    """The same, every slot, on a real PostgreSQL server."""
    store = open_storage(postgres, tmp_path / "tune", 10)
    for dead in range(3):
        retried_at_its_own_slot(store, tmp_path, dead, study_name=f"slots-{dead}")


def retried_at_its_own_slot(store, tmp_path, dead: int, study_name: str | None = None) -> None:
    """Three workers claim a cell's three slots and draw their points; slot `dead`'s worker dies; the next claim
    retries that slot and draws that point, and then no slot is free."""
    from lbt.apps.tune.grid import tune_grid
    from lbt.apps.tune.trials import claim_trial

    grid = tune_grid(["model=mlp", "data=synthetic", "data.val_fraction=0.1", "recipe=baseline", "dist.world_size=1",
                      "tune.trials=3", "tune.pruner=none", f"tune.dir={tmp_path / 'tune'}"])
    cell = grid.cells[0]
    study = optuna.create_study(storage=store.optuna, study_name=study_name or cell.name)
    claims, points = [], []
    for _ in range(3):  # each worker draws its point right after its claim, as run_trial does
        claims.append(claim_trial(grid, cell, study, store))
        points.append(claims[-1].trial.suggest_float("lr", 1e-3, 10.0, log=True))
    assert [claim.slot for claim in claims] == [0, 1, 2] and len(set(points)) == 3
    store.optuna.set_trial_state_values(claims[dead].trial._trial_id, state=optuna.trial.TrialState.FAIL)  # gone
    retry = claim_trial(grid, cell, study, store)
    assert retry.slot == dead and retry.trial.suggest_float("lr", 1e-3, 10.0, log=True) == points[dead]
    assert claim_trial(grid, cell, study, store) is None  # every slot is held again


@pytest.mark.parametrize("damage, says", [
    (lambda lines: [*lines[:2], b"garbage here", *lines[3:]], "is damaged at line 3 (Expecting value"),
    (lambda lines: [*lines[:-1], lines[-1][:-20]], "ends in a record cut short at line"),
])
def test_a_damaged_journal_is_one_line_naming_its_line(tmp_path, damage, says):
    """A garbage line, or a last line torn by a worker's death, in an Optuna journal is one line naming it, as the
    SQLite storage's damage is; Optuna alone raises a JSONDecodeError (for the torn one at the next write)."""
    opened = open_storage("journal", tmp_path, 2)
    study = optuna.create_study(storage=opened.optuna, study_name="cell")
    for _ in range(3):
        study.ask()
    path = tmp_path / "optuna.journal"
    lines = path.read_bytes().rstrip(b"\n").split(b"\n")
    broken = damage(lines)
    path.write_bytes(b"\n".join(broken) + (b"\n" if broken[-1] == lines[-1] else b""))
    with pytest.raises(ConfigError, match=f"the journal {path} {re.escape(says)}"):
        open_storage("journal", tmp_path, 2)
