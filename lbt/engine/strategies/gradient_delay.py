"""Delayed gradients: the update at step t applies the global-batch gradient of step t-d.

d=1 is double buffering (ChainerMN `create_multi_node_optimizer(...,
double_buffering=True)`, `chainermn/optimizers.py` `_DoubleBufferingOptimizer`):
step t's allreduce runs while step t+1 computes its forward and backward, and
step t+1's update applies it. d > 1 models the staleness of asynchronous SGD
with about d updates in flight (Dean et al. 2012; Chen et al. 2016 compare it
with synchronous SGD); the update rule is x_{t+1} = x_t - lr_t * g(x_{t-d})
as in Lian et al. 2015 ("Asynchronous Parallel Stochastic Gradient for
Nonconvex Optimization").

Convention (ChainerMN's): the optimizer is unchanged and is handed the
delayed gradient. Momentum accumulates the delayed gradients in the order
they are applied, weight decay acts on the current parameters, and the LR is
the schedule's at the update (a function of samples seen at step t, not at
step t-d). The first d steps have no averaged gradient to apply yet and take
no update (ChainerMN's `needs_update` is False at the first step); the last
d gradients are never applied. A run of T steps makes T-d updates.

Simulated workers (one process, or several processes' virtual workers before
their allreduce) keep the d most recent averaged gradients: exact. Real
processes launch each step's allreduce without waiting (`async_op=True` from
DDP's communication hook, which hands DDP the local gradient at once) and wait
for it only when the update d steps later needs it, so communication overlaps
the next steps' compute. The pending gradients (waited for first) are in every
rank's checkpoint, so a resume is exact.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from lbt.engine.strategies.base import StepStrategy
from lbt.errors import ConfigError
from lbt.metrics.text_log import note
from lbt.spec.batching import BatchLayout
from lbt.spec.validate import integer
from lbt.techniques.base import CommHook, Progress, Technique
from lbt.techniques.comm_compression import CommCompression
from lbt.techniques.gns import GradientNoiseScale


class DelayLine:
    """A queue of length d: push this step's item, get back the one pushed d steps ago (None at first)."""

    def __init__(self, delay: int):
        self.delay = delay
        self.items: deque = deque()

    def push(self, item):
        self.items.append(item)
        return self.items.popleft() if len(self.items) > self.delay else None


class _Allreduce:
    """One bucket's gradients on their way: a copy of the bucket, being averaged by an async allreduce."""

    def __init__(self, bucket, param_index: dict[int, int]):
        self.indices = [param_index[id(p)] for p in bucket.parameters()]
        self.sizes = [g.numel() for g in bucket.gradients()]
        self.shapes = [g.shape for g in bucket.gradients()]
        # Divide first, then sum: what torch's allreduce_hook does, so the mean is the same number.
        self.buffer = bucket.buffer().div(dist.get_world_size())
        self.work = dist.all_reduce(self.buffer, async_op=True)

    def wait(self) -> dict[int, torch.Tensor]:
        self.work.wait()
        parts = self.buffer.split(self.sizes)
        return {i: part.view(shape) for i, part, shape in zip(self.indices, parts, self.shapes)}


class GradientDelay(StepStrategy):
    """Apply at each step the averaged gradient of `delay` steps before (double buffering at 1)."""

    name = "gradient_delay"
    # After measurements (gns reads the step's own gradient), before clipping (which clips the applied one).
    order = 85
    conflicts = {CommCompression: "both replace DDP's allreduce (compressing a delayed allreduce is not supported)"}

    def __init__(self, delay: int = 1):
        self.delay = integer("strategy.delay", delay, 1, 1000)
        # Each entry: one step's averaged gradient, {parameter index: tensor}, or its allreduces in flight.
        self.line = DelayLine(self.delay)
        self.params: list[nn.Parameter] = []
        self.param_index: dict[int, int] = {}
        self.launched: list[_Allreduce] | None = None  # this step's, on real processes
        self.real = False

    def setup(self, layout: BatchLayout, techniques: list[Technique]) -> None:
        # measure=[gns], or technique.batch_ramp.mode=auto, which measures the noise scale the same way
        if any(isinstance(t, GradientNoiseScale) for t in techniques) and layout.procs > 1:
            raise ConfigError("strategy=gradient_delay with the noise scale measured (measure gns, or batch_ramp "
                              "mode=auto) on real processes: the noise scale "
                              "needs the step's own averaged gradient, which the delayed allreduce has not "
                              "delivered yet; measure it with simulated workers (dist.procs=1)")
        if layout.world_size == 1:
            note(f"strategy.delay={self.delay}: one worker in all; the delay is still applied "
                 "(it models a stale gradient, with no allreduce to overlap)")

    def comm_hook(self, allreduce: CommHook, ddp_model: nn.Module) -> CommHook:
        # Replaces the allreduce: launch it, hand DDP the local gradient now, wait d steps later.
        self.real = True
        module: nn.Module = ddp_model.module  # type: ignore[assignment]
        self.param_index = {id(p): i for i, p in enumerate(p for p in module.parameters() if p.requires_grad)}

        def launch(bucket: dist.GradBucket) -> torch.futures.Future:
            if self.launched is None:
                self.launched = []
            self.launched.append(_Allreduce(bucket, self.param_index))
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done

        return launch

    def after_backward(self, model: nn.Module, progress: Progress) -> None:
        if not self.params:
            self.params = [p for p in model.parameters() if p.requires_grad]
        fresh: list[_Allreduce] | dict[int, torch.Tensor] | None
        if self.real:
            fresh, self.launched = self.launched, None
        else:  # one process: .grad already is the mean over all (simulated) workers
            fresh = {i: p.grad.detach().clone() for i, p in enumerate(self.params) if p.grad is not None}
        delayed = self.line.push(fresh)
        if isinstance(delayed, list):
            delayed = _wait(delayed)
        # No gradient d steps ago (the first d steps): .grad None, so the optimizer skips every parameter.
        delayed = delayed or {}
        for i, p in enumerate(self.params):
            p.grad = delayed.get(i)

    @contextmanager
    def evaluated(self, model: nn.Module) -> Iterator[None]:
        self._settle()  # no collective of the evaluation behind unwaited ones
        yield

    def _settle(self) -> None:
        """Wait for the allreduces in flight; keep their results."""
        self.line.items = deque(_wait(item) if isinstance(item, list) else item for item in self.line.items)

    def state_dict(self) -> dict:
        self._settle()
        return {"pending": [{i: g.clone() for i, g in item.items()} for item in self.line.items]}

    def load_state_dict(self, state: dict) -> None:
        if state:
            self.line.items = deque(dict(item) for item in state["pending"])

    def describe(self) -> str:
        what = "double buffering" if self.delay == 1 else "stale gradients"
        return f"gradient delay d={self.delay} ({what}: step t applies step t-{self.delay}'s averaged gradient)"


def _wait(launched: list[_Allreduce]) -> dict[int, torch.Tensor]:
    grads: dict[int, torch.Tensor] = {}
    for allreduce in launched:
        grads.update(allreduce.wait())
    return grads
