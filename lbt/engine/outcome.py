"""What a run says when it starts and what it leaves when it ends: the start lines, result.json, the
HParams row and the closing line (rank 0 only)."""

from __future__ import annotations

from pathlib import Path

import torch
import yaml

from lbt.engine.build import Parts
from lbt.metrics.critical import b_simple_undefined, run_optimizer
from lbt.metrics.tensorboard import RunLogger
from lbt.metrics.text_log import say
from lbt.paths import atomic_write
from lbt.spec import lr as lbt_lr
from lbt.spec.objective import bits
from lbt.spec.result import RunResult, write_result
from lbt.spec.run import RunSpec
from lbt.techniques.gns import B_SIMPLE


def print_start(spec: RunSpec, parts: Parts, run_dir: str) -> None:
    """The resolved config, then one line with the batch arithmetic and the LR it leads to."""
    say(yaml.safe_dump(dict(spec.config), sort_keys=False, default_flow_style=False, allow_unicode=True).rstrip(),
        kind="config")
    techniques = [t.describe() for t in parts.techniques]
    if parts.strategy.name != "synchronous":
        techniques.insert(0, parts.strategy.describe())
    if techniques:
        say(f"techniques: {' | '.join(techniques)}")
    say(f"{parts.layout.describe(parts.data.num_train)} {lbt_lr.describe(parts.schedule, parts.budget)} "
        f"run_dir={run_dir}")
    largest = max(layout.global_batch for layout in parts.budget.layouts)
    for warning in (lbt_lr.warmup_outlasts_run(parts.schedule, parts.budget),
                    lbt_lr.adam_sqrt_out_of_range(parts.schedule, largest)):
        if warning:
            say(f"lbt: warning: {warning}", stderr=True)


def describe_techniques(parts: Parts) -> list[str]:
    """The techniques (and a strategy other than synchronous SGD) as result.json lists them."""
    strategy = [] if parts.strategy.name == "synchronous" else [parts.strategy.describe()]
    return strategy + [t.describe() for t in parts.techniques]


def hparams_identity(spec: RunSpec, parts: Parts) -> dict[str, str]:
    """What tells two runs apart in TensorBoard's HParams table besides batch and LR: model, data,
    optimizer, schedule and techniques (without them, runs differing only there look identical)."""
    s = parts.schedule
    warmup = f"{s.warmup_mode} warmup {s.warmup_samples:,} samples" if s.warmup_samples else "no warmup"
    optimizer = run_optimizer(spec.config) or spec.optim.name
    return {"model": spec.model.name, "data": spec.data.name, "optim": optimizer,
            "schedule": f"{s.scaling} scaling, {warmup}, {s.decay} decay",
            "techniques": ", ".join(describe_techniques(parts)) or "none"}


def finished_result(spec: RunSpec, parts: Parts, result: RunResult) -> RunResult:
    """The trainer's result with what was run: the layout, the LRs, the techniques and the resolved config."""
    layout = parts.layout
    result.peak_lr, result.peak_lr_samples = lbt_lr.peak(parts.schedule, parts.budget)
    result.recipe, result.overrides, result.seed = spec.recipe, list(spec.overrides), spec.trainer.seed
    result.world_size, result.procs = layout.gpus, layout.procs * layout.tensor_parallel
    result.tensor_parallel, result.data_parallel = layout.tensor_parallel, layout.world_size
    result.per_worker_batch, result.global_batch = layout.per_worker_batch, layout.global_batch
    result.steps_per_epoch, result.base_lr = layout.steps_per_epoch(parts.data.num_train), spec.base_lr
    result.epochs = round(result.samples_seen / max(parts.data.num_train, 1), 4)  # what ran, not what was asked
    result.token, result.techniques, result.config = parts.data.token, describe_techniques(parts), dict(spec.config)
    result.device = next(parts.model.parameters()).device.type if any(True for _ in parts.model.parameters()) \
        else None
    undefined = b_simple_undefined(run_optimizer(spec.config))
    if undefined and B_SIMPLE in {*result.technique_metrics, *result.technique_curves}:
        # Measured (it costs the run nothing), but no critical batch for this step: not reported as one.
        result.technique_metrics = {k: v for k, v in result.technique_metrics.items() if k != B_SIMPLE}
        result.technique_curves = {k: v for k, v in result.technique_curves.items() if k != B_SIMPLE}
        result.techniques.append(f"gns: B_simple {undefined}")
    return result


def finish(spec: RunSpec, parts: Parts, result: RunResult, run_dir: str, logger: RunLogger,
           model_state: dict) -> RunResult:
    """Write result.json, final_model.pt and the HParams row; print the closing line."""
    result = finished_result(spec, parts, result)
    layout, split = parts.layout, result.eval_split
    logger.hparams(
        {"world_size": layout.world_size, "per_worker_batch": layout.per_worker_batch,
         "global_batch": layout.global_batch, "recipe": spec.recipe, "lr": spec.base_lr, "peak_lr": result.peak_lr,
         "peak_lr_samples": result.peak_lr_samples, "seed": spec.trainer.seed, **hparams_identity(spec, parts)},
        {f"hparam/final_{split}_acc": result.final_acc, f"hparam/best_{split}_acc": result.best_acc,
         **({"hparam/test_acc": result.test_acc} if split == "val" and result.test_acc is not None else {})},
    )
    atomic_write(Path(run_dir) / "final_model.pt", lambda f: torch.save(model_state, f))
    write_result(run_dir, result)
    say(f"done: {closing_scores(result)} steps={result.steps} samples/s={result.samples_per_sec:,.0f} "
        f"wall={result.wall_seconds:.1f}s -> {run_dir}/result.json", kind="result")
    return result


def closing_scores(result: RunResult) -> str:
    """`val_acc=0.9512 test_acc=0.9488`; a language model's bits per token beside each accuracy."""
    if result.diverged:
        return "DIVERGED"
    scores: list[tuple[str, float, float | None]] = [(result.eval_split, result.final_acc, result.final_loss)]
    if result.test_acc is not None and result.eval_split != "test":
        scores.append(("test", result.test_acc, result.test_loss))
    token = result.token
    return " ".join(f"{split}_acc={acc:.4f}" + (f" {split}_bits_per_{token}={bits(loss):.4f}" if token else "")
                    for split, acc, loss in scores)
