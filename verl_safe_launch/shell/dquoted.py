"""A ``${NAME:-word}`` inside double quotes, as bash reads its word: there, single quotes and the characters that
split or redirect are plain, and a backslash escapes only ``" \\ $ ` newline``."""

from __future__ import annotations

DQ_ESCAPES = frozenset('"\\$`\n')
"""What a backslash escapes inside double quotes; before any other character it stays."""
DQ_LITERAL = frozenset("' \t<>|&;()#~")
"""Characters that are plain inside double quotes but mean something to the unquoted lexer."""


def as_in_double_quotes(text: str) -> str:
    """The word of a ``${NAME:-word}`` inside double quotes, rewritten for the unquoted lexer: bash keeps its single
    quotes as characters and a backslash before anything but ``" \\ $ ` newline``; ``$'...'``, nested double quotes
    and nested ``${...}`` are read as they are."""
    out: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text):
            nxt = text[i + 1]
            out.append(text[i : i + 2] if nxt in DQ_ESCAPES else "\\\\" + ("\\" if nxt == "'" else "") + nxt)
            i += 2
        elif c == "$" and text.startswith("$'", i):
            end = closing_quote(text, i + 1, "'")
            end = end if end >= 0 else len(text) - 1
            out.append(text[i : end + 1])
            i = end + 1
        elif c == '"' or text.startswith("${", i):
            end = _closing(text, i)
            out.append(text[i : end + 1])
            i = end + 1
        else:
            out.append("\\" + c if c in DQ_LITERAL else c)
            i += 1
    return "".join(out)


def closing_quote(text: str, start: int, quote: str = '"') -> int:
    """The index of the ``quote`` that closes the one at ``start`` (a backslash escapes the next character); -1
    when none does."""
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == quote:
            return i
        i += 1
    return -1


def _closing(text: str, i: int) -> int:
    """The index that closes the double quote or ``${`` at ``i`` (the end when nothing does)."""
    if text[i] == '"':
        end = closing_quote(text, i)
        return end if end >= 0 else len(text) - 1
    depth, j = 1, i + 2
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text.startswith("${", j):
            depth += 1
            j += 2
        else:
            if text[j] == "}":
                depth -= 1
                if depth == 0:
                    return j
            j += 1
    return len(text) - 1
