"""`run(cfg)`: one training run, callable from the CLI (lbt/cli.py), tests and notebooks alike.

`run()` resolves the config once in the launching process and hands plain
dicts to the workers, so every rank agrees on it and on the run folder. Each
process then builds its parts (`build_parts`: data, model, techniques,
optimizer, LR schedule) and hands them to the Trainer (lbt/trainer.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lbt import dist as lbt_dist
from lbt import lr as lbt_lr
from lbt import tensor_parallel
from lbt.accel import Precision, check_channels_last
from lbt.checkpoint import Checkpointer, run_identity
from lbt.config import (DEFAULT_PER_WORKER_BATCH, BatchPlan, Budget, auto_tensor_parallel, check_dist,
                        check_trainer, make_budget, plan_batches)
from lbt.data import DataSplits
from lbt.data.batches import loader_workers
from lbt.errors import ConfigError
from lbt.validate import integer
from lbt.metrics.tensorboard import RunLogger
from lbt.metrics.text_log import say, text_log
from lbt.objective import bits
from lbt.paths import atomic_write
from lbt.techniques import Technique, sort_techniques
from lbt.trainer import LoopSettings, Result, Trainer


def run(cfg: DictConfig | dict, run_dir: str | Path, recipe: str | None = None,
        overrides: list[str] | None = None, techniques: list[Technique] = ()) -> dict:
    """Train once as `cfg` says, writing TensorBoard events and result.json into run_dir.

    `recipe` names the recipe for reports; `overrides` (the command line's) are
    kept in result.json so a study report can tell its variants apart.
    `techniques` join the config's (built objects, e.g. a tuner's pruning hook;
    in-process runs only: they are not sent to spawned workers).
    """
    config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    config["recipe"] = recipe or config.get("recipe") or "custom"
    config["overrides"] = list(overrides or config.get("overrides") or [])
    run_dir = str(Path(run_dir).resolve())
    env = lbt_dist.torchrun_env()
    procs = check_layout(config, env)
    if env is not None:
        restarts = lbt_dist.elastic_restarts()
        if restarts:  # torchrun --max-restarts started the workers again after one died
            config["trainer"]["resume"] = "auto"
        # Only rank 0 has the summary; the other torchrun ranks return {}.
        summary = _train_process(env["rank"], None, config, run_dir, procs, env["local_rank"], env["local_procs"])
        if summary and restarts:
            summary = record_restarts(run_dir, [{"by": "torchrun --max-restarts", "restarts": restarts}])
        return summary
    if procs == 1 and not config["dist"]["max_restarts"]:
        return _train_process(0, None, config, run_dir, 1, 0, 1, list(techniques))
    if techniques:
        raise ConfigError("run(techniques=...) adds techniques to in-process runs only (dist.procs=1, "
                          "dist.max_restarts=0)")
    # Build the data once here: generates caches before the workers start and
    # reports a missing dataset as one line from one process.
    build(config["data"], "data")
    restarts = launch_with_restarts(config, run_dir, procs)
    result_path = Path(run_dir) / "result.json"
    if not result_path.exists():  # stopped by a signal after a checkpoint
        return {"stopped": True}
    return record_restarts(run_dir, restarts) if restarts else json.loads(result_path.read_text())


def record_restarts(run_dir: str, restarts: list[dict]) -> dict:
    """Add the job's restarts to the result.json its last attempt wrote; return the result."""
    path = Path(run_dir) / "result.json"
    result = {**json.loads(path.read_text()), "restarts": restarts}
    atomic_write(path, lambda f: f.write(json.dumps(result, indent=2, allow_nan=True).encode()))
    return result


def launch_with_restarts(config: dict, run_dir: str, procs: int) -> list[dict]:
    """Start the workers; when one dies, start them again from the last checkpoint, dist.max_restarts times.

    lbt's resume is exact, so a restarted job ends with the parameters of an uninterrupted one.
    A config error is not retried (the worker printed it; it would fail again), nor is a diverged
    run (its workers end well). Returns one record per restart: which rank died, how, at which
    step, and the step the job continued from.
    """
    restarts, limit = [], config["dist"]["max_restarts"]
    while True:
        steps = lbt_dist.step_board(procs)
        try:
            lbt_dist.launch_local(_spawned_process, (steps, config, run_dir, procs), procs)
            return restarts
        except lbt_dist.WorkerDied as died:
            if not died.restartable or len(restarts) >= limit:
                raise
            latest = Checkpointer(run_dir, 0, procs).latest()
            restarts.append({"rank": died.rank, "how": died.how, "step": steps[died.rank],
                             "resumed_from_step": latest["step"] if latest else 0})
            print(f"lbt: note: {died} after step {steps[died.rank]}; restarting ({len(restarts)} of {limit}) "
                  f"from the checkpoint at step {restarts[-1]['resumed_from_step']}", file=sys.stderr, flush=True)
        config = {**config, "trainer": {**config["trainer"], "resume": "auto"}}


def check_layout(config: dict, env: dict | None) -> int:
    """Validate what can be checked before any process starts; fill in dist.procs/world_size; return procs."""
    dist_cfg, trainer = config["dist"], config["trainer"]
    check_trainer(trainer)
    check_dist(dist_cfg, env is not None)
    for key in ("world_size", "procs"):  # null means "as many as there are"; 0 is a mistake, not "unset"
        if dist_cfg.get(key) is not None:
            integer(f"dist.{key}", dist_cfg[key])
    check_backend(dist_cfg["backend"], trainer.get("device", "auto"))
    if env is not None:
        if dist_cfg.get("procs") not in (None, env["procs"]):
            raise ConfigError(f"dist.procs={dist_cfg['procs']} but torchrun started {env['procs']} processes")
        dist_cfg["procs"] = env["procs"]
    resolve_tensor_parallel(dist_cfg, trainer, env)
    procs = dist_cfg.get("procs") or lbt_dist.default_procs()
    dist_cfg["procs"] = procs
    dist_cfg["world_size"] = dist_cfg.get("world_size") or procs
    plan_batches(dist_cfg["world_size"], procs, trainer.get("per_worker_batch"), trainer.get("global_batch"),
                 tensor_parallel=dist_cfg["tensor_parallel"])
    if dist_cfg["tensor_parallel"] > 1 and trainer["precision"] == "fp16":
        raise ConfigError(f"trainer.precision=fp16 with dist.tensor_parallel={dist_cfg['tensor_parallel']}: torch's "
                          "GradScaler cannot unscale split (DTensor) and replicated gradients together; use bf16")
    return procs


def resolve_tensor_parallel(dist_cfg: dict, trainer: dict, env: dict | None) -> int:
    """dist.tensor_parallel as a number: `auto` becomes the T that keeps the global batch under the cap."""
    value = dist_cfg["tensor_parallel"]
    if value == "auto":
        if trainer.get("global_batch") is not None:
            raise ConfigError("dist.tensor_parallel=auto sets the global batch from trainer.per_worker_batch and "
                              "dist.max_global_batch; give trainer.per_worker_batch, not trainer.global_batch")
        world_size = integer("dist.world_size", dist_cfg.get("world_size") or (env or {}).get("procs") or 1)
        value = auto_tensor_parallel(world_size, trainer.get("per_worker_batch") or DEFAULT_PER_WORKER_BATCH,
                                     dist_cfg.get("max_global_batch"))
        dist_cfg["world_size"] = world_size
        procs = dist_cfg.get("procs") or (env or {}).get("procs") or lbt_dist.default_procs()
        if isinstance(procs, int) and procs % value:
            raise ConfigError(f"dist.tensor_parallel=auto chose T={value} (global batch at or below "
                              f"{dist_cfg['max_global_batch']}), which does not divide dist.procs={procs}: start "
                              f"a multiple of {value} processes")
    elif isinstance(value, (str, bool)):
        raise ConfigError(f"dist.tensor_parallel={value}: give a number of processes per group or auto")
    dist_cfg["tensor_parallel"] = integer("dist.tensor_parallel", value)
    return dist_cfg["tensor_parallel"]


def check_backend(backend: str, device: str) -> None:
    """NCCL moves CUDA tensors only: refused up front on a CPU run, not as a worker's unexplained exit."""
    if backend != "nccl":
        return
    if device == "cpu":
        raise ConfigError("dist.backend=nccl with trainer.device=cpu: NCCL only moves CUDA tensors; "
                          "use dist.backend=gloo (or auto)")
    if not torch.cuda.is_available():
        raise ConfigError("dist.backend=nccl needs CUDA GPUs and this machine has none: "
                          "use dist.backend=auto (gloo on CPU) or gloo")


def check_model_takes(model: torch.nn.Module, data: DataSplits) -> None:
    """One forward pass of two training samples, so a model that cannot read the data's samples fails
    with one line before training (e.g. a 2-D network on 1-D signals). In eval mode and with the RNG
    forked: no BatchNorm statistic and no random stream of the run is touched."""
    samples = torch.stack([data.train[i][0] for i in range(min(2, len(data.train)))])
    training = model.training
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model(samples)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"the model cannot read this data's samples (shape {tuple(data.input_shape)}): {first}; "
                          "pick a model for this data (1-D signals: model=cnn1d or mlp; images: resnet20, "
                          "torchvision; text (data=text): char_transformer)") from None
    finally:
        model.train(training)


def check_run_folder(config: dict, run_dir: str) -> None:
    """The run folder's checkpoint against this run (config checked by check_layout), before anything is
    written: a fresh start over a checkpoint, or a resume of another run's, is a ConfigError.
    The workers check again, with the checksums (`Checkpointer.load_latest`)."""
    dist_cfg, trainer = config["dist"], config["trainer"]
    plan = plan_batches(dist_cfg["world_size"], dist_cfg["procs"], trainer["per_worker_batch"], trainer["global_batch"],
                        tensor_parallel=dist_cfg["tensor_parallel"])
    checkpointer = Checkpointer(Path(run_dir).expanduser(), 0, dist_cfg["procs"],
                                identity=run_identity(config, plan.per_worker_batch, plan.global_batch))
    if trainer["resume"] == "auto" or lbt_dist.elastic_restarts():  # torchrun restarts resume (see run())
        checkpointer.check_newest_belongs()
    else:
        checkpointer.refuse_other_run(tidy=False)


def build(node: dict, where: str, **kwargs):
    """hydra.utils.instantiate; a constructor rejecting its config values is a ConfigError naming `where`.

    _convert_="all": objects get plain lists and dicts, never omegaconf containers (a ListConfig in
    an optimizer's state_dict would make its checkpoint unreadable with weights_only=True).
    """
    try:
        return instantiate(node, _convert_="all", **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, (TypeError, ValueError)):
            raise ConfigError(f"{where}: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}") from None
        raise


@dataclass
class Parts:
    """What one process builds from the config before training."""

    data: DataSplits
    plan: BatchPlan  # the configured batch layout (epoch 0's, before any batch ramp)
    budget: Budget
    schedule: lbt_lr.Schedule
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss_fn: Callable
    techniques: list[Technique]


def build_parts(config: dict, ctx: lbt_dist.DistContext, extra_techniques: list[Technique] = ()) -> Parts:
    """Data, batch plan per epoch, model, techniques, the optimizer (once) and the LR schedule."""
    trainer_cfg = config["trainer"]
    data = build(config["data"], "data")
    num_train = len(data.train)
    plan = plan_batches(ctx.world_size, ctx.procs, trainer_cfg["per_worker_batch"], trainer_cfg["global_batch"],
                        num_train, ctx.tensor_parallel)
    techniques = sort_techniques(build_techniques(config) + list(extra_techniques))
    for technique in techniques:
        technique.check_together(techniques)
    torch.manual_seed(trainer_cfg["seed"])  # same initial weights in every process and layout
    model = build(config["model"], "model", input_shape=tuple(data.input_shape), num_classes=data.num_classes)
    check_model_takes(model, data)
    for technique in techniques:
        model = technique.on_model(model)
    model.to(ctx.device)
    if ctx.tensor_parallel > 1:
        tensor_parallel.refuse_comm_hooks(techniques, ctx.tensor_parallel, ctx.dp_procs)
        tensor_parallel.parallelize(model, ctx.mesh, str(config["model"]["_target_"]).rsplit(".", 1)[-1])
    if trainer_cfg["channels_last"]:
        check_channels_last(data.input_shape)
        model.to(memory_format=torch.channels_last)
    data = data.to(ctx.device)  # in-memory data lives on the device: batches are gathered there
    optimizer = build(config["optim"], "optim")(model)
    if ctx.tensor_parallel > 1:
        tensor_parallel.unfuse(optimizer)
    loss_fn = torch.nn.CrossEntropyLoss()
    for technique in techniques:
        loss_fn = technique.on_loss(loss_fn)
    plans = [plan] * trainer_cfg["epochs"]
    for technique in techniques:
        plans = technique.plan_epochs(plans, num_train)
    for technique in techniques:
        for layout in dict.fromkeys(plans):  # each distinct layout, in order
            technique.check_plan(layout)
    for technique in techniques:  # after check_plan: a technique knows by now whether its workers are real
        optimizer = technique.on_optimizer(optimizer, model)
    budget = make_budget(plans, num_train, trainer_cfg["max_steps"])
    optim_cfg = config["optim"]
    schedule = lbt_lr.build_schedule(config["schedule"], optim_cfg["lr"], plan.global_batch, budget,
                                     optim_cfg.get("betas"), optim_cfg.get("eps"))
    for technique in techniques:
        if technique.replaces_lr_decay and schedule.decay != "constant" and ctx.is_main:
            say(f"lbt: warning: technique {technique.name} replaces the LR decay (Smith et al. 2017), but "
                f"schedule.decay={schedule.decay} decays it too; use schedule=constant, as recipe=smith2017_ramp "
                "does", stderr=True)
    return Parts(data, plan, budget, schedule, model, optimizer, loss_fn, techniques)


def build_techniques(config: dict) -> list[Technique]:
    """Every technique the config lists, in their declared order."""
    techniques = []
    for name, node in (config.get("technique") or {}).items():
        if "_target_" not in node:
            # A recipe set options of a technique the command line then deselected.
            lbt_dist.note(f"technique.{name} is configured but not selected; ignored")
            continue
        techniques.append(build(node, f"technique.{name}"))
    return sort_techniques(techniques)


def _spawned_process(rank: int, store_port: int, steps, config: dict, run_dir: str, procs: int) -> None:
    """Body of a process started by lbt's local launcher: one line per failure, no traceback for user errors.

    `steps` (lbt.dist.step_board): where this rank writes each step it finishes.
    """
    def on_step(step: int) -> None:
        steps[rank] = step

    try:
        _train_process(rank, store_port, config, run_dir, procs, rank, procs, on_step=on_step)
    except ConfigError as error:
        if rank == 0:
            print(f"lbt: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except torch.distributed.DistError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"lbt: rank {rank} lost its peers: {first_line}", file=sys.stderr, flush=True)
        sys.exit(1)
    exit_worker()


def exit_worker() -> None:
    """End a finished worker process without the interpreter's teardown.

    Everything is written and the process group destroyed by now. Tearing down
    torch's distributed objects with the interpreter sometimes aborts a gloo
    worker (SIGABRT; bench/README.md "Known incidents"), which the launcher
    would report as a dead worker.
    """
    lbt_dist.flush_std()
    os._exit(0)


def _train_process(rank: int, store_port: int | None, config: dict, run_dir: str, procs: int, local_rank: int,
                   local_procs: int, extra_techniques: list[Technique] = (),
                   on_step: Callable[[int], None] | None = None) -> dict:
    dist_cfg, trainer_cfg = config["dist"], config["trainer"]
    # Share the cores among the processes of this machine, so P=2 on 2 cores
    # does not oversubscribe them.
    torch.set_num_threads(trainer_cfg.get("threads") or max(1, (os.cpu_count() or 1) // local_procs))
    device = lbt_dist.pick_device(trainer_cfg["device"], local_rank)
    backend = lbt_dist.pick_backend(dist_cfg["backend"], device)
    with lbt_dist.process_group(backend, rank, procs, dist_cfg["timeout_s"], store_port), ExitStack() as stack:
        if store_port is None and procs > 1:
            run_dir = _agree_on_run_dir(run_dir)
        stack.enter_context(text_log(run_dir if rank == 0 else None))
        tp = dist_cfg["tensor_parallel"]
        mesh = tensor_parallel.device_mesh(device, procs, tp) if tp > 1 else None
        ctx = lbt_dist.DistContext(rank, procs, local_rank, dist_cfg["world_size"], device, tp, mesh)
        started = time.perf_counter()
        parts = build_parts(config, ctx, extra_techniques)
        if ctx.is_main:
            _print_start(config, parts, run_dir)
        checkpointer = Checkpointer(run_dir, rank, procs, trainer_cfg["keep_checkpoints"],
                                    run_identity(config, parts.plan.per_worker_batch, parts.plan.global_batch))
        resume = None
        if trainer_cfg["resume"] == "auto":
            resume = checkpointer.load_latest()
        else:
            checkpointer.refuse_other_run()
        # TensorBoard purges what a stopped run logged after its checkpoint.
        loop = resume[0]["loop"] if resume else {"step": 0, "samples_seen": 0}
        logger = RunLogger(run_dir if ctx.is_main else None, loop["step"], loop["samples_seen"])
        settings = LoopSettings(seed=trainer_cfg["seed"], log_every=trainer_cfg["log_every"],
                                progress=trainer_cfg["progress"], evals=trainer_cfg["evals"],
                                fuse_workers=dist_cfg["fuse_workers"], checkpoint_every=trainer_cfg["checkpoint_every"],
                                compile=trainer_cfg["compile"], channels_last=trainer_cfg["channels_last"],
                                loader_workers=loader_workers(trainer_cfg["loader_workers"], local_procs))
        precision = Precision(trainer_cfg["precision"], device.type)
        if ctx.is_main:
            say(f"device={device} precision={precision.describe()} compile={settings.compile} "
                f"channels_last={settings.channels_last} loader_workers={settings.loader_workers}")
        trainer = Trainer(parts.model, parts.optimizer, parts.loss_fn, parts.techniques, parts.schedule,
                          parts.budget, parts.data, ctx, settings, logger, checkpointer, precision)
        trainer.on_step = on_step
        if resume is not None:
            trainer.load_checkpoint(*resume)
            trainer.say(f"resumed from step {trainer.state.step} (epoch {trainer.state.epoch + 1}) in {run_dir}")
        with stop_on_signals(trainer):
            result = trainer.fit()
        if result.stopped:
            logger.close()
            return {"stopped": True, "step": result.steps}
        result.wall_seconds = time.perf_counter() - started
        model_state = parts.model.state_dict()
        if ctx.tensor_parallel > 1:  # whole tensors (a collective), as one process would save them
            model_state = tensor_parallel.full_tensors(model_state)
        summary = _finish(config, parts, result, run_dir, logger, model_state) if ctx.is_main else {}
        logger.close()
        return summary


def _print_start(config: dict, parts: Parts, run_dir: str) -> None:
    """The resolved config, then one line with the batch arithmetic and the LR it leads to."""
    say(OmegaConf.to_yaml(OmegaConf.create(config)))
    if parts.techniques:
        say(f"techniques: {' | '.join(t.describe() for t in parts.techniques)}")
    say(f"{parts.plan.describe(len(parts.data.train))} {lbt_lr.describe(parts.schedule, parts.budget)} "
        f"run_dir={run_dir}")
    for warning in (lbt_lr.warmup_outlasts_run(parts.schedule, parts.budget),
                    lbt_lr.adam_sqrt_out_of_range(parts.schedule, max(p.global_batch for p in parts.budget.plans))):
        if warning:
            say(f"lbt: warning: {warning}", stderr=True)


def hparams_identity(config: dict, parts: Parts) -> dict[str, str]:
    """What tells two runs apart in TensorBoard's HParams table besides batch and LR: model, data,
    optimizer, schedule and techniques (without them, runs differing only there look identical)."""
    def target(node: dict) -> str:
        return str(node.get("_target_", "?")).rsplit(".", 1)[-1]

    s = parts.schedule
    warmup = f"{s.warmup_mode} warmup {s.warmup_samples:,} samples" if s.warmup_samples else "no warmup"
    optim = config["optim"]
    return {"model": target(config["model"]), "data": target(config["data"]),
            "optim": str(optim.get("optimizer_class") or target(optim)).rsplit(".", 1)[-1],
            "schedule": f"{s.scaling} scaling, {warmup}, {s.decay} decay",
            "techniques": ", ".join(t.describe() for t in parts.techniques) or "none"}


def _finish(config: dict, parts: Parts, result: Result, run_dir: str, logger: RunLogger, model_state: dict) -> dict:
    """Write result.json, final_model.pt and the HParams row; print the closing line."""
    plan, base_lr = parts.plan, config["optim"]["lr"]
    peak_lr, peak_samples = lbt_lr.peak(parts.schedule, parts.budget)
    summary = {
        "recipe": config["recipe"],
        "overrides": config["overrides"],
        "world_size": plan.gpus,  # GPUs: data-parallel workers x tensor-parallel ranks
        "procs": plan.procs * plan.tensor_parallel,
        "tensor_parallel": plan.tensor_parallel,
        "data_parallel": plan.world_size,
        "per_worker_batch": plan.per_worker_batch,
        "global_batch": plan.global_batch,
        "steps_per_epoch": plan.steps_per_epoch(len(parts.data.train)),
        "base_lr": base_lr,
        "peak_lr": peak_lr,
        "peak_lr_samples": peak_samples,
        "seed": config["trainer"]["seed"],
        # Named after their split: final_val_acc, val_history, ... or final_test_acc, ... without a val split.
        **result.summary(),
        "test/acc": result.test_acc,
        "test/loss": result.test_loss,
        **bits_per_token(result, parts.data.token),
        "techniques": [t.describe() for t in parts.techniques],
        "config": config,
    }
    logger.hparams(
        {"world_size": plan.world_size, "per_worker_batch": plan.per_worker_batch,
         "global_batch": plan.global_batch, "recipe": config["recipe"], "lr": base_lr, "peak_lr": peak_lr,
         "peak_lr_samples": peak_samples, "seed": config["trainer"]["seed"], **hparams_identity(config, parts)},
        {f"hparam/final_{result.eval_split}_acc": result.final_acc,
         f"hparam/best_{result.eval_split}_acc": result.best_acc,
         **({"hparam/test_acc": result.test_acc} if result.eval_split == "val" and result.test_acc is not None
            else {})},
    )
    atomic_write(Path(run_dir) / "final_model.pt", lambda f: torch.save(model_state, f))
    atomic_write(Path(run_dir) / "result.json",
                 lambda f: f.write(json.dumps(summary, indent=2, allow_nan=True).encode()))
    say(f"done: {closing_scores(result, parts.data.token)} steps={result.steps} "
        f"samples/s={result.samples_per_sec:,.0f} wall={result.wall_seconds:.1f}s -> {run_dir}/result.json")
    return summary


def bits_per_token(result: Result, token: str | None) -> dict:
    """A language model's loss in bits per token (final_val_bits_per_char, test_bits_per_char); {} for
    classification data, whose loss is per sample."""
    if token is None:
        return {}
    split, key = result.eval_split, f"bits_per_{token}"
    return {f"final_{split}_{key}": bits(result.final_loss),
            **({f"test_{key}": bits(result.test_loss)} if result.test_loss is not None else {})}


def closing_scores(result: Result, token: str | None) -> str:
    """`val_acc=0.9512 test_acc=0.9488`; a language model's bits per token beside each accuracy."""
    if result.diverged:
        return "DIVERGED"
    scores = [(result.eval_split, result.final_acc, result.final_loss)]
    if result.test_acc is not None and result.eval_split != "test":
        scores.append(("test", result.test_acc, result.test_loss))
    return " ".join(f"{split}_acc={acc:.4f}" + (f" {split}_bits_per_{token}={bits(loss):.4f}" if token else "")
                    for split, acc, loss in scores)


@contextmanager
def stop_on_signals(trainer: Trainer):
    """SIGTERM (how schedulers preempt) and SIGINT ask the loop to checkpoint and stop cleanly."""
    def request_stop(signum, frame):
        trainer.stop_requested = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _agree_on_run_dir(run_dir: str) -> str:
    """Under torchrun every rank ran Hydra; rank 0's run folder is the one."""
    holder = [run_dir]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]


def record_failure(config: dict, run_dir: str, message: str) -> None:
    """A failed job of a sweep leaves a result.json saying why, so the report shows it and the sweep goes on."""
    trainer, world_size = config["trainer"], config["dist"].get("world_size") or 1
    per_worker = trainer.get("per_worker_batch")
    if per_worker is None:
        per_worker = trainer["global_batch"] // world_size if trainer.get("global_batch") else DEFAULT_PER_WORKER_BATCH
    payload = {"error": message, "recipe": config.get("recipe") or "custom", "overrides": config.get("overrides", []),
               "world_size": world_size, "per_worker_batch": per_worker,
               "global_batch": trainer.get("global_batch") or per_worker * world_size, "seed": trainer.get("seed")}
    atomic_write(Path(run_dir) / "result.json", lambda f: f.write(json.dumps(payload, indent=2).encode()))
