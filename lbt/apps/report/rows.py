"""The study's table: jobs that share series and global batch (several seeds) averaged into one Row.

A Row holds the mean and standard deviation over seeds of the final and best numbers on the split the
runs evaluated during training, the test numbers scored once at the end, steps to the target, the
gradient noise scale and the communication paid. `default_target` picks the target when none is given,
and the gap column compares each row's test value with the smallest-batch baseline's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from lbt.apps.judging import target_from
from lbt.apps.report.jobs import Job, is_baseline
from lbt.metrics.critical import b_simple_undefined, crossing_step, gns_summary, run_optimizer
from lbt.metrics.spread import mean_std
from lbt.spec.objective import ACC, Metric, bits
from lbt.techniques.gns import B_SIMPLE

GNS_WINDOW = 0.2  # B_simple is summarised over this last fraction of training


@dataclass
class Row:
    """One (recipe, global batch) point of a study, averaged over seeds."""

    recipe: str
    global_batch: int
    world_size: int
    seeds: int
    split: str  # the split the runs evaluated during training: "val", or "test" without a validation split
    final_acc: float  # on `split`
    final_acc_std: float
    best_acc: float
    test_acc: float | None  # scored once per run, at the end
    test_acc_std: float | None
    gap: float | None  # the report metric on test minus the smallest-batch baseline's, in its units
    steps: float
    steps_to_target: float | None  # interpolated crossing on `split`, mean over seeds
    steps_to_target_std: float | None
    samples_per_sec: float
    diverged: int
    errors: int
    b_simple: float | None  # gradient noise scale over the last GNS_WINDOW of training, median over seeds;
    # None where it was not measured or is not defined for `optimizer` (b_simple_undefined)
    jobs: list[str] = field(default_factory=list)
    final_loss: float = math.nan  # on `split`
    final_loss_std: float = math.nan
    best_loss: float = math.nan
    test_loss: float | None = None
    test_loss_std: float | None = None
    bits_per_char: float | None = None  # a language model's final loss on `split` in bits per `token`
    test_bits_per_char: float | None = None
    token: str | None = None  # a language model's label: "char" (data=text) or "token" (data=tokens)
    # Model-sized allreduces per run and the bytes each worker sent (mean over seeds): accuracy against communication.
    allreduces: float | None = None
    bytes_sent: float | None = None
    optimizer: str | None = None  # the class that stepped the runs (`SGD`, `LARS`); None if result.json does not say

    def final(self, metric: Metric) -> float:
        """The final value of `metric` on `split` (mean over seeds): final_acc or final_loss."""
        return getattr(self, f"final_{metric.name}")

    def final_std(self, metric: Metric) -> float:
        return getattr(self, f"final_{metric.name}_std")

    def test(self, metric: Metric) -> float | None:
        return getattr(self, f"test_{metric.name}")

    def test_std(self, metric: Metric) -> float | None:
        return getattr(self, f"test_{metric.name}_std")


def mean_std_or_none(values: Sequence[float | None]) -> tuple[float | None, float | None]:
    """mean_std of the values that were measured at all; (None, None) when none was (a test never scored)."""
    measured = [v for v in values if v is not None]
    return mean_std(measured) if measured else (None, None)


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def shown(metric: Metric, value: float | None, char: str | bool | None = None) -> str:
    """A value in a sentence, with its unit: `97.20%` (accuracy, in percent everywhere in the report), `2.0000
    nats` (loss), `2.0000 nats = 2.8854 bits/char` (a language model's loss, `char` its token: "char" or
    "token" (True, from older summaries: "char"); its runs print bits per token)."""
    text = metric.show(value)
    if metric.name != "loss" or text == "-":
        return text + metric.suffix * (text != "-")
    unit = char if isinstance(char, str) else "char"
    return f"{text} nats" + (f" = {bits(value):.4f} bits/{unit}" if char and value is not None else "")


def char_level(rows: list[Row]) -> str | None:
    """A language model's token ("char": data=text, "token": data=tokens), whose losses also read in bits per
    token; None for a study of classifiers."""
    return next((r.token or "char" for r in rows if r.bits_per_char is not None), None)


def study_split(rows: list[Row]) -> str:
    """The split a study selects on: val when any of its runs held one out, else test."""
    return "val" if any(r.split == "val" for r in rows) else "test"


def default_target(jobs: list[Job], metric: Metric = ACC) -> float | None:
    """The base batch's final value of `metric` (the baseline's, mean over seeds), made worse by the
    metric's target margin (accuracy: minus 1 point)."""
    trained = [job for job in jobs if job.result.trained]
    if not trained:
        return None
    smallest = min(job.result.global_batch for job in trained)
    at_smallest = [job for job in trained if job.result.global_batch == smallest]
    baseline = [job for job in at_smallest if job.result.recipe == "baseline"] or at_smallest
    value, _ = mean_std([job.final(metric) for job in baseline])
    return target_from(value, metric)


def one_per_seed(jobs: list[Job]) -> list[Job]:
    """The jobs that are samples of a (recipe, batch) point: a DP x T run repeats the data-parallel run of
    its seed (tensor parallelism is exact), so where that run finished it is not another sample."""
    finished = {job.result.seed for job in jobs if job.result.tensor_parallel == 1 and not job.result.failed}
    return [job for job in jobs if job.result.tensor_parallel == 1 or job.result.seed not in finished]


def aggregate(jobs: list[Job], target: float | None, metric: Metric = ACC) -> list[Row]:
    """One Row per (series, global batch), sorted; each row's gap is its test value minus the reference's."""
    groups: dict[tuple[str, int], list[Job]] = {}
    for job in jobs:
        if job.readable:  # a damaged result.json has no batch to place it at: it is only listed as failed
            groups.setdefault((job.series, job.result.global_batch), []).append(job)
    rows = [group_row(series, batch, every, target, metric) for (series, batch), every in sorted(groups.items())]
    reference = reference_value(rows, metric)
    for row in rows:
        test = row.test(metric)
        if reference is not None and test is not None:
            row.gap = (test - reference) / metric.unit_size
    return rows


def group_row(series: str, global_batch: int, every: list[Job], target: float | None, metric: Metric) -> Row:
    """The Row of the jobs at one (series, global batch): means over the seeds that trained."""
    members = one_per_seed(every)
    ok = [job for job in members if not job.result.failed]
    trained = [job for job in ok if not job.result.diverged]
    final_acc, final_acc_std = mean_std([job.result.final_acc for job in trained])
    final_loss, final_loss_std = mean_std([job.result.final_loss for job in trained])
    test_acc, test_acc_std = mean_std_or_none([job.result.test_acc for job in trained])
    test_loss, test_loss_std = mean_std_or_none([job.result.test_loss for job in trained])
    steps_to_target, steps_to_target_std = mean_steps_to_target(trained, target, metric)
    b_simple = [b for b in (late_b_simple(job) for job in ok) if b is not None]
    return Row(
        recipe=series, global_batch=global_batch, world_size=members[0].data_parallel, seeds=len(members),
        split=members[0].result.eval_split, final_acc=final_acc, final_acc_std=final_acc_std,
        best_acc=mean_std([job.result.best_acc for job in trained])[0],
        test_acc=test_acc, test_acc_std=test_acc_std, gap=None,
        steps=mean_std([job.result.steps for job in ok])[0],
        steps_to_target=steps_to_target, steps_to_target_std=steps_to_target_std,
        samples_per_sec=mean_std([job.result.samples_per_sec for job in ok])[0],
        diverged=sum(job.result.diverged for job in ok), errors=len(members) - len(ok),
        b_simple=statistics.median(b_simple) if b_simple else None,
        jobs=[job.job_dir for job in every],
        final_loss=final_loss, final_loss_std=final_loss_std,
        best_loss=mean_std([job.result.best_loss for job in trained])[0],
        test_loss=test_loss, test_loss_std=test_loss_std,
        bits_per_char=finite_or_none(mean_std([job.bits_per_char(job.result.final_loss) for job in trained])[0]),
        test_bits_per_char=mean_std_or_none([job.bits_per_char(job.result.test_loss) for job in trained])[0],
        allreduces=mean_std([job.result.allreduces for job in ok])[0] if ok else None,
        bytes_sent=mean_std([job.result.bytes_sent for job in ok])[0] if ok else None,
        optimizer=run_optimizer(members[0].result.config),
        token=members[0].result.token,  # a series is one optimizer (optim= is swept apart)
    )


def late_b_simple(job: Job) -> float | None:
    """A job's gradient noise scale over the last GNS_WINDOW of training; None if it did not measure it, or
    if its optimizer's step is not the one B_simple is defined for (plain SGD's)."""
    if b_simple_undefined(run_optimizer(job.result.config)):
        return None
    curve = job.result.technique_curves.get(B_SIMPLE, [])
    return gns_summary([(samples, value) for samples, value in curve], GNS_WINDOW)


def mean_steps_to_target(trained: list[Job], target: float | None, metric: Metric) -> tuple[float | None, float | None]:
    """Mean and std over seeds of the interpolated steps to `target`; None unless every trained seed reached it
    (a mean over the seeds that got there would flatter the batch)."""
    if target is None or not trained:
        return None, None
    reached = [crossing_step(job.result.history, target, metric=metric) for job in trained]
    if any(step is None for step in reached):
        return None, None
    return mean_std(reached)


def reference_value(rows: list[Row], metric: Metric) -> float | None:
    """The test value of the baseline at the smallest global batch (any recipe there if no baseline)."""
    candidates = [r for r in rows if r.test(metric) is not None]
    if not candidates:
        return None
    smallest = min(r.global_batch for r in candidates)
    at_smallest = [r for r in candidates if r.global_batch == smallest]
    return ([r for r in at_smallest if is_baseline(r.recipe)] or at_smallest)[0].test(metric)
