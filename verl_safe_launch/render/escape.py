"""Control and invisible characters in user text shown as escapes, so text cannot drive the terminal or hide.

A newline in a YAML key could forge a ``GO: 0 errors`` line, ``ESC[8m`` hides what follows, ``ESC[2J`` clears
the screen and a right-to-left override reorders a line; a zero-width space or a tag character makes
``train_batch_size`` + U+200B print exactly like the real key. Every piece of user text that the text output
shows passes through :func:`escape` (``--format json`` escapes them by JSON's own rules), this module being the
one place that decides what is shown as an escape.
"""

from __future__ import annotations

import re

from verl_safe_launch.errors import ManyErrors, VslError

FORMAT_CHARACTERS = (
    "\u00ad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e"
    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U00013438"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f"
)
"""Unicode's format characters (category Cf, as of Unicode 14, Python 3.11's): the soft hyphen, zero-width
spaces and joiners, bidirectional marks, embeddings, overrides and isolates, the byte order mark, interlinear
annotations, tag characters."""
INVISIBLE = "\u034f\u115f\u1160\u180b-\u180d\u180f\u3164\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef"
"""Characters outside Cf that draw nothing either: the combining grapheme joiner, Hangul fillers, variation
selectors."""
_CONTROL = re.compile(f"[\x00-\x1f\x7f-\x9f\u2028\u2029{FORMAT_CHARACTERS}{INVISIBLE}]")
_HIDDEN = re.compile(f"[\\x80-\\x9f\\u2028\\u2029{FORMAT_CHARACTERS}{INVISIBLE}]")
"""What no line of this tool's own output holds: C1 codes, line separators, format and invisible characters
(newlines, tabs and the ESC of a table's colours are its own)."""
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escape(text: str) -> str:
    """``text`` on one line: every control character (newlines included) as a visible escape (``\\x1b``, ``\\n``)."""
    return _CONTROL.sub(_escaped, text) if _CONTROL.search(text) else text


def escape_hidden(text: str) -> str:
    """``text`` with every C1 code, line separator, format character (Cf: bidirectional controls included) and
    invisible character shown as an escape, and everything else as it is: the last guard of every stream."""
    return _HIDDEN.sub(_escaped, text) if _HIDDEN.search(text) else text


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
