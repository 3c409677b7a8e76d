"""Read raw bash launch scripts: every ``python -m verl.trainer.main_ppo`` launch with its overrides and lines."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from verl_safe_launch.errors import InputError
from verl_safe_launch.files import read_text_input
from verl_safe_launch.shell.branches import MAX_WORLDS, Ifs, Worlds, next_worlds
from verl_safe_launch.shell.cases import Cases, Step
from verl_safe_launch.shell.expand import OPAQUE, Env, Expander, Note, Scalar, apply_assignments
from verl_safe_launch.shell.launch import MODULE, Export, LaunchBuilder, ScriptLaunch, ScriptNote, module_end
from verl_safe_launch.shell.words import (
    ArrayAssign,
    PartKind,
    ShellSyntaxError,
    SimpleCommand,
    Token,
    Word,
    lex,
    split_commands,
)

MAX_SCRIPT_BYTES = 256 * 1024
"""The longest launch script read (verl's own examples are under 10 KiB)."""
_OPENERS = frozenset({"while", "until", "for", "case", "select"})
_CLOSERS = frozenset({"done", "esac"})
_PREFIX_WORDS = frozenset({"then", "else", "elif", "do", "!", "{", "}", "time", "exec", "nohup", "command"})
_DECLARE = frozenset({"export", "declare", "typeset", "local", "readonly"})
_NOT_RUN = frozenset({"echo", "printf", ":", "true", "logger"})
"""Commands that print or ignore their arguments: a launch written after them does not run."""
_SHELLS = frozenset({"bash", "sh"})


class NoLaunch(InputError):
    """A readable script with no ``python -m verl.trainer.main_ppo`` launch (``text``: what it holds)."""

    def __init__(self, message: str, where: str, fix: str, text: str) -> None:
        super().__init__(message, where=where, fix=fix)
        self.text = text


def read_script(path: Path | str, env: Env | None = None) -> tuple[ScriptLaunch, ...]:
    """Read a launch script; raise InputError when it is unreadable, not shell, or launches nothing.

    ``env`` holds variables the script may read without setting them (those Slurm sets in a job).
    """
    path = Path(path)
    text = read_text_input(
        path, what="script", missing_fix="check the path of the launch script", limit=MAX_SCRIPT_BYTES
    )
    launches = parse_script(text, str(path), base_dir=path.parent, env=env)
    if not launches:
        raise NoLaunch(
            f"no 'python -m {MODULE}' launch found in {path}",
            where=str(path),
            fix=f"audit a script that runs python3 -m {MODULE} key=value ...",
            text=text,
        )
    return launches


def parse_script(
    text: str, name: str, base_dir: Path | None = None, env: Env | None = None
) -> tuple[ScriptLaunch, ...]:
    """Every launch in the script text (possibly none); raise InputError on invalid shell syntax."""
    try:
        tokens = lex(text.replace("\r\n", "\n"))
    except ShellSyntaxError as exc:
        raise InputError(
            f"cannot read {name}: {exc.message}",
            where=f"{name}:{exc.line}",
            fix="write the value without nesting expansions that deep"
            if "(the limit)" in exc.message
            else "check the quotes and brackets on that line (bash -n runs the same check)",
        ) from None
    reader = _Reader(name, env)
    launches = reader.run(tokens)
    if reader.ifs.uncertain_points or reader.cases.uncertain_points:
        launches = _with_worlds(launches, tokens, name, env)
    if "\r\n" in text:
        line = text[: text.index("\r\n")].count("\n") + 1
        detail = (
            "the script has Windows (CRLF) line endings: bash reads each '\\r' as part of the last word, "
            "so a trailing '\\' does not continue the line and every last argument ends in '\\r'"
        )
        shown = text.split("\n")[line - 1].rstrip("\r")[:60]
        crlf = ScriptNote("crlf", line, shown, detail)
        launches = tuple(replace(launch, notes=(crlf, *launch.notes)) for launch in launches)
    return launches


def _with_worlds(
    launches: tuple[ScriptLaunch, ...], tokens: list[Token], name: str, env: Env | None
) -> tuple[ScriptLaunch, ...]:
    """Each launch with its readings in every possible world (one branch of every if/case bash cannot decide here).

    Past ``MAX_WORLDS`` worlds the launches are left as read in one uncertain pass.
    """
    pending: list[dict[int, int]] = [{}]
    by_line: dict[int, list[ScriptLaunch]] = {}
    count = 0
    while pending:
        count += 1
        if count > MAX_WORLDS:
            return launches
        worlds = Worlds(pending.pop(0))
        for launch in _Reader(name, env, worlds).run(tokens):
            seen = by_line.setdefault(launch.line, [])
            if all(other.tokens != launch.tokens or other.notes != launch.notes for other in seen):
                seen.append(replace(launch, branch=worlds.describe()))
        pending.extend(next_worlds(worlds))
    return tuple(replace(launch, worlds=tuple(by_line.get(launch.line, ()))) for launch in launches)


class _Reader:
    def __init__(self, name: str, env: Env | None = None, worlds: Worlds | None = None) -> None:
        self.name = name
        self.env: Env = dict(env or {})
        self.notes: list[ScriptNote] = []
        self.exported: dict[str, int] = {}
        self.depth = 0
        self.function_depth = 0
        self.launches: list[ScriptLaunch] = []
        worlds = worlds or Worlds()
        self.cases = Cases(worlds)
        self.ifs = Ifs(worlds)

    def run(self, tokens: list[Token]) -> tuple[ScriptLaunch, ...]:
        for command in split_commands(tokens):
            if self.function_depth:
                self._command(command)
                continue
            read = self.cases.step(command.items, command.end, self.env)
            self._defaults_that_chose(self.cases.notes)
            if read is not Step.READ or not command.items:
                continue
            items = self.ifs.step(command.items, command.end, self.env)
            self._defaults_that_chose(self.ifs.notes)
            if items:
                self._command(replace(command, items=items))
        return tuple(self.launches)

    def _defaults_that_chose(self, notes: list[Note]) -> None:
        """A ``case`` or ``if`` decided by a default the script does not set: noted as a value's default is."""
        self.notes.extend(ScriptNote("env-default", n.line, n.raw, n.detail) for n in notes)
        notes.clear()

    def _command(self, command: SimpleCommand) -> None:
        items = list(command.items)
        if self._in_function(items, command.function_header):
            return
        items = self._strip_keywords(items)
        if not items:
            return
        first = _literal(items[0])
        if first in _DECLARE:
            flags = [i for i in items[1:] if (_literal(i) or "").startswith("-")]
            items = [i for i in items[1:] if i not in flags]
            if first == "export" or any("x" in (_literal(f) or "") for f in flags):
                self._exported(items)
            self._assign(items, declared=True)
            return
        if first == "unset":
            for item in items[1:]:
                self.env.pop(_literal(item) or "", None)
            return
        if first in ("source", "."):
            self.notes.append(
                ScriptNote("sourced", _line(items[0]), _raw(items), "variables it sets are unknown")
            )
            return
        rest = self._assign(items, declared=False)
        if rest:
            self._maybe_launch(rest)

    def _exported(self, items: list[Word | ArrayAssign]) -> None:
        for item in items:
            if isinstance(item, Word) and item.parts and item.parts[0].kind is PartKind.LIT:
                name = item.parts[0].text.partition("=")[0]
                if name.isidentifier():
                    self.exported.setdefault(name, item.line)

    def _exports(self) -> tuple[Export, ...]:
        """Exported variables whose value is known here (unknown ones are the environment's, not the script's)."""
        out: list[Export] = []
        for name, line in self.exported.items():
            value = self.env.get(name)
            if (
                isinstance(value, Scalar)
                and value.problem is None
                and not value.tail
                and OPAQUE not in value.text
            ):
                out.append(Export(name, value.text, line))
        return tuple(out)

    def _in_function(self, items: list[Word | ArrayAssign], header: bool) -> bool:
        words = [_literal(i) for i in items]
        if self.function_depth:
            self.function_depth += words.count("{") - words.count("}")
            self.function_depth = max(self.function_depth, 0)
            return True
        if header or words[0] == "function":
            self.function_depth = max(words.count("{") - words.count("}"), 0)
            if "{" not in words:
                self.function_depth = 1
            return True
        return False

    def _strip_keywords(self, items: list[Word | ArrayAssign]) -> list[Word | ArrayAssign]:
        while items:
            word = _literal(items[0])
            if word in _OPENERS:
                self.depth += 1
                if word in ("for", "case", "select"):
                    return []
            elif word in _CLOSERS:
                self.depth = max(self.depth - 1, 0)
            elif word not in _PREFIX_WORDS:
                break
            items = items[1:]
        return items

    def _assign(self, items: list[Word | ArrayAssign], *, declared: bool) -> list[Word | ArrayAssign]:
        """Apply leading assignments; return the rest of the command (empty when it was only assignments)."""
        count = 0
        while count < len(items) and _is_assignment(items[count]):
            count += 1
        if declared:  # export/declare/...: every NAME=value argument, quoted ones included ('X=a b')
            chosen = [item for item in items if _is_assignment(item, quoted=True)]
        else:
            chosen = items if count == len(items) else []
        if chosen:
            conditional = self.depth > 0 or self.ifs.uncertain
            notes = apply_assignments(self.env, chosen, conditional=conditional)
            self.notes.extend(ScriptNote("env-default", n.line, n.raw, n.detail) for n in notes)
        return [] if declared else items[count:]

    def _maybe_launch(self, items: list[Word | ArrayAssign], unread: str | None = None) -> None:
        """A launch among the command's words (``unread``: why a marker in them, from an ``eval``'d string, is
        not known)."""
        words = [i for i in items if isinstance(i, Word)]
        if not any("main_ppo" in w.raw or "$" in w.raw for w in words) or _literal(words[0]) in _NOT_RUN:
            return
        first = _literal(words[0])
        if first == "eval" or (first in _SHELLS and len(words) > 2 and _literal(words[1]) == "-c"):
            self._evaluated(words[1:] if first == "eval" else words[2:3])
            return
        expander = Expander(self.env)
        fields = [f for w in words for f in expander.word(w)]
        if unread is not None:
            fields = [replace(f, problem=f.problem or unread) if OPAQUE in f.text else f for f in fields]
        start = module_end(fields)
        if start is None:
            return
        notes = [*self.notes, *(ScriptNote("env-default", n.line, n.raw, n.detail) for n in expander.notes)]
        conditional = self.depth > 0 or self.ifs.uncertain
        launch = LaunchBuilder(self.name, len(self.launches) + 1, words[0].line, notes, conditional)
        self.launches.append(replace(launch.build(fields[start:]), exports=self._exports()))

    def _evaluated(self, words: list[Word]) -> None:
        """``eval "$CMD"``, ``bash -c "$CMD"``: the string's words, read as bash reads them again, when the
        string holds a launch (parts of it that are not known stay unread, each on the eval's line)."""
        expander = Expander(self.env)
        fields = [f for w in words for f in expander.word(w)]
        text = " ".join(f.text for f in fields)
        if MODULE not in text and "main_ppo.py" not in text:
            return
        unread = next((f.problem for f in fields if f.problem), None)
        try:
            tokens = lex(text)
        except ShellSyntaxError:
            return
        line = words[0].line
        for command in split_commands(tokens):
            inner = [replace(i, line=line) if isinstance(i, Word) else i for i in command.items]
            inner = self._assign(inner, declared=False)
            if inner:
                self._maybe_launch(inner, unread)


def _literal(item: Word | ArrayAssign) -> str | None:
    """The word's text when it is one unquoted literal (keywords, command names), else None."""
    if isinstance(item, Word) and len(item.parts) == 1 and not item.parts[0].quoted:
        part = item.parts[0]
        return part.text if part.kind is PartKind.LIT else None
    return None


def _is_assignment(item: Word | ArrayAssign, *, quoted: bool = False) -> bool:
    """``NAME=...`` (``quoted``: also ``'NAME=...'``, as the arguments of ``export`` and ``declare`` are read)."""
    if isinstance(item, ArrayAssign):
        return True
    first = item.parts[0] if item.parts else None
    if first is None or first.kind is not PartKind.LIT or (first.quoted and not quoted):
        return False
    name, eq, _ = first.text.partition("=")
    return bool(eq) and name.rstrip("+").isidentifier() and name.rstrip("+").isascii()


def _line(item: Word | ArrayAssign) -> int:
    return item.line


def _raw(items: list[Word | ArrayAssign]) -> str:
    return " ".join(i.raw for i in items)


__all__ = ["parse_script", "read_script"]
