"""`run(spec, run_dir)`: one training run, callable from the CLI, tests, tune and notebooks alike.

The spec is built and checked once in the launching process (`make_spec`), so every rank agrees on
it and on the run folder. Each process then builds its parts (lbt/engine/build.py) and hands them to
the Trainer (lbt/engine/trainer.py):

    run(spec): torchrun started us  -> train_process (this rank)
               one process          -> train_process (here)
               several processes    -> lbt's launcher starts them (lbt/parallel/launcher.py), each
                                       train_process; a dead worker restarts the job from its last
                                       checkpoint, dist.max_restarts times
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from lbt.data.batches import loader_workers
from lbt.engine.branch import start_branch, take_snapshot
from lbt.engine.build import build_data, build_parts
from lbt.engine.checkpoint import Checkpointer, exported_model, load_snapshot
from lbt.engine.outcome import finish, print_start
from lbt.engine.precision import Precision
from lbt.engine.trainer import LoopSettings, Trainer
from lbt.errors import ConfigError, first_line
from lbt.metrics.tensorboard import RunLogger
from lbt.metrics.text_log import say_once, text_log
from lbt.parallel import launcher
from lbt.parallel import process_group as pg
from lbt.parallel.tensor_parallel import device_mesh
from lbt.paths import check_free, folder_lock
from lbt.spec.result import ResultError, RunResult, read_result, write_result
from lbt.spec.run import Launch, RunSpec, build_spec, identity_differences, run_identity
from lbt.stop import StoppedWhileBuilding, forget_stop, handling, note_stop, stop_asked
from lbt.techniques.base import Technique


def make_spec(config: Mapping[str, Any], recipe: str | None = None, overrides: list[str] | None = None) -> RunSpec:
    """The RunSpec of a composed config on this machine (torchrun's process count, the CUDA devices)."""
    env = pg.torchrun_env()
    spec = build_spec(config, Launch(env["procs"] if env else None, pg.default_procs()), recipe, overrides)
    check_backend(spec.dist.backend, spec.trainer.device)
    if env is None:  # lbt's launcher will start them: the machine must have room (torchrun's are started)
        check_gpus_per_process(spec.dist.backend, spec.trainer.device, spec.procs, spec.layout.tensor_parallel)
        launcher.check_resources(spec.procs, spec.dist.allow_oversubscribe)
    return spec


def run(spec: RunSpec, run_dir: str | Path, techniques: list[Technique] | tuple = ()) -> RunResult:
    """Train once as `spec` says, writing TensorBoard events, result.json and final_model.pt into run_dir.

    `techniques` join the spec's (built objects, e.g. a tuner's pruning hook; in-process runs only:
    they are not sent to spawned workers). A run stopped by a signal returns `stopped` and writes
    no result.json; torchrun's ranks other than 0 return an empty result.
    """
    run_dir = str(Path(run_dir).resolve())
    env = pg.torchrun_env()
    try:
        if env is not None and env["rank"] != 0:
            return _run(spec, run_dir, techniques)  # torchrun's rank 0 holds the folder for the run
        with folder_lock(run_dir):  # one process at a time; a second gets one line naming the first
            return _run(spec, run_dir, techniques)
    except StoppedWhileBuilding:
        return RunResult(stopped=True)


def _run(spec: RunSpec, run_dir: str, techniques: list[Technique] | tuple) -> RunResult:
    finished = finished_run(spec, run_dir)
    if finished is not None:
        say_once(f"{run_dir} holds this run, finished ({finished.steps:,} steps, result.json): nothing to train")
        return finished
    env = pg.torchrun_env()
    if env is not None:
        elastic = pg.elastic_restarts()
        if elastic:  # torchrun --max-restarts started the workers again after one died
            spec = spec.with_trainer(resume="auto")
        result = train_process(env["rank"], None, spec, run_dir, env["local_rank"], env["local_procs"])
        if env["rank"] == 0 and elastic and not result.stopped:
            result = record_restarts(run_dir, [{"by": "torchrun --max-restarts", "restarts": elastic}])
        return result
    if spec.procs == 1 and not spec.dist.max_restarts:
        return in_process(spec, run_dir, list(techniques))
    if techniques:
        raise ConfigError("run(techniques=...) adds techniques to in-process runs only (dist.procs=1, "
                          "dist.max_restarts=0)")
    # Build the data once here: generates caches before the workers start and
    # reports a missing dataset as one line from one process.
    build_data(spec.data)
    restarts = launch_with_restarts(spec, run_dir)
    if not (Path(run_dir) / "result.json").exists():  # stopped by a signal after a checkpoint
        return RunResult(stopped=True)
    return record_restarts(run_dir, restarts) if restarts else read_result(run_dir)


def in_process(spec: RunSpec, run_dir: str, techniques: list[Technique]) -> RunResult:
    """The run in this process. An error of the disk or of permissions (a full disk while writing the final
    model, a folder made read-only) is one line, a ConfigError, with its traceback in train.log."""
    try:
        return train_process(0, None, spec, run_dir, 0, 1, techniques)
    except ConfigError:
        raise
    except Exception as error:
        if out_of_memory(error):
            log_traceback(run_dir, 0, error)
            raise ConfigError(f"out of memory: {launcher.describe(error)}; a smaller trainer.per_worker_batch or "
                              "model fits, or fewer dist.procs; the traceback is in train.log") from None
        if not launcher.lasting(error) or launcher.os_error_of(error) is None:
            raise
        log_traceback(run_dir, 0, error)
        raise ConfigError(f"{launcher.describe(error)}; the traceback is in train.log") from None


def out_of_memory(error: BaseException) -> bool:
    """CUDA's OutOfMemoryError, Python's MemoryError, or torch's CPU allocator failing (a plain RuntimeError)."""
    return isinstance(error, (torch.cuda.OutOfMemoryError, MemoryError)) or (
        isinstance(error, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(error))


def log_traceback(run_dir: str, rank: int, error: BaseException) -> None:
    """Append a failure's whole traceback to the run's train.log (its console line is one line)."""
    lines = traceback.format_exception(error)
    try:
        with open(Path(run_dir) / "train.log", "a", encoding="utf-8") as log:
            log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} rank {rank} failed:\n{''.join(lines)}")
    except OSError:
        print("".join(lines), file=sys.stderr, flush=True)  # train.log cannot take it: the console does


def record_restarts(run_dir: str, restarts: list[dict]) -> RunResult:
    """Add the job's restarts to the result.json its last attempt wrote; return the result."""
    result = read_result(run_dir)
    result.restarts = restarts
    write_result(run_dir, result)
    return result


def launch_with_restarts(spec: RunSpec, run_dir: str) -> list[dict]:
    """Start the workers; when one dies, start them again from the last checkpoint, dist.max_restarts times.

    lbt's resume is exact, so a restarted job ends with the parameters of an uninterrupted one.
    An error a restart would meet again is not retried (a config error, a full disk, no permission,
    out of memory in the first step), nor is a diverged run (its workers end well), nor a job told to
    stop (SIGTERM/SIGINT). Returns one record per restart: which rank died, how, at which step, and
    the step the job continued from.
    """
    restarts: list[dict] = []
    procs, limit = spec.procs, spec.dist.max_restarts
    while True:
        steps = launcher.step_board(procs)
        try:
            launcher.launch_local(_spawned_process, (steps, spec, run_dir), procs)
            return restarts
        except launcher.WorkerDied as died:
            if not died.restartable or len(restarts) >= limit:
                raise
            latest = Checkpointer(run_dir, 0, procs).latest()
            restarts.append({"rank": died.rank, "how": died.how, "step": steps[died.rank],
                             "resumed_from_step": latest["step"] if latest else 0})
            print(f"lbt: note: {died} after step {steps[died.rank]}; restarting ({len(restarts)} of {limit}) "
                  f"from the checkpoint at step {restarts[-1]['resumed_from_step']}", file=sys.stderr, flush=True)
        spec = spec.with_trainer(resume="auto")


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


def check_gpus_per_process(backend: str, device: str, procs: int, tensor_parallel: int = 1) -> None:
    """NCCL wants a GPU per process: lbt's launcher does not start more NCCL processes than this machine has
    GPUs (two NCCL ranks on one GPU fail with NCCL's "invalid usage", or hang). Under torchrun or another
    launcher the user placed the processes (one GPU per SLURM task, say), and they are left alone."""
    gpus = torch.cuda.device_count()
    nccl = backend == "nccl" or (backend == "auto" and device != "cpu")
    if not nccl or gpus == 0 or procs <= gpus:
        return
    fallback = " or trainer.device=cpu" if backend == "auto" else ""
    has = f"NCCL processes and this machine has {gpus} CUDA GPU{'s' * (gpus > 1)}: NCCL needs a GPU per process"
    if tensor_parallel > gpus:  # dist.procs is a multiple of it: no fewer processes fit
        raise ConfigError(f"dist.tensor_parallel={tensor_parallel} {has}; give dist.tensor_parallel at most "
                          f"{gpus}{fallback}")
    most = gpus // tensor_parallel * tensor_parallel
    group = f", a multiple of dist.tensor_parallel={tensor_parallel}" if tensor_parallel > 1 else ""
    raise ConfigError(f"dist.procs={procs} {has}; start at most {most}{group} (the dist.world_size workers are "
                      f"simulated on them){fallback}")


def finished_run(spec: RunSpec, run_dir: str | Path) -> RunResult | None:
    """The run folder's result.json against this run: a folder belongs to one run, finished or not.

    This run, finished, and asked to resume: its result (nothing to train). Another run's result, or
    this one's without trainer.resume=auto: a ConfigError, never an overwrite. A failed attempt's
    result.json (it records an error, no measurement) is left for this run to replace.
    """
    path = Path(run_dir).expanduser() / "result.json"
    if not path.is_file():
        return None
    try:
        saved = read_result(path)
    except ResultError as error:
        raise ConfigError(f"{error}; the folder holds a run's result: start this one in another folder") from None
    if saved.failed:
        return None
    differ = identity_differences(run_identity(saved.config, saved.per_worker_batch, saved.global_batch),
                                  spec.identity()) if saved.config else ["its config (result.json has none)"]
    if differ:
        raise ConfigError(f"{path.parent} holds another run's result (it differs in {'; '.join(differ[:3])}"
                          f"{'; ...' if len(differ) > 3 else ''}): start this one in another folder "
                          "(hydra.run.dir=...)")
    if spec.trainer.resume != "auto":
        raise ConfigError(f"{path.parent} holds this run, finished ({saved.steps:,} steps): nothing to do; "
                          "to train it again, give another folder (hydra.run.dir=...)")
    trained = saved.config.get("trainer") or {}
    if (trained.get("epochs"), trained.get("max_steps")) == (spec.trainer.epochs, spec.trainer.max_steps):
        return saved
    # Another budget: the run is extended (or cut) from its newest checkpoint, and its result replaced.
    if Checkpointer(path.parent, 0, spec.procs).latest() is None:
        raise ConfigError(f"{path.parent} holds this run, finished with trainer.epochs={trained.get('epochs')} "
                          f"trainer.max_steps={trained.get('max_steps')} and no checkpoint to continue it from: "
                          "train the new budget in another folder (hydra.run.dir=...)")
    return None


def check_run_folder(spec: RunSpec, run_dir: str) -> None:
    """The run folder against this run, before anything is written: a fresh start over a checkpoint or
    a finished run, or a resume of another run's, is a ConfigError. The workers check the checkpoint
    again, with the checksums (`Checkpointer.load_latest`)."""
    check_free(Path(run_dir).expanduser())  # in use by another command: say that, not what it wrote so far
    if finished_run(spec, run_dir) is not None:
        return
    checkpointer = Checkpointer(Path(run_dir).expanduser(), 0, spec.procs, identity=spec.identity())
    if spec.trainer.resume == "auto" or pg.elastic_restarts():  # torchrun restarts resume (see run())
        checkpointer.check_newest_belongs()
    else:
        checkpointer.refuse_other_run(tidy=False)


def _spawned_process(rank: int, store_port: int, steps: Any, spec: RunSpec, run_dir: str) -> None:
    """Body of a process started by lbt's local launcher: one line per failure, no traceback for user errors.

    `steps` (lbt.parallel.launcher.step_board): where this rank writes each step it finishes.
    """
    stepped: list[int] = []

    def on_step(step: int) -> None:
        steps[rank] = step
        stepped.append(step)

    try:
        train_process(rank, store_port, spec, run_dir, rank, spec.procs, on_step=on_step)
    except ConfigError as error:
        if rank == 0:
            print(f"lbt: error: {error}", file=sys.stderr, flush=True)
        launcher.report_failure(rank, str(error), retry=False)
        sys.exit(2)
    except torch.distributed.DistError as error:  # the launcher names the rank that brought the job down
        reason = first_line(error)
        launcher.report_failure(rank, f"lost its peers: {reason}", retry=True, lost_peers=True)
        sys.exit(1)
    except Exception as error:
        log_traceback(run_dir, rank, error)
        at_start = out_of_memory(error) and not stepped  # a restart meets it again
        launcher.report_failure(rank, launcher.describe(error), retry=not (launcher.lasting(error) or at_start))
        sys.exit(1)
    exit_worker()


def exit_worker() -> None:
    """End a finished worker process without the interpreter's teardown.

    Everything is written and the process group destroyed by now. Tearing down torch's distributed
    objects with the interpreter sometimes aborts a gloo worker (SIGABRT), which the launcher would
    report as a dead worker.
    """
    pg.flush_std()
    os._exit(0)


def train_process(rank: int, store_port: int | None, spec: RunSpec, run_dir: str, local_rank: int,
                  local_procs: int, extra_techniques: list[Technique] | tuple = (),
                  on_step: Callable[[int], None] | None = None) -> RunResult:
    """One process of the run, from joining its process group to its result (rank 0's; others' are empty)."""
    procs = spec.procs
    torch.set_num_threads(spec.trainer.threads or default_threads(local_procs))
    device = pg.pick_device(spec.trainer.device, local_rank)
    backend = pg.pick_backend(spec.dist.backend, device)
    with stop_on_signals(), pg.process_group(backend, rank, procs, spec.dist.timeout_s, store_port), \
            ExitStack() as stack:
        if store_port is None and procs > 1:
            run_dir = _agree_on_run_dir(run_dir)
        stack.enter_context(text_log(run_dir if rank == 0 else None))
        t = spec.layout.tensor_parallel
        sharded = spec.dist.shard == "fsdp" and procs // t > 1  # one data-parallel rank has nothing to shard
        mesh = device_mesh(device, procs, t) if t > 1 or sharded else None
        ctx = pg.DistContext(rank, procs, local_rank, spec.gpus, device, t, mesh, sharded)
        started = time.perf_counter()
        trainer = make_trainer(spec, ctx, run_dir, local_procs, extra_techniques)
        trainer.on_step = on_step
        # Closed however the run ends (an exception too: a tuner's pruning unwinds it), so its curves reach the disk.
        stack.callback(trainer.log.close)
        if stop_agreed(ctx):  # told to stop before the first step: stopped as it would be later
            return RunResult(stopped=True)
        result = trainer.fit()
        if result.stopped:
            return result
        result.wall_seconds = time.perf_counter() - started
        trainer.optimizer.zero_grad(set_to_none=True)  # the gradients' memory, for the export
        model_state = exported_model(trainer.model, ctx)  # whole tensors, as one process saves them
        if ctx.is_main:
            result = finish(spec, trainer.parts, result, run_dir, trainer.log, model_state)
        return result if ctx.is_main else RunResult()


def default_threads(local_procs: int) -> int:
    """Intra-op threads when trainer.threads is null: OMP_NUM_THREADS where it is set (as torch itself reads
    it; torchrun sets 1 per process), else the machine's cores shared among its processes, so P=2 on 2 cores
    does not oversubscribe them."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) // local_procs)


def make_trainer(spec: RunSpec, ctx: pg.DistContext, run_dir: str, local_procs: int,
                 extra_techniques: list[Technique] | tuple = ()) -> Trainer:
    """Build the parts, say how the run starts, and resume from the run folder's checkpoint when asked."""
    parts = build_parts(spec, ctx, extra_techniques)
    if ctx.is_main:
        print_start(spec, parts, run_dir)
    checkpointer = Checkpointer(run_dir, ctx.rank, ctx.procs, spec.trainer.keep_checkpoints, spec.identity())
    resume = None
    if spec.trainer.resume == "auto":
        resume = checkpointer.load_latest()
    else:
        checkpointer.refuse_other_run()
    # TensorBoard purges what a stopped run logged after its checkpoint.
    loop = resume[0]["loop"] if resume else {"step": 0, "samples_seen": 0}
    logger = RunLogger(run_dir if ctx.is_main else None, loop["step"], loop["samples_seen"])
    t = spec.trainer
    settings = LoopSettings(seed=t.seed, log_every=t.log_every, progress=t.progress, evals=t.evals,
                            fuse_workers=spec.dist.fuse_workers, checkpoint_every=t.checkpoint_every,
                            compile=t.compile, channels_last=t.channels_last,
                            loader_workers=loader_workers(t.loader_workers, local_procs),
                            snapshot_samples=t.snapshot_samples, diverge_factor=t.diverge_factor,
                            diverge_log_steps=t.diverge_log_steps, stop_at_val=t.stop_at_val)
    if t.stop_at_val is not None and parts.data.val is None:
        raise ConfigError(f"trainer.stop_at_val_{t.stop_at_val[0]} stops on the val split, and this data holds none "
                          "out (data.val_fraction=0?): a run never stops on test")
    precision = Precision(t.precision, ctx.device.type)
    say_once(f"device={ctx.device} precision={precision.describe()} compile={settings.compile} "
             f"channels_last={settings.channels_last} loader_workers={settings.loader_workers}")
    trainer = Trainer(parts, ctx, settings, logger, checkpointer, precision)
    if resume is not None:
        trainer.load_checkpoint(*resume)
        check_budget(trainer, spec, run_dir)
        trainer.say(f"resumed from step {trainer.state.step} (epoch {trainer.state.epoch + 1}) in {run_dir}")
    elif t.branch_from is not None:
        assert t.branch_at is not None and t.branch_samples is not None  # TrainerSpec.check: all three or none
        start_branch(trainer, load_snapshot(t.branch_from, t.branch_at), t.branch_samples, t.branch_diverge,
                     t.branch_lr)
    if t.snapshot_samples:
        trainer.snapshot = lambda: take_snapshot(trainer, run_dir)
    return trainer


def check_budget(trainer: Trainer, spec: RunSpec, run_dir: str) -> None:
    """A resume whose budget is smaller than what the run has trained is refused: its result would say
    trainer.epochs=3 of a run that trained more. Every rank checks (they raise together)."""
    done, total = trainer.state.step, trainer.budget.total_steps
    finished = Path(run_dir) / "result.json"
    if finished.is_file():
        try:
            saved = read_result(finished)
            done = max(done, 0 if saved.failed else saved.steps)
        except ResultError:
            pass  # finished_run said so already
    if done <= total:
        return
    t = spec.trainer
    cap = "null" if t.max_steps is None else t.max_steps
    raise ConfigError(f"{run_dir} has trained {done:,} steps and this run's budget is {total:,} "
                      f"(trainer.epochs={t.epochs} trainer.max_steps={cap}): a resume cannot train less than was "
                      "trained; give at least that budget, or train this one in another folder (hydra.run.dir=...)")


def stop_agreed(ctx: pg.DistContext) -> bool:
    """Whether any rank was told to stop (all ranks call this together, and agree)."""
    asked = torch.tensor([float(stop_asked() is not None)], dtype=torch.float64, device=ctx.device)
    pg.all_reduce_sum(asked, ctx)
    return asked.item() > 0


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM (how schedulers preempt) and SIGINT ask the run to checkpoint and stop cleanly, from its
    first moment: the loop reads the stop at its log steps, a run not started yet does not start."""
    forget_stop(run_start=True)  # an earlier run in this process was stopped, not this one
    with handling(note_stop):  # the loop reads it (stop_asked); the study this run is a job of stops too
        yield


def _agree_on_run_dir(run_dir: str) -> str:
    """Under torchrun every rank ran Hydra; rank 0's run folder is the one."""
    holder = [run_dir]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]
