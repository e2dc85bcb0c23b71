"""Markdown tables, drawn one way for every report lbt writes (a study's report.md, a tune's tune_report.md,
a probe's probe.md)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> list[str]:
    """A table's lines: the header, the alignment row (`align`: a letter a column, `l` left or `r` right, as
    numbers are) and a line per row."""
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align {align!r} must give l or r for each of the {len(header)} columns")
    return [line(header), "|" + "".join("---:|" if a == "r" else "---|" for a in align), *map(line, rows)]


def line(cells: Sequence[object]) -> str:
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def cell_text(text: object) -> str:
    """Free text in a table cell: one line, no column breaks."""
    return " ".join(str(text or "").split()).replace("|", "\\|")
