"""The cost of data parallelism: how long one step and one epoch take on W workers (pure formulas).

`lbt plan` (lbt/apps/plan/) evaluates them with a measured compute time; the trainer counts the
bytes each worker sends with `ring_bytes_sent`. A cost model of one step of synchronous data-parallel SGD (every worker
computes its per-worker batch b, then the gradients are averaged by a ring
allreduce), evaluated for W = 1, 2, 4, ... workers:

    compute   = forward + backward + optimizer step of ONE worker at batch b (measured)
    slowest   = E[max of W workers' compute]: the step waits for its slowest worker
    allreduce = 2 (W-1)/W x bytes / bandwidth + 2 (W-1) x latency       (ring, Patarasuk & Yuan 2009)
    step      = slowest + allreduce - hidden,  hidden = min(allreduce, overlap x backward)
    epoch     = N / (b W) x step

With gradient delay (`plan.delay=d`, strategy=gradient_delay; d=1 is double
buffering) a step's allreduce runs while the next step computes, so a step
costs max(slowest, allreduce) instead of their sum; the table then shows both.

bytes = 4 x parameters (fp32 gradients; halved by fp16/bf16 compression).
With W workers an epoch takes N/(bW) steps instead of N/b, so adding workers
pays only while allreduce(W) stays small against the compute it divides:
speedup(W) = epoch(1) / epoch(W), efficiency = speedup / W. Past the critical
batch (global batch b W > B_crit) the extra workers also cost accuracy.

Data x tensor parallelism (T ranks share a worker's batch and split its dense layers: global batch
b x DP) is lbt/cost/tensor_parallel.py.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_PER_FP32 = 4
# Backward costs about twice the forward (one matmul for the input gradient,
# one for the weight gradient), so ~2/3 of a step's compute; used when the
# backward time was not measured (from a result.json).
DEFAULT_BACKWARD_SHARE = 2.0 / 3.0


@dataclass(frozen=True)
class Network:
    name: str
    bandwidth_gbps: float  # per-direction bandwidth each worker can push, gigabits/s
    latency_us: float  # per message (one ring hop), microseconds
    source: str

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_us * 1e-6


# Typical values: link data rates per direction and small-message latencies as
# vendors and common benchmarks state them, each with its source. They are upper bounds on what an
# allreduce reaches (NCCL typically gets 80-95% of the link rate, TCP less):
# measure yours (bench/allreduce.py, nccl-tests) and pass plan.bandwidth_gbps/plan.latency_us.
# Fastest first: `lbt plan --help` lists them in this order.
NETWORKS: dict[str, Network] = {
    n.name: n
    for n in (
        Network("nvlink4", 3600.0, 5.0,
                "NVLink 4 (H100/H200 SXM): 900 GB/s total = 18 links x 25 GB/s = 450 GB/s per direction "
                "(NVIDIA H100 datasheet); nccl-tests show ~10-15 us for a tiny 2-GPU allreduce"),
        Network("nvlink", 2400.0, 5.0,
                "NVLink 3 (A100): 600 GB/s total = 300 GB/s per direction (NVIDIA A100 datasheet); "
                "nccl-tests show ~10-15 us for a tiny 2-GPU allreduce"),
        Network("ib-ndr", 400.0, 0.6,
                "InfiniBand NDR 4x: 400 Gb/s per port (4 lanes x 100 Gb/s PAM4; IBTA roadmap, NVIDIA ConnectX-7); "
                "~0.6 us MPI latency adapter to adapter (osu_latency)"),
        Network("400gbe", 400.0, 3.0,
                "400 Gigabit Ethernet (IEEE 802.3bs) with RoCE v2 (NVIDIA ConnectX-7, Spectrum-X): ~2-3 us "
                "through a switch; over TCP sockets expect ~10 us and less of the bandwidth"),
        Network("ib-hdr", 200.0, 0.6,
                "InfiniBand HDR 4x: 200 Gb/s per port (4 lanes x 50 Gb/s PAM4; IBTA roadmap, NVIDIA ConnectX-6); "
                "~0.6 us MPI latency adapter to adapter (osu_latency)"),
        Network("100gbe", 100.0, 3.0,
                "100 Gigabit Ethernet (IEEE 802.3ba/cd) with RoCE v2 (NVIDIA ConnectX-5/6): ~2-3 us through a "
                "switch; over TCP sockets expect ~10 us and less of the bandwidth"),
        Network("ib-edr", 97.0, 0.6,
                "InfiniBand EDR 4x: 100 Gb/s signalling, 97 Gb/s data (64b/66b); ~0.6 us latency (ConnectX-4/5)"),
        Network("100g", 97.0, 0.6,
                "100 Gb/s InfiniBand EDR 4x (the same as ib-edr): 97 Gb/s data (64b/66b); ~0.6 us latency "
                "(ConnectX-4/5)"),
        Network("ib-fdr", 54.5, 0.7,
                "InfiniBand FDR 4x: 56 Gb/s signalling, 54.5 Gb/s data (64b/66b); ~0.7 us MPI latency "
                "(Mellanox ConnectX-3)"),
        Network("25gbe", 25.0, 10.0,
                "25 Gigabit Ethernet, TCP/IP (gloo, NCCL socket): ~10 us one-way through the kernel stack"),
        Network("10gbe", 10.0, 10.0,
                "10 Gigabit Ethernet, TCP/IP: ~7-10 us one-way latency"),
        Network("1gbe", 1.0, 50.0,
                "Gigabit Ethernet, TCP/IP: ~50 us one-way latency (ping round trips ~0.1 ms)"),
    )
}


# -- the formulas ---------------------------------------------------------------
def ring_allreduce_seconds(nbytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """Time of a ring allreduce of `nbytes` over `workers` (0 for one worker).

    Reduce-scatter then all-gather: 2 (W-1) steps, each sending one W-th of the
    buffer to the next worker, so every worker sends 2 (W-1)/W x nbytes and
    waits for 2 (W-1) messages.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        return 0.0
    return ring_bytes_sent(nbytes, workers) / bandwidth_bytes_per_s + 2 * (workers - 1) * latency_s


def fsdp_seconds(nbytes: float, workers: int, bandwidth_bytes_per_s: float, latency_s: float) -> float:
    """A sharded step's communication (lbt/parallel/fsdp.py): two all-gathers and a reduce-scatter of
    `nbytes`, each (W-1) messages of 1/W of it per worker: 1.5x a ring allreduce's bytes and messages."""
    return 1.5 * ring_allreduce_seconds(nbytes, workers, bandwidth_bytes_per_s, latency_s)


def ring_bytes_sent(nbytes: float, workers: int) -> float:
    """Bytes each worker sends in a ring allreduce of `nbytes`: 2 (W-1)/W x nbytes (0 for one worker)."""
    return 2 * (workers - 1) / workers * nbytes


def fsdp_bytes_sent(nbytes: float, workers: int) -> float:
    """Bytes each worker sends per step under sharded data parallelism (lbt/parallel/fsdp.py): an all-gather
    of the parameters in forward and one in backward, a reduce-scatter of the gradients, each (W-1)/W x
    nbytes: 3 (W-1)/W x nbytes, 1.5x the ring allreduce's (ZeRO stage 3; Rajbhandari et al. 2020, sec. 7)."""
    return 3 * (workers - 1) / workers * nbytes


def step_seconds(compute_s: float, allreduce_s: float, overlap: float = 0.0, backward_s: float | None = None) -> float:
    """One synchronous step: compute, plus the allreduce time not hidden behind the backward pass.

    `overlap` in [0, 1] is the fraction of the backward during which gradients
    already travel (DDP sends a bucket as soon as its gradients are ready):
    at most overlap x backward_s of the allreduce is hidden. `backward_s`
    defaults to 2/3 of the compute.
    """
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if backward_s is None:
        backward_s = DEFAULT_BACKWARD_SHARE * compute_s
    hidden = min(allreduce_s, overlap * backward_s)
    return compute_s + allreduce_s - hidden


def overlapped_step_seconds(compute_s: float, allreduce_s: float) -> float:
    """One step with a delayed gradient (d >= 1): the allreduce of step t runs during step t+1's compute,
    so the slower of the two sets the pace (ChainerMN double buffering)."""
    return max(compute_s, allreduce_s)


def expected_max(samples, workers: int) -> float:
    """Mean time of the slowest of `workers` independent draws from the measured `samples`.

    A synchronous step ends when its slowest worker's gradient arrives, so step
    times that vary (other processes, interrupts, the allreduce threads sharing
    the cores) cost more as workers are added: the straggler effect (Dean &
    Barroso 2013, "The tail at scale"; Chen et al. 2016). With the samples
    sorted, x_1 <= ... <= x_n, the slowest of W draws is <= x_i with probability
    (i/n)^W, so E[max] = sum_i x_i ((i/n)^W - ((i-1)/n)^W); one worker: the mean.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    ordered = sorted(samples)
    if not ordered:
        raise ValueError("no samples")
    n = len(ordered)
    return sum(x * ((i / n) ** workers - ((i - 1) / n) ** workers) for i, x in enumerate(ordered, start=1))


def epoch_seconds(step_s: float, train_samples: int, global_batch: int) -> float:
    """N / B steps of `step_s` (fractional: lbt drops the last partial batch, N // B steps)."""
    return train_samples / global_batch * step_s


def gradient_bytes(num_params: int, compression: str = "none") -> float:
    """Bytes one worker's gradient takes on the wire: fp32, or half with fp16/bf16 compression."""
    if compression not in ("none", "fp16", "bf16"):
        raise ValueError(f"compression must be none, fp16 or bf16, got {compression!r}")
    return num_params * BYTES_PER_FP32 * (0.5 if compression != "none" else 1.0)


def worker_counts(max_workers: int) -> list[int]:
    """1, 2, 4, ... up to max_workers (max_workers itself included)."""
    if max_workers < 1:
        raise ValueError(f"plan.max_workers must be >= 1, got {max_workers}")
    counts, w = [], 1
    while w < max_workers:
        counts.append(w)
        w *= 2
    return counts + [max_workers]


@dataclass(frozen=True)
class Compute:
    """One worker's compute per step at its per-worker batch."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    per_worker_batch: int
    num_params: int
    source: str
    # Per-step totals as measured (a profile has them; a result.json only its mean).
    step_samples: tuple[float, ...] = ()

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def slowest_of(self, workers: int) -> float:
        """Expected compute of the slowest of `workers` workers (the mean step for one worker)."""
        if not self.step_samples:
            return self.total_s
        return expected_max(self.step_samples, workers)


@dataclass(frozen=True)
class ScalingRow:
    workers: int
    global_batch: int
    compute_s: float
    allreduce_s: float
    step_s: float
    epoch_s: float
    speedup: float
    efficiency: float
    slower: bool  # the epoch takes longer than with the previous (smaller) W
    beyond_critical: bool  # b x W > critical batch
    beyond_dataset: bool  # b x W > N: not even one step per epoch
    synchronous_step_s: float | None = None  # with plan.delay: the step without overlap, for comparison


def scaling_rows(
    compute: Compute,
    network: Network,
    workers: list[int],
    train_samples: int,
    compression: str = "none",
    overlap: float = 0.0,
    critical_batch: float | None = None,
    delay: int = 0,
    shard: str = "none",
) -> list[ScalingRow]:
    """The table over W: step and epoch time, speedup vs W=1 and scaling efficiency (`shard=fsdp`: the
    communication of a sharded step, `fsdp_seconds`, in the allreduce column)."""
    nbytes = gradient_bytes(compute.num_params, compression)
    b = compute.per_worker_batch
    base_epoch = epoch_seconds(compute.slowest_of(1), train_samples, b)  # W=1: no communication
    communicate = fsdp_seconds if shard == "fsdp" else ring_allreduce_seconds
    rows: list[ScalingRow] = []
    for w in workers:
        comm = communicate(nbytes, w, network.bandwidth_bytes_per_s, network.latency_s)
        slowest = compute.slowest_of(w)
        synchronous = step_seconds(slowest, comm, overlap, compute.backward_s)
        step = overlapped_step_seconds(slowest, comm) if delay else synchronous
        epoch = epoch_seconds(step, train_samples, b * w)
        speedup = base_epoch / epoch
        rows.append(ScalingRow(
            workers=w, global_batch=b * w, compute_s=slowest, allreduce_s=comm, step_s=step,
            epoch_s=epoch, speedup=speedup, efficiency=speedup / w,
            slower=bool(rows) and epoch > rows[-1].epoch_s,
            beyond_critical=critical_batch is not None and b * w > critical_batch,
            beyond_dataset=b * w > train_samples,
            synchronous_step_s=synchronous if delay else None,
        ))
    return rows


