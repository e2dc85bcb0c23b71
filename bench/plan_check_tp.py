"""Does `lbt plan plan.tensor_parallel=T` predict a DP x T step on this machine? mlp at P = 1, 2 and 4 processes.

    python bench/plan_check_tp.py                  # 3 interleaved repeats
    python bench/plan_check_tp.py --quick          # 1 repeat, fewer steps
    python bench/plan_check_tp.py --predict-only   # the prediction side alone (no lbt train runs)

mlp with model.hidden=1024 (default; 2 layers, 1.09M parameters: the split pair holds ~99% of
the FLOPs) on MNIST-1D at a fixed per-worker batch b, one thread per process, for the splits
DP x T = 1 x 1 (P=1, reference), 1 x 2 (P=2), 2 x 2 and 1 x 4 (P=4):
- predicted: the rows `lbt plan plan.tensor_parallel=T` prints (`lbt.cost.tensor_parallel.split_rows`), fed with
  compute = `profile_compute(mlp, MNIST-1D's shape, b, threads=1)` run in P processes at once
  (the step waits for the slowest of P: `expected_max`), the split's FLOP share and collectives
  (`lbt.apps.plan.compute.model_split`), and the loopback gloo link as bench/allreduce.py fits it *paced*
  (each allreduce after a step's worth of compute, as in training; measured between 2 processes);
- measured: `python -m lbt train model=mlp model.hidden=H dist.procs=P dist.world_size=P
  dist.tensor_parallel=T trainer.per_worker_batch=b` (fresh processes),
  step = global batch (b x DP) / samples_per_sec.
Each repeat profiles, measures the link, then runs every split, so a changing load on the
machine hits prediction and measurement alike. The last line is
`plan_tp_error=<max |relative error| over the T > 1 splits of the median step times>` (target <= 0.25).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

from _common import LoadWatch, describe_machine, headline, median, run_lbt_subprocess
from allreduce import paced_network
from plan_check import concurrent_compute

from lbt.apps.plan.compute import model_and_data, model_split
from lbt.cost.data_parallel import Compute, Network
from lbt.cost.tensor_parallel import DenseSplit, SplitRow, split_rows
from lbt.engine.build import data_shape
from lbt.spec.targets import Target

SPLITS = ((1, 1), (2, 2), (4, 2), (4, 4))  # (processes P = W, tensor-parallel T); DP = P / T


def mlp_model(hidden: int) -> Target:
    mlp, _ = model_and_data("mlp", "mnist1d")
    return dataclasses.replace(mlp, kwargs={**mlp.kwargs, "hidden": hidden})


def predicted_row(samples: list[float], num_params: int, split: DenseSplit, procs: int, tensor_parallel: int,
                  per_worker_batch: int, bandwidth_bytes_per_s: float, latency_s: float,
                  train_samples: int) -> SplitRow:
    """The row `lbt plan plan.tensor_parallel=T` prints for W = P, from compute samples profiled in P
    processes at once and the measured link."""
    compute = Compute(statistics.median(samples) / 3, 2 * statistics.median(samples) / 3, 0.0, per_worker_batch,
                      num_params, "profiled", step_samples=tuple(samples))
    network = Network("loopback", bandwidth_bytes_per_s * 8 / 1e9, latency_s * 1e6, "bench/allreduce.py, paced")
    rows = split_rows(compute, split, network, [procs], [tensor_parallel], train_samples)
    row, = [r for r in rows if r.tensor_parallel == tensor_parallel]
    return row


def train_overrides(hidden: int, procs: int, tensor_parallel: int, per_worker_batch: int, steps: int) -> list[str]:
    """`lbt train` overrides of one measured split."""
    return ["model=mlp", f"model.hidden={hidden}", "data=mnist1d", f"dist.world_size={procs}", f"dist.procs={procs}",
            f"dist.tensor_parallel={tensor_parallel}", f"trainer.per_worker_batch={per_worker_batch}",
            "trainer.threads=1", "trainer.epochs=1", f"trainer.max_steps={steps}"]


def measured_step(hidden: int, procs: int, tensor_parallel: int, per_worker_batch: int, steps: int) -> float:
    """lbt's step time (s) of a DP x T split: its global batch over its samples/s."""
    result = run_lbt_subprocess(train_overrides(hidden, procs, tensor_parallel, per_worker_batch, steps))
    global_batch = per_worker_batch * procs // tensor_parallel
    if result.global_batch != global_batch:
        print(f"warning: result.json global_batch {result.global_batch} != b x DP = {global_batch}")
    return result.global_batch / result.samples_per_sec


def error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured: negative, the model is optimistic."""
    return (predicted - measured) / measured


def format_table(rows: dict[tuple[int, int], dict[str, list[float]]]) -> list[str]:
    """Markdown table of the medians over repeats per split (measured: n/a when not run)."""
    lines = ["| P | DP x T | predicted step | compute (slowest of P, x (1-s+s/T)) | TP comm | DP allreduce | "
             "measured step (lbt) | error |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (procs, t), values in rows.items():
        pred, meas = median(values["step"]), median(values["measured"])
        err = f"{error(pred, meas):+.1%}" if values["measured"] else "n/a"
        meas_text = f"{meas * 1e3:.2f} ms" if values["measured"] else "n/a"
        lines.append(f"| {procs} | {procs // t} x {t} | {pred * 1e3:.2f} ms | {median(values['compute']) * 1e3:.2f} ms "
                     f"| {median(values['tp']) * 1e3:.2f} ms | {median(values['dp']) * 1e3:.2f} ms | {meas_text} "
                     f"| {err} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat, fewer steps")
    parser.add_argument("--predict-only", action="store_true", help="profile and fit the link only; no lbt train")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 3, quick 1)")
    parser.add_argument("--hidden", type=int, default=1024, help="mlp width (default 1024: the dense part dominates)")
    parser.add_argument("--per-worker-batch", "-b", type=int, default=64)
    parser.add_argument("--steps", type=int, help="optimizer steps per measured run (default 300, quick 80)")
    args = parser.parse_args(argv)
    b, hidden = args.per_worker_batch, args.hidden
    repeats = args.repeats or (1 if args.quick else 3)
    steps = args.steps or (80 if args.quick else 300)
    profile_steps = 20 if args.quick else 60
    print(describe_machine(), flush=True)
    watch = LoadWatch(own=4)
    shape = data_shape(model_and_data("mlp", "mnist1d")[1])
    split = model_split(mlp_model(hidden), shape, f"mlp hidden={hidden}")
    print(f"mlp hidden={hidden}: {split.sharded_params:,} of {split.sharded_params + split.replicated_params:,} "
          f"parameters split, {split.dense_share:.1%} of the FLOPs; per step among the T ranks: "
          + ", ".join(f"{c.op} {c.phase} of {b * c.bytes_per_sample / 1e3:.0f} kB" for c in split.collectives))
    rows = {s: {k: [] for k in ("compute", "tp", "dp", "step", "measured")} for s in SPLITS}
    for r in range(repeats):
        samples, params = {}, 0
        for procs in sorted({p for p, _ in SPLITS}):
            samples[procs], params = concurrent_compute(procs, b, profile_steps, mlp_model(hidden))
        pace = statistics.mean(samples[2])
        bandwidth, latency = paced_network(pace, ops=50 if args.quick else 100)
        order = SPLITS if r % 2 == 0 else SPLITS[::-1]
        for procs, t in order:
            row = predicted_row(samples[procs], params, split, procs, t, b, bandwidth, latency, shape.num_train)
            for key, value in (("compute", row.compute_s), ("tp", row.tp_comm_s), ("dp", row.dp_comm_s),
                               ("step", row.step_s)):
                rows[(procs, t)][key].append(value)
            if not args.predict_only:
                rows[(procs, t)]["measured"].append(measured_step(hidden, procs, t, b, steps))
            watch.sample()
        print(f"repeat {r + 1}/{repeats}: compute alone {statistics.mean(samples[1]) * 1e3:.2f} ms, "
              f"4 at once {statistics.mean(samples[4]) * 1e3:.2f} ms; loopback {bandwidth / 1e9:.2f} GB/s "
              f"+ {latency * 1e6:.0f} us; "
              + "; ".join(f"{p // t}x{t} predicted {v['step'][-1] * 1e3:.2f} ms"
                          + (f", measured {v['measured'][-1] * 1e3:.2f} ms" if v["measured"] else "")
                          for (p, t), v in rows.items()), flush=True)
    print()
    print(f"mlp hidden={hidden} on MNIST-1D, per_worker_batch={b}, 1 thread per process, {steps} steps per "
          f"measured run, median of {repeats} repeats:")
    for line in format_table(rows):
        print(line)
    print(watch.verdict())
    if args.predict_only:
        print("(--predict-only: nothing measured)")
        headline("plan_tp_error", "n/a")
        return 0
    worst = max(abs(error(median(v["step"]), median(v["measured"]))) for (p, t), v in rows.items() if t > 1)
    print(f"target |error| <= 25% over the T > 1 splits: {'met' if worst <= 0.25 else 'MISSED'}")
    headline("plan_tp_error", worst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
