"""`lbt train`: the Hydra entry point and `run(cfg)`, callable without the CLI.

    lbt train model=mlp dist.world_size=64 trainer.per_worker_batch=32
    torchrun --nproc-per-node=2 -m lbt.train dist.world_size=8

`run()` resolves the config once in the launching process and hands plain
dicts to the workers, so every rank agrees on it and on the run folder.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from lbt import dist as lbt_dist
from lbt.checkpoint import Checkpointer
from lbt.config import BatchPlan, DistConfig, TrainerConfig, check_dist, check_trainer, lr_is_sane, plan_batches
from lbt.errors import ConfigError
from lbt.metrics.tensorboard import RunLogger
from lbt.paths import conf_dir
from lbt.techniques import Progress, Technique, learning_rate, sort_techniques
from lbt.trainer import LoopSettings, Trainer

ConfigStore.instance().store(group="dist", name="dist_schema", node=DistConfig)
ConfigStore.instance().store(group="trainer", name="trainer_schema", node=TrainerConfig)


def run(cfg: DictConfig | dict, run_dir: str | Path, recipe: str | None = None,
        overrides: list[str] | None = None) -> dict:
    """Train once as `cfg` says, writing TensorBoard events and result.json into run_dir.

    `recipe` names the recipe for reports; `overrides` (the command line's) are
    kept in result.json so a study report can tell its variants apart.
    """
    config = OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg
    config["recipe"] = recipe or config.get("recipe") or "custom"
    config["overrides"] = list(overrides or config.get("overrides") or [])
    run_dir = str(Path(run_dir).resolve())
    env = lbt_dist.torchrun_env()
    procs = _check_layout(config, env)
    if env is not None:
        # Only rank 0 has the summary; the other torchrun ranks return {}.
        return _train_process(env["rank"], None, config, run_dir, procs, env["local_rank"], env["local_procs"])
    if procs == 1:
        return _train_process(0, None, config, run_dir, 1, 0, 1)
    else:
        # Build the data once here: generates caches before the workers start and
        # reports a missing dataset as one line from one process.
        _build_data(config)
        lbt_dist.launch_local(_spawned_process, (config, run_dir, procs), procs)
    result_path = Path(run_dir) / "result.json"
    if not result_path.exists():  # stopped by a signal after a checkpoint
        return {"stopped": True}
    return json.loads(result_path.read_text())


def _check_layout(config: dict, env: dict | None) -> int:
    """Validate what can be checked before any process starts; return procs."""
    dist_cfg, trainer = config["dist"], config["trainer"]
    check_trainer(trainer)
    check_dist(dist_cfg, env is not None)
    lr_is_sane(config["optim"].get("lr"))
    if env is not None:
        if dist_cfg.get("procs") not in (None, env["procs"]):
            raise ConfigError(f"dist.procs={dist_cfg['procs']} but torchrun started {env['procs']} processes")
        dist_cfg["procs"] = env["procs"]
    procs = dist_cfg.get("procs") or lbt_dist.default_procs()
    dist_cfg["procs"] = procs
    dist_cfg["world_size"] = dist_cfg.get("world_size") or procs
    plan_batches(dist_cfg["world_size"], procs, trainer.get("per_worker_batch"), trainer.get("global_batch"))
    return procs


def build(node: dict, where: str, **kwargs):
    """hydra.utils.instantiate; a constructor rejecting its config values is a ConfigError naming `where`."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, (TypeError, ValueError)):
            raise ConfigError(f"{where}: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}") from None
        raise


def _build_data(config: dict):
    return build(config["data"], "data")


def _spawned_process(rank: int, store_port: int, config: dict, run_dir: str, procs: int) -> None:
    """Body of a process started by lbt's local launcher: one line per failure, no traceback for user errors."""
    try:
        _train_process(rank, store_port, config, run_dir, procs, rank, procs)
    except ConfigError as error:
        if rank == 0:
            print(f"lbt: error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)
    except torch.distributed.DistError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        print(f"lbt: rank {rank} lost its peers: {first_line}", file=sys.stderr, flush=True)
        sys.exit(1)
    _exit_worker()


def _exit_worker() -> None:
    """End a finished worker process without the interpreter's teardown.

    Everything is written and the process group destroyed by now. Tearing down
    torch's distributed objects with the interpreter sometimes aborts a gloo
    worker ("terminate called without an active exception", SIGABRT; a few
    percent of P=2 runs here), which the launcher would report as a dead worker.
    """
    lbt_dist.flush_std()
    os._exit(0)


def _train_process(
    rank: int, store_port: int | None, config: dict, run_dir: str, procs: int, local_rank: int, local_procs: int
) -> dict:
    dist_cfg, trainer_cfg = config["dist"], config["trainer"]
    # Share the cores among the processes of this machine, so P=2 on 2 cores
    # does not oversubscribe them.
    torch.set_num_threads(trainer_cfg.get("threads") or max(1, (os.cpu_count() or 1) // local_procs))
    device = lbt_dist.pick_device(trainer_cfg["device"], local_rank)
    backend = lbt_dist.pick_backend(dist_cfg["backend"], device)
    with lbt_dist.process_group(backend, rank, procs, dist_cfg["timeout_s"], store_port):
        if store_port is None and procs > 1:
            run_dir = _agree_on_run_dir(run_dir)
        ctx = lbt_dist.DistContext(rank, procs, local_rank, dist_cfg["world_size"], device)
        started = time.perf_counter()
        data = _build_data(config)
        plan = plan_batches(
            ctx.world_size, procs, trainer_cfg["per_worker_batch"], trainer_cfg["global_batch"], len(data.train)
        )
        techniques = build_techniques(config)
        torch.manual_seed(trainer_cfg["seed"])  # same initial weights in every process and layout
        model = build(config["model"], "model", input_shape=tuple(data.input_shape), num_classes=data.num_classes)
        for technique in techniques:
            model = technique.on_model(model)
        model.to(device)
        try:
            optimizer = build(config["optim"], "optim")(model.parameters())
        except (TypeError, ValueError) as error:  # torch.optim checks its hyper-parameters here
            raise ConfigError(f"optim: {error}") from None
        for technique in techniques:
            optimizer = technique.on_optimizer(optimizer, model)
        loss_fn = torch.nn.CrossEntropyLoss()
        for technique in techniques:
            loss_fn = technique.on_loss(loss_fn)

        epoch_plans = [plan] * trainer_cfg["epochs"]
        for technique in techniques:
            epoch_plans = [technique.epoch_plan(epoch, p) for epoch, p in enumerate(epoch_plans)]
        for p in epoch_plans:
            plan_batches(p.world_size, procs, p.per_worker_batch, None, len(data.train))
        steps, samples = _budget(epoch_plans, len(data.train), trainer_cfg["max_steps"])
        settings = LoopSettings(total_steps=steps, total_samples=samples, seed=trainer_cfg["seed"],
                                log_every=trainer_cfg["log_every"], progress=trainer_cfg["progress"],
                                fuse_workers=dist_cfg["fuse_workers"],
                                checkpoint_every=trainer_cfg["checkpoint_every"])
        base_lr = config["optim"]["lr"]
        if ctx.is_main:
            print(OmegaConf.to_yaml(OmegaConf.create(config)), flush=True)
            print(f"{plan.describe(len(data.train))} {describe_lr(base_lr, techniques, plan, len(data.train), samples)} "
                  f"run_dir={run_dir}", flush=True)
        checkpointer = Checkpointer(run_dir, rank, procs)
        resume = _resume_point(trainer_cfg["resume"], checkpointer)
        logger = RunLogger(run_dir if ctx.is_main else None, *(_resume_position(checkpointer, resume)))
        trainer = Trainer(
            model, optimizer, loss_fn, techniques, base_lr, epoch_plans, ctx,
            (data.train, data.val, data.test), settings, logger, checkpointer,
        )
        if resume is not None:
            trainer.load_checkpoint(*checkpointer.load(resume))
            if ctx.is_main:
                print(f"resumed from step {trainer.step} (epoch {trainer.epoch + 1}) in {run_dir}", flush=True)
        with stop_on_signals(trainer):
            result = trainer.fit()
        if result.stopped:
            logger.close()
            return {"stopped": True, "step": result.steps}
        result.wall_seconds = time.perf_counter() - started
        if ctx.is_main:
            summary = _summary(config, plan, plan.steps_per_epoch(len(data.train)), base_lr, result)
            summary["techniques"] = [t.describe() for t in techniques]
            logger.hparams(
                {"world_size": plan.world_size, "per_worker_batch": plan.per_worker_batch,
                 "global_batch": plan.global_batch, "recipe": config["recipe"], "lr": base_lr,
                 "seed": trainer_cfg["seed"]},
                {"hparam/final_val_acc": result.final_val_acc, "hparam/best_val_acc": result.best_val_acc},
            )
            _save_atomic(model.state_dict(), Path(run_dir) / "final_model.pt")
            _write_json_atomic(Path(run_dir) / "result.json", summary)
            state = "DIVERGED" if result.diverged else f"val_acc={result.final_val_acc:.4f}"
            test = f" test_acc={result.test_acc:.4f}" if result.test_acc is not None else ""
            print(f"done: {state}{test} steps={result.steps} samples/s={result.samples_per_sec:,.0f} "
                  f"wall={result.wall_seconds:.1f}s -> {run_dir}/result.json", flush=True)
        logger.close()
        return summary if ctx.is_main else {}


def build_techniques(config: dict) -> list[Technique]:
    """The schedule's decay plus every technique the config lists, in their declared order."""
    techniques = [build(config["schedule"], "schedule")]
    for name, node in (config.get("technique") or {}).items():
        if "_target_" not in node:
            # A recipe set options of a technique the command line then deselected.
            print(f"lbt: note: technique.{name} is configured but not selected; ignored", file=sys.stderr)
            continue
        techniques.append(build(node, f"technique.{name}"))
    return sort_techniques(techniques)


def _budget(epoch_plans: list[BatchPlan], num_train: int, max_steps: int | None) -> tuple[int, int]:
    """Total optimizer steps and samples of the run (the LR schedule spans them)."""
    steps = samples = 0
    for plan in epoch_plans:
        epoch_steps = plan.steps_per_epoch(num_train)
        if max_steps is not None:
            epoch_steps = min(epoch_steps, max_steps - steps)
        steps += epoch_steps
        samples += epoch_steps * plan.global_batch
    return steps, samples


def describe_lr(base_lr: float, techniques: list[Technique], plan: BatchPlan, num_train: int, total: int) -> str:
    """`lr=0.8 (base 0.1 x linear 8 | linear warmup over 5 epochs from base LR | cosine decay)`."""
    start = Progress(0, 0, 0, plan.global_batch, plan.global_batch, num_train, total)
    _, scale = learning_rate(base_lr, techniques, start)
    factors = [f"base {base_lr:g}" + (f" x {scale:g}" if scale != 1 else "")]
    factors += [t.describe() for t in techniques]
    return f"lr={base_lr * scale:g} ({' | '.join(factors)})"


def _resume_point(resume: str | None, checkpointer: Checkpointer) -> dict | None:
    """trainer.resume: null (start fresh), auto (the run folder's latest checkpoint, if any)."""
    if resume is None:
        return None
    if resume != "auto":
        raise ConfigError(f"trainer.resume must be null or auto, got {resume!r}")
    latest = checkpointer.latest()
    if latest is None and checkpointer.rank == 0:
        print(f"lbt: note: no checkpoint in {checkpointer.root}; starting from scratch", file=sys.stderr, flush=True)
    return latest


def _resume_position(checkpointer: Checkpointer, resume: dict | None) -> tuple[int, int]:
    """(step, samples seen) of the checkpoint: TensorBoard purges what came after it."""
    if resume is None:
        return 0, 0
    main, _ = checkpointer.load(resume)
    return main["loop"]["step"], main["loop"]["samples_seen"]


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


def _summary(config: dict, plan, steps_per_epoch: int, base_lr: float, result) -> dict:
    return {
        "recipe": config["recipe"],
        "overrides": config["overrides"],
        "world_size": plan.world_size,
        "procs": plan.procs,
        "per_worker_batch": plan.per_worker_batch,
        "global_batch": plan.global_batch,
        "steps_per_epoch": steps_per_epoch,
        "base_lr": base_lr,
        "seed": config["trainer"]["seed"],
        **{k: v for k, v in vars(result).items()},
        # The held-out test split under the names val/* has in TensorBoard (None without data.val_fraction).
        "test/acc": result.test_acc,
        "test/loss": result.test_loss,
        "config": config,
    }


def _save_atomic(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=2, allow_nan=True))
    os.replace(tmp, path)


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    output_dir = hydra_cfg.runtime.output_dir
    recipe = hydra_cfg.runtime.choices.get("recipe")
    # In a sweep, a failing job is recorded in its result.json and the sweep goes on.
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    try:
        run(cfg, output_dir, recipe=recipe, overrides=overrides)
    except (ConfigError, lbt_dist.WorkerDied) as error:
        if str(error):
            print(f"lbt: error: {error}", file=sys.stderr, flush=True)
        if not sweeping:
            sys.exit(2 if isinstance(error, ConfigError) or not str(error) else 1)
        _record_failure(cfg, output_dir, recipe, overrides, str(error) or "config error in a worker")
    except Exception as error:  # a crash in one job of a sweep must not stop the others
        if not sweeping:
            raise
        print(f"lbt: job failed: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
        _record_failure(cfg, output_dir, recipe, overrides, f"{type(error).__name__}: {error}")


def _record_failure(cfg: DictConfig, output_dir: str, recipe: str | None, overrides: list[str], message: str) -> None:
    trainer, dist_cfg = cfg.trainer, cfg.dist
    world_size = dist_cfg.world_size or 1
    per_worker = trainer.per_worker_batch or (trainer.global_batch // world_size if trainer.global_batch else 64)
    _write_json_atomic(Path(output_dir) / "result.json", {
        "error": message, "recipe": recipe or "custom", "overrides": overrides, "world_size": world_size,
        "per_worker_batch": per_worker, "global_batch": trainer.global_batch or per_worker * world_size,
        "seed": trainer.seed,
    })


def main() -> None:
    """`python -m lbt.train` / torchrun entry: same as `lbt train`."""
    from lbt.cli import train_command

    train_command(sys.argv[1:])
    if lbt_dist.torchrun_env() is not None:  # a torchrun worker: see _exit_worker
        _exit_worker()


if __name__ == "__main__":
    main()
