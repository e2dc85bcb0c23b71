"""Numbers in the sentences lbt prints: a count with its noun ("1 GPU", "64 GPUs"), a signed difference."""

from __future__ import annotations


def count(n: int, noun: str) -> str:
    """`1 GPU`, `4,096 GPUs`: the noun in the plural unless n is one."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def gpus(n: int) -> str:
    return count(n, "GPU")
