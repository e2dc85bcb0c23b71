"""report.md: what the splits and the target mean, the critical batch, one table per recipe, the failed
jobs, the data x tensor parallel points, and last the answer to "how many GPUs?".

Every column is named after the split it was measured on; a row evaluated on another split than the
study's leaves the split-named cells empty rather than put a test number under a val heading.
"""

from __future__ import annotations

import math
from typing import Any

from lbt.apps.report.answer import answer_lines
from lbt.apps.report.critical import B_SIMPLE_CAVEAT, FIT_CAVEAT
from lbt.apps.report.hybrid import hybrid_lines
from lbt.apps.report.jobs import Job
from lbt.apps.report.rows import GNS_WINDOW, Row, study_split
from lbt.metrics.critical import b_simple_undefined
from lbt.spec.objective import ACC, Metric


def fmt(value: float | None, spec: str = ".4f", std: float | None = None) -> str:
    """A table cell: `-` for a number not measured (None or NaN), else the value and any nonzero spread."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    text = format(value, spec)
    return text + (f" ± {format(std, spec)}" if std else "")


def markdown(rows: list[Row], target: float | None, crit: dict[str, Any], jobs: list[Job],
             answer: dict[str, Any] | None = None, metric: Metric = ACC, hybrid: list[dict[str, Any]] | tuple = (),
             hybrid_cap_given: bool = False) -> str:
    """The whole report.md."""
    split = study_split(rows)
    lines = ["# lbt study report", "", lead_line(crit, metric), ""] + preamble_lines(split, target, metric)
    lines += ["", "## Diagnostics: other estimates of the critical batch", ""] + critical_lines(crit)
    # The loss columns for a loss-judged study or a language model, whose loss reads as bits per char.
    text = any(r.bits_per_char is not None for r in rows)
    losses = metric.name == "loss" or text
    for recipe in sorted({r.recipe for r in rows}):
        lines += recipe_table(sorted((r for r in rows if r.recipe == recipe), key=lambda r: r.global_batch),
                              split, metric, losses, text)
    failed = [job for job in jobs if job.result.failed]
    if failed:
        lines += ["", "## Failed jobs", ""]
        lines += [f"- `{job.job_dir}` ({job.series}): {job.result.error}" for job in failed]
    # The answer is the report's last section; the hybrid (past the answer's batches) comes just before it.
    lines += hybrid_lines(list(hybrid), split, metric, hybrid_cap_given)
    if answer is not None:
        lines += answer_lines(answer)
    return "\n".join(lines) + "\n"


def preamble_lines(split: str, target: float | None, metric: Metric) -> list[str]:
    """What the splits are, and what steps to target and the gap measure."""
    if split == "val":
        splits = ("Splits: **val** is held out of the training set and is what the runs select on (best "
                  "accuracy, steps to target); **test** is scored once per run, at the end.")
    else:
        splits = ("Splits: **no validation split** (data.val_fraction=0): the runs evaluated the **test** split "
                  "during training, so every number below is a test number and says so. Hold out a validation "
                  "split to select on val.")
    target_text = f"{metric.show(target)}{metric.suffix}" if target is not None else "-"
    return [splits,
            f"Steps to target: interpolated step at which {split} {metric.label} first reached {target_text} (the "
            f"base batch's final {split} {metric.label}, {metric.units(metric.target_margin)} worse, unless "
            f"--target is given). Gap: test {metric.label} minus the baseline's at the smallest global batch, in "
            f"{metric.unit}s."]


def lead_line(crit: dict[str, Any], metric: Metric) -> str:
    """The report's one critical-batch figure: how it was measured, and how sure it is (the bracket
    between the last batch that held and the first that did not, and the seeds' spread)."""
    def shown(value: float) -> str:
        return f"{metric.show(value)}{metric.suffix}"

    def units(amount: float) -> str:
        return metric.units(round(amount, metric.decimals))

    how = (f"the largest global batch whose mean final {crit['split']} {metric.label} stays within "
           f"{metric.units(crit['tolerance'])} of the base batch's, from {crit['runs']} runs")
    if not crit["value"]:
        return f"**Critical batch: not measured**: no run finished (the report measures it as {how})."
    base, value, failed = crit["base"], crit["value"], crit["failed"]
    seeds = (f"mean of {crit['seeds']} seeds ± {units(crit['held_std'] / metric.unit_size)}" if crit["seeds"] > 1
             else "1 seed")
    held = (f"At {value:,}, {crit['recipe']} reached {shown(crit['held_value'])} ({seeds}; "
            f"{units(crit['held_by'])} worse than the base)")
    if failed and crit["failed_value"] is not None:
        bracket = (f"the next batch tried, {failed:,}, was {units(crit['failed_by'])} worse "
                   f"({shown(crit['failed_value'])}): the critical batch lies between {value:,} and {failed:,}")
    elif failed:
        bracket = (f"the next batch tried, {failed:,}, diverged or failed: the critical batch lies between {value:,} "
                   f"and {failed:,}")
    else:
        bracket = f"no larger batch was tried: the critical batch is at least {value:,}"
    return (f"**Critical batch: {value:,}** (global batch, {crit['recipe']}; measured: {how}; base: "
            f"{base['recipe']} at {base['global_batch']:,}, {shown(base[metric.name])}). {held}; {bracket}.")


def critical_lines(crit: dict[str, Any]) -> list[str]:
    """The critical batch from steps to target and from the gradient noise scale, or why each is missing,
    each with why it can differ from the figure the report leads with."""
    lines = ["These measure other things than the figure above and can disagree with it by orders of magnitude; "
             "they are not the answer.", ""]
    if crit["fit"]:
        low, high = crit["fit_interval"]
        lines.append(f"- From steps to target ({crit['series']}, {crit['fit_points']} runs, S = S_min (1 + B_noise/B), "
                     f"McCandlish et al. 2018): {crit['fit']:,.0f} (90% bootstrap interval {low:,.0f} - "
                     f"{high:,.0f}; S_min {crit['s_min']:,.1f} steps, E_min {crit['e_min']:,.0f} samples). "
                     f"{FIT_CAVEAT}")
    else:
        lines.append(f"- From steps to target ({crit['series']}): not measured: {crit['fit_error']}")
    if crit["gns"]:
        lines.append(f"- From the gradient noise scale B_simple ({crit['gns_series']}, median over runs of its median "
                     f"over the last {100 * GNS_WINDOW:g}% of training): {crit['gns']:,.0f}. {B_SIMPLE_CAVEAT}")
    else:
        lines.append(f"- From the gradient noise scale B_simple ({crit['gns_series']}): {crit['gns_note']}")
    if crit["ratio"]:
        lines.append(f"- Ratio fit / gns: {crit['ratio']:.2f}")
    return lines


def recipe_table(rows: list[Row], split: str, metric: Metric, losses: bool, text: bool) -> list[str]:
    """One recipe's section: a row per global batch (`losses`: loss columns; `text`: bits per char)."""
    header = ([f"final {split} acc", f"best {split} acc", "test acc"]
              + [f"final {split} loss", f"best {split} loss", "test loss"] * losses
              + [f"{split} bits/char", "test bits/char"] * text
              + [f"gap ({metric.unit}s)", "steps", f"steps to target ({split} {metric.name})",
                 f"B_simple (last {100 * GNS_WINDOW:g}%)", "samples/s", "allreduces", "MB sent per worker"])
    return ["", f"## {rows[0].recipe}", "",
            "| global batch | world size | seeds | " + " | ".join(header) + " | diverged |",
            "|---:|---:|---:|" + "---:|" * len(header) + "---|",
            *("| " + " | ".join(row_cells(r, split, metric, losses, text)) + " |" for r in rows)]


def row_cells(r: Row, split: str, metric: Metric, losses: bool, text: bool) -> list[str]:
    """The cells of one row of a recipe's table, in its header's order."""
    mine = r.split == split  # a row evaluated on another split leaves the split-named columns empty
    cells = [f"{r.global_batch:,}", str(r.world_size), str(r.seeds),
             fmt(r.final_acc if mine else None, ".4f", r.final_acc_std), fmt(r.best_acc if mine else None),
             fmt(r.test_acc, ".4f", r.test_acc_std)]
    if losses:
        cells += [fmt(r.final_loss if mine else None, ".4f", r.final_loss_std),
                  fmt(r.best_loss if mine else None), fmt(r.test_loss, ".4f", r.test_loss_std)]
    if text:
        cells += [fmt(r.bits_per_char if mine else None), fmt(r.test_bits_per_char)]
    status = ", ".join([f"diverged {r.diverged}/{r.seeds}"] * bool(r.diverged)
                       + [f"error {r.errors}/{r.seeds}"] * bool(r.errors)) or "no"
    return cells + [fmt(r.gap, metric.gap_spec), fmt(r.steps, ".0f"),
                    fmt(r.steps_to_target if mine else None, ".0f", r.steps_to_target_std),
                    b_simple_cell(r), fmt(r.samples_per_sec, ",.0f"), fmt(r.allreduces, ",.0f"),
                    fmt(None if r.bytes_sent is None else r.bytes_sent / 1e6, ",.1f"), status]


def b_simple_cell(r: Row) -> str:
    """B_simple of a row, or `not defined for LARS` where the optimizer's step is not the raw gradient."""
    return f"not defined for {r.optimizer}" if b_simple_undefined(r.optimizer) else fmt(r.b_simple, ",.0f")
