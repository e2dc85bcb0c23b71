"""A job as Hydra starts it (a run alone, or one job of a sweep or study), and the record of how it ended.

In a sweep a failing job is recorded in its result.json and the sweep goes on; a run alone ends with one
line and its exit code. A study's job says one line on the terminal when it ends (its log is its train.log).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lbt.apps.compose import one_line
from lbt.apps.errors import Stopped, continue_with, end_on, stopped
from lbt.apps.study_folder import STUDY_PID, job_line, study_of_job
from lbt.engine import make_spec, run
from lbt.errors import ConfigError, place_problem
from lbt.parallel.launcher import WorkerDied
from lbt.spec.batching import DEFAULT_PER_WORKER_BATCH
from lbt.spec.result import ResultError, RunResult, read_result, write_result
from lbt.stop import STOP_SIGNALS, end_with_sweep, stop_asked, stop_kept, stopped_by


@dataclass(frozen=True)
class HydraJob:
    config: dict[str, Any]  # resolved
    recipe: str | None
    overrides: list[str]  # the job's own (Hydra's task overrides)
    output_dir: str
    sweeping: bool
    study: Path | None  # the study this job is one of
    hydra_cfg: Any

    @classmethod
    def current(cls, cfg: DictConfig) -> HydraJob:
        hydra_cfg = HydraConfig.get()
        container = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(container, dict)
        return cls({str(k): v for k, v in container.items()}, hydra_cfg.runtime.choices.get("recipe"),
                   list(hydra_cfg.overrides.task), hydra_cfg.runtime.output_dir,
                   hydra_cfg.mode == RunMode.MULTIRUN, study_of_job(), hydra_cfg)

    def prepare(self) -> bool:
        """Whether the job runs: not once its sweep is stopping (the same command runs it later)."""
        if self.sweeping and stop_asked() is not None:
            return False
        if self.sweeping:
            end_with_sweep()  # a launcher's worker process dies with the sweep's, however it dies
        if self.study is not None and os.environ.get(STUDY_PID) != str(os.getpid()):
            # A launcher's worker process: Ctrl-C reaches the study, which tells its jobs (lbt/stop.py); a
            # worker killed by it between jobs would take the launcher, and the running jobs, down with it.
            for sig in STOP_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
        return True

    def train(self) -> RunResult:
        """The run's result. Stopped: a run alone exits as a stop does (130/143, as at any moment); a job's
        stop is its record (no result.json: what the job is comes from its config)."""
        result = run(make_spec(self.config, self.recipe, self.overrides), self.output_dir)
        if result.stopped and self.study is None and not self.sweeping:
            if stop_kept():  # a run inside a probe (keep_stop): that command says how to continue it
                raise Stopped(stopped_by())
            stopped(stopped_by(), continue_with(self.config, self.output_dir))
        if result.stopped:
            return replace(self.failure(""), error=None, stopped=True)
        return result

    def failed(self, error: Exception) -> RunResult:
        """A job's failure as its result; a run alone ends here, with one line and its exit code."""
        if isinstance(error, (ConfigError, WorkerDied)):
            if str(error) and self.study is None:
                print(f"lbt: error: {error}", file=sys.stderr, flush=True)
            if not self.sweeping:
                sys.exit(2 if isinstance(error, ConfigError) or not str(error) else 1)
            return self.failure(str(error) or "config error in a worker")
        problem = place_problem(error)
        if problem is not None:  # a full disk or a read-only folder: every later job would fail the same way
            end_on(*problem)
        if not self.sweeping:
            raise error
        if self.study is None:
            print(f"lbt: job failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        return self.failure(f"{type(error).__name__}: {error}")

    def failure(self, message: str) -> RunResult:
        return failure_result({**self.config, "overrides": self.overrides}, self.recipe, message)


def record_failure(output_dir: str, failure: RunResult) -> bool:
    """A failed job's result.json, saying why; False where the folder holds another run's finished result,
    which is never replaced by why this one could not run."""
    if finished_here(output_dir):
        print(f"lbt: error: {failure.error}", file=sys.stderr, flush=True)
        return False
    try:
        write_result(output_dir, failure)
    except OSError as error:
        end_on(*(place_problem(error) or (f"cannot write {output_dir}/result.json: {one_line(error)}", 1)))
    return True


def finished_here(run_dir: str) -> bool:
    """Whether the folder holds a run's finished (not failed) result.json."""
    try:
        return not read_result(run_dir).failed if (Path(run_dir) / "result.json").is_file() else False
    except ResultError:
        return True  # damaged, but someone's: kept


def say_job(study: Path, result: RunResult, seconds: float, hydra_cfg: Any) -> None:
    """A study's job ends with one line on the terminal (its whole log is in its train.log)."""
    parallel = int(hydra_cfg.launcher.get("n_jobs") or 1) if "launcher" in hydra_cfg else 1
    print(job_line(study, result, seconds, parallel), flush=True)


def failure_result(config: dict[str, Any], recipe: str | None, message: str) -> RunResult:
    """What a failed job of a sweep was (recipe, batches, seed, as far as its config says) and why it failed."""
    trainer, world_size = config.get("trainer") or {}, (config.get("dist") or {}).get("world_size") or 1
    per_worker = trainer.get("per_worker_batch")
    if per_worker is None:
        per_worker = trainer["global_batch"] // world_size if trainer.get("global_batch") else DEFAULT_PER_WORKER_BATCH
    return RunResult(error=message, recipe=recipe or "custom", overrides=list(config.get("overrides") or []),
                     world_size=world_size, per_worker_batch=per_worker,
                     global_batch=trainer.get("global_batch") or per_worker * world_size, seed=trainer.get("seed"),
                     config=config)
