"""Expand shell words with the variables a script assigns itself; anything else stays unresolved, never guessed."""

from __future__ import annotations

from dataclasses import dataclass

from verl_safe_launch.shell.words import ArrayAssign, Part, PartKind, Word


@dataclass(frozen=True)
class Field:
    """One argument after expansion; ``problem`` says why it could not be resolved, ``args`` marks ``"$@"``."""

    text: str
    line: int
    raw: str
    problem: str | None = None
    args: bool = False


@dataclass(frozen=True)
class Scalar:
    """A variable holding a string."""

    text: str


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

    def word(self, word: Word) -> list[Field]:
        """The fields a word expands to (unquoted expansions are split on whitespace, as bash does)."""
        if len(word.parts) == 1 and word.parts[0].kind is PartKind.ARGS:
            return [Field(word.raw, word.line, word.raw, args=True)]
        if len(word.parts) == 1 and word.parts[0].kind is PartKind.ARRAY:
            return self._array(word, word.parts[0])
        splitter = _Splitter()
        problem: str | None = None
        length = 0
        for part in word.parts:
            length += len(part.text)
            if length > MAX_VALUE_CHARS:
                problem = problem or _too_long(word)
                break
            if part.kind is PartKind.LIT:
                splitter.literal(part.text, part.quoted)
                continue
            text, why = self._part(part, word)
            length += len(text)
            if why is None and length > MAX_VALUE_CHARS:
                why = _too_long(word)
            if why is not None:
                problem = problem or why
            elif part.quoted:
                splitter.literal(text, True)
            else:
                splitter.split(text)
        if problem is not None:
            return [Field(word.raw, word.line, word.raw, problem=problem)]
        return [Field(text, word.line, word.raw) for text in splitter.finish()]

    def assignment(self, word: Word) -> tuple[str, bool, Value]:
        """``NAME=value`` / ``NAME+=value``: the name, whether it appends, and the value (never split)."""
        head = word.parts[0].text
        name, _, rest = head.partition("=")
        parts = (Part(PartKind.LIT, rest, False), *word.parts[1:])
        text, problem = self._join(parts, word)
        value: Value = Unknown(problem) if problem is not None else Scalar(text)
        return name.rstrip("+"), name.endswith("+"), value

    def _array(self, word: Word, part: Part) -> list[Field]:
        value = self.env.get(part.text)
        if isinstance(value, ArrayValue):
            if part.quoted:
                return list(value.items)
            return [_piece(item, text) for item in value.items for text in _words_of(item)]
        if isinstance(value, Unknown):
            return [Field(word.raw, word.line, word.raw, problem=value.reason)]
        if isinstance(value, Scalar):
            splitter = _Splitter()
            if part.quoted:
                splitter.literal(value.text, True)
            else:
                splitter.split(value.text)
            return [Field(text, word.line, word.raw) for text in splitter.finish()]
        return [
            Field(
                word.raw, word.line, word.raw, problem=f"${{{part.text}[@]}}, which the script does not set"
            )
        ]

    def _part(self, part: Part, word: Word) -> tuple[str, str | None]:
        if part.kind is PartKind.SUBST:
            return "", f"the command substitution {part.text} (line {word.line})"
        if part.kind is PartKind.ARGS:
            return "", f"the script's arguments (${part.text}) inside a longer word (line {word.line})"
        if part.kind is PartKind.ARRAY:
            return "", f"the array ${{{part.text}[@]}} inside a longer word (line {word.line})"
        return self._lookup(part, word)

    def _lookup(self, part: Part, word: Word) -> tuple[str, str | None]:
        name = part.text
        value = self.env.get(name)
        if isinstance(value, Unknown):
            return "", value.reason
        if isinstance(value, ArrayValue):
            first = value.items[0] if value.items else Field("", word.line, word.raw)
            return first.text, first.problem
        empty_replaced = part.default is not None and value == Scalar("") and not part.unset_only
        if isinstance(value, Scalar) and not empty_replaced:
            return value.text, None
        if part.default is not None:
            text, problem = self._join(part.default, word)
            if problem is None and value is None:
                detail = f"{name} is not set in the script, so its default '{text}' is used"
                self.notes.append(Note(word.line, word.raw, detail))
            return text, problem
        if value is not None:
            return "", None
        return "", _outside(name)

    def _join(self, parts: tuple[Part, ...], word: Word) -> tuple[str, str | None]:
        out: list[str] = []
        length = 0
        for part in parts:
            if part.kind is PartKind.LIT:
                text, problem = part.text, None
            else:
                text, problem = self._part(part, word)
            if problem is not None:
                return "", problem
            length += len(text)
            if length > MAX_VALUE_CHARS:
                return "", _too_long(word)
            out.append(text)
        return "".join(out), None


def _words_of(item: Field) -> list[str]:
    """An unquoted ``${NAME[@]}`` splits each element on whitespace, as bash does (an empty one vanishes)."""
    return [item.text] if item.problem is not None or item.args else item.text.split()


def _piece(item: Field, text: str) -> Field:
    return Field(text, item.line, item.raw, item.problem, item.args)


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
    """Assign variables in order (``NAME=...``, ``NAME+=...``, ``NAME=(...)``); return the default notes."""
    expander = Expander(env)
    for item in items:
        if isinstance(item, ArrayAssign):
            name, append = item.name, item.append
            value: Value = ArrayValue(tuple(f for w in item.items for f in expander.word(w)))
        else:
            name, append, value = expander.assignment(item)
        value = _appended(env.get(name), value) if append else value
        if _length(value) > MAX_VALUE_CHARS:
            value = Unknown(f"${name}, {_too_long_at(item.line)}")
        if conditional:
            value = Unknown(f"${name}, which is assigned inside an if/for/while block (line {item.line})")
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


def _appended(old: Value | None, new: Value) -> Value:
    if isinstance(old, Unknown) or isinstance(new, Unknown):
        return old if isinstance(old, Unknown) else new
    if isinstance(old, ArrayValue) and isinstance(new, ArrayValue):
        return ArrayValue(old.items + new.items)
    if isinstance(old, Scalar) and isinstance(new, Scalar):
        return Scalar(old.text + new.text)
    return new
