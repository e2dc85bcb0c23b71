"""Matplotlib for lbt's figures, set up once: a headless backend, a global-batch axis, one way to save.

Matplotlib is imported when the first figure is drawn, not when a command starts: a study, probe or tune
draws only at its end, and its import costs about half a second of every process start on 2 cores.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from lbt.paths import atomic_write


@functools.cache
def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (files only: lbt runs on machines without a screen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def colormap(name: str) -> Any:
    from matplotlib import colormaps

    return colormaps[name]


def figure(columns: int = 1, width: float = 7.0, height: float = 4.5) -> tuple[Any, Any]:
    """A new figure with `columns` axes side by side: (figure, axes or tuple of axes)."""
    return pyplot().subplots(1, columns, figsize=(width, height))


def batch_axis(ax: Any, label: str = "global batch") -> None:
    """A log2 x axis labelled with the batches (or GPU counts) themselves."""
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlabel(label)


def save_figure(fig: Any, path: str | Path, title: str | None = None, dpi: int = 120) -> Path:
    """Title (as a suptitle), tight layout, write the PNG (its folder made), close the figure."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    # tight_layout leaves a placeholder layout engine behind, and savefig runs a whole layout pass over the
    # figure for any engine: without it, the same pixels in about two thirds of the time.
    fig.set_layout_engine(None)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, dpi=dpi, format="png"))
    pyplot().close(fig)
    return path
