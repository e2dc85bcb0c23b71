"""`lbt` command line: `lbt train [hydra overrides]`.

Together with lbt/train.py, the only place that imports Hydra. A config
mistake ends with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import os
import sys

USAGE = """usage: lbt COMMAND [hydra overrides]

commands:
  train   one training run, e.g. `lbt train model=mlp dist.world_size=16`
          (add -m for a Hydra multirun sweep, --cfg job to print the config)
"""


def one_line(error: BaseException) -> str:
    """Fold a (possibly multi-line) Hydra/OmegaConf error into one readable line."""
    messages = [str(error)]
    if error.__cause__ is not None and str(error.__cause__) not in messages[0]:
        messages.append(str(error.__cause__))
    noise = ("full_key:", "object_type=", "reference_type=", "Set the environment", "To append")
    parts: list[str] = []
    for message in messages:
        for raw in message.splitlines():
            line = raw.strip()
            if not line or line.startswith(noise):
                continue
            if raw[:1] in ("\t", " ") and parts:  # an item of a listed set of options
                parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
            else:
                parts.append(line)
    return " ".join(parts) or type(error).__name__


def fail(message: str) -> None:
    print(f"lbt: error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def precheck(overrides: list[str]) -> None:
    """Compose the config as Hydra will and validate it, before Hydra's own reporting.

    Hydra prints composition errors over several lines with a hint about
    HYDRA_FULL_ERROR; composing here first turns them into one line.
    """
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lbt.errors import ConfigError
    from lbt.paths import conf_dir
    from lbt.train import _check_layout
    from lbt import dist as lbt_dist

    try:
        with initialize_config_dir(str(conf_dir()), version_base="1.3", job_name="lbt_precheck"):
            cfg = compose("config", overrides=overrides)
        config = OmegaConf.to_container(cfg, resolve=True)
        _check_layout(config, lbt_dist.torchrun_env())
    except ConfigError as error:
        fail(str(error))
    except Exception as error:  # Hydra / OmegaConf composition errors
        fail(one_line(error))


def train_command(args: list[str]) -> None:
    from lbt.dist import torchrun_env

    env = torchrun_env()
    worker_rank = env["rank"] if env else 0
    plain_overrides = not any(arg.startswith("-") for arg in args)
    if plain_overrides:
        if worker_rank == 0:
            precheck(args)
        else:
            # Only torchrun's rank 0 owns the run folder: the others must not
            # create folders or log files of their own (see lbt.train._agree_on_run_dir).
            args = args + ["hydra.output_subdir=null", "hydra.run.dir=.",
                           "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    from lbt.train import hydra_main

    sys.argv = ["lbt train", *args]
    hydra_main()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, args = argv[0], argv[1:]
    if command == "train":
        train_command(args)
    else:
        print(USAGE, file=sys.stderr)
        fail(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
