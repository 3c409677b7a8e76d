"""The one table helper: plain aligned text when piped, a rich table on a terminal (checked through a real pty)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest

from verl_safe_launch.render import Column, render_table

COLUMNS = [Column("name"), Column("GiB", "right"), Column("note")]
ROWS = [("rollout", "56.2", "fits"), ("actor update", "3.0", "[bold]literal[/bold]")]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_plain_columns_are_aligned_without_trailing_spaces() -> None:
    assert render_table(COLUMNS, ROWS, rich=False).splitlines() == [
        "name           GiB  note",
        "rollout       56.2  fits",
        "actor update   3.0  [bold]literal[/bold]",
    ]


def test_plain_gap_and_least_width() -> None:
    columns = [Column("a", min_width=4), Column("b", "right", 3), Column("c")]
    assert render_table(columns, [("x", "1", "")], gap=1, rich=False) == "a      b c\nx      1\n"


def test_a_row_of_the_wrong_length_is_refused() -> None:
    with pytest.raises(ValueError, match="every row needs 3 cells"):
        render_table(COLUMNS, [("only", "two")], rich=False)


def test_rich_table_keeps_every_cell_literally() -> None:
    text = render_table(COLUMNS, ROWS, rich=True)
    plain = ANSI.sub("", text)
    assert ANSI.search(text)  # styled for a terminal
    assert "[bold]literal[/bold]" in plain  # cells are text, never rich markup
    for cell in ("name", "GiB", "note", "rollout", "56.2", "actor update"):
        assert cell in plain
    assert "─" in plain  # the rule under the header


def run_on_a_terminal(*argv: str) -> str:
    """Run the console script with its stdout on a pseudo-terminal; return what it printed."""
    main, child = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"} | {"COLUMNS": "120", "TERM": "xterm"}
    script = str(Path(sys.executable).parent / "verl-safe-launch")
    proc = subprocess.Popen([script, *argv], stdout=child, stderr=subprocess.PIPE, env=env)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(main)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return b"".join(chunks).decode()


def test_presets_list_is_rich_on_a_terminal_and_plain_when_piped() -> None:
    script = str(Path(sys.executable).parent / "verl-safe-launch")
    piped = subprocess.run([script, "presets"], capture_output=True, text=True, check=True).stdout
    assert piped.splitlines()[0].split() == ["NAME", "HARDWARE", "MODELS", "SUMMARY"]
    assert not ANSI.search(piped) and "─" not in piped
    on_terminal = run_on_a_terminal("presets")
    assert ANSI.search(on_terminal) and "─" in on_terminal
    names = [line.split()[0] for line in piped.splitlines()[1:] if line and not line.startswith("Use ")]
    for name in names:
        assert name in ANSI.sub("", on_terminal)
