"""Control characters in user text shown as escapes, so a key, a value or a log line cannot drive the terminal.

A newline in a YAML key could forge a ``GO: 0 errors`` line, ``ESC[8m`` hides what follows, ``ESC[2J`` clears
the screen and a right-to-left override reorders a line. Every piece of user text that the text output shows
passes through :func:`escape` (``--format json`` escapes them by JSON's own rules).
"""

from __future__ import annotations

import re

from verl_safe_launch.errors import ManyErrors, VslError

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` on one line: every control character (newlines included) as a visible escape (``\\x1b``, ``\\n``)."""
    return _CONTROL.sub(_escaped, text) if _CONTROL.search(text) else text


def escape_lines(text: str) -> str:
    """Like :func:`escape`, keeping the line breaks: for a block of lines whose every part is shown."""
    return "\n".join(escape(line) for line in text.split("\n"))


def render_error(exc: VslError) -> str:
    """A user error's compact message (what, where, fix) with every part escaped; several one after the other."""
    if isinstance(exc, ManyErrors):
        return "\n".join(render_error(e) for e in exc.errors)
    lines = [f"error: {escape(exc.what)}"]
    if exc.where:
        lines.append(f"  where: {escape(exc.where)}")
    if exc.fix:
        lines.append(f"  fix: {escape(exc.fix)}")
    return "\n".join(lines)
