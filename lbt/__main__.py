"""`lbt ...`, `python -m lbt ...` and `torchrun ... -m lbt train ...`: one entry point.

The installed `lbt` script calls `run` too, so a stop that arrives while torch and Hydra import (the
first seconds), or while a command with no stop of its own runs (report, plan, tokens), is a stop: exit
143/130 with its line, not a KeyboardInterrupt traceback. Commands of runs (train, study, tune, probe)
take the signals over while they can stop cleanly.
"""


def run() -> None:
    from lbt.apps.errors import exit_when_stopped  # light: no torch, no Hydra

    exit_when_stopped()
    from lbt.apps.cli import main

    main()


if __name__ == "__main__":
    run()
