"""Whether a study's data can carry an answer: every job finished, two batches measured, a base batch that learned.

The report states its answer (the critical batch, "how many GPUs", the fastest GPU count) only when
all of these hold, and otherwise says why not (`Trust.reasons`):

- **Complete**: every job the study expects (study.json, else the folders Hydra made: lbt/apps/study_folder.py)
  holds a result.json without an error. A job without one is *missing* (not started, still running, or
  stopped); one whose result.json holds an error, or cannot be read, *failed*. A diverged run finished:
  it is a measurement. Running the same `lbt study` command again runs the missing and failed jobs.
- **Two batches**: the answer compares larger batches with the smallest; one batch measured answers nothing.
- **The base batch learned** (judged by accuracy, classes known): the reference run (the baseline at the
  smallest batch) ended more than CHANCE_MARGIN above chance, 1 / classes.

Warnings leave the answer standing, flagged: the base batch is *undertrained* when it gained more than
RISING x the tolerance over the last LATE of its samples (still rising steeply; for either metric), or
(accuracy, classes known, not a language model) it ended below halfway between chance and 100%.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lbt.apps.report.jobs import Job
from lbt.apps.report.rows import Row, char_level, shown
from lbt.apps.study_folder import STUDY_FILE, StudyJob, expected_jobs
from lbt.engine.build import data_shape
from lbt.errors import ConfigError
from lbt.spec.objective import Metric
from lbt.spec.result import EvalPoint
from lbt.spec.targets import target_of

CHANCE_MARGIN = 0.02  # accuracy: a base batch within 2 points of chance (1 / classes) did not learn
RISING = 3.0  # the base gained more than this many tolerances over its last LATE of training: still rising steeply
LATE = 0.25  # the last quarter of the samples it saw
MISSING = "missing (not started, still running, or stopped)"
UNDERTRAINED = "the base batch is undertrained"


@dataclass
class Trust:
    """What the report may say: the jobs it lacks, why it gives no answer, and what to warn about."""

    missing: list[dict[str, Any]] = field(default_factory=list)  # a job of the study without a result.json
    failed: list[dict[str, Any]] = field(default_factory=list)  # a job whose result.json holds an error
    recorded: bool = False  # the folder holds study.json (`lbt study` made it), not a bare sweep's folders
    reasons: list[str] = field(default_factory=list)  # why there is no answer; none: the answer stands
    warnings: list[str] = field(default_factory=list)  # the answer stands, but read it with these (whole lines)
    headlines: list[str] = field(default_factory=list)  # each warning in a few words, said again above the answer

    @property
    def complete(self) -> bool:
        return not self.missing and not self.failed

    @property
    def withheld(self) -> str | None:
        """Why the answer is withheld, in one sentence (None: it is given)."""
        return "; ".join(self.reasons) or None


def judge_study(study_dir: Path, jobs: list[Job], rows: list[Row], answer: dict[str, Any], metric: Metric) -> Trust:
    """The study's Trust: missing and failed jobs, why there is no answer, and warnings on the base batch.
    `answer` is gpu_answer's (its reference is the base batch, its tolerance the one the answer uses)."""
    trust = Trust(recorded=(study_dir / STUDY_FILE).is_file())
    try:
        expected = expected_jobs(study_dir)
    except ConfigError as error:  # a damaged study.json: which jobs the study has is not known
        expected = []
        trust.reasons.append(f"which jobs the study has is not known: {error}")
    shared = set.intersection(*(set(job.overrides) for job in expected)) if len(expected) > 1 else set()
    trust.missing = [missing_cell(job, jobs, shared) for job in expected
                     if not (study_dir / job.dir / "result.json").is_file()]
    trust.failed = [failed_cell(job, expected, jobs) for job in jobs if job.result.failed]
    if not trust.complete:
        counts = [f"{len(trust.missing)} missing"] * bool(trust.missing) + [f"{len(trust.failed)} failed"] * bool(
            trust.failed)
        total = max(len(expected), len(jobs))
        trust.reasons.append(f"the study is incomplete: {' and '.join(counts)} of its {total} job{'s' * (total > 1)}")
    reference = answer.get("reference")
    if reference is None:
        return trust  # no run finished: the answer section says so
    batches = sorted({r.global_batch for r in rows if r.split == answer["split"]
                      and (math.isfinite(r.final(metric)) or r.diverged)})
    if len(batches) < 2:
        trust.reasons.append(f"one global batch measured ({batches[0]:,}): the answer needs at least two")
    base = [job for job in jobs if job.series == reference["recipe"] and job.readable and job.result.trained
            and job.result.global_batch == reference["global_batch"]]
    value = reference[metric.name]
    what = f"{reference['recipe']} at the smallest global batch ({reference['global_batch']:,})"
    chance = chance_level(base) if metric.name == "acc" else None
    reached = f"{shown(metric, value, char_level(rows))} on {answer['split']}"
    if chance is not None and value <= chance + CHANCE_MARGIN:
        trust.reasons.append(
            f"the base batch did not learn: {what} reached {reached}, within {100 * CHANCE_MARGIN:g} points of chance "
            f"({100 * chance:.2f}%, 1 of {round(1 / chance)} classes); fix its recipe or train it longer")
        return trust
    warning = undertrained(base, value, what, reached, chance, answer["tolerance"], metric)
    if warning:
        trust.warnings.append(warning)
        trust.headlines.append(UNDERTRAINED)
    return trust


def undertrained(base: list[Job], value: float, what: str, reached: str, chance: float | None, tolerance: float,
                 metric: Metric) -> str | None:
    """The warning that the base batch is undertrained, or None: it is still rising steeply at the end, or
    (accuracy, classes known) below halfway between chance and 100%; not for a language model, whose
    next-token accuracy is bounded by the text's own entropy far below 100%."""
    why = []
    gains = [g for g in (late_gain(job.result.history, metric, chance) for job in base) if g is not None]
    gain = statistics.mean(gains) if gains else None
    if gain is not None and gain > RISING * tolerance:
        why.append(f"it gained {metric.units(round(gain, metric.decimals))} over the last {100 * LATE:g}% of its "
                   f"training (still rising: more than {RISING:g} x the {metric.units(tolerance)} tolerance)")
    if chance is not None and value < (chance + 1) / 2 and not any(job.result.token for job in base):
        why.append(f"it ended below halfway between chance ({100 * chance:.2f}%) and 100% "
                   f"({50 * (chance + 1):.2f}%)")
    if not why:
        return None
    epochs = next((job.result.config.get("trainer", {}).get("epochs") for job in base
                   if isinstance(job.result.config.get("trainer", {}).get("epochs"), (int, float))), None)
    longer = f"trainer.epochs={2 * epochs:g}, now {epochs:g}" if epochs else "more trainer.epochs"
    return (f"**Warning: {UNDERTRAINED}**: {what} reached {reached}: {', and '.join(why)}. The answer "
            f"compares larger batches with an unfinished base: train longer ({longer}, for every job) before "
            "trusting it.")


def late_gain(history: list[EvalPoint], metric: Metric, chance: float | None = None) -> float | None:
    """How many units (points, nats) a run improved over the last LATE of the samples it saw: its final value
    against its value (interpolated) at 1 - LATE of them. Before its first evaluation a run starts at chance
    (accuracy, classes known; else the metric's start); None where that is not known, or it has no history."""
    points = [(p.samples_seen, getattr(p, metric.name)) for p in history
              if math.isfinite(getattr(p, metric.name))]
    if not points or points[-1][0] <= 0:
        return None
    start = chance if chance is not None else metric.start
    if start is not None:
        points.insert(0, (0, start))
    at = (1 - LATE) * points[-1][0]
    later = next((i for i, (samples, _) in enumerate(points) if samples >= at), None)
    if not later:  # no point before the last quarter to measure from
        return None
    (s0, v0), (s1, v1) = points[later - 1], points[later]
    then = v1 if s1 == s0 else v0 + (v1 - v0) * (at - s0) / (s1 - s0)
    return metric.gap(then, points[-1][1])


def chance_level(base: list[Job]) -> float | None:
    """1 / classes of the base batch's data (result.json's config), None where the config does not say."""
    for job in base:
        classes = num_classes(job.result.config)
        if classes:
            return 1 / classes
    return None


def num_classes(config: dict[str, Any]) -> int | None:
    """The classes of a run's data: its config's data.num_classes, else what the data builder says without
    loading the data; None where neither knows (an image folder, a config without data)."""
    data = config.get("data")
    if not isinstance(data, dict):
        return None
    given = data.get("num_classes")
    if isinstance(given, int) and given > 1:
        return given
    try:
        classes = data_shape(target_of(data, "data")).num_classes
    except Exception:  # noqa: BLE001  (whatever the builder raises: the chance level is then not known)
        return None
    return classes if isinstance(classes, int) and classes > 1 else None


# -- a cell: what a job is, as far as its overrides and result.json say ---------------------------------------------
def missing_cell(job: StudyJob, finished: list[Job], shared: set[str] | frozenset = frozenset()) -> dict[str, Any]:
    """A missing job: its folder, its overrides (`swept`: those not `shared` by every job of the study), and its
    recipe, world size, global batch and seed where its overrides say them, or where every finished job agrees
    (a setting the study does not sweep)."""
    said = dict(o.lstrip("+~").split("=", 1) for o in job.overrides if "=" in o)
    readable = [j.result for j in finished if j.readable]

    def agreed(attribute: str) -> Any:
        values = {getattr(r, attribute) for r in readable}
        return values.pop() if len(values) == 1 else None

    world = integer(said.get("dist.world_size")) or agreed("world_size")
    per_worker = integer(said.get("trainer.per_worker_batch")) or agreed("per_worker_batch")
    tensor = said.get("dist.tensor_parallel", "1")
    batch = integer(said.get("trainer.global_batch")) or (
        per_worker * world // int(tensor) if per_worker and world and tensor.isdigit() else None)
    seed = integer(said.get("trainer.seed"))
    return {"job_dir": job.dir, "recipe": said.get("recipe") or agreed("recipe"), "world_size": world,
            "global_batch": batch, "seed": agreed("seed") if seed is None else seed,
            "overrides": list(job.overrides), "swept": [o for o in job.overrides if o not in shared],
            "state": MISSING}


def failed_cell(job: Job, expected: list[StudyJob], finished: list[Job]) -> dict[str, Any]:
    """A failed job: what its result.json says it was (a damaged one: what the study's record says) and why."""
    r = job.result
    if job.readable:
        return {"job_dir": job.job_dir, "recipe": r.recipe, "world_size": r.world_size,
                "global_batch": r.global_batch or None, "seed": r.seed, "overrides": list(r.overrides),
                "state": "failed", "error": r.error}
    listed = next((j for j in expected if j.dir == job.job_dir), None)
    cell = missing_cell(listed, finished) if listed else {"job_dir": job.job_dir, "recipe": None, "world_size": None,
                                                          "global_batch": None, "seed": None, "overrides": []}
    cell.pop("swept", None)
    return {**cell, "state": "failed", "error": r.error}


def integer(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
