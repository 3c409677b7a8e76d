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
            end = _closing_single(text, i + 2)
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


def _closing_single(text: str, i: int) -> int:
    """The index of the quote that closes a ``$'...'`` whose body starts at ``i`` (the end when none does)."""
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text[i] == "'":
            return i
        i += 1
    return len(text) - 1


def _closing(text: str, i: int) -> int:
    """The index that closes the double quote or ``${`` at ``i`` (the end when nothing does)."""
    closer, depth, j = ('"', 0, i + 1) if text[i] == '"' else ("}", 1, i + 2)
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if closer == '"' and c == '"':
            return j
        if closer == "}":
            if text.startswith("${", j):
                depth += 1
                j += 2
                continue
            if c == "}":
                depth -= 1
                if depth == 0:
                    return j
        j += 1
    return len(text) - 1
