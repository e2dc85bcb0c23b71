"""What `lbt plan` prints and draws: the table over W (data parallelism) and the split table (plan.tensor_parallel)."""

from __future__ import annotations

from pathlib import Path

from lbt.apps.plotting import figure, save_figure
from lbt.cost.data_parallel import ScalingRow
from lbt.cost.memory import ModelMemory, fewest_gpus
from lbt.cost.tensor_parallel import DenseSplit, SplitRow
from lbt.parallel.tensor_parallel import Split, why_not


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:,.2f} h"
    if seconds >= 60:
        return f"{seconds / 60:,.1f} min"
    return f"{seconds:,.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:,.1f} ms"


def aligned(lines: list[list[str] | None]) -> str:
    """A text table: the header first, then a rule; columns right-aligned but the last (notes); None: a blank line."""
    cells = [line for line in lines if line is not None]
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    out = []
    for k, line in enumerate(lines):
        if line is None:
            out.append("")
            continue
        out.append("  ".join(c.rjust(w) if i < len(line) - 1 else c
                             for i, (c, w) in enumerate(zip(line, widths))).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def format_table(rows: list[ScalingRow], shard: str = "none") -> str:
    delayed = bool(rows) and rows[0].synchronous_step_s is not None
    comm = "gather+scatter ms" if shard == "fsdp" else "allreduce ms"
    header = ["W", "global batch", "slowest compute ms", comm, "step ms", "epoch", "speedup", "efficiency", "note"]
    if delayed:
        header[4:5] = ["sync step ms", "delayed step ms"]
    lines: list[list[str] | None] = [header]
    for r in rows:
        notes = []
        if r.slower:
            notes.append("SLOWER than W/2")
        if r.beyond_critical:
            notes.append("B > B_crit")
        if r.beyond_dataset:
            notes.append("B > N")
        steps = [_ms(r.synchronous_step_s or 0.0), _ms(r.step_s)] if delayed else [_ms(r.step_s)]
        lines.append([
            str(r.workers), f"{r.global_batch:,}", _ms(r.compute_s), _ms(r.allreduce_s), *steps,
            _duration(r.epoch_s), f"{r.speedup:,.2f}x", f"{r.efficiency:.0%}", ", ".join(notes),
        ])
    return aligned(lines)


def summarize(rows: list[ScalingRow], critical_batch: float | None, critical_why: str | None = None) -> list[str]:
    """The lines under the table. A row whose global batch exceeds N (less than one step per epoch: its epoch
    time means nothing) stays in the table, flagged, but never heads a line."""
    usable = [r for r in rows if not r.beyond_dataset]
    b = rows[0].global_batch // rows[0].workers
    if not usable:
        return [f"no W fits the data: even one worker's batch b={b} exceeds N, the training samples per epoch "
                "(lower trainer.per_worker_batch)"]
    best = min(usable, key=lambda r: r.epoch_s)
    lines = [f"fastest epoch: W={best.workers} ({_duration(best.epoch_s)}, {best.speedup:.1f}x W=1, "
             f"efficiency {best.efficiency:.0%})"]
    safe = [r for r in usable if not r.beyond_critical]
    if critical_batch is not None and best.beyond_critical and safe:
        fastest_safe = min(safe, key=lambda r: r.epoch_s)
        lines.append(f"fastest epoch within B_crit: W={fastest_safe.workers} ({_duration(fastest_safe.epoch_s)}, "
                     f"{fastest_safe.speedup:.1f}x W=1, efficiency {fastest_safe.efficiency:.0%})")
    slower = [r.workers for r in usable if r.slower]
    if slower:
        lines.append(f"adding workers slows the epoch from W={slower[0]} on "
                     "(communication outgrows the compute it saves)")
    half = [r.workers for r in usable if r.efficiency < 0.5]
    if half:
        lines.append(f"scaling efficiency falls below 50% at W={half[0]}")
    if len(usable) < len(rows):
        lines.append(f"from W={rows[len(usable)].workers} on the global batch exceeds N (B > N: less than one step "
                     "per epoch); those rows are never chosen")
    if critical_batch is not None:
        lines.append(critical_line(rows, b, critical_batch, critical_why))
    return lines


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:,.1f} MB"


def memory_lines(memory: ModelMemory, optimizer: str, counts: list[int], gpu_gb: float | None) -> list[str]:
    """Memory per GPU replicated and sharded (lbt/cost/memory.py), and the fewest GPUs the model trains on."""
    shown = [w for w in counts if w in (2, 4, 8)] + [w for w in counts[-1:] if w > 8]
    sharded = ", ".join(f"{_size(memory.per_rank(w))} at W={w}" for w in shown)
    slots = memory.optimizer_slots
    lines = [f"memory per GPU (fp32 parameters, gradients and {optimizer}'s {slots} state tensor"
             f"{'s' if slots != 1 else ''} per parameter; activations not counted): one GPU "
             f"{_size(memory.per_rank(1))}; replicated (DDP, its buckets too) {_size(memory.replicated(2))} at any W; "
             f"sharded (dist.shard=fsdp; largest block {memory.largest_block:,} parameters) {sharded}"]
    if gpu_gb is None:
        return lines
    fewest = fewest_gpus(memory, gpu_gb * 1e9, counts)
    if fewest is None:
        lines.append(f"trains on: no W up to {counts[-1]:,} holds it in {gpu_gb:g} GB per GPU, even sharded")
    elif fewest[1] == "none" and memory.replicated(2) <= gpu_gb * 1e9:
        lines.append(f"trains on: 1 GPU and up ({_size(memory.replicated(2))} of {gpu_gb:g} GB: the memory does not "
                     "limit W)")
    elif fewest[1] == "none":
        lines.append(f"trains on: 1 GPU ({_size(memory.per_rank(1))} of {gpu_gb:g} GB); on more, replicated needs "
                     f"{_size(memory.replicated(2))} per GPU: shard them (dist.shard=fsdp)")
    else:
        lines.append(f"trains on: at least {fewest[0]:,} GPUs, sharded (dist.shard=fsdp: "
                     f"{_size(memory.per_rank(fewest[0]))} of {gpu_gb:g} GB each); replicated it needs "
                     f"{_size(memory.replicated(2))} per GPU")
    return lines


def critical_line(rows: list[ScalingRow], b: int, critical_batch: float, critical_why: str | None) -> str:
    """Where the global batch b x W passes the critical batch, and the largest W that stays within it."""
    named = f"critical batch B_crit={critical_batch:,.0f}" + (f" ({critical_why})" if critical_why else "")
    beyond = [r.workers for r in rows if r.beyond_critical]
    largest = int(critical_batch // b)
    if not beyond:
        return f"{named}: not reached up to W={rows[-1].workers}"
    if largest < 1:
        return f"{named}: even W=1's global batch {b:,} exceeds it (accuracy expected to suffer at every W)"
    return (f"{named}: global batch exceeds it from W={beyond[0]} on (accuracy expected to suffer); largest safe "
            f"W at b={b}: {largest} (global batch {largest * b:,})")


def plot(rows: list[ScalingRow], path: str | Path, title: str, critical_batch: float | None) -> Path:
    ws = [r.workers for r in rows]
    fig, (ax_time, ax_eff) = figure(2, 11, 4.2)
    ax_time.plot(ws, [r.epoch_s for r in rows], "o-", label="epoch time (model)")
    ax_time.plot(ws, [rows[0].epoch_s / w for w in ws], ":", color="gray", label="perfect scaling")
    ax_time.set_yscale("log")
    ax_time.set_ylabel("epoch time (s)")
    ax_eff.plot(ws, [r.efficiency for r in rows], "o-", color="tab:green", label="scaling efficiency")
    ax_eff.set_ylim(0, 1.05)
    ax_eff.set_ylabel("efficiency = speedup / W")
    slower = [r.workers for r in rows if r.slower and not r.beyond_dataset]
    beyond = [r.workers for r in rows if r.beyond_critical]
    past_n = [r.workers for r in rows if r.beyond_dataset]
    for ax in (ax_time, ax_eff):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers W")
        ax.grid(True, which="both", alpha=0.3)
        if slower:
            ax.axvline(slower[0], color="tab:red", linestyle="--", label=f"slower from W={slower[0]}")
        if beyond:
            ax.axvspan(beyond[0], ws[-1], color="tab:orange", alpha=0.15,
                       label=f"b·W > B_crit={critical_batch:,.0f}")
        if past_n:
            ax.axvspan(past_n[0], ws[-1], color="gray", alpha=0.2, label="b·W > N (< 1 step per epoch)")
        ax.legend(fontsize=8)
    return save_figure(fig, path, title, dpi=110)


def format_split_table(rows: list[SplitRow]) -> str:
    header = ["W", "DP x T", "global batch", "compute ms", "TP comm ms", "DP allreduce ms", "step ms", "epoch",
              "speedup", "note"]
    lines: list[list[str] | None] = [header]
    for i, r in enumerate(rows):
        if i and r.workers != rows[i - 1].workers:
            lines.append(None)  # a blank line between GPU counts
        notes = (["<- recommended"] if r.recommended else []) + (["B > B_crit"] if r.beyond_critical else []) \
            + (["B > N"] if r.beyond_dataset else [])
        lines.append([str(r.workers), f"{r.data_parallel} x {r.tensor_parallel}", f"{r.global_batch:,}",
                      _ms(r.compute_s), _ms(r.tp_comm_s), _ms(r.dp_comm_s), _ms(r.step_s), _duration(r.epoch_s),
                      f"{r.speedup:,.2f}x", ", ".join(notes)])
    return aligned(lines)


def summarize_splits(rows: list[SplitRow], critical_batch: float | None,
                     critical_why: str | None = None) -> list[str]:
    chosen = [r for r in rows if r.recommended]
    lines = ["recommended split per W: " + ", ".join(f"W={r.workers}: {r.data_parallel} x {r.tensor_parallel}"
                                                      for r in chosen)]
    hybrid = [r for r in chosen if r.tensor_parallel > 1]
    rule = "fastest epoch" + (f" with global batch <= B_crit={critical_batch:,.0f}" if critical_batch else "") \
        + " and <= N"
    if hybrid:
        lines.append(f"tensor parallelism recommended from W={hybrid[0].workers} on ({rule})")
    else:
        lines.append(f"data parallelism alone at every W ({rule})")
    if critical_why:
        lines.append(f"B_crit={critical_batch:,.0f}: {critical_why}")
    stuck = [r.workers for r in chosen if r.beyond_critical]
    if stuck:
        lines.append(f"from W={stuck[0]} on every split's global batch exceeds B_crit: the one closest to it is shown")
    past_n = [r.workers for r in chosen if r.beyond_dataset]
    if past_n:
        lines.append(f"from W={past_n[0]} on every split's global batch exceeds N (less than one step per epoch): "
                     "the smallest is shown, its epoch time means nothing")
    return lines


def plot_splits(rows: list[SplitRow], path: str | Path, title: str, critical_batch: float | None) -> Path:
    """Epoch time and global batch vs W: data parallelism alone and the recommended split."""
    dp_only = [r for r in rows if r.tensor_parallel == 1]
    chosen = [r for r in rows if r.recommended]
    fig, (ax_time, ax_batch) = figure(2, 11, 4.2)
    for ax, value, label in ((ax_time, "epoch_s", "epoch time (s)"), (ax_batch, "global_batch", "global batch")):
        ax.plot([r.workers for r in dp_only], [getattr(r, value) for r in dp_only], "o-", label="data parallel only")
        ax.plot([r.workers for r in chosen], [getattr(r, value) for r in chosen], "s--", color="tab:purple",
                label="recommended DP x T")
        for r in chosen:
            if r.tensor_parallel > 1:
                ax.annotate(f"T={r.tensor_parallel}", (r.workers, getattr(r, value)), fontsize=7,
                            textcoords="offset points", xytext=(4, -10))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs W")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    if critical_batch:
        ax_batch.axhline(critical_batch, color="tab:orange", linestyle=":", label=f"B_crit={critical_batch:,.0f}")
    for ax in (ax_time, ax_batch):
        ax.legend(fontsize=8)
    return save_figure(fig, path, title, dpi=110)


def layer_words(split: DenseSplit, index: int) -> str:
    """One split layer in plain words: `layer 11 (Linear 64 -> 10), split by its 10 outputs`."""
    layer = split.layers[index]
    size = f" (Linear {split.sizes[index][0]:,} -> {split.sizes[index][1]:,})" if index < len(split.sizes) else ""
    return f"layer {layer.name}{size}, split by its {layer.width:,} {unit_words(layer)}" + \
        (", gathered back after it" if layer.style == "gather" else "")


def unit_words(layer: Split) -> str:
    """What a split layer shares out among the T GPUs: its outputs, its inputs or its attention heads."""
    if layer.unit == "heads":
        return "attention heads"
    return "inputs" if layer.style == "rowwise" else "outputs"


def impossible_words(split: DenseSplit, tensor_parallel: int) -> str | None:
    """Why T GPUs cannot share this model's dense layers, in plain words (None: they can)."""
    if why_not(list(split.layers), tensor_parallel) is None:
        return None
    for i, layer in enumerate(split.layers):
        if layer.width % tensor_parallel:
            size = f" (Linear {split.sizes[i][0]:,} -> {split.sizes[i][1]:,})" if i < len(split.sizes) else ""
            return (f"its layer {layer.name}{size} is split by its {layer.width:,} {unit_words(layer)}, which "
                    f"{tensor_parallel} GPUs cannot share equally")
    return "it has no dense layer lbt can split (pairs of Linear layers, attention heads, or a model's only Linear)"


def describe_split(split: DenseSplit, per_worker_batch: int, tensor_parallel: list[int], name: str) -> list[str]:
    """What the rule splits in this model, what it sends per step and which T it rules out: the lines
    above the table."""
    impossible = [f"note: T={t} impossible for {name}: {impossible_words(split, t)} (left out of the table)"
                  for t in tensor_parallel if impossible_words(split, t)]
    if not split.layers:
        return [f"tensor parallel: {name} has nothing to split (no pair of Linear layers, no lone Linear): "
                "data parallelism only", *impossible]
    layers = "; ".join(layer_words(split, i) for i in range(len(split.layers)))
    kinds = [(c.op, c.phase, c.bytes_per_sample) for c in split.collectives]
    ops = {"allreduce": "allreduce", "allgather": "all-gather"}
    sends = ", ".join(f"{kinds.count(k)} {ops[k[0]]}{'s' if kinds.count(k) > 1 else ''} in the {k[1]} pass of "
                      f"{per_worker_batch * k[2] / 1e3:,.1f} kB" for k in dict.fromkeys(kinds)) or "nothing"
    return [f"tensor parallel: each of the T GPUs of a group holds 1/T of {name}'s {layers}; "
            f"{split.sharded_params:,} of {split.sharded_params + split.replicated_params:,} parameters shared out "
            f"this way, {split.dense_share:.1%} of the FLOPs",
            f"  per step among the T GPUs at b={per_worker_batch}: {sends}",
            "  step = compute x (1 - s + s/T) + activation collectives over T + gradient allreduce over DP of "
            "(replicated + sharded/T) x 4 bytes; DP x 1 rows are the data-parallel model above", *impossible]
