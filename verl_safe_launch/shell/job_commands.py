"""The commands of a job script in order: their words (expanded where the script determines them), loop depth,
and whether they run in the background."""

from __future__ import annotations

from dataclasses import dataclass

from verl_safe_launch.shell.expand import Env, Expander, Scalar, apply_assignments
from verl_safe_launch.shell.words import ArrayAssign, PartKind, Token, Word, split_commands

_LOOPS = frozenset({"while", "until", "for", "select"})
_PREFIX = frozenset({"then", "else", "elif", "do", "!", "{", "}", "time", "exec", "nohup", "command"})


@dataclass(frozen=True)
class Command:
    """One simple command of the job script: its words (expanded where the script determines them)."""

    words: tuple[str, ...]
    raws: tuple[str, ...]
    line: int
    background: bool
    polling: bool
    top_level: bool

    @property
    def name(self) -> str:
        """The command's first word."""
        return self.words[0] if self.words else ""

    def has(self, *words: str) -> bool:
        """True when ``words`` appear in order, one after the other."""
        n = len(words)
        return any(self.words[i : i + n] == words for i in range(len(self.words) - n + 1))

    def option(self, *names: str) -> str | None:
        """The value of the first of ``names`` given as ``--name=value`` or ``--name value``; None if absent."""
        for i, word in enumerate(self.words):
            for name in names:
                if word == name and i + 1 < len(self.words):
                    return self.words[i + 1]
                if word.startswith(name + "=") or (len(name) == 2 and word.startswith(name) and word != name):
                    return word[len(name) :].removeprefix("=")
        return None

    def raw_option(self, *names: str) -> str | None:
        """Like ``option`` but the value as written (quotes and ``$`` kept)."""
        for i, word in enumerate(self.raws):
            for name in names:
                if word == name and i + 1 < len(self.raws):
                    return self.raws[i + 1]
                if word.startswith(name + "="):
                    return word[len(name) + 1 :]
        return None

    @property
    def text(self) -> str:
        """The command as written, on one line."""
        return " ".join(self.raws)


class CommandWalker:
    """Simple commands in order, each with its loop depth and whether it runs in the background."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.loops: list[str] = []
        self.blocks = 0

    def run(self, tokens: list[Token]) -> tuple[list[Command], list[ArrayAssign]]:
        pending = [c for c in split_commands(tokens) if c.items]
        background = False
        flags: list[bool] = []
        for item in reversed(pending):
            if item.end in ("|", "|&"):
                flags.append(background)
            else:
                background = item.end == "&"
                flags.append(background)
        flags.reverse()
        commands: list[Command] = []
        arrays: list[ArrayAssign] = []
        for item, bg in zip(pending, flags, strict=True):
            arrays.extend(i for i in item.items if isinstance(i, ArrayAssign))
            command = self._command(item.items, bg)
            if command is not None:
                commands.append(command)
        return commands, arrays

    def _command(self, items: list[Word | ArrayAssign], background: bool) -> Command | None:
        while items:
            word = _literal(items[0])
            if word in _LOOPS:
                self.loops.append(word)
                if word not in ("while", "until"):
                    return None
            elif word in ("if", "case"):
                self.blocks += 1
            elif word in ("fi", "esac"):
                self.blocks = max(self.blocks - 1, 0)
            elif word == "done" and self.loops:
                self.loops.pop()
            elif word not in _PREFIX:
                break
            items = items[1:]
        if not items:
            return None
        top = not self.loops and self.blocks == 0
        count = 0
        while count < len(items) and _is_assignment(items[count]):
            count += 1
        if count == len(items) or _literal(items[0]) in ("export", "declare", "readonly", "local"):
            start = 1 if count < len(items) else 0
            assigns = [i for i in items[start:] if _is_assignment(i)]
            apply_assignments(self.env, assigns, conditional=not top)
        words = [i for i in items[count:] if isinstance(i, Word)]
        if not words and count < len(items):
            return None
        shown = words or [i for i in items if isinstance(i, Word)]
        if not shown:
            return None
        expander = Expander(self.env)
        texts = [_text_of(expander, w) for w in shown]
        return Command(
            tuple(texts),
            tuple(w.raw for w in shown),
            shown[0].line,
            background,
            any(loop in ("while", "until") for loop in self.loops),
            top,
        )


def _text_of(expander: Expander, word: Word) -> str:
    fields = expander.word(word)
    if len(fields) == 1 and fields[0].problem is None:
        return fields[0].text
    if fields and all(f.problem is None for f in fields):
        return " ".join(f.text for f in fields)
    return word.raw.replace('"', "").replace("'", "")


def _literal(item: Word | ArrayAssign) -> str | None:
    if isinstance(item, Word) and len(item.parts) == 1 and not item.parts[0].quoted:
        part = item.parts[0]
        return part.text if part.kind is PartKind.LIT else None
    return None


def _is_assignment(item: Word | ArrayAssign) -> bool:
    if isinstance(item, ArrayAssign):
        return True
    first = item.parts[0] if item.parts else None
    if first is None or first.kind is not PartKind.LIT or first.quoted:
        return False
    name, eq, _ = first.text.partition("=")
    return bool(eq) and name.rstrip("+").isidentifier()


def seeded_env(values: dict[str, str]) -> Env:
    """An expansion environment holding the given variables (the ones Slurm sets in the job)."""
    return {name: Scalar(value) for name, value in values.items()}


__all__ = ["Command", "CommandWalker", "seeded_env"]
