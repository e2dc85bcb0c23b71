"""The `lbt` command: `lbt train | study | probe | tune | report | plan`, also as `python -m lbt` and `torchrun -m lbt`.

Each command is its own module of lbt/apps; this one only dispatches. A mistake ends with one
`lbt: error:` line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import re
import sys
from importlib import import_module, metadata

from lbt.apps.errors import end_on, exit_when_stopped, fail
from lbt.errors import place_problem

# Each command's module is imported only when it runs: `lbt train` does not pay for `lbt plan`'s matplotlib
# and profiler imports (about 1 s of every process start on 2 cores).
COMMANDS = {
    "train": ("lbt.apps.train", "train_command"),
    "study": ("lbt.apps.study", "study_command"),
    "tune": ("lbt.apps.tune", "tune_command"),
    "probe": ("lbt.apps.probe", "probe_command"),
    "report": ("lbt.apps.report.cli", "report_command"),
    "tokens": ("lbt.apps.tokens", "tokens_command"),
    "plan": ("lbt.apps.plan.cli", "plan_main"),
}


# The oldest torch lbt runs on, as pyproject.toml says: fully_shard (torch.distributed.fsdp) and DTensor
# (torch.distributed.tensor) are public from 2.6. tests/test_cli_errors.py checks the two agree and that the
# installed torch has what the floor stands for.
TORCH_FLOOR = (2, 6)


def torch_problem(version: str) -> str | None:
    """Why this torch cannot run lbt, or None."""
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) >= TORCH_FLOOR:
        return None
    floor = ".".join(map(str, TORCH_FLOOR))
    return f"lbt needs torch>={floor} (fully_shard and DTensor), this is torch {version}: pip install 'torch>={floor}'"


USAGE = """usage: lbt COMMAND [args]

commands:
  train [overrides]     one training run, e.g. `lbt train model=mlp dist.world_size=16`
                        (-m for a Hydra multirun sweep, --cfg job to print the config)
  study [overrides]     run a study (default: study=default, recipes x GPU counts on MNIST-1D)
                        and write its report; e.g. `lbt study study=gpu_counts`
  tune [overrides]      the same tuning budget (Optuna trials, chosen on val) for every cell of
                        recipes x world sizes, then the best and the untuned defaults over seeds,
                        scored on test; e.g. `lbt tune recipe=baseline,lamb dist.world_size=16,64`
  probe [overrides]     the critical batch predicted from one base run and short branches from its
                        snapshots, at a fraction of a sweep's cost; e.g. `lbt probe model=mlp`
  report DIR [--target ACC] [--metric loss --target LOSS]
                        turn a multirun folder into report.md, PNG curves, summary.json, tb_summary/
  tokens TEXT_FILE DIR  write a token folder for data=tokens (train.bin, val.bin) from any file,
                        one token per byte; your own tokenizer: docs/language-models.md
  plan [overrides]      predict time per epoch vs GPU count from measured compute and a network
                        model: where adding GPUs stops paying; e.g. `lbt plan model=resnet20
                        data=cifar10 plan.network=25gbe` (`lbt plan --help`: its plan.* settings)
"""


def main(argv: list[str] | None = None) -> None:
    if argv is None:  # the command's own process: a stop is exit 143/130 (lbt/__main__.py)
        exit_when_stopped()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        print(USAGE, file=sys.stderr)
        fail(f"unknown command {command!r}")
    module, function = COMMANDS[command]
    too_old = torch_problem(metadata.version("torch"))
    if too_old is not None:
        fail(too_old)
    try:
        code = getattr(import_module(module), function)(args)  # `lbt plan` returns its exit code, the others None
    except (OSError, RuntimeError) as error:  # PIL, torch.save and open() each report a full disk their own way
        problem = place_problem(error)
        if problem is None:
            raise
        end_on(*problem)
    if command == "train":
        from lbt.parallel import process_group as pg

        if pg.torchrun_env() is not None:  # a torchrun worker: see lbt.engine.worker.exit_worker
            from lbt.engine.worker import exit_worker

            exit_worker()
    if code is not None:
        sys.exit(code)


if __name__ == "__main__":
    main()
