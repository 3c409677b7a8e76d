"""Expand shell words with the variables a script assigns itself; anything else stays unresolved, never guessed."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace

from verl_safe_launch.secret import register
from verl_safe_launch.shell.words import ArrayAssign, Part, PartKind, Word

OPAQUE = "\ue000"
"""Stands in a field's text for a piece the reader could not determine (one marker per piece)."""

WORKDIR = "\ue001"
"""Follows the ``OPAQUE`` of ``$(pwd)``: the piece not read is the working directory (a config path can still be
looked for from the script's directory)."""
_PWD_BODIES = frozenset({"pwd", "pwd -P", "pwd -L"})

MACHINE = frozenset({"HOME", "PWD", "USER"})
"""Variables that are always present but differ per machine: their text is kept as written."""


@dataclass(frozen=True)
class Field:
    """One argument after expansion.

    ``problem`` says why a piece (an ``OPAQUE`` marker in ``text``) could not be resolved, ``args`` marks
    ``"$@"``, ``maybe`` says why the field is present only on some paths through the script, and ``machine``
    names a per-machine variable (``$HOME``) kept as written in ``text``.
    """

    text: str
    line: int
    raw: str
    problem: str | None = None
    args: bool = False
    maybe: str | None = None
    machine: str | None = None


@dataclass(frozen=True)
class Scalar:
    """A variable holding a string; ``problem`` when the text holds ``OPAQUE`` markers.

    ``tail`` is text appended on some paths only (``X="$X more"`` inside an if), and ``tail_why`` says where.
    """

    text: str
    problem: str | None = None
    tail: str = ""
    tail_why: str | None = None


@dataclass(frozen=True)
class ArrayValue:
    """A bash array: its elements, each with the line it was written on."""

    items: tuple[Field, ...]


@dataclass(frozen=True)
class Unknown:
    """A variable whose value the script does not determine, and why."""

    reason: str


Value = Scalar | ArrayValue | Unknown
MAX_VALUE_CHARS = 64 * 1024
"""The longest value a variable or argument may expand to; past it the value is unknown (never a hang)."""
Env = dict[str, Value]


@dataclass(frozen=True)
class Note:
    """A value taken from ``${NAME:-default}`` because the script does not set NAME."""

    line: int
    raw: str
    detail: str


class Expander:
    """Expand words against the variables assigned so far; collects the ``${NAME:-default}`` notes."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.notes: list[Note] = []
        self.machine: str | None = None

    def word(self, word: Word) -> list[Field]:
        """The fields a word expands to (unquoted expansions are split on whitespace, as bash does)."""
        if len(word.parts) == 1 and word.parts[0].kind is PartKind.ARGS:
            return [Field(word.raw, word.line, word.raw, args=True)]
        if len(word.parts) == 1 and word.parts[0].kind is PartKind.ARRAY:
            return self._array(word, word.parts[0])
        tailed = self._tailed(word)
        if tailed is not None:
            return tailed
        splitter = _Splitter()
        problem: str | None = None
        length = 0
        self.machine = None
        for part in word.parts:
            length += len(part.text)
            if length > MAX_VALUE_CHARS:
                problem = problem or _too_long(word)
                splitter.literal(OPAQUE, True)  # unknown past the limit, never silently cut short
                break
            if part.kind is PartKind.LIT:
                splitter.literal(part.text, part.quoted)
                continue
            if part.kind is PartKind.VAR:
                pieces, why = self._lookup_pieces(part, word)
            else:
                found, why = self._part(part, word)
                pieces = [(found, part.quoted)]
            text = "".join(t for t, _ in pieces)
            length += len(text)
            if why is None and length > MAX_VALUE_CHARS:
                why = _too_long(word)
            problem = problem or why
            for piece, quoted in pieces:
                if quoted:
                    splitter.literal(piece, True)
                else:
                    splitter.split(piece)
        machine = self.machine
        return [
            Field(
                text,
                word.line,
                word.raw,
                problem=problem if OPAQUE in text else None,
                machine=machine if machine and f"${machine}" in text else None,
            )
            for text in splitter.finish()
        ]

    def assignment(self, word: Word) -> tuple[str, bool, Value]:
        """``NAME=value`` / ``NAME+=value``: the name, whether it appends, and the value (never split)."""
        head = word.parts[0].text
        name, _, rest = head.partition("=")
        parts = (Part(PartKind.LIT, rest, word.parts[0].quoted), *word.parts[1:])
        text, problem = self._join(parts, word)
        return name.rstrip("+"), name.endswith("+"), Scalar(text, problem)

    def _tailed(self, word: Word) -> list[Field] | None:
        """An unquoted ``$X`` whose tail is conditional: its words, then the tail's words marked as maybe."""
        part = word.parts[0] if len(word.parts) == 1 else None
        if part is None or part.kind is not PartKind.VAR or part.quoted or part.default is not None:
            return None
        value = self.env.get(part.text)
        if not isinstance(value, Scalar) or not value.tail:
            return None
        head = Expander({part.text: replace(value, tail="", tail_why=None)}).word(word)
        tail = [
            Field(
                text,
                word.line,
                word.raw,
                problem=value.problem if OPAQUE in text else None,
                maybe=value.tail_why,
            )
            for text in value.tail.split()
        ]
        return [*head, *tail]

    def _array(self, word: Word, part: Part) -> list[Field]:
        value = self.env.get(part.text)
        if isinstance(value, ArrayValue):
            if part.quoted:
                return list(value.items)
            return [_piece(item, text) for item in value.items for text in _words_of(item)]
        if isinstance(value, Unknown):
            return [Field(OPAQUE, word.line, word.raw, problem=value.reason)]
        if isinstance(value, Scalar):
            splitter = _Splitter()
            if part.quoted:
                splitter.literal(value.text, True)
            else:
                splitter.split(value.text)
            return [
                Field(text, word.line, word.raw, problem=value.problem if OPAQUE in text else None)
                for text in splitter.finish()
            ]
        return []

    def _part(self, part: Part, word: Word) -> tuple[str, str | None]:
        """The text of one expansion (``OPAQUE`` where unknown) and why it is unknown."""
        if part.kind is PartKind.SUBST:
            body = part.text.removeprefix("$(").removeprefix("`").removesuffix(")").removesuffix("`").strip()
            marker = OPAQUE + WORKDIR if body in _PWD_BODIES else OPAQUE
            return marker, f"the command substitution {part.text} (line {word.line})"
        if part.kind is PartKind.ARGS:
            return OPAQUE, f"the script's arguments (${part.text}) inside a longer word (line {word.line})"
        if part.kind is PartKind.ARRAY:
            return OPAQUE, f"the array ${{{part.text}[@]}} inside a longer word (line {word.line})"
        if part.kind is PartKind.ARITH:
            return arithmetic(part.text, self.env, word.line)
        pieces, why = self._lookup_pieces(part, word)
        return "".join(t for t, _ in pieces), why

    def _lookup_pieces(self, part: Part, word: Word) -> tuple[list[tuple[str, bool]], str | None]:
        """A variable's value as pieces with their quoting (a default's own quotes keep bash from splitting that
        piece: ``${U:-'a b'}`` is one field) and why it is unknown."""
        name = part.text
        value = self.env.get(name)

        def whole(text: str, why: str | None = None) -> tuple[list[tuple[str, bool]], str | None]:
            return [(text, part.quoted)], why

        if isinstance(value, Unknown):
            return whole(OPAQUE, value.reason)
        if isinstance(value, ArrayValue):
            first = value.items[0] if value.items else Field("", word.line, word.raw)
            return whole(first.text, first.problem or first.maybe)
        if part.alt and part.default is not None:
            return self._alternative(part, value, word)
        if isinstance(value, Scalar) and value.tail:
            return whole(OPAQUE, value.tail_why)
        if isinstance(value, Scalar) and not (
            part.default is not None and value.text == "" and not part.unset_only
        ):
            return whole(value.text, value.problem)
        if part.default is not None:
            pieces, problem = self._pieces(part.default, word)
            if problem is None and value is None:
                text = "".join(t for t, _ in pieces)
                detail = f"{name} is not set in the script, so its default '{text}' is used"
                self.notes.append(Note(word.line, word.raw, detail))
            return pieces, problem
        if value is not None:
            return whole("")
        if name in MACHINE:
            self.machine = name
            return whole(f"${name}")
        return whole(OPAQUE, _outside(name))

    def _alternative(
        self, part: Part, value: Value | None, word: Word
    ) -> tuple[list[tuple[str, bool]], str | None]:
        """``${NAME:+word}``: the word when NAME is set and not empty, else nothing."""
        assert part.default is not None
        if isinstance(value, Scalar):
            if value.problem is not None:
                return [(OPAQUE, part.quoted)], value.problem
            return self._pieces(part.default, word) if value.text else ([("", part.quoted)], None)
        detail = f"{part.text} is not set in the script, so ${{{part.text}:+...}} is empty"
        self.notes.append(Note(word.line, word.raw, detail))
        return [("", part.quoted)], None

    def _join(self, parts: tuple[Part, ...], word: Word) -> tuple[str, str | None]:
        pieces, problem = self._pieces(parts, word)
        return "".join(t for t, _ in pieces), problem

    def _pieces(self, parts: tuple[Part, ...], word: Word) -> tuple[list[tuple[str, bool]], str | None]:
        """Each part expanded, with its quoting; one unknown piece past ``MAX_VALUE_CHARS``."""
        out: list[tuple[str, bool]] = []
        problem: str | None = None
        length = 0
        for part in parts:
            if part.kind is PartKind.LIT:
                text = part.text
            else:
                text, why = self._part(part, word)
                problem = problem or why
            length += len(text)
            if length > MAX_VALUE_CHARS:
                return [(OPAQUE, True)], _too_long(word)
            out.append((text, part.quoted))
        return out, problem


_ARITH_NAME = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$?([A-Za-z_][A-Za-z0-9_]*)")
_ARITH_NODES = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop)


def arithmetic(expr: str, env: Env, line: int) -> tuple[str, str | None]:
    """``$((expr))`` over integer variables the script sets; ``OPAQUE`` and why otherwise."""
    unknown: list[str] = []

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        found = env.get(name)
        if isinstance(found, Scalar) and found.problem is None and _INT.fullmatch(found.text.strip()):
            return f"({found.text.strip()})"
        unknown.append(name)
        return "0"

    text = _ARITH_NAME.sub(value, expr)
    why = f"the arithmetic $(({expr})) (line {line})"
    if unknown:
        return OPAQUE, f"{why} over ${unknown[0]}, which the script does not set to a number"
    result = _evaluate(text.replace("/", "//"))
    return (str(result), None) if result is not None else (OPAQUE, why)


_INT = re.compile(r"-?[0-9]+")


def _evaluate(text: str) -> int | None:
    """A bash integer expression (``+ - * / % **``, parentheses), or None when it is anything else."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None
    if not all(isinstance(node, _ARITH_NODES) for node in ast.walk(tree)):
        return None
    return _eval_node(tree.body)


def _eval_node(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, int) and not isinstance(node.value, bool) else None
    if isinstance(node, ast.UnaryOp):
        inner = _eval_node(node.operand)
        if inner is None:
            return None
        return -inner if isinstance(node.op, ast.USub) else inner if isinstance(node.op, ast.UAdd) else None
    if isinstance(node, ast.BinOp):
        left, right = _eval_node(node.left), _eval_node(node.right)
        if left is None or right is None:
            return None
        return _binary(node.op, left, right)
    return None


def _binary(op: ast.operator, left: int, right: int) -> int | None:
    if isinstance(op, ast.Add):
        return left + right
    if isinstance(op, ast.Sub):
        return left - right
    if isinstance(op, ast.Mult):
        return left * right
    if isinstance(op, ast.Pow):
        return left**right if 0 <= right < 64 else None
    if right == 0:
        return None
    quotient = abs(left) // abs(right) * (1 if (left >= 0) == (right >= 0) else -1)
    if isinstance(op, ast.FloorDiv):
        return quotient
    if isinstance(op, ast.Mod):
        return left - right * quotient
    return None


def _words_of(item: Field) -> list[str]:
    """An unquoted ``${NAME[@]}`` splits each element on whitespace, as bash does (an empty one vanishes)."""
    return [item.text] if item.problem is not None or item.args else item.text.split()


def _piece(item: Field, text: str) -> Field:
    return replace(item, text=text)


def _too_long(word: Word) -> str:
    return _too_long_at(word.line)


def _outside(name: str) -> str:
    if name.isdigit():
        return f"${name}, an argument of the script"
    if name in "#?$!-":
        return f"${name}, which the shell sets at run time"
    return f"${name}, which the script does not set"


class _Splitter:
    """Builds fields: quoted text joins the current field, unquoted expansions split on whitespace."""

    def __init__(self) -> None:
        self.fields: list[str] = []
        self.buf: list[str] = []
        self.have = False

    def literal(self, text: str, quoted: bool) -> None:
        self.buf.append(text)
        self.have = self.have or quoted or bool(text)

    def split(self, text: str) -> None:
        pieces = text.split()
        if text[:1].isspace() and self.have:
            self._flush()
        for k, piece in enumerate(pieces):
            if k:
                self._flush()
            self.buf.append(piece)
            self.have = True
        if pieces and text[-1:].isspace():
            self._flush()

    def _flush(self) -> None:
        if self.have:
            self.fields.append("".join(self.buf))
        self.buf = []
        self.have = False

    def finish(self) -> list[str]:
        self._flush()
        return self.fields


def apply_assignments(env: Env, items: list[Word | ArrayAssign], *, conditional: bool) -> list[Note]:
    """Assign variables in order (``NAME=...``, ``NAME+=...``, ``NAME=(...)``); return the default notes.

    Inside an if/case/loop the value is unknown, except for ``NAME+=(...)`` on an array: its elements are kept,
    marked as present only on some paths.
    """
    expander = Expander(env)
    for item in items:
        if isinstance(item, ArrayAssign):
            name, append = item.name, item.append
            value: Value = ArrayValue(tuple(f for w in item.items for f in expander.word(w)))
        else:
            name, append, value = expander.assignment(item)
            if isinstance(value, Scalar) and value.problem is None:
                register(name, value.text)  # a secret the script holds is hidden wherever it would show
        why = f"${name}, which is assigned inside an if/case/loop block (line {item.line})"
        old = env.get(name)
        if conditional and append and isinstance(value, ArrayValue) and isinstance(old, ArrayValue | None):
            maybe = tuple(replace(f, maybe=why) for f in value.items)
            value = ArrayValue((old.items if old else ()) + maybe)
        elif conditional:
            value = _conditional_suffix(old, value, why)
        elif append:
            value = _appended(old, value)
        if _length(value) > MAX_VALUE_CHARS:
            value = Unknown(f"${name}, {_too_long_at(item.line)}")
        env[name] = value
    return expander.notes


def _too_long_at(line: int) -> str:
    return f"a value longer than {MAX_VALUE_CHARS:,} characters (the limit; line {line})"


def _length(value: Value) -> int:
    if isinstance(value, Scalar):
        return len(value.text)
    if isinstance(value, ArrayValue):
        return sum(len(item.text) + 1 for item in value.items)
    return 0


def _conditional_suffix(old: Value | None, new: Value, why: str) -> Value:
    """``X="$X more"`` inside an if: X keeps its text, and ``more`` is a tail present on some paths only."""
    if not (isinstance(old, Scalar) and isinstance(new, Scalar)) or new.problem is not None or old.tail:
        return Unknown(why)
    suffix = new.text[len(old.text) :]
    if new.text.startswith(old.text) and suffix[:1].isspace():
        return Scalar(old.text, old.problem, suffix, why)
    return Unknown(why)


def _appended(old: Value | None, new: Value) -> Value:
    if isinstance(old, Unknown) or isinstance(new, Unknown):
        return old if isinstance(old, Unknown) else new
    if isinstance(old, ArrayValue) and isinstance(new, ArrayValue):
        return ArrayValue(old.items + new.items)
    if isinstance(old, Scalar) and isinstance(new, Scalar):
        return Scalar(old.text + new.text, old.problem or new.problem)
    return new
