"""The engine: builds a run's parts from its spec and trains them (lbt/engine/worker.py `run`)."""

from lbt.engine.worker import make_spec, run

__all__ = ["make_spec", "run"]
