"""A small bash lexer: words with their quoting, expansions and line numbers, and the operators between them."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from verl_safe_launch.shell.ansi_c import ansi_c
from verl_safe_launch.shell.dquoted import as_in_double_quotes, closing_quote
from verl_safe_launch.shell.subst import (
    MAX_NESTING,
    NestedTooDeep,
    arithmetic_end,
    backquote_end,
    substitution_end,
)


class PartKind(StrEnum):
    """What one piece of a word is."""

    LIT = "lit"  # literal text
    VAR = "var"  # $NAME, ${NAME}, ${NAME:-default}, $1
    ARGS = "args"  # $@, $*, ${@}
    ARRAY = "array"  # ${NAME[@]}
    ARITH = "arith"  # $((...)): the expression inside
    SUBST = "subst"  # $(...), `...`, and expansions this lexer does not evaluate


@dataclass(frozen=True)
class Part:
    """One piece of a word; ``default`` holds the parts of ``${NAME:-default}`` (``${NAME-default}``: also
    ``unset_only``, the default replaces an unset NAME but not an empty one; ``${NAME:+alt}`` when ``alt``)."""

    kind: PartKind
    text: str
    quoted: bool
    default: tuple[Part, ...] | None = None
    unset_only: bool = False
    alt: bool = False


@dataclass(frozen=True)
class Word:
    """A shell word: its parts, the line it starts on and its text as written."""

    parts: tuple[Part, ...]
    line: int
    raw: str


@dataclass(frozen=True)
class ArrayAssign:
    """``NAME=(item ...)`` or ``NAME+=(item ...)``."""

    name: str
    items: tuple[Word, ...]
    append: bool
    line: int
    raw: str


@dataclass(frozen=True)
class Op:
    """A control operator (newline, ``;``, ``&&``, ``|`` ...), a redirection, or ``()`` of a function."""

    text: str
    line: int


Token = Word | ArrayAssign | Op


class ShellSyntaxError(Exception):
    """The text is not valid shell (an unterminated quote or expansion)."""

    def __init__(self, message: str, line: int) -> None:
        super().__init__(message)
        self.message = message
        self.line = line


_PLAIN = re.compile(r"[^\s'\"\\$`;&|()<>]+")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGN_PREFIX = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)(\+?)=$")
_BRACE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*|[0-9]+|[@*])(?:\[([@*])\])?(?:(:?[-=+])(.*))?$", re.DOTALL)
_ARGS_FROM = re.compile(r"[@*]:[0-9]+")
_OPERATORS = ("&&", "||", ";;", "|&", ">>", "<<<", "<<-", "<<", "&>", ">&", "<&", ";", "&", "|", ">", "<")
_DQ_ESCAPABLE = '$`"\\'
_SPECIAL_PARAMS = "#?$!-0123456789"


class _Lexer:
    def __init__(self, text: str, nesting: int = 0) -> None:
        self.text = text
        self.nesting = nesting
        self.i = 0
        self.line = 1
        self.out: list[Token] = []
        self.heredocs: list[tuple[str, bool]] = []
        self._reset_word()

    def _reset_word(self) -> None:
        self.parts: list[Part] = []
        self.lit: list[str] = []
        self.word_start = -1
        self.word_line = self.line
        self.has_word = False

    def _start_word(self) -> None:
        if not self.has_word:
            self.has_word = True
            self.word_start = self.i
            self.word_line = self.line

    def _flush_lit(self, quoted: bool = False) -> None:
        if self.lit:
            self.parts.append(Part(PartKind.LIT, "".join(self.lit), quoted))
            self.lit = []

    def _end_word(self) -> None:
        if self.has_word:
            self._flush_lit()
            raw = self.text[self.word_start : self.i].replace("\\\n", "")
            self.out.append(Word(tuple(self.parts), self.word_line, raw))
        self._reset_word()

    def run(self) -> list[Token]:
        try:
            while self.i < len(self.text):
                self._step()
        except NestedTooDeep:
            raise ShellSyntaxError(
                f"quotes and expansions nested over {MAX_NESTING} deep (the limit)", self.line
            ) from None
        self._end_word()
        return self.out

    def _step(self) -> None:
        text, i = self.text, self.i
        ch = text[i]
        if ch != "\n" and ch.isspace():
            self._end_word()
            self.i += 1
        elif ch == "\n":
            self._end_word()
            self.out.append(Op("\n", self.line))
            self.i += 1
            self.line += 1
            self._read_heredocs()
        elif ch == "#" and not self.has_word:
            end = text.find("\n", i)
            self.i = len(text) if end < 0 else end
        elif ch == "\\":
            self._backslash()
        elif ch == "'":
            self._start_word()
            self._single_quoted()
        elif ch == '"':
            self._start_word()
            self._double_quoted()
        elif ch == "$" or ch == "`":
            self._start_word()
            self._flush_lit()
            self.parts.append(self._dollar(quoted=False) if ch == "$" else self._backtick(False))
        elif ch in ";&|<>()":
            self._operator(ch)
        else:
            match = _PLAIN.match(text, i)
            assert match is not None
            self._start_word()
            self.lit.append(match.group())
            self.i = match.end()

    def _backslash(self) -> None:
        nxt = self.text[self.i + 1 : self.i + 2]
        if nxt == "\n":
            self.i += 2
            self.line += 1
            return
        self._start_word()
        self.lit.append(nxt)
        self.i += 2

    def _single_quoted(self) -> None:
        end = self.text.find("'", self.i + 1)
        if end < 0:
            raise ShellSyntaxError("unterminated single quote", self.line)
        body = self.text[self.i + 1 : end]
        self._flush_lit()
        self.parts.append(Part(PartKind.LIT, body, True))
        self.line += body.count("\n")
        self.i = end + 1

    def _double_quoted(self) -> None:
        start_line = self.line
        self._flush_lit()
        self.i += 1
        buf: list[str] = []
        saw_part = False
        while True:
            if self.i >= len(self.text):
                raise ShellSyntaxError("unterminated double quote", start_line)
            ch = self.text[self.i]
            if ch == '"':
                self.i += 1
                break
            if ch == "\\" and self.text[self.i + 1 : self.i + 2] in (*_DQ_ESCAPABLE, "\n"):
                nxt = self.text[self.i + 1]
                if nxt == "\n":
                    self.line += 1
                else:
                    buf.append(nxt)
                self.i += 2
            elif ch in "$`":
                if buf:
                    self.parts.append(Part(PartKind.LIT, "".join(buf), True))
                    buf = []
                self.parts.append(self._dollar(quoted=True) if ch == "$" else self._backtick(True))
                saw_part = True
            else:
                if ch == "\n":
                    self.line += 1
                buf.append(ch)
                self.i += 1
        if buf or not saw_part:
            self.parts.append(Part(PartKind.LIT, "".join(buf), True))

    def _backtick(self, quoted: bool) -> Part:
        end = backquote_end(self.text, self.i + 1)
        if end < 0:
            raise ShellSyntaxError("unterminated backquote", self.line)
        raw = self.text[self.i : end]
        self.line += raw.count("\n")
        self.i = end
        return Part(PartKind.SUBST, raw, quoted)

    def _dollar(self, quoted: bool) -> Part:
        text, i = self.text, self.i
        nxt = text[i + 1 : i + 2]
        if text.startswith("((", i + 1) and (end := arithmetic_end(text, i + 3)) > 0:
            part = self._subst(i, end, quoted)
            return Part(PartKind.ARITH, part.text[3:-2], quoted)
        if nxt == "(":
            end = substitution_end(text, i + 2)
            if end < 0:
                raise ShellSyntaxError("unterminated $( ... )", self.line)
            return self._subst(i, end + 1, quoted)
        if nxt == "{":
            end = _matching(text, i + 1, "{", "}")
            if end < 0:
                raise ShellSyntaxError("unterminated ${ ... }", self.line)
            return self._brace(i, end, quoted)
        if nxt == "'" and not quoted:  # inside "...", $' is a literal $ (bash)
            value, end = ansi_c(text, i + 2)
            if end < 0:
                raise ShellSyntaxError("unterminated $'...' string", self.line)
            self.line += text.count("\n", i, end)
            self.i = end
            return Part(PartKind.LIT, value, True)
        match = _NAME.match(text, i + 1)
        if match:
            self.i = match.end()
            return Part(PartKind.VAR, match.group(), quoted)
        if nxt and nxt in "@*":
            self.i = i + 2
            return Part(PartKind.ARGS, nxt, quoted)
        if nxt and nxt in _SPECIAL_PARAMS:
            self.i = i + 2
            return Part(PartKind.VAR, nxt, quoted)
        self.i = i + 1
        return Part(PartKind.LIT, "$", quoted)

    def _subst(self, start: int, end: int, quoted: bool) -> Part:
        raw = self.text[start:end]
        self.line += raw.count("\n")
        self.i = end
        return Part(PartKind.SUBST, raw, quoted)

    def _brace(self, start: int, close: int, quoted: bool) -> Part:
        body = self.text[start + 2 : close]
        raw = self.text[start : close + 1]
        self.line += raw.count("\n")
        self.i = close + 1
        if _ARGS_FROM.fullmatch(body):  # "${@:1}", "${@:2}": the script's own arguments, like "$@"
            return Part(PartKind.ARGS, body[0], quoted)
        match = _BRACE.match(body)
        if not match:
            return Part(PartKind.SUBST, raw, quoted)
        name, index, op, default = match.groups()
        if name in "@*":
            return (
                Part(PartKind.ARGS, name, quoted) if not (index or op) else Part(PartKind.SUBST, raw, quoted)
            )
        if index:
            kind = PartKind.ARRAY if not op else PartKind.SUBST
            return Part(kind, name if not op else raw, quoted)
        if op is None:
            return Part(PartKind.VAR, name, quoted)
        alt = op.endswith("+")
        if self.nesting >= MAX_NESTING:
            raise ShellSyntaxError(f"expansions nested over {MAX_NESTING} deep (the limit)", self.line)
        default_parts = _default_parts(default, quoted, self.nesting + 1)
        return Part(
            PartKind.VAR, name, quoted, default=default_parts, unset_only=not op.startswith(":"), alt=alt
        )

    def _operator(self, ch: str) -> None:
        text, i = self.text, self.i
        if ch == "(" and self._array_assignment():
            return
        if ch == "(" and text[i + 1 : i + 2] == ")" and self.has_word:
            self._end_word()
            self.out.append(Op("()", self.line))
            self.i += 2
            return
        if ch in "<>" and self.has_word and not self.parts and "".join(self.lit).isdigit():
            self._reset_word()
        self._end_word()
        op = next((o for o in _OPERATORS if text.startswith(o, i)), ch)
        self.i += len(op)
        if op in ("<<", "<<-"):
            self._heredoc_marker(op == "<<-")
            return
        self.out.append(Op(op, self.line))

    def _array_assignment(self) -> bool:
        if self.parts or not self.lit:
            return False
        match = _ASSIGN_PREFIX.match("".join(self.lit))
        if not match:
            return False
        start, line = self.word_start, self.word_line
        self._reset_word()
        self.i += 1
        items: list[Word] = []
        depth_out = len(self.out)
        while True:
            while self.i < len(self.text) and self.text[self.i].isspace():
                if self.text[self.i] == "\n":
                    self.line += 1
                self.i += 1
            if self.i >= len(self.text):
                raise ShellSyntaxError("unterminated array ( ... )", line)
            ch = self.text[self.i]
            if ch == ")":
                self.i += 1
                break
            if ch == "#":
                end = self.text.find("\n", self.i)
                self.i = len(self.text) if end < 0 else end
                continue
            self._array_item(ch)
        items = [t for t in self.out[depth_out:] if isinstance(t, Word)]
        del self.out[depth_out:]
        raw = self.text[start : self.i]
        self.out.append(ArrayAssign(match.group(1), tuple(items), match.group(2) == "+", line, raw))
        return True

    def _array_item(self, ch: str) -> None:
        if ch in ";&|<>(":
            raise ShellSyntaxError(f"unexpected '{ch}' inside an array", self.line)
        while self.i < len(self.text) and not self.text[self.i].isspace() and self.text[self.i] != ")":
            if self.text[self.i] in ";&|<>(":
                raise ShellSyntaxError(f"unexpected '{self.text[self.i]}' inside an array", self.line)
            self._step()
        self._end_word()

    def _heredoc_marker(self, strip_tabs: bool) -> None:
        while self.i < len(self.text) and self.text[self.i] in " \t":
            self.i += 1
        match = re.compile(r"['\"]?([^\s'\"<>;&|()]+)['\"]?").match(self.text, self.i)
        if not match:
            raise ShellSyntaxError("here-document without a delimiter", self.line)
        self.heredocs.append((match.group(1), strip_tabs))
        self.i = match.end()

    def _read_heredocs(self) -> None:
        for delimiter, strip_tabs in self.heredocs:
            while self.i < len(self.text):
                end = self.text.find("\n", self.i)
                end = len(self.text) if end < 0 else end
                body_line = self.text[self.i : end]
                self.i = min(end + 1, len(self.text))
                self.line += 1
                if (body_line.lstrip("\t") if strip_tabs else body_line) == delimiter:
                    break
        self.heredocs = []


def _matching(text: str, start: int, open_ch: str, close_ch: str) -> int:
    """Index of the bracket closing the one at ``start`` (quotes and nesting respected), or -1."""
    depth = 0
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "'" and open_ch == "(":
            end = text.find("'", i + 1)
            if end < 0:
                return -1
            i = end + 1
            continue
        if ch == '"':
            end = closing_quote(text, i)
            if end < 0:
                return -1
            i = end + 1
            continue
        if ch == open_ch:
            depth += 1
        elif ch == close_ch:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def _default_parts(text: str, quoted: bool, nesting: int) -> tuple[Part, ...]:
    """The parts of the ``word`` in ``${NAME:-word}``."""
    tokens = _Lexer(as_in_double_quotes(text) if quoted else text.replace("\n", " "), nesting).run()
    parts: list[Part] = []
    for token in tokens:
        if isinstance(token, Word):
            if parts:
                parts.append(Part(PartKind.LIT, " ", quoted))
            parts.extend(
                Part(p.kind, p.text, p.quoted or quoted, p.default, p.unset_only, p.alt) for p in token.parts
            )
        else:
            parts.append(Part(PartKind.SUBST, text, quoted))
            break
    return tuple(parts) if parts else (Part(PartKind.LIT, "", quoted),)


def lex(text: str) -> list[Token]:
    """Split shell text into words, array assignments and operators; raise ShellSyntaxError."""
    return _Lexer(text).run()


SEPARATORS = frozenset({"\n", ";", "&", "&&", "||", "|", "|&", ";;", "(", ")"})
"""Operators that end a simple command."""
REDIRECTS = frozenset({">", ">>", "<", "<<", "<<-", "<<<", "&>", ">&", "<&"})
"""Operators whose next word is a redirection target (a file, a here-document delimiter, a here-string)."""


@dataclass
class SimpleCommand:
    """One simple command: its words and assignments, what ended it, and whether it heads a function."""

    items: list[Word | ArrayAssign] = field(default_factory=list)
    function_header: bool = False
    end: str = "\n"


def split_commands(tokens: list[Token]) -> list[SimpleCommand]:
    """Split tokens into simple commands; redirections and their targets are dropped (an empty command is kept
    only where ``;;`` ends a ``case`` branch)."""
    commands: list[SimpleCommand] = [SimpleCommand()]
    skip_next = False
    for token in tokens:
        if skip_next and isinstance(token, Word):
            skip_next = False
            continue
        skip_next = False
        if isinstance(token, Op):
            if token.text in SEPARATORS:
                commands[-1].end = token.text
                commands.append(SimpleCommand())
            elif token.text in REDIRECTS:
                skip_next = True
            elif token.text == "()":
                commands[-1].function_header = True
            continue
        commands[-1].items.append(token)
    return [c for c in commands if c.items or c.end == ";;"]
