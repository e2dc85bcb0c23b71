"""Processes and how they work together: the process group (process_group.py), lbt's local launcher
(launcher.py) and tensor parallelism (tensor_parallel.py)."""
