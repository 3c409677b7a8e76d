"""Where a ``$( ... )`` ends, read as bash reads it: a command list with quotes, comments, here-documents and case."""

from __future__ import annotations

import re

_WORD = re.compile(r"[^\s;&|()<>'\"\\$`]+")
_DELIMITER = re.compile(r"(?:'([^']*)'|\"([^\"]*)\"|\\?([^\s;&|()<>'\"]+))")
_BOUNDARY = " \t\n;&|()<>"
_STARTS_COMMAND = frozenset({"do", "then", "else", "elif", "{", "!", "in", "time"})
MAX_NESTING = 32
"""The deepest quotes and expansions may nest (``$(...$(...))``, ``${A:-${B:-...}}``): bash has no limit, Python's
stack has."""


class NestedTooDeep(Exception):
    """Quotes and expansions nested past MAX_NESTING."""


class _Scan:
    """One scan of a substitution body; ``end`` is the index of its closing ``)``, or -1."""

    def __init__(self, text: str, start: int, nested: int) -> None:
        self.text, self.i = text, start
        self.nested = nested
        self.depth = 1
        self.pending: list[tuple[str, bool]] = []
        self.case: list[str] = []  # per open ``case``: "word", "in", "pattern" or "body"
        self.command_start = True

    def run(self) -> int:
        while self.i < len(self.text):
            ch = self.text[self.i]
            if ch == ")" and not (self.case and self.case[-1] == "pattern"):
                self.depth -= 1
                if self.depth == 0:
                    return self.i
                self.i += 1
            elif not self._step(ch):
                return -1
        return -1

    def _step(self, ch: str) -> bool:
        if ch == "\n":
            self.i += 1
            self.command_start = True
            return self._bodies()
        if ch in " \t":
            self.i += 1
        elif ch == "#" and (self.i == 0 or self.text[self.i - 1] in _BOUNDARY):
            end = self.text.find("\n", self.i)
            self.i = len(self.text) if end < 0 else end
        elif ch in ";&|()<>":
            self._operator(ch)
        else:
            return self._word()
        return True

    def _operator(self, ch: str) -> None:
        text, i = self.text, self.i
        if text.startswith("<<", i) and not text.startswith("<<<", i):
            strip = text.startswith("<<-", i)
            self.i += 3 if strip else 2
            self._heredoc(strip)
            return
        if ch == ")":  # a case pattern's end (any other ')' is handled by run)
            self.case[-1] = "body"
            self.i += 1
            self.command_start = True
            return
        if ch == "(" and not (self.case and self.case[-1] == "pattern"):
            self.depth += 1
        elif text.startswith((";;", ";&"), i) and self.case:
            self.case[-1] = "pattern"
            self.i += 3 if text.startswith(";;&", i) else 2
            self.command_start = True
            return
        self.i += 1
        self.command_start = ch in ";&|("

    def _heredoc(self, strip: bool) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t":
            self.i += 1
        match = _DELIMITER.match(self.text, self.i)
        if match:
            self.pending.append((next(g for g in match.groups() if g is not None), strip))
            self.i = match.end()

    def _bodies(self) -> bool:
        for delimiter, strip in self.pending:
            while True:
                if self.i >= len(self.text):
                    return False
                end = self.text.find("\n", self.i)
                end = len(self.text) if end < 0 else end
                line = self.text[self.i : end]
                self.i = min(end + 1, len(self.text))
                if (line.lstrip("\t") if strip else line) == delimiter:
                    break
        self.pending = []
        return True

    def _word(self) -> bool:
        """One word: plain text, quotes and expansions up to the next blank or operator."""
        start, plain = self.i, True
        while self.i < len(self.text) and self.text[self.i] not in _BOUNDARY:
            ch = self.text[self.i]
            if ch in "'\"\\$`":
                plain = False
                end = skip_quoted(self.text, self.i, nested=self.nested)
                if end < 0:
                    return False
                self.i = end
            else:
                match = _WORD.match(self.text, self.i)
                self.i = match.end() if match else self.i + 1
        self._keyword(self.text[start : self.i] if plain else "")
        return True

    def _keyword(self, word: str) -> None:
        state = self.case[-1] if self.case else ""
        if state == "word":
            self.case[-1] = "in"
        elif state == "in" and word == "in":
            self.case[-1] = "pattern"
        elif word == "esac" and (state == "pattern" or (state == "body" and self.command_start)):
            self.case.pop()
        elif word == "case" and self.command_start:
            self.case.append("word")
        self.command_start = word in _STARTS_COMMAND


def skip_quoted(text: str, i: int, in_double: bool = False, *, nested: int = 0) -> int:
    """The index just past the quote, escape or expansion starting at ``text[i]``, or -1 if it never ends.

    ``nested`` counts the quotes and expansions around ``text[i]``; past MAX_NESTING, NestedTooDeep."""
    ch, nxt = text[i], text[i + 1 : i + 2]
    if ch == "\\":
        return min(i + 2, len(text))
    if ch == "'":
        end = text.find("'", i + 1)
        return -1 if end < 0 else end + 1
    if nested >= MAX_NESTING:
        raise NestedTooDeep
    if ch == '"':
        return _double_quoted_end(text, i + 1, nested + 1)
    if ch == "`":
        return backquote_end(text, i + 1)
    if ch == "$" and text.startswith("((", i + 1) and (end := arithmetic_end(text, i + 3, nested + 1)) > 0:
        return end
    if nxt == "(":
        end = substitution_end(text, i + 2, nested + 1)
        return -1 if end < 0 else end + 1
    if nxt == "{":
        return _brace_end(text, i + 2, nested + 1)
    if nxt == "'" and not in_double:
        return _ansi_c_end(text, i + 2)
    return i + 1


def substitution_end(text: str, start: int, nested: int = 0) -> int:
    """The index of the ``)`` that closes a ``$(`` whose body starts at ``start``, or -1; NestedTooDeep when
    its body nests quotes and expansions past MAX_NESTING."""
    return _Scan(text, start, nested).run()


def _double_quoted_end(text: str, i: int, nested: int) -> int:
    while i < len(text):
        ch = text[i]
        if ch == '"':
            return i + 1
        if ch in "\\$`":
            i = skip_quoted(text, i, in_double=True, nested=nested)
            if i < 0:
                return -1
        else:
            i += 1
    return -1


def arithmetic_end(text: str, i: int, nested: int = 0) -> int:
    """Just past the ``))`` closing ``$((`` (body from ``i``), or -1 when the parentheses close otherwise."""
    j = _depth_reached(text, i, "()", depth=2, stop=1, nested=nested)
    return j + 2 if j >= 0 and text[j + 1 : j + 2] == ")" else -1


def backquote_end(text: str, i: int) -> int:
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == "`":
            return i + 1
        else:
            i += 1
    return -1


def _brace_end(text: str, i: int, nested: int) -> int:
    j = _depth_reached(text, i, "{}", depth=1, stop=0, nested=nested)
    return j + 1 if j >= 0 else -1


def _depth_reached(text: str, i: int, pair: str, *, depth: int, stop: int, nested: int) -> int:
    """The index where nesting by ``pair`` (quotes and expansions skipped) falls from ``depth`` to ``stop``; -1: never."""
    while i < len(text):
        ch = text[i]
        if ch in "\"\\$`'":
            i = skip_quoted(text, i, nested=nested)
            if i < 0:
                return -1
            continue
        depth += {pair[0]: 1, pair[1]: -1}.get(ch, 0)
        if depth == stop:
            return i
        i += 1
    return -1


def _ansi_c_end(text: str, i: int) -> int:
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == "'":
            return i + 1
        else:
            i += 1
    return -1
