"""gloo allreduce bandwidth between 2 local processes, against a memcpy of the same bytes.

    python bench/allreduce.py             # 1 KiB .. 256 MiB, 5 rounds
    python bench/allreduce.py --quick     # 3 rounds, fewer iterations per size
    python bench/allreduce.py --json out.json   # also write the table and the ring-model fit

Two processes (torch.multiprocessing spawn) join a gloo process group through
a TCPStore on 127.0.0.1 (as lbt's local launcher does) and allreduce (sum)
float32 buffers of gradient-like sizes; every op is timed on rank 0 and the
per-size figure is the median over ops. Between two sizes, rank 0 times
`dst.copy_(src)` of the same bytes while rank 1 waits: a memcpy is the local
physical limit of moving those bytes (the loopback "network" is memory).
Each round sweeps all sizes; figures are the median over rounds.

Bandwidths are bytes / time (nccl-tests' algbw); for 2 workers the ring's bus
bandwidth 2 (W-1)/W x bytes / time is the same number. A least-squares fit of
t = bytes / bandwidth + 2 x latency (the ring model of lbt/cost/data_parallel.py at W=2)
gives the loopback network that bench/plan_check.py feeds to `lbt plan`.
The last line is `allreduce_vs_memcpy=<allreduce / memcpy bandwidth at the largest size>`.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import LoadWatch, describe_machine, headline

HOST = "127.0.0.1"
SIZES = [1024 * 4**k for k in range(10)]  # 1 KiB, 4 KiB, ..., 256 MiB


def iterations(nbytes: int, quick: bool) -> int:
    """Enough ops for a stable median at small sizes, few at large ones (~0.1-0.3 s each)."""
    scale = 2e7 if quick else 1e8
    return int(min(200 if not quick else 50, max(3 if quick else 5, scale / nbytes)))


def _time_ops(fn, n: int) -> float:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _join(rank: int, port: int) -> None:
    """One of the two benchmark processes joins the gloo group (1 thread, as lbt's P=2 workers here)."""
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, port, 2, is_master=False, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)


def _run_pair(worker, *args) -> dict:
    """Run worker(rank, store_port, *args, out_path) in 2 spawned processes; return what rank 0 wrote."""
    store = dist.TCPStore(HOST, 0, 3, is_master=True, wait_for_workers=False)
    with tempfile.TemporaryDirectory(prefix="lbt-allreduce-") as tmp:
        out = os.path.join(tmp, "timings.json")
        mp.start_processes(worker, args=(store.port, *args, out), nprocs=2, join=True, start_method="spawn")
        return json.loads(Path(out).read_text())


def _worker(rank: int, port: int, sizes: list[int], rounds: int, quick: bool, memcpy_threads: list[int],
            out_path: str) -> None:
    _join(rank, port)
    results = {"allreduce": {s: [] for s in sizes}, "memcpy": {f"{t}": {s: [] for s in sizes} for t in memcpy_threads}}
    try:
        for _ in range(rounds):
            for nbytes in sizes:
                n = nbytes // 4
                buffer = torch.ones(n)
                for _warm in range(2):
                    dist.all_reduce(buffer)
                dist.barrier()
                seconds = _time_ops(functools.partial(dist.all_reduce, buffer), iterations(nbytes, quick))
                results["allreduce"][nbytes].append(seconds)
                buffer = None  # free it before the memcpy buffers
                dist.barrier()
                if rank == 0:
                    src, dst = torch.ones(n), torch.empty(n)
                    for threads in memcpy_threads:
                        torch.set_num_threads(threads)
                        dst.copy_(src)
                        results["memcpy"][f"{threads}"][nbytes].append(
                            _time_ops(functools.partial(dst.copy_, src), iterations(nbytes, quick)))
                    torch.set_num_threads(1)
                    del src, dst
                dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def measure(sizes: list[int] = SIZES, rounds: int = 5, quick: bool = False,
            memcpy_threads: list[int] | None = None) -> dict:
    """Per size: median allreduce seconds (2 processes, gloo, loopback) and memcpy seconds per thread count.

    Returns {"allreduce": {bytes: [seconds per round]}, "memcpy": {threads: {bytes: [...]}}}.
    """
    memcpy_threads = memcpy_threads or sorted({1, os.cpu_count() or 1})
    raw = _run_pair(_worker, sizes, rounds, quick, memcpy_threads)
    return {
        "allreduce": {int(k): v for k, v in raw["allreduce"].items()},
        "memcpy": {int(t): {int(k): v for k, v in d.items()} for t, d in raw["memcpy"].items()},
    }


def fit_ring(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(bandwidth bytes/s, latency s) of t = bytes / bandwidth + 2 latency, least squares in relative error."""
    # Minimise sum(((a + c S_i) - t_i) / t_i)^2: a weighted linear fit with weights 1/t_i.
    w = [1.0 / t for t in seconds]
    sw = sum(x * x for x in w)
    sws = sum(x * x * s for x, s in zip(w, sizes))
    swss = sum(x * x * s * s for x, s in zip(w, sizes))
    swt = sum(x * x * t for x, t in zip(w, seconds))
    swst = sum(x * x * s * t for x, s, t in zip(w, sizes, seconds))
    det = sw * swss - sws * sws
    a = (swss * swt - sws * swst) / det
    c = (sw * swst - sws * swt) / det
    return 1.0 / c, max(a, 0.0) / 2.0


def _busy(seconds: float, work: torch.Tensor) -> None:
    """Keep this process's core busy for `seconds`, as a training step's compute does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        work @ work


def _paced_worker(rank: int, port: int, sizes: list[int], ops: int, pace_s: float, out_path: str) -> None:
    _join(rank, port)
    work = torch.randn(128, 128)
    results = {}
    try:
        for nbytes in sizes:
            buffer = torch.ones(nbytes // 4)
            dist.all_reduce(buffer)
            dist.barrier()
            times = []
            for _ in range(ops):
                _busy(pace_s, work)
                start = time.perf_counter()
                dist.all_reduce(buffer)
                times.append(time.perf_counter() - start)
            results[nbytes] = statistics.mean(times)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def paced(sizes: list[int], pace_s: float, ops: int = 200) -> dict[int, float]:
    """Mean allreduce seconds per size when each op follows `pace_s` of compute on both ranks.

    This is how a training step uses the link: compute, then the gradient
    allreduce, then compute again. Between bursts a rank waits idle for its
    peer's bytes, and on this VM a waiting process is sometimes woken only at
    the next scheduler tick (~4 ms): a tail that back-to-back ops, whose ranks
    never go idle, do not show. Means, not medians: a step time is a mean.
    """
    return {int(k): v for k, v in _run_pair(_paced_worker, sizes, ops, pace_s).items()}


PACED_SIZES = [1024 * 4**k for k in range(8)]  # 1 KiB .. 16 MiB: gradient sizes of small and mid models


def paced_network(pace_s: float, ops: int = 200) -> tuple[float, float]:
    """The loopback 'network' as training steps see it: ring fit of `paced` means (bandwidth bytes/s, latency s)."""
    means = paced(PACED_SIZES, pace_s, ops)
    return fit_ring(PACED_SIZES, [means[s] for s in PACED_SIZES])


def loopback_network(quick: bool = True, sizes: list[int] | None = None, rounds: int = 2) -> tuple[float, float]:
    """Measure and fit the loopback gloo 'network': (bandwidth bytes/s, latency s)."""
    sizes = sizes or SIZES[:-1]
    data = measure(sizes, rounds=rounds, quick=quick, memcpy_threads=[1])
    medians = [statistics.median(data["allreduce"][s]) for s in sizes]
    return fit_ring(sizes, medians)


def _human(nbytes: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:g} {unit}"
    return f"{nbytes} B"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, fewer ops per size")
    parser.add_argument("--rounds", type=int, help="sweeps over all sizes (default 5, quick 3)")
    parser.add_argument("--max-mib", type=int, default=256, help="largest buffer, MiB (default 256)")
    parser.add_argument("--json", help="also write the table and the fit to this file")
    parser.add_argument("--pace-ms", type=float, default=4.0,
                        help="also time allreduces that each follow this much compute, as in training "
                             "(default 4 ms, about a cnn1d step at batch 64; 0 to skip)")
    args = parser.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    sizes = [s for s in SIZES if s <= args.max_mib * 2**20]
    print(describe_machine(), flush=True)
    watch = LoadWatch(own=2)
    watch.sample()
    started = time.perf_counter()
    data = measure(sizes, rounds, args.quick)
    watch.sample()
    threads = sorted(data["memcpy"])
    print(f"2 processes, gloo over {HOST}, float32 sum; {rounds} rounds, median per size "
          f"({time.perf_counter() - started:.0f} s)")
    header = "| size | allreduce time | allreduce GB/s | " + " | ".join(f"memcpy GB/s ({t} thr)" for t in threads) + \
        " | allreduce / memcpy |"
    print(header)
    print("|" + " --- |" * (4 + len(threads)))
    table, ratio = [], float("nan")
    for s in sizes:
        t_ar = statistics.median(data["allreduce"][s])
        memcpy = {t: statistics.median(data["memcpy"][t][s]) for t in threads}
        best = min(memcpy.values())
        ratio = best / t_ar  # bandwidth ratio = time ratio inverted
        table.append({"bytes": s, "allreduce_s": t_ar, "allreduce_GBps": s / t_ar / 1e9,
                      **{f"memcpy_{t}thr_GBps": s / memcpy[t] / 1e9 for t in threads}, "ratio": ratio})
        time_text = f"{t_ar * 1e6:,.0f} us" if t_ar < 1e-2 else f"{t_ar * 1e3:,.1f} ms"
        print(f"| {_human(s)} | {time_text} | {s / t_ar / 1e9:.3f} | "
              + " | ".join(f"{s / memcpy[t] / 1e9:.2f}" for t in threads) + f" | {ratio:.3f} |")
    bandwidth, latency = fit_ring(sizes, [statistics.median(data["allreduce"][s]) for s in sizes])
    print(f"ring model fit (t = bytes / bandwidth + 2 x latency): bandwidth {bandwidth / 1e9:.2f} GB/s "
          f"= {bandwidth * 8 / 1e9:.1f} Gb/s, latency {latency * 1e6:.0f} us  "
          f"-> lbt plan plan.bandwidth_gbps={bandwidth * 8 / 1e9:.1f} plan.latency_us={latency * 1e6:.0f}")
    if args.pace_ms > 0:
        means = paced(PACED_SIZES, args.pace_ms / 1e3, ops=100 if args.quick else 200)
        print(f"\npaced: every allreduce follows {args.pace_ms:g} ms of compute on both ranks (as in training); "
              "mean per size")
        print("| size | back-to-back (median) | paced (mean) |")
        print("| --- | --- | --- |")
        for s in PACED_SIZES:
            back = statistics.median(data["allreduce"][s]) if s in data["allreduce"] else float("nan")
            print(f"| {_human(s)} | {back * 1e6:,.0f} us | {means[s] * 1e6:,.0f} us |")
        paced_bw, paced_lat = fit_ring(PACED_SIZES, [means[s] for s in PACED_SIZES])
        print(f"paced ring fit: bandwidth {paced_bw / 1e9:.2f} GB/s = {paced_bw * 8 / 1e9:.1f} Gb/s, latency "
              f"{paced_lat * 1e6:.0f} us  -> lbt plan plan.bandwidth_gbps={paced_bw * 8 / 1e9:.1f} "
              f"plan.latency_us={paced_lat * 1e6:.0f}")
    watch.sample()
    print(watch.verdict())
    if args.json:
        Path(args.json).write_text(json.dumps({"table": table, "bandwidth_Bps": bandwidth, "latency_s": latency},
                                              indent=2))
    print(f"at {_human(sizes[-1])}: allreduce reaches {ratio:.1%} of a memcpy's bandwidth "
          f"(each rank sends and receives the buffer once through loopback TCP and sums it, vs one copy in memory)")
    headline("allreduce_vs_memcpy", ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
