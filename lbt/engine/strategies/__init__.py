"""Step strategies: synchronous SGD (base.py), local SGD and gradient delay."""
