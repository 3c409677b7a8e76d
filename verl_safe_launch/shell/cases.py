"""``case WORD in pattern) ... ;; esac`` over a value the script determines: only the branch bash takes is read."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from enum import Enum

from verl_safe_launch.shell.branches import NONE_TAKEN, Worlds, word_value
from verl_safe_launch.shell.expand import Env, Note
from verl_safe_launch.shell.words import ArrayAssign, Word


class Step(Enum):
    """What the reader does with one command."""

    READ = "read"  # read it as usual (an if/loop around it still makes it conditional)
    SKIP = "skip"  # bash does not run it: a branch not taken, a pattern, case/esac of a known subject


@dataclass
class _Frame:
    subject: str | None  # None: a case the reader leaves to the if/loop rules (every branch conditional)
    skipped: bool = False
    in_pattern: bool = True
    patterns: list[str] = field(default_factory=list)
    taken: bool = False
    active: bool = False
    world: int = 0  # the line of a case on an unknown subject read as possible worlds (0: not one)
    branches: int = 0
    catch_all: bool = False


class Cases:
    """Tracks the ``case`` statements around each command."""

    def __init__(self, worlds: Worlds | None = None) -> None:
        self.frames: list[_Frame] = []
        self.worlds = worlds or Worlds()
        self.uncertain_points = 0
        self.notes: list[Note] = []
        """Defaults (``${NAME:-x}``) a subject or pattern used because the script does not set NAME."""

    def step(self, items: list[Word | ArrayAssign], end: str, env: Env) -> Step:
        """Whether to read a command (its words ``items``, ended by the operator ``end``)."""
        first = _text(items[0]) if items else None
        frame = self.frames[-1] if self.frames else None
        if first == "case":
            return self._open(items, end, env, frame)
        if first == "esac" and frame is not None:
            self.frames.pop()
            self._close(frame)
            if end == ";;" and self.frames:
                self._branch_end(self.frames[-1])
            return Step.READ if frame.subject is None else Step.SKIP
        if frame is None or frame.subject is None:
            return Step.READ
        if frame.skipped:
            return Step.SKIP
        if frame.in_pattern:
            self._pattern(frame, items, end, env)
            return Step.SKIP
        step = Step.READ if frame.active else Step.SKIP
        if end == ";;":
            self._branch_end(frame)
        return step

    @staticmethod
    def _branch_end(frame: _Frame) -> None:
        if frame.subject is not None and not frame.in_pattern:
            frame.taken = frame.taken or frame.active
            frame.in_pattern, frame.active = True, False

    def _open(self, items: list[Word | ArrayAssign], end: str, env: Env, frame: _Frame | None) -> Step:
        if frame is not None and frame.subject is not None and (frame.skipped or not frame.active):
            self.frames.append(_Frame("", skipped=True))
            return Step.SKIP
        subject = (
            word_value(items[1], env, self.notes) if len(items) > 2 and _text(items[2]) == "in" else None
        )
        line = items[0].line
        if subject is None and self.worlds.enumerating and len(items) > 2:
            self.frames.append(_Frame("", world=line))
        else:
            self.frames.append(_Frame(subject))
        if subject is None and not self.frames[-1].world:
            self.uncertain_points += 1
            return Step.READ
        self._pattern(self.frames[-1], items[3:], end, env)
        return Step.SKIP

    def _pattern(self, frame: _Frame, items: list[Word | ArrayAssign], end: str, env: Env) -> None:
        for item in items:
            text = word_value(item, env, self.notes)
            frame.patterns.append((text or "").lstrip("("))
        if end == ")":
            assert frame.subject is not None
            hit = any(fnmatch.fnmatchcase(frame.subject, p) for p in frame.patterns if p)
            if frame.world:
                hit = self._world_branch(frame)
            frame.active = hit and not frame.taken
            frame.in_pattern, frame.patterns = False, []

    def _world_branch(self, frame: _Frame) -> bool:
        """In a possible world, the branch of a case on an unknown subject runs when the world chose it."""
        assert self.worlds.choices is not None
        k = frame.branches
        frame.branches += 1
        frame.catch_all = frame.catch_all or "*" in frame.patterns
        return self.worlds.choices.get(frame.world, 0) == k

    def _close(self, frame: _Frame) -> None:
        if frame.world:
            options = (*range(frame.branches), *(() if frame.catch_all else (NONE_TAKEN,)))
            assert self.worlds.choices is not None
            self.worlds.record(frame.world, options, self.worlds.choices.get(frame.world, 0), "case")


def _text(item: Word | ArrayAssign) -> str | None:
    if isinstance(item, Word) and len(item.parts) == 1 and not item.parts[0].quoted:
        return item.parts[0].text
    return None


__all__ = ["Cases", "Step"]
