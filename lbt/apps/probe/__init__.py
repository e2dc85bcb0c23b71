"""`lbt probe`: the critical batch from one run (branched probes); see command.py."""

from lbt.apps.probe.command import probe_command

__all__ = ["probe_command"]
