"""One table helper for every verb: a rich table on a terminal, plain aligned text when piped or compared."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from verl_safe_launch.render.escape import escape


@dataclass(frozen=True)
class Column:
    """A column: its header, its alignment and the least width of its plain text."""

    header: str
    align: Literal["left", "right"] = "left"
    min_width: int = 0


def use_rich() -> bool:
    """Rich output (tables, colour) only on a terminal, and never with ``NO_COLOR`` set."""
    return sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def render_table(
    columns: Sequence[Column], rows: Sequence[Sequence[str]], *, gap: int = 2, rich: bool | None = None
) -> str:
    """The table as text, one line per row after the header; ``rich`` defaults to :func:`use_rich`.

    Plain text is deterministic: each column as wide as its widest cell (or ``min_width``), ``gap`` spaces
    between columns, no trailing spaces.
    """
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"every row needs {len(columns)} cells")
    rows = [[escape(cell) for cell in row] for row in rows]
    if use_rich() if rich is None else rich:
        return _rich(columns, rows)
    return _plain(columns, rows, gap)


def _plain(columns: Sequence[Column], rows: Sequence[Sequence[str]], gap: int) -> str:
    table = [[c.header for c in columns], *([*row] for row in rows)]
    widths = [max(c.min_width, *(len(row[i]) for row in table)) for i, c in enumerate(columns)]
    lines = []
    for row in table:
        cells = [
            cell.rjust(width) if column.align == "right" else cell.ljust(width)
            for cell, width, column in zip(row, widths, columns, strict=True)
        ]
        lines.append((" " * gap).join(cells).rstrip())
    return "\n".join(lines) + "\n"


def _rich(columns: Sequence[Column], rows: Sequence[Sequence[str]]) -> str:
    import io
    import shutil

    from rich import box
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for column in columns:
        table.add_column(Text(column.header), justify=column.align, min_width=column.min_width or None)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    out = io.StringIO()
    width = shutil.get_terminal_size().columns
    Console(file=out, width=width, force_terminal=True, highlight=False).print(table)
    return out.getvalue()
