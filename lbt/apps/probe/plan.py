"""Where `lbt probe` branches and what it costs: the base run's budget, its snapshots and the branches' jobs."""

from __future__ import annotations

from dataclasses import dataclass

from lbt.apps.probe.settings import ProbeSettings
from lbt.errors import ConfigError
from lbt.spec.batching import make_budget
from lbt.spec.run import RunSpec

SWEEP_SEEDS = 2  # the full sweep a probe replaces: every world size k x W0 of the probe, this many seeds


@dataclass(frozen=True)
class ProbePlan:
    base_batch: int  # B0, the base run's global batch
    world_size: int  # W0, its data-parallel workers
    per_worker_batch: int
    budget: int  # samples the base run trains (the user's budget)
    epoch_samples: int  # samples in one epoch at B0
    checkpoints: tuple[int, ...]  # samples seen at each snapshot
    branch_samples: int  # Δ, each held-LR branch's
    cooldowns: tuple[int, ...]  # each checkpoint's k=1 cooldown, in samples (empty: none)
    factors: tuple[int, ...]
    seeds: tuple[int, ...]  # the k=1 branches' seeds; the first is the base run's, used at every k
    sweep_samples: int  # what the sweep over the same batches (SWEEP_SEEDS seeds) trains

    def batch(self, factor: int) -> int:
        return factor * self.base_batch

    @property
    def most_samples(self) -> int:
        """The probe's samples if no branch stops early and none is pruned."""
        branches = len(self.checkpoints) * (len(self.factors) - 1 + len(self.seeds))
        return self.budget + branches * self.branch_samples + sum(self.cooldowns)


def make_plan(spec: RunSpec, num_train: int, settings: ProbeSettings) -> ProbePlan:
    """Snapshots log-uniform in samples from `first` to `last` of the budget, each moved to where every
    probed batch has a step boundary (a multiple of the largest batch into its epoch), so all branches
    of a checkpoint start together and train on the same samples."""
    layout = spec.layout
    if layout.tensor_parallel > 1:
        raise ConfigError("lbt probe: a base run with dist.tensor_parallel > 1 is not supported; probe the "
                          "data-parallel layout (the batch arithmetic is the same)")
    base, largest = layout.global_batch, settings.max_factor * layout.global_batch
    if largest > num_train:
        raise ConfigError(f"probe.max_factor={settings.max_factor}: the largest branch's global batch "
                          f"({largest:,}) exceeds the training set ({num_train:,} samples)")
    budget = make_budget([layout] * spec.trainer.epochs, num_train, spec.trainer.max_steps)
    total, epoch_samples = budget.total_samples, layout.steps_per_epoch(num_train) * base
    starts = num_train // largest  # whole steps of the largest batch in an epoch: where snapshots may lie
    points = []
    for i in range(settings.checkpoints):
        fraction = settings.first * (settings.last / settings.first) ** (i / max(settings.checkpoints - 1, 1))
        epoch, into = divmod(fraction * total, epoch_samples)
        at = int(epoch) * epoch_samples + min(round(into / largest), starts - 1) * largest
        points.append(at if at > 0 else largest)
    checkpoints = tuple(sorted(set(points)))
    delta = max(round(settings.delta * total), 2 * largest)  # two steps of the largest batch at least
    if checkpoints[-1] + delta > total:
        raise ConfigError(f"probe.delta={settings.delta:g}: a branch of {delta:,} samples from the last snapshot "
                          f"(at {checkpoints[-1]:,}) runs past the budget ({total:,} samples); lower probe.delta, "
                          "probe.last or probe.max_factor")
    cooldowns = tuple(max(round(settings.cooldown * at), base) for at in checkpoints) if settings.cooldown else ()
    if any(at + cool > total for at, cool in zip(checkpoints, cooldowns)):
        raise ConfigError(f"probe.cooldown={settings.cooldown:g}: the last snapshot's cooldown runs past the budget "
                          f"({total:,} samples); lower probe.cooldown or probe.last")
    factors = tuple(settings.factors)
    sweep = sum(make_budget([layout.grown(k, "world_size")] * spec.trainer.epochs, num_train,
                            spec.trainer.max_steps).total_samples for k in factors) * SWEEP_SEEDS
    seed = spec.trainer.seed
    return ProbePlan(base, layout.world_size, layout.per_worker_batch, total, epoch_samples, checkpoints, delta,
                     cooldowns, factors, tuple(seed + i for i in range(settings.seeds)), sweep)
