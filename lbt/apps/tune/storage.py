"""Where a tune's trials live, and how workers share them.

tune.storage (conf/tune/default.yaml):
    sqlite (default)   tune.dir/optuna.db: one machine, any number of processes
    journal            tune.dir/optuna.journal (`journal:PATH`: another file): Optuna's JournalStorage, an
                       append-only file that processes on a shared filesystem (NFS) write safely
    a database URL     postgresql://user@host:5432/db (any URL SQLAlchemy and Optuna take): many machines
unset, $LBT_TUNE_STORAGE holds it, so a password never goes on the command line; a PostgreSQL password
may also come from PGPASSWORD or ~/.pgpass (libpq reads them). What lbt writes names the storage with
its password hidden (`redacted`).

Workers (the processes of `tune.workers=N`, or N `lbt tune` commands on one tune.dir and storage)
take a cell's trials one at a time under a lock (`claim_lock`), so a cell never gets more than
tune.trials trials. A running trial is its worker's: a heartbeat thread marks it alive every
tune.heartbeat seconds (Optuna's RDB heartbeat; for a journal, a trial attribute). A trial whose
heartbeat is older than GRACE heartbeats belongs to a worker that is gone (killed, its machine lost):
the next worker that looks fails it (`fail_stale`) and runs its slot again as a new trial. A live
worker's trial is never failed by another one.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from lbt.apps.compose import one_line
from lbt.errors import ConfigError
from lbt.paths import waiting_lock

ENV = "LBT_TUNE_STORAGE"
GRACE = 3  # heartbeats a trial may miss before it counts as left by a dead worker
BEAT = "lbt:heartbeat"  # a journal trial's last heartbeat (time.time() of its worker)
WORKER = "worker"  # user attribute: host and pid of the worker that ran a trial (optuna-dashboard shows it)


@dataclass
class TuneStorage:
    """The opened Optuna storage, what to call it in print, and its heartbeat settings."""

    optuna: Any  # optuna.storages.RDBStorage or JournalStorage
    shown: str  # the storage's URL with its password hidden: what reports and logs say
    dashboard: str  # the argument of `optuna-dashboard` that opens it
    folder: Path  # tune.dir: its lock files
    heartbeat: int  # seconds between a running trial's heartbeats

    @property
    def grace(self) -> int:
        return GRACE * self.heartbeat

    @property
    def journal(self) -> bool:
        return not isinstance(self.optuna, optuna.storages.RDBStorage)

    def trial_id(self, study_name: str, number: int) -> int:
        """The storage's id of a study's trial `number` (Optuna's heartbeat and state calls take the id)."""
        study_id = self.optuna.get_study_id_from_name(study_name)
        return int(self.optuna.get_trial_id_from_study_id_trial_number(study_id, number))


def storage_name(setting: str | None) -> str:
    """tune.storage, or $LBT_TUNE_STORAGE when it is unset, or sqlite."""
    return str(setting or os.environ.get(ENV) or "sqlite")


def redacted(name: str) -> str:
    """A storage URL with its password hidden (`postgresql://user:***@host/db`); other names as they are."""
    if "://" not in name:
        return name
    from sqlalchemy.engine import make_url

    try:
        return make_url(name).render_as_string(hide_password=True)
    except Exception:  # not a URL SQLAlchemy reads: keep only its scheme and host part, never a password
        scheme, _, rest = name.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}" if "@" in rest else name


def open_storage(setting: str | None, folder: Path, heartbeat: int) -> TuneStorage:
    """Open (creating once, under a lock: several workers may start together) the tune's storage."""
    name = storage_name(setting)
    shown = redacted(name)
    try:
        with claim_lock(folder):
            return _open(name, shown, folder, heartbeat)
    except ConfigError:
        raise
    except Exception as error:
        message = one_line(error).replace(name, shown)
        password = _password(name)
        if password:
            message = message.replace(password, "***")
        message = re.sub(r"\s*\(Background on this error at: [^)]*\)", "", message)
        hint = " (a PostgreSQL URL needs a driver: pip install 'psycopg[binary]')" \
            if isinstance(error, ImportError) and name.startswith("postgres") else ""
        raise ConfigError(f"tune.storage={shown}: cannot open the trials' storage: {message}{hint}") from None


def _open(name: str, shown: str, folder: Path, heartbeat: int) -> TuneStorage:
    if name == "journal" or name.startswith("journal:"):
        path = Path(name.partition(":")[2] or folder / "optuna.journal").expanduser().absolute()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab"):
                pass
        except OSError as error:
            raise ConfigError(f"tune.storage={name}: cannot write the journal file {path}: "
                              f"{error.strerror or error}") from None
        check_journal(path)
        return TuneStorage(optuna.storages.JournalStorage(_journal_backend(path)), f"journal:{path}", str(path),
                           folder, heartbeat)
    if name == "sqlite":
        name = shown = f"sqlite:///{folder / 'optuna.db'}"
    if "://" not in name:
        raise ConfigError(f"tune.storage must be sqlite, journal, journal:PATH or a database URL "
                          f"(postgresql://user@host/db), got {name!r}")
    engine: dict[str, Any] = {"connect_args": {"timeout": 60}} if name.startswith("sqlite") else {}
    if name.startswith("postgresql"):
        engine = {"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True}
        name = _postgres_driver(name)
    with _quiet():  # Optuna calls its heartbeat experimental
        rdb = optuna.storages.RDBStorage(name, engine_kwargs=engine, heartbeat_interval=heartbeat,
                                         grace_period=GRACE * heartbeat)
    return TuneStorage(rdb, shown, shown, folder, heartbeat)


def check_journal(path: Path) -> None:
    """Every line of the journal is one JSON record, or one line names the first that is not: Optuna raises a
    JSONDecodeError traceback at the first read past it. A last line with no newline is a write torn when
    its worker died (Optuna skips it, then fails once a record follows it), unless a live worker is writing
    it: it is looked at again a second later."""
    data = path.read_bytes()
    lines = data.split(b"\n")
    torn = lines.pop()  # b"" when the file ends with a newline
    for number, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except ValueError as error:
            raise ConfigError(f"the journal {path} is damaged at line {number} ({error}): restore it from a copy, or "
                              f"delete that line (its change is lost) and run the same command again") from None
    if torn:
        time.sleep(1)
        if path.read_bytes() == data:
            raise ConfigError(f"the journal {path} ends in a record cut short at line {len(lines) + 1} (a write torn "
                              "when its worker died; Optuna never applied it): delete that line and run the same "
                              "command again")
        check_journal(path)


def _postgres_driver(url: str) -> str:
    """postgresql:// with the driver that is installed: SQLAlchemy < 2.1 means psycopg2 by it, 2.1 psycopg (3)."""
    if not url.startswith("postgresql://"):
        return url  # the user named a driver: postgresql+psycopg2://...
    installed = [d for d in ("psycopg", "psycopg2") if importlib.util.find_spec(d) is not None]
    return f"postgresql+{installed[0]}://{url.removeprefix('postgresql://')}" if installed else url


def _journal_backend(path: Path) -> Any:
    from optuna.storages.journal import JournalFileBackend

    return JournalFileBackend(str(path))


def _password(name: str) -> str | None:
    if "://" not in name:
        return None
    from sqlalchemy.engine import make_url

    try:
        password = make_url(name).password
        return None if password is None else str(password)
    except Exception:
        return None


@contextlib.contextmanager
def claim_lock(folder: Path) -> Iterator[None]:
    """tune.dir's lock, held for a moment: while the storage is created, a trial is claimed, or the
    report is written. A flock: the kernel drops it when its holder dies, however it dies."""
    folder.mkdir(parents=True, exist_ok=True)
    with waiting_lock(folder / ".tune.lock"):
        yield


@contextlib.contextmanager
def cell_lock(folder: Path, cell: str) -> Iterator[bool]:
    """A cell's lock for its final runs, if no other worker holds it (yields False then, at once)."""
    (folder / "cells").mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / "cells" / f".{cell}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def mark_mine(storage: TuneStorage, trial: optuna.Trial) -> None:
    """Right after a claim: the trial's first heartbeat, and who runs it."""
    beat(storage, storage.trial_id(trial.study.study_name, trial.number))
    trial.set_user_attr(WORKER, f"{socket.gethostname()} pid {os.getpid()}")


def beat(storage: TuneStorage, trial_id: int) -> None:
    if storage.journal:
        storage.optuna.set_trial_system_attr(trial_id, BEAT, time.time())
    else:
        storage.optuna.record_heartbeat(trial_id)


@contextlib.contextmanager
def heartbeat(storage: TuneStorage, trial_id: int) -> Iterator[None]:
    """While the block runs (the trial trains), a thread marks the trial alive every tune.heartbeat seconds."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(storage.heartbeat):
            try:
                beat(storage, trial_id)
            except Exception:  # the trial was finished (or the storage is away a moment): try next time
                pass

    thread = threading.Thread(target=loop, name="lbt-tune-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def fail_stale(storage: TuneStorage, study: optuna.Study) -> list[int]:
    """Fail the study's trials whose worker is gone (no heartbeat for storage.grace seconds); their numbers.

    RDB storages: Optuna's own rule (`fail_stale_trials`, the database's clock). A journal: the trial's
    BEAT attribute. Either way also a trial with no mark of its worker at all, started that long ago
    (its worker died between claiming it and its first heartbeat, or an older lbt left it).
    """
    TrialState = optuna.trial.TrialState
    running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    if not running:
        return []
    if not storage.journal:
        with _quiet():
            optuna.storages.fail_stale_trials(study)
    now, stale = time.time(), []
    for trial in running:
        last = trial.system_attrs.get(BEAT) if storage.journal else None
        if last is None and (storage.journal or WORKER not in trial.user_attrs):
            last = trial.datetime_start.timestamp() if trial.datetime_start else now
        if last is not None and now - last > storage.grace:
            stale.append(trial)
    for trial in stale:
        with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError, RuntimeError):
            storage.optuna.set_trial_state_values(storage.trial_id(study.study_name, trial.number),
                                                  state=TrialState.FAIL)
    after = {t.number: t.state for t in study.get_trials(deepcopy=False)}
    return [t.number for t in running if after.get(t.number) == TrialState.FAIL]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield
