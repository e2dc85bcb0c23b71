"""`lbt probe`: the critical batch from one base run and short branches from its snapshots (no full sweep).

    lbt probe [overrides] [probe.KEY=VALUE ...]
      1. compose and check the run as `lbt train` would; lay out snapshots and branches (plan.py)
      2. say what it costs (samples, and minutes from a short timed run) before it starts
      3. the base run, saving snapshots (trainer.snapshot_samples), in DIR/base
      4. rounds of branches, each a Hydra multirun (so hydra/launcher=... runs them side by side, or on
         SLURM): a k=1 cooldown from each snapshot, then branches holding the snapshot's LR, k=1 with every
         seed, then k=2, 4, ... at the checkpoints still open (a checkpoint closes at the first factor it
         predicts to fail), in DIR/branches/<hold|cooldown>_at<samples>_w<world size>_seed<seed>
      5. read them (analysis.py) and write probe.json, probe.md, the figures and TensorBoard (output.py)
      6. with probe.confirm=true, full runs around the prediction (confirm.py) until they give the
         answer a sweep would

Run again with the same command (and probe.dir) and it continues: a finished base run or branch is
read, never run again or overwritten; a branch that was cut off is run again from its snapshot.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from omegaconf import OmegaConf

from lbt.apps.compose import Composed, cfg_job_flag, compose
from lbt.apps.errors import Stopped, fail, raise_if_stopped, stop_between_runs
from lbt.apps.estimate import duration, timed_rate
from lbt.apps.probe.analysis import analyse, branch_dir, branch_done, budget_points, checkpoint_numbers, verdicts
from lbt.apps.probe.confirm import confirm
from lbt.apps.probe.output import write_outputs
from lbt.apps.probe.plan import SWEEP_SEEDS, ProbePlan, make_plan
from lbt.apps.probe.settings import ProbeSettings, split_args
from lbt.apps.train import train_command
from lbt.data.base import dataset_size
from lbt.engine import make_spec
from lbt.engine.build import build_data
from lbt.engine.checkpoint import snapshot_problem
from lbt.errors import ConfigError
from lbt.metrics.text_log import CONSOLE
from lbt.paths import atomic_write, folder_lock
from lbt.spec.result import ResultError, read_result
from lbt.spec.run import RunSpec, identity_differences, result_identity
from lbt.stop import job_stop_file

PROBE_HELP = """usage: lbt probe [overrides] [probe.KEY=VALUE ...]

The largest global batch (GPU count) that stays within the study's tolerance of the base batch,
predicted from one base run and short branches from its snapshots instead of a full sweep.

  lbt probe                                  the default run (cnn1d on MNIST-1D, baseline recipe)
  lbt probe recipe=goyal2017 model=mlp       any `lbt train` override sets the base run
  lbt probe hydra/launcher=local_parallel    branches side by side (submitit on SLURM)
  probe.dir=runs/probe/mine                  where it goes; the same command continues it
  probe.checkpoints=2 probe.first=0.171 probe.last=0.5  snapshots, log-uniform in the budget
  probe.max_factor=128 probe.delta=0.05      held-LR branches at k x the base batch, each 5% of the budget
  probe.cooldown=0.2                         k=1 cooldowns of 20% of each snapshot's samples (0: none)
  probe.seeds=1                              k=1 branches over data orders (2+: a noise floor)
  probe.metric=acc probe.tolerance=1         the study's criterion (points; loss: nats, 0.05)
  probe.confirm=true                         then full runs around the prediction: the sweep's answer
  --cfg job                                  print the probe's settings and the base run's config, run nothing
  --config-dir DIR                           your own configs, as `lbt train --config-dir` takes them
"""

# Keys a branch sets itself: the user's values for them define the base run only.
BRANCH_KEYS = ("dist.world_size", "trainer.global_batch", "trainer.per_worker_batch", "trainer.seed",
               "trainer.resume", "hydra.run.dir", "hydra.sweep.dir", "hydra.sweep.subdir", "trainer.evals",
               "trainer.checkpoint_every", "trainer.log_every", "trainer.progress")


def probe_command(args: list[str]) -> None:
    if any(a in ("-h", "--help") for a in args):
        print(PROBE_HELP)
        return
    started = time.perf_counter()
    try:
        shown, args = cfg_job_flag(args, "probe", "the probe's settings and its base run's config")
        settings, overrides = split_args(args)
        if shown:  # the probe's settings (probe.dir: where it would write) above the base run's config
            print(OmegaConf.to_yaml({"probe": vars(settings), **compose_base(settings, overrides).config}), end="")
            return
        spec, plan = plan_probe(settings, overrides)
    except ConfigError as error:
        fail(str(error))
    folder = Path(settings.dir)
    claim_folder(folder, settings, overrides, spec)
    given = [a for a in args if a.startswith("probe.") and not a.startswith("probe.dir=")]
    again = f"lbt probe {' '.join([*overrides, *given])} probe.dir={folder}"
    with ExitStack() as held:
        try:  # two probes on one folder: the second gets one line naming the first
            held.enter_context(folder_lock(folder))
        except ConfigError as error:
            fail(str(error))
        probe = run_probe(folder, spec, plan, settings, overrides, again)
        probe["cost"]["command_seconds"] = round(time.perf_counter() - started, 1)  # this invocation
        write_outputs(folder, probe)
    print(f"probe finished in {time.perf_counter() - started:.0f} s: {probe['answer']['sentence']}")
    if "confirm" in probe:
        print(f"probe: {probe['confirm']['sentence']} (probe and runs: {probe['confirm']['share']:.0%} of a sweep)")
    print(f"report: {(folder / 'probe.md').resolve()}")


def run_probe(folder: Path, spec: RunSpec, plan: ProbePlan, settings: ProbeSettings, overrides: list[str],
              again: str) -> dict:
    """The base run, its branches, the analysis and the confirm runs; stopped, one line and the signal's code."""
    try:
        with stop_between_runs(), branches_stop_with_the_probe(folder):
            with console("silent"):  # the timed steps say nothing (each job's train.log has all it says)
                say_cost(spec, plan, folder)
            with console("brief"):  # the base run's epochs, without its config
                base = run_base(folder, plan, overrides, again)
            with console("quiet"):  # a branch's closing line only
                run_branches(folder, plan, settings, overrides, base, again)
            probe = analyse(folder, plan, settings, base)
            if settings.confirm:
                write_outputs(folder, probe)  # the prediction stands while the full runs train
                print(f"probe: {probe['answer']['sentence']}; confirming with full runs", flush=True)
                with console("quiet"):
                    probe["confirm"] = confirm(folder, plan, settings, overrides, base,
                                               probe["answer"]["largest_batch"], again)
                probe["confirm"]["share"] = (probe["cost"]["samples"] + probe["confirm"]["samples"]) / \
                    plan.sweep_samples
    except (Stopped, KeyboardInterrupt) as stop:
        print(f"\nlbt: probe stopped; finished runs are kept. Continue with: {again}", file=sys.stderr)
        sys.exit(128 + (stop.signum if isinstance(stop, Stopped) else signal.SIGINT))
    return probe


@contextmanager
def branches_stop_with_the_probe(folder: Path) -> Iterator[None]:
    """A stop asked of the probe alone (`kill PID`; Ctrl-C reaches every process of the terminal) reaches the
    branches a launcher runs in other processes (hydra/launcher=local_parallel) through a stop file they poll
    (lbt/stop.py), so they stop at their next step rather than train to the end of their round."""
    stop = folder.resolve() / ".stop"  # the branches' processes may have another working directory
    stop.unlink(missing_ok=True)  # an earlier probe's, told to stop
    try:
        with job_stop_file(stop):
            yield
    finally:
        stop.unlink(missing_ok=True)  # after the stop file is no longer named: a late signal rewrites none


@contextmanager
def console(level: str) -> Iterator[None]:
    """What the runs started inside show on the console (lbt.metrics.text_log.CONSOLE); restored after."""
    before = os.environ.get(CONSOLE)
    os.environ[CONSOLE] = level
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(CONSOLE, None)
        else:
            os.environ[CONSOLE] = before


def plan_probe(settings: ProbeSettings, overrides: list[str]) -> tuple[RunSpec, ProbePlan]:
    composed = compose_base(settings, overrides)
    spec = make_spec(composed.config, composed.recipe, [o for o in overrides if not o.startswith("--config-dir=")])
    if spec.trainer.branch_from is not None or spec.trainer.snapshot_samples:
        raise ConfigError("lbt probe sets trainer.snapshot_samples and trainer.branch_* itself")
    data = build_data(spec.data)
    return spec, make_plan(spec, dataset_size(data.train), settings)


def compose_base(settings: ProbeSettings, overrides: list[str]) -> Composed:
    """The base run's config: the overrides and --config-dir checked as the probe takes them."""
    config_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("--config-dir=")), None)
    overrides = [o for o in overrides if not o.startswith("--config-dir=")]
    flags = [o for o in overrides if o.startswith("-")]
    if flags:
        raise ConfigError(f"lbt probe takes overrides, probe.KEY=VALUE settings and --config-dir DIR, not {flags[0]}")
    if config_dir and not Path(config_dir).is_dir():
        raise ConfigError(f"--config-dir {config_dir}: no such folder")
    folders = [o for o in overrides if o.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    if folders:
        raise ConfigError(f"{folders[0]}: lbt probe writes every run of it under probe.dir (now {settings.dir}): "
                          f"give probe.dir=... instead")
    return compose([o for o in overrides if not o.startswith("hydra")], config_dir)


def claim_folder(folder: Path, settings: ProbeSettings, overrides: list[str], spec: RunSpec) -> None:
    """The probe folder holds one probe: a rerun of another config or settings is refused, not mixed in.

    A probe is its settings and its composed config less the keys that cannot change a result
    (`result_identity`): reordered overrides, an added trainer.threads=1 or another launcher continue it."""
    identity = result_identity(spec.config, spec.layout.per_worker_batch, spec.layout.global_batch)
    own_settings = {k: v for k, v in vars(settings).items() if k != "dir"}
    record = {"overrides": overrides, "settings": own_settings, "identity": identity}
    path = folder / "probe_command.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        keys = {*saved["settings"], *own_settings}  # by key: a None and a number do not sort together
        differ = sorted(f"probe.{k}" for k in keys if saved["settings"].get(k) != own_settings.get(k))
        if "identity" in saved:
            differ += identity_differences(saved["identity"], json.loads(json.dumps(identity)))
        elif saved["overrides"] != overrides:
            differ.append("the overrides")
        if differ:
            shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
            fail(f"{folder} holds another probe (it differs in {shown}): give another probe.dir, "
                 f"or the same command to continue it")
        return  # the record of how it started is kept
    try:
        if folder.exists() and any(folder.iterdir()):
            fail(f"probe.dir={folder} is not empty and holds no probe: give a new folder")
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # /dev/null, a path under /proc, a read-only folder
        fail(f"probe.dir={folder}: cannot make the probe's folder: {error.strerror or error} "
             f"({error.filename or folder}): give another path")
    atomic_write(path, lambda out: out.write(json.dumps(record, indent=1).encode()))  # stopped mid-write: none


def say_cost(spec: RunSpec, plan: ProbePlan, folder: Path) -> None:
    """Before anything runs: the samples to train at most, against the sweep's, and the time it may take."""
    rate = timed_rate(spec)
    raise_if_stopped()  # told to stop while it timed steps: no cost from a cut-off measurement
    most, done = plan.most_samples, done_samples(folder, plan)
    print(f"probe: base run of {plan.budget:,} samples at global batch {plan.base_batch:,} with snapshots at "
          f"{', '.join(f'{c:,}' for c in plan.checkpoints)}; branches of {plan.branch_samples:,} samples at "
          f"{plan.factors[0]}x..{plan.factors[-1]}x")
    print(f"probe: at most {most:,} samples ({most / plan.sweep_samples:.0%} of the sweep it replaces: "
          f"{len(plan.factors)} world sizes x {SWEEP_SEEDS} seeds, {plan.sweep_samples:,} samples); "
          f"about {duration(max(most - done, 0) / rate)}{' left' if done else ''} at {rate:,.0f} samples/s measured "
          f"here (less when branches stop early or are pruned){f'; {done:,} trained earlier' if done else ''}; "
          f"folder {folder.resolve()}", flush=True)


def done_samples(folder: Path, plan: ProbePlan) -> int:
    """The samples of the probe's runs that finished before this command: a continued probe's estimate is of
    what is left. A held branch trains plan.branch_samples, a cooldown its checkpoint's share."""
    done = plan.budget if finished(folder / "base") else 0
    for run_dir in (folder / "branches").glob("*_at*_w*_seed*"):
        if not finished(run_dir):
            continue
        kind, _, rest = run_dir.name.partition("_at")
        at = int(rest.split("_w")[0])
        if kind == "cooldown" and at in plan.checkpoints and plan.cooldowns:
            done += plan.cooldowns[plan.checkpoints.index(at)]
        elif kind != "cooldown":
            done += plan.branch_samples
    return done


def run_base(folder: Path, plan: ProbePlan, overrides: list[str], again: str) -> Path:
    """The base run with its snapshots; a finished one is read, an interrupted one continued."""
    base = folder / "base"
    if (base / "result.json").is_file():
        try:
            read_result(base)
        except ResultError as error:  # cut short by a full disk: the checkpoints beside it hold the run
            fail(f"{error}; delete that file and the same command resumes the base run from its last checkpoint: "
                 f"{again}")
    if not finished(base):
        print(f"probe: base run -> {base}", flush=True)
        snapshots = ",".join(str(c) for c in plan.checkpoints)
        own = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("hydra.run.dir", "hydra.sweep.dir",
                                                                              "trainer.resume")]
        train_command([*own, f"trainer.snapshot_samples=[{snapshots}]", "trainer.resume=auto",
                       f"hydra.run.dir={base}"])
    if not finished(base):
        fail(f"the base run in {base} did not finish; continue it with: {again}")
    result = read_result(base)
    if result.diverged or result.failed:
        fail(f"the base run diverged ({base}): probe a recipe that trains at the base batch")
    return base


def finished(run_dir: Path) -> bool:
    try:
        result = read_result(run_dir)
    except (ResultError, FileNotFoundError, OSError):
        return False
    return not result.stopped


def run_branches(folder: Path, plan: ProbePlan, settings: ProbeSettings, overrides: list[str], base: Path,
                 again: str) -> None:
    """The k=1 cooldowns, then held-LR branches: k=1 at every checkpoint and seed, then each larger factor at
    the checkpoints still open."""
    common = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in BRANCH_KEYS]
    common += [f"trainer.branch_from={base.resolve()}", f"trainer.branch_diverge={settings.diverge}",
               f"trainer.evals={settings.evals}", f"trainer.per_worker_batch={plan.per_worker_batch}",
               "trainer.checkpoint_every=0", "trainer.log_every=1", "trainer.progress=false",
               f"hydra.sweep.dir={folder.resolve()}/branches", "hydra/hydra_logging=disabled",
               "hydra/job_logging=disabled",
               "hydra.sweep.subdir=${trainer.branch_lr}_at${trainer.branch_at}_w${dist.world_size}_seed${trainer.seed}"]

    def one_round(kind: str, points: list[int], factor: int, seed: int, samples: int) -> None:
        raise_if_stopped()
        todo = [c for c in points if not branch_done(folder, plan, c, factor, seed, kind)]
        if not todo:
            return
        for at in todo:  # cut off earlier: run again from its snapshot
            shutil.rmtree(branch_dir(folder, plan, at, factor, seed, kind), ignore_errors=True)
        what = "cooldown(s)" if kind == "cooldown" else f"branch(es) at {factor}x (global batch {plan.batch(factor):,})"
        print(f"probe: {len(todo)} {what}, seed {seed}", flush=True)
        multirun([*common, f"trainer.branch_lr={kind}", f"trainer.branch_samples={samples}",
                  f"dist.world_size={factor * plan.world_size}", f"trainer.seed={seed}",
                  f"trainer.branch_at={','.join(str(c) for c in todo)}"])
        raise_if_stopped()  # told to stop while a branch trained: the ones it did not start are left
        for at in todo:
            if not branch_done(folder, plan, at, factor, seed, kind):
                fail(f"the branch in {branch_dir(folder, plan, at, factor, seed, kind)} did not finish: "
                     f"{failure(branch_dir(folder, plan, at, factor, seed, kind))}; continue the probe with: {again}")

    for at in plan.checkpoints:  # no answer comes from a missing or damaged snapshot
        problem = snapshot_problem(base, at)
        if problem:
            fail(f"{problem}; delete {base} and run the same command: the base run and its snapshots are trained "
                 "again (finished branches are kept)")
    for at, cool in zip(plan.checkpoints, plan.cooldowns):  # each its own length
        one_round("cooldown", [at], 1, plan.seeds[0], cool)
    base_result = read_result(base)
    for factor in plan.factors:
        points = budget_points(folder, plan, settings, base_result)
        open_points = [c for c in plan.checkpoints if factor == 1 or not settings.prune or still_open(
            checkpoint_numbers(folder, plan, settings, c, base_result, points), settings, factor)]
        for seed in plan.seeds if factor == 1 else plan.seeds[:1]:
            one_round("hold", open_points, factor, seed, plan.branch_samples)


def failure(run_dir: Path) -> str:
    try:
        return read_result(run_dir).error or "stopped"
    except (ResultError, FileNotFoundError, OSError):
        return "no result (stopped?)"


def still_open(point: dict, settings: ProbeSettings, factor: int) -> bool:
    """A checkpoint stays open while, alone, it predicts every smaller factor within tolerance."""
    passed = verdicts(point, settings)
    return all(passed.get(k, False) for k in passed if k < factor)


def multirun(overrides: list[str]) -> None:
    try:
        train_command(["-m", *overrides], report_failures=False)
    except SystemExit as done:
        if done.code not in (0, None):
            raise
    sys.stdout.flush()
