"""A study folder's own record, study.json: the command that made it and every job its grids expand to.

    <study>/study.json   {"format": 1, "command": ["recipe=baseline,lars", ...],
                          "jobs": [{"dir": "0", "overrides": ["recipe=baseline", "dist.world_size=1"]}, ...]}

`lbt study` writes it before any job starts. The same command continues the study in that folder; a
command whose grid differs is refused (`claim`), so two grids never mix. `lbt report` reads it to
tell finished, failed and missing jobs apart (`expected_jobs`); a folder without study.json (a plain
`lbt train -m` sweep) has as jobs the folders Hydra made for them (each holds `.hydra/`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from lbt.apps.compose import sweep_grid
from lbt.apps.estimate import duration
from lbt.errors import ConfigError
from lbt.paths import atomic_write
from lbt.spec.result import ResultError, RunResult, read_result
from lbt.spec.run import result_free

STUDY_FILE = "study.json"
FORMAT = 1


@dataclass(frozen=True)
class StudyJob:
    dir: str  # relative to the study folder: Hydra's job number, under the extra grid's name for extra grids
    overrides: tuple[str, ...]  # the job's overrides, as Hydra gives them to it (its result.json's `overrides`)


@dataclass(frozen=True)
class StudyRecord:
    command: tuple[str, ...]  # the study's overrides, without the folder (hydra.sweep.dir)
    jobs: tuple[StudyJob, ...]


def grid_jobs(params: dict[str, str], overrides: list[str], prefix: str = "") -> list[StudyJob]:
    """The jobs Hydra's basic sweeper makes of a config's `hydra.sweeper.params` and the command's overrides,
    numbered as it numbers them (job folder `${hydra.job.num}`, under `prefix`)."""
    lines = [f"{k}={v}" for k, v in params.items()] + [o for o in overrides if not o.startswith("hydra.")]
    batch = sweep_grid(lines)
    if not batch:
        parsed = OverridesParser.create().parse_overrides(lines)
        empty = next((o.input_line for o in parsed if o.is_sweep_override() and not list(o.sweep_string_iterator())),
                     "the grid")
        raise ConfigError(f"{empty} sweeps no values: the study would run no job")
    return [StudyJob(f"{prefix}{number}", tuple(job)) for number, job in enumerate(batch)]


def read_study(folder: str | Path) -> StudyRecord | None:
    """The folder's study.json, or None when it has none; a damaged one is a ConfigError naming it."""
    path = Path(folder) / STUDY_FILE
    if not path.is_file():
        return None
    try:
        saved = json.loads(path.read_text())
        jobs = tuple(StudyJob(str(j["dir"]), tuple(j["overrides"])) for j in saved["jobs"])
        return StudyRecord(tuple(saved["command"]), jobs)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{path} is damaged ({type(error).__name__}: {error}); it says which study the "
                          "folder holds: restore it, or run the study in a new folder") from None


def write_study(folder: str | Path, record: StudyRecord) -> None:
    path = Path(folder) / STUDY_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"format": FORMAT, "command": list(record.command),
                       "jobs": [{**asdict(j), "overrides": list(j.overrides)} for j in record.jobs]}, indent=1)
    atomic_write(path, lambda f: f.write(text.encode()))


def claim(folder: str | Path, record: StudyRecord) -> bool:
    """Make `folder` this study's, or find it already is (True: a continued study).

    A folder holding another grid's study, or a sweep's results without study.json, is refused with
    one line naming what differs: results of two grids must never mix in one report.
    """
    folder = Path(folder)
    saved = read_study(folder)
    if saved is None:
        if any(folder.rglob("result.json")):
            raise ConfigError(f"{folder} holds results of another sweep (no {STUDY_FILE}): run the study in a "
                              "new folder (hydra.sweep.dir=...)")
        write_study(folder, record)
        return False
    if result_jobs(saved) != result_jobs(record):
        raise ConfigError(f"{folder} holds another study ({differences(saved, record)}): give the same command "
                          "to continue it, or another hydra.sweep.dir for this one")
    return True


def result_jobs(record: StudyRecord) -> dict[str, frozenset[str]]:
    """Each job's folder and the overrides that can change its result: reordered overrides, an added
    trainer.threads=1 or another launcher continue the study."""
    return {job.dir: frozenset(o for o in job.overrides if not free_override(o)) for job in record.jobs}


def free_override(override: str) -> bool:
    """An override that cannot change a job's result: Hydra's own, or a RESULT_FREE key's value. A group
    choice (recipe=lars) is never free: it selects what the job runs."""
    key = override.split("=", 1)[0].lstrip("+~")
    return key.startswith(("hydra.", "hydra/")) or ("." in key and result_free(key))


def differences(saved: StudyRecord, new: StudyRecord) -> str:
    """What differs between two studies' grids, in a few words: the overrides only one of them has."""
    before = set().union(*result_jobs(saved).values())
    after = set().union(*result_jobs(new).values())
    parts = []
    if before - after:
        parts.append(f"it has {', '.join(sorted(before - after)[:4])}")
    if after - before:
        parts.append(f"this command has {', '.join(sorted(after - before)[:4])}")
    return "; ".join(parts) or f"{len(saved.jobs)} jobs in another order than this command's {len(new.jobs)}"


def expected_jobs(folder: str | Path) -> list[StudyJob]:
    """Every job of the study or sweep in `folder`: study.json's, else those Hydra made a folder for."""
    folder = Path(folder)
    record = read_study(folder)
    if record is not None:
        return list(record.jobs)
    jobs = []
    for overrides in sorted(folder.rglob(".hydra/overrides.yaml")):
        job_dir = overrides.parent.parent
        jobs.append(StudyJob(str(job_dir.relative_to(folder)), tuple(map(str, OmegaConf.load(overrides)))))
    return jobs


# -- a job's one line ---------------------------------------------------------------------------------
STUDY_ENV = "LBT_STUDY"  # set by `lbt study` for its jobs: the study folder they belong to
STUDY_PID = "LBT_STUDY_PID"  # the study's own process (jobs of the basic launcher run inside it)


def study_of_job() -> Path | None:
    folder = os.environ.get(STUDY_ENV)
    return Path(folder) if folder else None


def job_line(study: Path, result: RunResult, seconds: float, parallel: int = 1) -> str:
    """`[7/32] lamb W=64 b=64 B=4,096: val 98.50% test 98.35% in 41 s (about 3 min left)`.

    k counts the study's jobs that hold a result now (jobs end out of order); the time left is the
    finished jobs' mean wall time x the jobs left / the jobs that run at once.
    """
    record = read_study(study)
    jobs = list(record.jobs) if record else []
    finished = [read_quietly(study / job.dir / "result.json") for job in jobs]
    done = [r for r in finished if r is not None]
    what = (f"{result.recipe} W={result.world_size:,} b={result.per_worker_batch:,} B={result.global_batch:,}"
            f"{f' seed={result.seed}' if result.seed else ''}")
    if result.stopped:
        outcome = "stopped, checkpoint saved"
    elif result.failed:
        outcome = f"failed: {result.error}"
    elif result.diverged:
        outcome = f"diverged at step {result.steps:,}"
    elif result.token:
        outcome = f"{result.eval_split} loss {result.final_loss:.3f}"
    else:
        test = f" test {result.test_acc:.2%}" if result.test_acc is not None and result.eval_split != "test" else ""
        outcome = f"{result.eval_split} {result.final_acc:.2%}{test}"
    line = f"[{len(done)}/{len(jobs)}] {what}: {outcome} in {seconds:.0f} s"
    walls = [r.wall_seconds for r in done if r.wall_seconds]
    left = len(jobs) - len(done)
    if walls and left and not result.stopped:
        line += f" (about {duration(sum(walls) / len(walls) * left / max(parallel, 1))} left)"
    return line


def jobs_to_run(folder: str | Path, jobs: list[StudyJob]) -> list[StudyJob]:
    """The jobs a study still has to run: those without a result, or with a failed attempt's (which a
    rerun replaces); a stopped job has no result.json."""
    results = [read_quietly(Path(folder) / job.dir / "result.json") for job in jobs]
    return [job for job, result in zip(jobs, results) if result is None or result.failed]


def read_quietly(path: Path) -> RunResult | None:
    try:
        return read_result(path) if path.is_file() else None
    except ResultError:
        return None

