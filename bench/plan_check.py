"""Does `lbt plan`'s cost model predict this machine? Predicted vs measured step time, P=1 and P=2.

    python bench/plan_check.py            # 5 interleaved repeats
    python bench/plan_check.py --quick    # under 2 minutes: 2 repeats, fewer steps

cnn1d on MNIST-1D at a fixed per-worker batch b (default 64), one thread per
process (lbt's default for P=2 on 2 cores: the cores are shared out):
- predicted (lbt/cost/data_parallel.py, lbt/apps/plan/compute.py):
  compute = `profile_compute(cnn1d, MNIST-1D's shape, b, threads=1)`
  (forward + backward + SGD step on random data) run in P processes at once,
  as the P workers share this machine's cores and memory; the step waits for
  the slower worker, `expected_max(per-step times, P)`; network = the loopback
  gloo link as bench/allreduce.py measures and fits it *paced* (each allreduce
  after a step's worth of compute, as in training: see `allreduce.paced`);
  step = slowest compute + ring_allreduce(4 x params bytes, W=P);
- measured: `python -m lbt train model=cnn1d dist.world_size=P dist.procs=P
  trainer.per_worker_batch=b` (fresh processes), step = global_batch / samples_per_sec.
Each repeat profiles, measures the network, then runs P=1 and P=2, so a
changing load on the machine hits prediction and measurement alike.
`--diagnose` adds where a 2-process step's time goes beyond compute: two
processes train cnn1d in lockstep without DDP (compute only), with a barrier
per step, with an allreduce of the flat gradient per step, and under DDP.
The last line is `plan_error=<max relative error over P=1, P=2 of the median step times>` (target <= 0.25).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch.multiprocessing as mp
from _common import LoadWatch, describe_machine, headline, median, run_lbt_subprocess
from allreduce import paced_network

from lbt.apps.plan.compute import model_and_data, profile_compute
from lbt.cost.data_parallel import expected_max, gradient_bytes, ring_allreduce_seconds, step_seconds
from lbt.engine.build import data_shape
from lbt.spec.targets import Target


def _profile_worker(rank: int, b: int, repeats: int, out_dir: str, model: Target | None) -> None:
    cnn1d, mnist1d = model_and_data("cnn1d", "mnist1d")
    compute = profile_compute(model or cnn1d, data_shape(mnist1d), b, threads=1, repeats=repeats,
                              name=model.name if model else "cnn1d")
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"samples": compute.step_samples,
                                                         "params": compute.num_params}))


def concurrent_compute(procs: int, b: int, repeats: int, model: Target | None = None) -> tuple[list[float], int]:
    """Per-step compute times (s) of `procs` workers profiling at once in fresh processes, pooled; and the
    parameter count. lbt plan's step waits for the slowest worker: `expected_max(samples, W)`.
    `model`: a model (default cnn1d), on MNIST-1D's shape."""
    with tempfile.TemporaryDirectory(prefix="lbt-plan-check-") as out_dir:
        mp.start_processes(_profile_worker, args=(b, repeats, out_dir, model), nprocs=procs, join=True,
                           start_method="spawn")
        results = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(procs)]
    return [s for r in results for s in r["samples"]], results[0]["params"]


def _lockstep_worker(rank: int, port: int, b: int, steps: int, rounds: int, out_dir: str) -> None:
    import time
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from lbt.models import CNN1d

    warnings.filterwarnings("ignore", category=FutureWarning)  # DDP's broadcast_buffers rename
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    x_all, y_all = torch.randn(steps * b, 40), torch.randint(0, 10, (steps * b,))
    modes = ("compute only", "+ barrier per step", "+ allreduce of the flat gradient", "DDP")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(rounds):
        for mode in modes:
            torch.manual_seed(0)
            model = CNN1d(input_shape=(40,))
            net = DistributedDataParallel(model, broadcast_buffers=False) if mode == "DDP" else model
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
            dist.barrier()
            start = time.perf_counter()
            for step in range(steps):
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(net(x_all[step * b:(step + 1) * b]), y_all[step * b:(step + 1) * b]).backward()
                if mode == "+ barrier per step":
                    dist.barrier()
                elif mode == "+ allreduce of the flat gradient":
                    dist.all_reduce(torch.cat([q.grad.flatten() for q in model.parameters()]))
                optimizer.step()
            times[mode].append((time.perf_counter() - start) / steps)
            dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        Path(out_dir, "lockstep.json").write_text(json.dumps(times))


def lockstep(b: int, steps: int, rounds: int) -> dict[str, float]:
    """Median seconds per step of 2 processes in lockstep, by what they synchronise (see --diagnose)."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="lbt-plan-check-") as out_dir:
        mp.start_processes(_lockstep_worker, args=(store.port, b, steps, rounds, out_dir), nprocs=2, join=True,
                           start_method="spawn")
        times = json.loads(Path(out_dir, "lockstep.json").read_text())
    return {mode: statistics.median(v) for mode, v in times.items()}


def measured_step(procs: int, b: int, steps: int) -> tuple[float, dict]:
    """lbt's step time (s) and its own per-phase means (result.json step_seconds)."""
    result = run_lbt_subprocess([
        "model=cnn1d", "data=mnist1d", f"dist.world_size={procs}", f"dist.procs={procs}",
        f"trainer.per_worker_batch={b}", "trainer.threads=1", "trainer.epochs=1", f"trainer.max_steps={steps}",
    ])
    return result.global_batch / result.samples_per_sec, result.step_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats, fewer steps (under 2 minutes)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default 5, quick 2)")
    parser.add_argument("--per-worker-batch", "-b", type=int, default=64)
    parser.add_argument("--steps", type=int, help="optimizer steps per measured run (default 400, quick 120)")
    parser.add_argument("--diagnose", action="store_true",
                        help="also time 2 processes in lockstep: compute only, + barrier, + allreduce, DDP")
    args = parser.parse_args(argv)
    b = args.per_worker_batch
    repeats = args.repeats or (2 if args.quick else 5)
    steps = args.steps or (120 if args.quick else 400)
    print(describe_machine(), flush=True)
    watch = LoadWatch(own=2)
    keys = ("compute1", "compute2", "slowest2", "allreduce", "pred1", "pred2", "meas1", "meas2")
    rows: dict[str, list[float]] = {k: [] for k in keys}
    phases: dict[int, list[dict]] = {1: [], 2: []}
    nbytes = None
    profile_steps = 60 if args.quick else 200
    for r in range(repeats):
        samples1, params = concurrent_compute(1, b, profile_steps)
        samples2, _ = concurrent_compute(2, b, profile_steps)
        compute1, compute2 = statistics.mean(samples1), statistics.mean(samples2)
        slowest2 = expected_max(samples2, 2)  # the step waits for the slower of the two workers
        nbytes = gradient_bytes(params)
        # The link as a training step uses it: each allreduce after a step's worth of compute.
        bandwidth, latency = paced_network(compute2, ops=100 if args.quick else 200)
        comm = ring_allreduce_seconds(nbytes, 2, bandwidth, latency)
        rows["compute1"].append(compute1)
        rows["compute2"].append(compute2)
        rows["slowest2"].append(slowest2)
        rows["allreduce"].append(comm)
        rows["pred1"].append(step_seconds(compute1, 0.0))
        rows["pred2"].append(step_seconds(slowest2, comm))
        order = (1, 2) if r % 2 == 0 else (2, 1)
        for p in order:
            seconds, breakdown = measured_step(p, b, steps)
            rows[f"meas{p}"].append(seconds)
            phases[p].append(breakdown)
            watch.sample()
        print(f"repeat {r + 1}/{repeats}: compute {compute1 * 1e3:.2f} ms alone, {compute2 * 1e3:.2f} ms 2 at once "
              f"(slower of 2: {slowest2 * 1e3:.2f} ms); "
              f"loopback {bandwidth / 1e9:.2f} GB/s "
              f"+ {latency * 1e6:.0f} us -> allreduce of {nbytes / 1e3:.0f} kB {comm * 1e3:.2f} ms; "
              f"predicted P=1 {rows['pred1'][-1] * 1e3:.2f} ms, P=2 {rows['pred2'][-1] * 1e3:.2f} ms; "
              f"measured P=1 {rows['meas1'][-1] * 1e3:.2f} ms, P=2 {rows['meas2'][-1] * 1e3:.2f} ms", flush=True)
    print()
    print(f"cnn1d, per_worker_batch={b}, 1 thread per process, {nbytes / 1e3:.0f} kB of gradient, "
          f"{steps} steps per measured run, median of {repeats} repeats:")
    print("| procs P (= W) | predicted step | mean compute | slowest of P | allreduce | measured step (lbt) | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    errors = []
    for p in (1, 2):
        pred, meas = median(rows[f"pred{p}"]), median(rows[f"meas{p}"])
        error = (pred - meas) / meas
        errors.append(abs(error))
        comm = median(rows["allreduce"]) if p == 2 else 0.0
        slowest = median(rows["slowest2"]) if p == 2 else median(rows["compute1"])
        print(f"| {p} | {pred * 1e3:.2f} ms | {median(rows[f'compute{p}']) * 1e3:.2f} ms | {slowest * 1e3:.2f} ms | "
              f"{comm * 1e3:.2f} ms | {meas * 1e3:.2f} ms | {error:+.1%} |")
    print("(medians over the repeats, column by column: they need not add up exactly; "
          "error = (predicted - measured) / measured, negative: the model is optimistic)")
    for p in (1, 2):
        keys = sorted({k for d in phases[p] for k in d})
        if keys:
            print(f"lbt's own timer at P={p} (median ms per step): "
                  + ", ".join(f"{k[:-2]} {median([d[k] for d in phases[p] if k in d]) * 1e3:.2f}" for k in keys)
                  + ("  (compute includes the allreduce wait the backward could not hide)" if p == 2 else ""))
    if args.diagnose:
        print(f"\nwhere a P=2 step goes (2 processes in lockstep, cnn1d b={b}, 1 thread each, {steps} steps, "
              f"median of {repeats} rounds):")
        print("| what both processes do per step | ms per step |")
        print("| --- | --- |")
        for mode, seconds in lockstep(b, steps, repeats).items():
            print(f"| {mode} | {seconds * 1e3:.2f} |")
        watch.sample()
    print(watch.verdict())
    worst = max(errors)
    print(f"target |error| <= 25%: {'met' if worst <= 0.25 else 'MISSED'}")
    headline("plan_error", worst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
