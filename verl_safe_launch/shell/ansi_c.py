"""Bash's ANSI-C quoting (``$'...'``): the string's value, escapes decoded as bash decodes them."""

from __future__ import annotations

import re

_C_ESCAPES = {
    "a": "\a",
    "b": "\b",
    "e": "\x1b",
    "E": "\x1b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
}
_C_NUMERIC = {"x": (16, 2), "u": (16, 4), "U": (16, 8)}


def ansi_c(text: str, start: int) -> tuple[str, int]:
    """The value of a ``$'...'`` string whose body starts at ``start``, and the index after its closing quote
    (-1: unterminated). Escapes as bash's ANSI-C quoting: ``\\n``, ``\\'``, ``\\nnn``, ``\\xHH``, ``\\uHHHH``, ``\\cX``."""
    out: list[str] = []
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "'":
            return "".join(out), i + 1
        if ch != "\\" or i + 1 >= len(text):
            out.append(ch)
            i += 1
            continue
        value, i = _c_escape(text, i + 1)
        out.append(value)
    return "".join(out), -1


def _c_escape(text: str, i: int) -> tuple[str, int]:
    """One escape after its backslash (at ``i``): its value and the index after it."""
    ch = text[i]
    if ch in _C_ESCAPES:
        return _C_ESCAPES[ch], i + 1
    if ch == "c" and i + 1 < len(text):
        return chr(ord(text[i + 1].upper()) ^ 0x40), i + 2
    base, width = _C_NUMERIC.get(ch, (8, 3))
    first = i + 1 if ch in _C_NUMERIC else i
    digits = re.match("[0-7]+" if base == 8 else "[0-9A-Fa-f]+", text[first : first + width])
    if digits is None:
        return ("\\" + ch, i + 1) if ch not in "\\'\"?" else (ch, i + 1)
    code = int(digits.group(), base)
    return (chr(code & 0xFF) if base == 8 else chr(min(code, 0x10FFFF))), first + len(digits.group())


__all__ = ["ansi_c"]
