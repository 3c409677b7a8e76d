"""``if``/``elif``/``else`` over values the script determines, and possible worlds for the branches it does not.

A condition the script decides (``backend=fsdp; if [ "$backend" = fsdp ]``) picks its branch, as bash would. A
condition on a value from outside makes a branch point: read as one pass, its branches are uncertain (what they
assign is unknown); read as possible worlds, each pass takes one branch of every point (``Worlds``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from verl_safe_launch.shell.expand import Env, Expander, Note
from verl_safe_launch.shell.words import ArrayAssign, Word

NONE_TAKEN = -1
"""The choice of a branch point where no branch runs (an ``if`` without ``else`` whose conditions all fail)."""
MAX_WORLDS = 32
"""The most possible worlds read for one script; past it the branches are read as uncertain."""


@dataclass
class Worlds:
    """The branch each point takes in one pass (``choices``, by the line of its ``if``/``case``), and the points seen.

    ``choices`` is None for the single uncertain pass; a point absent from ``choices`` takes its default branch.
    """

    choices: dict[int, int] | None = None
    seen: dict[int, tuple[tuple[int, ...], int]] = field(default_factory=dict)
    labels: dict[int, str] = field(default_factory=dict)

    @property
    def enumerating(self) -> bool:
        """True when this pass takes one branch of every point."""
        return self.choices is not None

    def record(self, line: int, options: tuple[int, ...], taken: int, label: str) -> None:
        """A point met in this pass: its possible branches and the one this pass took."""
        if len(options) > 1:
            self.seen[line] = (options, taken)
            self.labels[line] = label

    def describe(self) -> str:
        """Which branch this pass took at each point, for messages."""
        parts = []
        for line, (_options, taken) in sorted(self.seen.items()):
            kind = self.labels[line]
            which = "no branch" if taken == NONE_TAKEN else f"branch {taken + 1}"
            parts.append(f"the {kind} on line {line} takes {which}")
        return ", ".join(parts)


def next_worlds(done: Worlds) -> list[dict[int, int]]:
    """The other choices at the points a pass met first (depth-first enumeration of every world)."""
    assert done.choices is not None
    out: list[dict[int, int]] = []
    fixed = dict(done.choices)
    for line, (options, taken) in sorted(done.seen.items()):
        if line in done.choices:
            continue
        out.extend({**fixed, line: option} for option in options if option != taken)
        fixed[line] = taken
    return out


@dataclass
class _IfFrame:
    line: int
    skipped: bool
    conds: list[bool | None] = field(default_factory=list)
    taken: bool = False
    active: bool = False
    uncertain: bool = False
    in_cond: bool = True
    join: str = ""


class Ifs:
    """Tracks the ``if`` statements around each command: which branch runs, and whether that is certain."""

    def __init__(self, worlds: Worlds) -> None:
        self.worlds = worlds
        self.frames: list[_IfFrame] = []
        self.uncertain_points = 0
        self.notes: list[Note] = []
        """Defaults (``${NAME:-1}``) a condition used because the script does not set NAME: they chose a branch."""

    @property
    def uncertain(self) -> bool:
        """True inside a branch that runs on some paths only (the single uncertain pass)."""
        return any(f.uncertain for f in self.frames)

    def step(self, items: list[Word | ArrayAssign], end: str, env: Env) -> list[Word | ArrayAssign] | None:
        """The command without its ``if``/``then``/``else`` keywords, or None when bash does not run it."""
        first = _text(items[0]) if items else None
        frame = self.frames[-1] if self.frames else None
        if first == "if":
            skipped = frame is not None and (frame.skipped or not frame.active)
            self.frames.append(_IfFrame(_line(items[0]), skipped))
            self.frames[-1].conds.append(None if skipped else _condition(items[1:], env, self.notes))
            self.frames[-1].join = end
            return None
        if frame is None:
            return items
        if first == "fi":
            self._close(self.frames.pop())
            return None
        if first == "elif":
            frame.conds.append(_condition(items[1:], env, self.notes))
            frame.in_cond, frame.join = True, end
            return None
        if first in ("then", "else"):
            if first == "else":
                frame.conds.append(True)
            frame.in_cond = False
            self._enter(frame)
            rest = items[1:]
            return rest if rest and frame.active and not frame.skipped else None
        if frame.in_cond:
            frame.conds[-1] = _join(frame.conds[-1], frame.join, _condition(items, env, self.notes))
            frame.join = end
            return None
        return items if frame.active and not frame.skipped else None

    def _enter(self, frame: _IfFrame) -> None:
        """Decide whether the branch that starts now runs."""
        k, cond = len(frame.conds) - 1, frame.conds[-1]
        frame.uncertain = False
        if frame.skipped or frame.taken or cond is False:
            frame.active = False
            return
        doubt = None in frame.conds[:k]
        if cond is True and (self.worlds.enumerating or not doubt):
            frame.active = frame.taken = True
            return
        if not self.worlds.enumerating:
            frame.active = frame.uncertain = True
            return
        assert self.worlds.choices is not None
        want = self.worlds.choices.get(frame.line, k)
        frame.active = frame.taken = want == k

    def _close(self, frame: _IfFrame) -> None:
        if frame.skipped:
            return
        options: list[int] = []
        for k, cond in enumerate(frame.conds):
            if cond is False:
                continue
            options.append(k)
            if cond is True:
                break
        else:
            options.append(NONE_TAKEN)
        if len(options) > 1:
            self.uncertain_points += 1
        if self.worlds.enumerating:
            assert self.worlds.choices is not None
            default = options[0]
            self.worlds.record(frame.line, tuple(options), self.worlds.choices.get(frame.line, default), "if")


def _join(left: bool | None, op: str, right: bool | None) -> bool | None:
    if op == "&&":
        return False if left is False or right is False else (None if None in (left, right) else True)
    if op == "||":
        return True if left is True or right is True else (None if None in (left, right) else False)
    return right


def _condition(items: list[Word | ArrayAssign], env: Env, notes: list[Note]) -> bool | None:
    """A ``test``/``[``/``[[`` condition over values the script determines; None when it depends on others."""
    words = [word_value(item, env, notes) for item in items]
    negate = bool(words) and words[0] == "!"
    words = words[1:] if negate else words
    if len(words) < 2 or words[0] not in ("[", "[[", "test"):
        return None
    double = words[0] == "[["
    body = words[1:-1] if words[0] != "test" else words[1:]
    if words[0] != "test" and words[-1] not in ("]", "]]"):
        return None
    result = _test(body, double)
    return None if result is None else result != negate


def _test(body: list[str | None], double: bool) -> bool | None:
    if len(body) == 2 and body[0] in ("-n", "-z") and body[1] is not None:
        return bool(body[1]) == (body[0] == "-n")
    if len(body) != 3 or None in body:
        return None
    left, op, right = (str(w) for w in body)
    if op in ("=", "=="):
        return fnmatch.fnmatchcase(left, right) if double else left == right
    if op == "!=":
        return not fnmatch.fnmatchcase(left, right) if double else left != right
    numeric = {"-eq": int.__eq__, "-ne": int.__ne__, "-gt": int.__gt__, "-ge": int.__ge__}
    numeric.update({"-lt": int.__lt__, "-le": int.__le__})
    if op in numeric and _is_int(left) and _is_int(right):
        return bool(numeric[op](int(left), int(right)))
    return None


def _is_int(text: str) -> bool:
    return text.strip().lstrip("-").isdigit()


def _text(item: Word | ArrayAssign) -> str | None:
    if isinstance(item, Word) and len(item.parts) == 1 and not item.parts[0].quoted:
        return item.parts[0].text
    return None


def _line(item: Word | ArrayAssign) -> int:
    return item.line


def word_value(item: Word | ArrayAssign, env: Env, notes: list[Note]) -> str | None:
    """The word's one value when the script determines it, else None (a default it used goes to ``notes``)."""
    if not isinstance(item, Word):
        return None
    expander = Expander(env)
    fields = expander.word(item)
    notes.extend(expander.notes)
    if len(fields) == 0:
        return ""
    if len(fields) != 1 or fields[0].problem or fields[0].maybe or fields[0].args:
        return None
    return fields[0].text


__all__ = ["MAX_WORLDS", "NONE_TAKEN", "Ifs", "Worlds", "next_worlds", "word_value"]
