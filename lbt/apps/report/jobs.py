"""The jobs of a study folder: every result.json under it, read through lbt/spec/result.py, as a Job.

A job knows its folder (relative to the study), its RunResult, the overrides that differ between
the study's jobs (`swept`), and its series: the curve it belongs to, the recipe plus any setting
swept besides batch and seed (`lars (optim.lr=20)`). A result.json that cannot be read does not
stop the report: it becomes a failed job whose error names the file, listed under "Failed jobs".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lbt.spec.objective import Metric
from lbt.spec.result import ResultError, RunResult, read_result

SUMMARY_DIR = "tb_summary"  # the report's own TensorBoard run inside the study folder, not a job
PROBE_MARK = "probe_command.json"  # an `lbt probe` folder inside a study: its runs are the probe's, not jobs
UNREADABLE = "unreadable result.json"  # the series of a job whose result.json is damaged

# Overrides that place a job on the curve (batch) or average it (seed), not a variant of the recipe.
# Tensor parallelism is exact (lbt/parallel/tensor_parallel.py): a DP x T run is a point of its recipe's
# curve at its global batch, beside the data-parallel runs at that batch.
AXIS_KEYS = ("recipe", "study", "trainer.seed", "dist.world_size", "dist.procs", "trainer.per_worker_batch",
             "trainer.global_batch", "hydra.", "trainer.progress", "dist.tensor_parallel", "dist.max_global_batch")


@dataclass
class Job:
    """One job of a study: its folder, what it reported, and the curve it belongs to."""

    job_dir: str  # relative to the study folder
    path: Path  # its result.json
    result: RunResult
    readable: bool = True  # False: result.json is damaged and `result.error` says why
    swept: list[str] = field(default_factory=list)  # its overrides that differ between the study's jobs
    series: str = ""  # the curve it is a point of: the recipe, plus any other swept setting

    @property
    def data_parallel(self) -> int:
        """Its data-parallel workers: its GPUs, or its GPUs / T under tensor parallelism. Derived from
        world_size, which every result.json records, so files older than tensor parallelism read right."""
        return self.result.world_size // max(self.result.tensor_parallel, 1)

    def final(self, metric: Metric) -> float:
        """Its final value of `metric` on the split it evaluated during training (NaN if it has none)."""
        return getattr(self.result, f"final_{metric.name}")

    def bits_per_char(self, loss: float | None) -> float | None:
        """A language model's `loss` in bits per its token (a char for data=text); None for any other run."""
        return self.result.bits_per_token(loss)


def load_jobs(study_dir: Path) -> list[Job]:
    """Every job under `study_dir` (its result.json files, the report's own tb_summary/ and any probe folder
    left out), in path order."""
    probes = {p.parent for p in study_dir.rglob(PROBE_MARK)}
    paths = [p for p in sorted(study_dir.rglob("result.json")) if SUMMARY_DIR not in p.relative_to(study_dir).parts
             and not probes.intersection(p.parents)]
    jobs = [read_job(path, study_dir) for path in paths]
    # Only overrides that differ between jobs make a variant; ones shared by all are the study's setting.
    readable = [job for job in jobs if job.readable]
    shared = set.intersection(*(set(job.result.overrides) for job in readable)) if readable else set()
    for job in jobs:
        job.swept = [o for o in job.result.overrides if o not in shared]
        job.series = series_name(job.result.recipe, job.result.overrides, job.swept) if job.readable else UNREADABLE
    return jobs


def read_job(path: Path, study_dir: Path) -> Job:
    """One job; a damaged result.json is a failed job whose error names the file."""
    job_dir = str(path.parent.relative_to(study_dir))
    try:
        return Job(job_dir, path, read_result(path))
    except ResultError as error:
        return Job(job_dir, path, RunResult(recipe="?", error=str(error)), readable=False)


def series_name(recipe: str, overrides: list[str], swept: list[str]) -> str:
    """The recipe, plus any other swept setting (`lars (optim.lr=20)`): one curve each."""
    variant = [o for o in overrides if o in swept and o.split("=", 1)[0].lstrip("+~") not in AXIS_KEYS
               and not o.startswith("hydra.")]
    return f"{recipe} ({', '.join(variant)})" if variant else recipe


def is_baseline(series: str) -> bool:
    """Whether a series is the baseline recipe (with or without a swept setting): the reference of comparisons."""
    return series.split(" (")[0] == "baseline"
