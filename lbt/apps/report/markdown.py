"""report.md: whether it can answer (missing and failed jobs, an undertrained base batch), what the splits and
the target mean, the critical batch, one table per recipe, the data x tensor parallel points, and last the
answer to "how many GPUs?".

Every column is named after the split it was measured on; a row evaluated on another split than the
study's leaves the split-named cells empty rather than put a test number under a val heading. Accuracy
is in percent everywhere (tables, sentences, plots); a loss in nats, and a character-level language
model's also in bits per char, as its runs print it.
"""

from __future__ import annotations

import math
from typing import Any

from lbt.apps.report.answer import answer_lines
from lbt.apps.report.critical import B_SIMPLE_CAVEAT, FIT_CAVEAT
from lbt.apps.report.hybrid import hybrid_lines
from lbt.apps.report.rows import GNS_WINDOW, Row, char_level, shown, study_split
from lbt.apps.report.trust import Trust
from lbt.apps.tables import cell_text, table
from lbt.metrics.critical import b_simple_undefined
from lbt.spec.objective import ACC, Metric

CONTINUE = ("Run the same `lbt study` command again: it continues the study in this folder (finished jobs are kept "
            "as they are, stopped ones resume from their checkpoints, missing and failed ones run), then reports.")
CONTINUE_SWEEP = ("Run the missing and failed jobs (the same `lbt train -m` command with trainer.resume=auto continues "
                  "the sweep), then `lbt report` this folder again.")


def fmt(value: float | None, spec: str = ".4f", std: float | None = None) -> str:
    """A table cell: `-` for a number not measured (None or NaN), else the value and any nonzero spread."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    text = format(value, spec)
    return text + (f" ± {format(std, spec)}" if std else "")


def percent(value: float | None, std: float | None = None) -> str:
    """An accuracy cell in percent, as every accuracy of the report: `92.00 ± 2.83`."""
    return fmt(None if value is None else 100 * value, ".2f", None if std is None or math.isnan(std) else 100 * std)


def markdown(rows: list[Row], target: float | None, crit: dict[str, Any],
             answer: dict[str, Any] | None = None, metric: Metric = ACC, hybrid: list[dict[str, Any]] | tuple = (),
             hybrid_cap_given: bool = False, trust: Trust | None = None, probe: list[str] | tuple = ()) -> str:
    """The whole report.md."""
    split, trust = study_split(rows), trust or Trust()
    text = char_level(rows)  # a language model's: its losses also read in bits per char
    lines = ["# lbt study report", "", *top_lines(crit, metric, trust, text), ""]
    lines += [*preamble_lines(split, target, metric, text), *job_state_lines(trust)]
    lines += ["", "## Diagnostics: other estimates of the critical batch", ""] + critical_lines(crit, trust)
    # The loss columns for a loss-judged study or a language model, whose loss reads as bits per char.
    losses = metric.name == "loss" or bool(text)
    for recipe in sorted({r.recipe for r in rows}):
        lines += recipe_table(sorted((r for r in rows if r.recipe == recipe), key=lambda r: r.global_batch),
                              split, metric, losses, text)
    # The answer is the report's last section; the hybrid (past the answer's batches) comes just before it.
    lines += hybrid_lines(list(hybrid), split, metric, hybrid_cap_given)
    if answer is not None:
        lines += answer_lines(answer, trust.headlines)
    return "\n".join([*lines, *probe]) + "\n"


def top_lines(crit: dict[str, Any], metric: Metric, trust: Trust, text: str | None) -> list[str]:
    """The report's first statement: the critical batch, or why there is no answer (and how to get one), then
    any warning on the data the answer comes from."""
    if trust.withheld:
        first = (f"**No answer: {trust.withheld}.** The critical batch and \"how many GPUs?\" are withheld; the "
                 "tables below hold what the finished jobs measured.")
        if not trust.complete:
            first += " " + (CONTINUE if trust.recorded else CONTINUE_SWEEP)
        return [first]
    return [lead_line(crit, metric, text), *("\n" + w for w in trust.warnings)]


def job_state_lines(trust: Trust) -> list[str]:
    """The study's missing and failed jobs, each with what it was (recipe, world size, global batch, seed) and,
    for a missing one, its overrides that differ between the study's jobs (summary.json holds them all)."""
    lines: list[str] = []
    for title, cells, last in (("Missing jobs", trust.missing, "overrides"), ("Failed jobs", trust.failed, "error")):
        if not cells:
            continue
        rows = ([f"`{c['job_dir']}`", c["recipe"] or "?", fmt(c["world_size"], ","), fmt(c["global_batch"], ","),
                 fmt(c["seed"], "d"), f"`{' '.join(c['swept'])}`" if last == "overrides" else cell_text(c["error"])]
                for c in cells)
        lines += ["", f"## {title}", "",
                  *table(["job folder", "recipe", "world size", "global batch", "seed", last], "llrrrl", rows)]
    return lines


def preamble_lines(split: str, target: float | None, metric: Metric, text: str | None = None) -> list[str]:
    """What the splits are, what steps to target and the gap measure, and the units."""
    if split == "val":
        splits = ("Splits: **val** is held out of the training set and is what the runs select on (best "
                  "accuracy, steps to target); **test** is scored once per run, at the end.")
    else:
        splits = ("Splits: **no validation split** (data.val_fraction=0): the runs evaluated the **test** split "
                  "during training, so every number below is a test number and says so. Hold out a validation "
                  "split to select on val.")
    target_text = shown(metric, target, text) if target is not None else "-"
    units = ("Units: accuracy in percent; losses in nats (natural log, what the runs minimize)"
             + (f"; a language model's loss also in bits per {text} (nats / ln 2, as its runs print "
                f"it: the bits/{text} columns)." if text else "."))
    return [splits,
            f"Steps to target: interpolated step at which {split} {metric.label} first reached {target_text} (the "
            f"base batch's final {split} {metric.label}, {metric.units(metric.target_margin)} worse, unless "
            f"--target is given). Gap: test {metric.label} minus the baseline's at the smallest global batch, in "
            f"{metric.unit}s.", units]


def lead_line(crit: dict[str, Any], metric: Metric, text: str | None = None) -> str:
    """The report's one critical-batch figure: how it was measured, and how sure it is (the bracket
    between the last batch that held and the first that did not, and the seeds' spread)."""
    def show(value: float) -> str:
        return shown(metric, value, text)

    def units(amount: float) -> str:
        return metric.units(round(amount, metric.decimals))

    how = (f"the largest global batch whose mean final {crit['split']} {metric.label} stays within "
           f"{metric.units(crit['tolerance'])} of the base batch's, from {crit['runs']} runs")
    if not crit["value"]:
        return f"**Critical batch: not measured**: no run finished (the report measures it as {how})."
    base, value, failed = crit["base"], crit["value"], crit["failed"]
    seeds = (f"mean of {crit['seeds']} seeds ± {units(crit['held_std'] / metric.unit_size)}" if crit["seeds"] > 1
             else "1 seed")
    def than_base(amount: float) -> str:  # a held batch may do better than the base: never "-0.17 points worse"
        return f"{units(-amount)} better" if round(amount, metric.decimals) < 0 else f"{units(amount)} worse"

    held = (f"At {value:,}, {crit['recipe']} reached {show(crit['held_value'])} ({seeds}; "
            f"{than_base(crit['held_by'])} than the base)")
    if failed and crit["failed_value"] is not None:
        bracket = (f"the next batch tried, {failed:,}, was {than_base(crit['failed_by'])} "
                   f"({show(crit['failed_value'])}): the critical batch lies between {value:,} and {failed:,}")
    elif failed:
        bracket = (f"the next batch tried, {failed:,}, diverged or failed: the critical batch lies between {value:,} "
                   f"and {failed:,}")
    else:
        bracket = f"no larger batch was tried: the critical batch is at least {value:,}"
    return (f"**Critical batch: {value:,}** (global batch, {crit['recipe']}; measured: {how}; base: "
            f"{base['recipe']} at {base['global_batch']:,}, {show(base[metric.name])}). {held}; {bracket}.")


def critical_lines(crit: dict[str, Any], trust: Trust | None = None) -> list[str]:
    """The critical batch from steps to target and from the gradient noise scale, or why each is missing,
    each with why it can differ from the figure the report leads with."""
    lines = ["These measure other things than the figure above and can disagree with it by orders of magnitude; "
             "they are not the answer."
             + (" The study gives no answer (see the top): these are what its finished jobs measured." if trust and
                trust.withheld else ""), ""]
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


def recipe_table(rows: list[Row], split: str, metric: Metric, losses: bool, text: str | None) -> list[str]:
    """One recipe's section: a row per global batch (`losses`: loss columns; `text`: bits per that token)."""
    header = ([f"final {split} acc (%)", f"best {split} acc (%)", "test acc (%)"]
              + [f"final {split} loss (nats)", f"best {split} loss (nats)", "test loss (nats)"] * losses
              + [f"{split} bits/{text}", "test bits/{text}"] * bool(text)
              + [f"gap ({metric.unit}s)", "steps", f"steps to target ({split} {metric.name})",
                 f"B_simple (last {100 * GNS_WINDOW:g}%)", "samples/s", "allreduces", "MB sent per worker"])
    return ["", f"## {rows[0].recipe}", "",
            *table(["global batch", "world size", "seeds", *header, "diverged"], "rrr" + "r" * len(header) + "l",
                   (row_cells(r, split, metric, losses, text) for r in rows))]


def row_cells(r: Row, split: str, metric: Metric, losses: bool, text: str | None) -> list[str]:
    """The cells of one row of a recipe's table, in its header's order."""
    mine = r.split == split  # a row evaluated on another split leaves the split-named columns empty
    cells = [f"{r.global_batch:,}", str(r.world_size), str(r.seeds),
             percent(r.final_acc if mine else None, r.final_acc_std), percent(r.best_acc if mine else None),
             percent(r.test_acc, r.test_acc_std)]
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
