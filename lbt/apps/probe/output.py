"""The probe folder's outputs: probe.json (every number), probe.md, two figures, TensorBoard scalars."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lbt.apps.judging import tolerance_floor, within
from lbt.apps.plotting import batch_axis, figure, save_figure
from lbt.apps.tables import table
from lbt.apps.words import gpus
from lbt.metrics.tensorboard import RunLogger
from lbt.paths import atomic_write
from lbt.spec.objective import Metric, metric_named


def plain(value: Any) -> Any:
    """JSON's numbers: a non-finite float (an unmeasured floor, a diverged branch's loss) is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def write_outputs(folder: Path, probe: dict[str, Any]) -> None:
    atomic_write(folder / "probe.json", lambda f: f.write(json.dumps(plain(probe), indent=1).encode()))
    plot_over_training(folder / "critical_batch_over_training.png", probe)
    plot_branches(folder / "branches.png", probe)
    log_tensorboard(folder / "tb", probe)
    atomic_write(folder / "probe.md", lambda f: f.write(markdown(probe).encode()))


def plot_over_training(path: Path, probe: dict[str, Any]) -> None:
    """Local critical batch vs samples seen: the batch that held, a bar up to the first that failed
    (an arrow where nothing failed), hollow where not resolved; the fitted noise scale beside it."""
    fig, ax = figure()
    for point in probe["checkpoints"]:
        verdict, at = point["local_critical"], point["samples"]
        top = verdict["failed"] or verdict["held"] * 2
        ax.plot([at, at], [verdict["held"], top], color="C0", lw=3, alpha=0.35)
        ax.plot([at], [verdict["held"]], "o", color="C0", mfc="C0" if verdict["resolved"] else "white",
                label="local critical batch (held; bar: to the first that failed)" if at == probe["checkpoints"][0]
                ["samples"] else None)
        ax.plot([at], [point["noise_scale"]], "s", color="C1", ms=4,
                label="B_noise fitted to the branches" if at == probe["checkpoints"][0]["samples"] else None)
        ax.plot([at], [point["answer_alone"]], "^", color="C2", ms=5,
                label="largest batch this checkpoint predicts alone" if at == probe["checkpoints"][0]["samples"]
                else None)
    ax.axhline(probe["answer"]["largest_batch"], color="C2", lw=1, ls="--", label="the answer")
    ax.set_xscale("log")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("samples seen by the base run")
    ax.set_ylabel("global batch")
    ax.legend(fontsize=8)
    save_figure(fig, path, f"critical batch over training (hollow: not resolved); answer: "
                           f"{probe['answer']['largest_batch']:,}")


def plot_branches(path: Path, probe: dict[str, Any]) -> None:
    """One panel per checkpoint: each branch's held-out value after its samples against its batch, the
    tolerance band under the k=1 branch, the k=1 seeds' spread (the noise floor)."""
    metric = metric_named(probe["settings"]["metric"], "probe.metric")
    points = probe["checkpoints"]
    fig, axes = figure(len(points), width=3.2 * len(points), height=3.2)
    axes = axes if len(points) > 1 else [axes]
    for ax, point in zip(axes, points):
        branches = [b for b in point["branches"] if b["value"] is not None and math.isfinite(b["value"])]
        ones = [b for b in branches if b["factor"] == 1]
        ax.plot([b["global_batch"] for b in branches], [b["value"] * metric.scale for b in branches], "o", ms=4)
        if ones and point.get("reference") is not None:
            edge = tolerance_floor(point["reference"], probe["settings"]["tolerance"], metric) * metric.scale
            values = [b["value"] * metric.scale for b in branches]
            beyond = max(values) if metric.higher_is_better else min(values)
            ax.axhspan(min(edge, beyond), max(edge, beyond), color="C2", alpha=0.15)
            ax.axhline(point["reference"] * metric.scale, color="C2", lw=1)
        failed = [b["global_batch"] for b in point["branches"] if b not in branches]
        for batch in failed:
            ax.axvline(batch, color="C3", ls=":", lw=1)
        batch_axis(ax)
        ax.set_title(f"at {point['samples']:,} samples ({point['fraction']:.0%})", fontsize=8)
    axes[0].set_ylabel(f"val {metric.label} after the branch")
    save_figure(fig, path, "branches per checkpoint (green line: k=1 median over seeds; band: within tolerance; "
                           "dotted: diverged)")


def log_tensorboard(folder: Path, probe: dict[str, Any]) -> None:
    logger = RunLogger(folder)
    for point in probe["checkpoints"]:
        at, verdict = point["samples"], point["local_critical"]
        values = {"probe/local_critical_batch": float(verdict["held"]), "probe/noise_scale_fit": point["noise_scale"]}
        for branch in point["branches"]:
            if branch["seed"] == probe["settings"].get("base_seed", branch["seed"]) and branch["loss"] is not None:
                values[f"probe/branch_loss/k{branch['factor']:04d}"] = branch["loss"]
        logger.scalars({k: v for k, v in values.items() if v is not None and math.isfinite(v)}, at, at)
    logger.close()


def shown(value: Any) -> str:
    return f"{value:,.0f}" if isinstance(value, (int, float)) else str(value or "-")


def markdown(probe: dict[str, Any]) -> str:
    answer, base, cost, settings = probe["answer"], probe["base"], probe["cost"], probe["settings"]
    metric = metric_named(settings["metric"], "probe.metric")
    cooled = ", ".join(f"{s:,.0f}: {metric.show(v)}" for s, v in probe["budget_curve"])
    lines = [f"# lbt probe: {answer['sentence']}", "",
             f"Measured by branching: one base run at global batch {base['global_batch']:,} "
             f"({base['world_size']} GPU(s) x {base['per_worker_batch']}), {len(probe['checkpoints'])} snapshots, "
             f"branches at 1x..{settings['max_factor']}x holding the snapshot's LR (scaled to their batch) for "
             f"{settings['delta']:.0%} of the budget, and k=1 cooldowns of {settings['cooldown']:.0%} of each "
             f"snapshot's samples; judged by {metric.label} within {settings['tolerance']:g} {metric.unit}(s).", "",
             f"Cost: {cost['samples']:,} samples in {cost['branches']} branches and the base run = "
             f"{cost['share']:.0%} of the sweep it replaces ({cost['sweep_samples']:,} samples); "
             f"{cost['run_seconds']:.0f} s of runs here (their wall times summed; side by side they take less).", "",
             "## How the answer is read", "",
             "At a fixed budget E, a run at batch B makes the progress the base batch makes with E / r(B) samples "
             "(McCandlish et al. 2018), so it ends where a base-batch run of E / r(B) samples ends: F(E / r(B)). "
             "r(B): the k=1 branch's val loss decrease over the batch-B branch's, from the same start over the same "
             "samples, averaged over the checkpoints by each one's share of training; F: the final value against "
             f"the budget, from the cooldowns and the base run's end ({cooled}). A batch holds when F(E / r(B)) is "
             "within the tolerance of F(E) and none of its branches diverged; the interval is one doubling either "
             "side, as far as the prediction has been from full sweeps (bench/critical.py).", ""]
    rows = []
    for batch, p in probe["prediction"].items():
        shortfall = "diverged" if p["diverged"] else f"{p['shortfall']:.3g}"
        holds = not p["diverged"] and within(p["shortfall"], settings["tolerance"])
        rows.append([f"{int(batch):,}", f"{p['samples_ratio']:.3g}", f"{p['effective_samples']:,.0f}", shortfall,
                     "yes" if holds else "no"])
    lines += table(["global batch", "samples ratio r", "effective samples E / r", "predicted shortfall", "holds"],
                   "rrrrl", rows)
    lines += ["", "## Each checkpoint", "",
              "![critical batch over training](critical_batch_over_training.png)", ""]
    rows = []
    for p in probe["checkpoints"]:
        v, start = p["local_critical"], p["start"] or {}
        floor = "n/a" if p["noise_floor"] is None or not math.isfinite(p["noise_floor"]) else f"{p['noise_floor']:.3g}"
        rows.append([f"{p['samples']:,}", f"{p['fraction']:.1%}", f"{start.get('acc', math.nan):.4f}", floor,
                     f"{p['answer_alone']:,}", f"{v['held']:,}", f"{p['noise_scale']:,.0f}", shown(p.get("b_simple"))])
    lines += table(["samples seen", "of budget", "start val acc", "noise floor", "alone predicts", "local held",
                    "B_noise fit", "B_simple (base run)"], "rrrrrrrl", rows)
    schedule = " -> ".join(f"{s['global_batch']:,} from {s['from_samples']:,}" for s in probe["batch_schedule"])
    low, high = answer["interval"]
    lines += ["", "![branches](branches.png)", "", "## Batch-size schedule", "",
              f"Start at the base batch and double it whenever the local critical batch reaches twice the "
              f"current one: {schedule}. Train with it: `lbt train ... technique=batch_ramp "
              f"technique.batch_ramp.mode=probe technique.batch_ramp.probe=<this folder>/probe.json`.", "",
              f"**Answer (predicted): up to {gpus(answer['gpus'])} (global batch {answer['largest_batch']:,}; interval "
              f"{low:,}..{high:,})** within {settings['tolerance']:g} {metric.unit}(s) of the base batch; a study "
              f"would measure it with a full sweep at {1 / cost['share']:.1f}x this probe's compute "
              "(`probe.confirm=true` measures it around the prediction).", ""]
    return "\n".join(lines + confirm_lines(probe.get("confirm"), metric))


def confirm_lines(confirm: dict[str, Any] | None, metric: Metric) -> list[str]:
    if not confirm:
        return []
    rows = ([f"{row['global_batch']:,}", ", ".join(metric.show(v) for v in row["values"]), metric.show(row["mean"]),
             "yes" if row["holds"] else "no"] for row in confirm["runs"])
    return ["## Confirmed by full runs", "", confirm["sentence"], "",
            *table(["global batch", "seeds' final values", "mean", "holds"], "rlrl", rows), ""]
