"""Gradient noise scale and critical batch size (McCandlish, Kaplan, Amodei et al. 2018).

"An Empirical Model of Large-Batch Training", appendix A: from the squared
norms of the gradient of a small batch b (one worker's) and of the averaged
gradient of the global batch B, two unbiased estimates

    |G|^2 = (B |g_B|^2 - b |g_b|^2) / (B - b)     tr(S) = (|g_b|^2 - |g_B|^2) / (1/b - 1/B)

are each smoothed by an exponential moving average; B_simple = tr(S) / |G|^2
(ratio of the averages). Batches are drawn without replacement from N
samples, so 1/B becomes the finite-population factor c(B) = (N - B) / ((N - 1) B).

B_simple is McCandlish et al.'s critical batch for plain SGD, whose step is the raw gradient. Under
LARS, LAMB or AdamW the ratio is still measured from the gradients, but it is no critical batch of
that step: readers of result.json (lbt report, lbt probe) show "not defined" for such runs
(lbt/metrics/critical.py: b_simple_undefined).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from lbt.metrics.text_log import note
from lbt.parallel.tensor_parallel import whole
from lbt.spec.batching import BatchLayout
from lbt.spec.result import EvalPoint
from lbt.spec.validate import integer, number
from lbt.techniques.base import CommHook, Progress, Technique

B_SIMPLE = "gns/b_simple"  # the metric and curve B_simple is logged under (result.json, TensorBoard)

def finite_population_factor(batch: float, population: float | None) -> float:
    """Variance factor of a batch mean drawn without replacement: (N - B) / ((N - 1) B); 1/B if N is None."""
    if population is None:
        return 1.0 / batch
    return (population - batch) / ((population - 1) * batch)


def noise_scale_terms(small_sq: float, big_sq: float, small_batch: float, big_batch: float,
                      population: float | None = None) -> tuple[float, float]:
    """Unbiased (|G|^2, tr(S)) from one pair of squared gradient norms."""
    c_small = finite_population_factor(small_batch, population)
    c_big = finite_population_factor(big_batch, population)
    trace = (small_sq - big_sq) / (c_small - c_big)
    return big_sq - c_big * trace, trace


class NoiseScaleEstimator:
    """EMAs of |G|^2 and tr(S), with bias correction; B_simple is their ratio."""

    def __init__(self, decay: float = 0.95):
        self.decay = decay
        self.grad_sq = self.trace = 0.0
        self.weight = 0.0  # sum of EMA weights, for the bias correction

    def update(self, small_sq: float, big_sq: float, small_batch: float, big_batch: float,
               population: float | None = None) -> None:
        grad_sq, trace = noise_scale_terms(small_sq, big_sq, small_batch, big_batch, population)
        self.grad_sq = self.decay * self.grad_sq + (1 - self.decay) * grad_sq
        self.trace = self.decay * self.trace + (1 - self.decay) * trace
        self.weight = self.decay * self.weight + (1 - self.decay)

    @property
    def b_simple(self) -> float:
        if self.weight == 0 or self.grad_sq <= 0:
            return float("nan")
        return self.trace / self.grad_sq

    def state(self) -> dict[str, float]:
        if self.weight == 0:
            return {}
        return {"gns/grad_sq": self.grad_sq / self.weight, "gns/trace": self.trace / self.weight,
                B_SIMPLE: self.b_simple}


def grad_sq_norm(model: nn.Module) -> torch.Tensor:
    grads = [p.grad.detach() for p in model.parameters() if p.grad is not None]
    return torch.stack([whole(g.double().pow(2).sum()) for g in grads]).sum()


# `every: auto` keeps the measurement's extra pass near this share of a step's compute.
AUTO_EVERY_COST = 0.03
# A pass of one worker's b samples costs about this many times b/(k b) of a fused k-worker pass:
# small passes use the hardware worse (bench/results/2026-11-23-gns-cost.md).
SMALL_PASS_PENALTY = 1.5


def measure_every(every: int | str, workers_per_proc: int) -> int:
    """Measure on every n-th step: n as given, or for `auto` the smallest n whose extra pass costs about
    AUTO_EVERY_COST of the step (1 where the worker's gradient comes free: one worker per process)."""
    if isinstance(every, int):
        return every
    if workers_per_proc == 1:
        return 1
    return max(1, math.ceil(SMALL_PASS_PENALTY / (workers_per_proc * AUTO_EVERY_COST)))


class GradientNoiseScale(Technique):
    """Measure B_simple every n-th step: a running estimate of the critical batch size.

    The small batch is one worker's batch b. With several workers per process
    the trainer computes the first worker's gradient on its own, beside the step,
    and calls on_worker_gradient; with one worker per process (real workers) a
    DDP communication hook reads the local gradient before the allreduce. Either
    way the step itself is the one the run takes without the measurement. Needs
    world_size >= 2; with one worker there is nothing to compare, and the
    technique records nothing. Order 80: before gradient clipping.

    The extra pass of the first way costs about 1/k of a step of k fused workers: with `every: auto` it
    runs every n-th step only (`measure_every`). The EMA keeps its decay per measurement, so it averages
    as many measurements (1 / (1 - ema_decay)) whatever n is: fewer measurements in the average would
    let B_simple's denominator |G|^2 fall below zero more often (bench/results/2026-11-23-gns-cost.md).
    """

    name = "gns"
    order = 80

    def __init__(self, ema_decay: float = 0.95, finite_population: bool = True, every: int | str = "auto"):
        number("technique.gns.ema_decay", ema_decay, 0, 1, high_open=True)
        self.every_setting: int | str = "auto"
        if every != "auto":
            self.every_setting = self.worker_gradient_every = integer("technique.gns.every (or auto)", every, 1)
        self.estimator = NoiseScaleEstimator(ema_decay)
        self.finite_population = finite_population
        self.worker_sq: torch.Tensor | None = None
        self.worker_batch: int | None = None
        # Each parameter's local squared gradient norm as DDP's hook saw it, summed in parameter order at the
        # step's end: the same float sum whatever buckets DDP groups the gradients in (they differ on resume).
        self.hook_sq: dict[int, torch.Tensor] = {}
        self.param_index: dict[int, int] = {}
        # B_simple at each evaluation: how the estimate moves over training (it grows as the loss falls).
        self.curve: list[list[float]] = []

    def check_layout(self, layout: BatchLayout) -> None:
        if layout.world_size == 1:
            note("measure gns: one worker in all, so no smaller batch to compare with: no noise scale is measured")
        if self.worker_gradient_every is None:  # decided by the first batch layout
            self.worker_gradient_every = measure_every(self.every_setting, layout.workers_per_proc)

    def on_worker_gradient(self, grads: list[torch.Tensor], per_worker_batch: int, workers: int) -> None:
        self.worker_sq = torch.stack([whole(g.double().pow(2).sum()) for g in grads]).sum()
        self.worker_batch = per_worker_batch

    def comm_hook(self, inner: CommHook, ddp_model: nn.Module) -> CommHook:
        # Order 80: wraps any compression, so it reads the full-precision local gradient.
        module = ddp_model.module
        assert isinstance(module, nn.Module)
        self.param_index = {id(p): i for i, p in enumerate(module.parameters())}

        def measure_then_reduce(bucket):
            for param, grad in zip(bucket.parameters(), bucket.gradients()):
                self.hook_sq[self.param_index[id(param)]] = grad.double().pow(2).sum()
            return inner(bucket)

        return measure_then_reduce

    def after_backward(self, model: nn.Module, progress: Progress) -> None:
        worker_sq, self.worker_sq = self.worker_sq, None
        hook_sq = torch.stack([self.hook_sq[i] for i in sorted(self.hook_sq)]).sum() if self.hook_sq else None
        self.hook_sq = {}
        if progress.step % (self.worker_gradient_every or 1):
            return  # a real worker's hook read this step for free: skipped alike, so layouts measure alike
        procs = dist.get_world_size() if dist.is_initialized() else 1
        if worker_sq is None:
            if hook_sq is None or procs == 1:
                return  # one worker in all: no small batch to compare with
            # The hook read the gradient before fp16's scaling was undone.
            worker_sq, small_batch = hook_sq / progress.grad_scale ** 2, progress.global_batch // procs
        else:
            small_batch = self.worker_batch or progress.global_batch  # set with worker_sq, by on_worker_gradient
        if small_batch >= progress.global_batch:
            return
        if procs > 1:
            worker_sq = self.combine_processes(worker_sq, procs)
        population = progress.samples_per_epoch if self.finite_population else None
        small_sq, big_sq = worker_sq.item(), grad_sq_norm(model).item()
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return  # an fp16 step that overflowed (and is skipped): nothing to learn from it
        self.estimator.update(small_sq, big_sq, small_batch, progress.global_batch, population)

    def combine_processes(self, worker_sq: torch.Tensor, procs: int) -> torch.Tensor:
        """Every process measured its own first worker: average them (a steadier estimate)."""
        dist.all_reduce(worker_sq)
        return worker_sq / procs

    def after_eval(self, point: EvalPoint) -> None:
        if self.estimator.weight:
            self.curve.append([point.samples_seen, self.estimator.b_simple])

    def metrics(self) -> dict[str, float]:
        return self.estimator.state()

    def curves(self) -> dict[str, list[list[float]]]:
        return {B_SIMPLE: list(self.curve)}

    def state_dict(self) -> dict:
        e = self.estimator
        return {"grad_sq": e.grad_sq, "trace": e.trace, "weight": e.weight, "curve": [list(p) for p in self.curve]}

    def load_state_dict(self, state: dict) -> None:
        if not state:  # the checkpoint was written without this measurement
            return
        self.curve = [list(p) for p in state["curve"]]
        for key in ("grad_sq", "trace", "weight"):
            setattr(self.estimator, key, state[key])

    def describe(self) -> str:
        every = self.worker_gradient_every or 1
        return "gradient noise scale (B_simple)" + (f", every {every} steps" if every > 1 else "")
