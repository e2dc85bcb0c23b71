"""Matplotlib for lbt's figures, set up once: a headless backend, a global-batch axis, one way to save."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: lbt runs on machines without a screen

import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
from matplotlib.ticker import FuncFormatter  # noqa: E402

from lbt.paths import atomic_write


def figure(columns: int = 1, width: float = 7.0, height: float = 4.5) -> tuple[Any, Any]:
    """A new figure with `columns` axes side by side: (figure, axes or tuple of axes)."""
    return plt.subplots(1, columns, figsize=(width, height))


def batch_axis(ax: Any, label: str = "global batch") -> None:
    """A log2 x axis labelled with the batches (or GPU counts) themselves."""
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlabel(label)


def save_figure(fig: Any, path: str | Path, title: str | None = None, dpi: int = 120) -> Path:
    """Title (as a suptitle), tight layout, write the PNG (its folder made), close the figure."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format="png"))
    plt.close(fig)
    return path
