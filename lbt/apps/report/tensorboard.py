"""tb_summary/: the study as one TensorBoard run, so `tensorboard --logdir STUDY/tb_summary` draws it.

Scalars use the global batch as their step (`study/<recipe>/val_acc`, `.../test_acc`, the losses and
steps to target), so TensorBoard's line is the metric against the batch; the HParams tab holds one
row per finished job, named after what it ran (`lars_W64_B4096_seed1`, `run_names`). Tags are named after
the split their numbers come from.
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

from lbt.apps.report.jobs import Job
from lbt.apps.report.rows import Row


def write_tensorboard(rows: list[Row], jobs: list[Job], path: Path) -> None:
    """Scalars with the global batch as step and an HParams row per job, replacing any earlier summary."""
    shutil.rmtree(path, ignore_errors=True)  # a second report replaces the first, not adds to it
    writer = SummaryWriter(str(path))
    for row in sorted(rows, key=lambda r: r.global_batch):
        write_row_scalars(writer, row)
    finished = [job for job in jobs if not job.result.failed]
    for job, name in zip(finished, run_names(finished)):
        write_job_hparams(writer, job, name)
    writer.close()


def run_name(job: Job) -> str:
    """A job's TensorBoard run: its series (recipe, and any other swept setting), world size, global batch and
    seed (`lars_W64_B4096_seed1`; `_T2` under tensor parallelism), in characters any file system takes."""
    r = job.result
    series = re.sub(r"[^\w.=+-]+", "_", job.series).strip("_") or "run"
    tensor = f"_T{r.tensor_parallel}" if r.tensor_parallel > 1 else ""
    return f"{series}_W{r.world_size}{tensor}_B{r.global_batch}_seed{r.seed or 0}"


def run_names(jobs: list[Job]) -> list[str]:
    """Each job's run_name; a name two jobs would share gets each job's folder after it."""
    names = [run_name(job) for job in jobs]
    return [name if names.count(name) == 1 else name + "_" + re.sub(r"[^\w.-]+", "_", job.job_dir)
            for name, job in zip(names, jobs)]


def write_row_scalars(writer: Any, row: Row) -> None:
    """One row's numbers at step = its global batch; a val tag only for numbers measured on val."""
    tag = f"study/{row.recipe}"
    if math.isfinite(row.final_acc) and row.split == "val":
        writer.add_scalar(f"{tag}/val_acc", row.final_acc, row.global_batch)
    if row.test_acc is not None:
        writer.add_scalar(f"{tag}/test_acc", row.test_acc, row.global_batch)
    if math.isfinite(row.final_loss) and row.split == "val":
        writer.add_scalar(f"{tag}/val_loss", row.final_loss, row.global_batch)
    if row.test_loss is not None:
        writer.add_scalar(f"{tag}/test_loss", row.test_loss, row.global_batch)
    if row.steps_to_target:
        writer.add_scalar(f"{tag}/steps_to_target_{row.split}", row.steps_to_target, row.global_batch)


def write_job_hparams(writer: Any, job: Job, name: str) -> None:
    """A finished job's layout and LR beside its final numbers, named after the split they were measured on."""
    result, split = job.result, job.result.eval_split
    hparams = {"recipe": result.recipe, "world_size": result.world_size, "global_batch": result.global_batch,
               "per_worker_batch": result.per_worker_batch, "seed": result.seed or 0,
               "lr": result.base_lr if math.isfinite(result.base_lr) else 0.0}
    metrics = {f"hparam/final_{split}_acc": result.final_acc, f"hparam/best_{split}_acc": result.best_acc,
               "hparam/diverged": float(result.diverged)}
    if result.test_acc is not None:
        metrics["hparam/test_acc"] = result.test_acc
    writer.add_hparams(hparams, metrics, run_name=name)
