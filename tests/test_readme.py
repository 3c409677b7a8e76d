"""The shell sessions of the README and of every page under docs/ replay as shown.

Every ``$ command`` runs and prints the lines under it. A block's commands run in order in one fresh folder holding
a copy of the shipped examples, with the installed ``verl-safe-launch`` first on PATH, no hardware detection and
output piped (so reports are plain text). Under a command, ``...`` stands for any number of lines; every other line
must appear, in order. The folder's path is shown as ``/tmp/runs``. Blocks that run the same commands (a short
form on the front page, the full one in docs/) run once, and each block's lines are checked against that output.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SHOWN_AS = "/tmp/runs"
_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Step:
    """One ``$ command`` and the lines the README shows under it."""

    command: str
    expected: tuple[str, ...]


@dataclass(frozen=True)
class Session:
    """A fenced block holding ``$`` commands, with the file and line it starts on."""

    line: int
    steps: tuple[Step, ...]
    where: str = "README.md"

    @property
    def commands(self) -> tuple[str, ...]:
        return tuple(step.command for step in self.steps)


def sessions(text: str, where: str = "README.md") -> list[Session]:
    """Every fenced block of ``text`` (the file ``where``) that holds ``$ `` commands."""
    found: list[Session] = []
    for match in _FENCE.finditer(text):
        body = match.group(1).splitlines()
        if not any(line.startswith("$ ") for line in body):
            continue
        steps: list[Step] = []
        for line in body:
            if steps and not steps[-1].expected and steps[-1].command.endswith("\\"):
                steps[-1] = Step(steps[-1].command[:-1] + line.strip(), ())
            elif line.startswith("$ "):
                steps.append(Step(line[2:], ()))
            elif steps:
                last = steps[-1]
                steps[-1] = Step(last.command, (*last.expected, line))
        found.append(Session(text.count("\n", 0, match.start()) + 2, tuple(steps), where))
    return found


def matches(expected: tuple[str, ...], actual: list[str]) -> str | None:
    """None when ``actual`` shows every expected line in order (``...`` skips any lines), else the first miss."""
    index = 0
    skipping = False
    for want in expected:
        if want.strip() == "...":
            skipping = True
            continue
        while index < len(actual) and skipping and actual[index].rstrip() != want.rstrip():
            index += 1
        if index >= len(actual) or actual[index].rstrip() != want.rstrip():
            return want
        index += 1
        skipping = False
    if not skipping and index < len(actual):
        return f"(unexpected extra output) {actual[index]}"
    return None


def test_matches_understands_ellipses() -> None:
    assert matches(("a", "...", "d"), ["a", "b", "c", "d"]) is None
    assert matches(("a", "d"), ["a", "b", "d"]) == "d"
    assert matches(("a",), ["a", "b"]) == "(unexpected extra output) b"
    assert matches(("a", "..."), ["a", "b"]) is None


def shown_files() -> list[Path]:
    """The README and every page of the docs, in a stable order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def replay_groups(found: list[Session]) -> list[tuple[Session, ...]]:
    """The sessions grouped by the commands they run, in order of first appearance."""
    groups: dict[tuple[str, ...], list[Session]] = {}
    for session in found:
        groups.setdefault(session.commands, []).append(session)
    return [tuple(group) for group in groups.values()]


SESSIONS = [s for path in shown_files() for s in sessions(path.read_text(), str(path.relative_to(ROOT)))]
GROUPS = replay_groups(SESSIONS)


def test_sessions_are_found_in_readme_and_docs() -> None:
    found = {s.where for s in SESSIONS}
    assert "README.md" in found
    assert "docs/verbs/check.md" in found
    assert len({s.where for s in SESSIONS if s.where.startswith("docs/")}) >= 5


def test_replay_groups_share_one_run() -> None:
    a = Session(1, (Step("x", ("1",)),), "README.md")
    b = Session(9, (Step("x", ("...",)),), "docs/a.md")
    c = Session(3, (Step("y", ()),), "docs/a.md")
    assert replay_groups([a, b, c]) == [(a, b), (c,)]


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RAY_", "VSL_", "CUDA_"))}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        HOME=str(home),
        VSL_HARDWARE_DETECT="0",
        PYTHONPATH=str(ROOT),
        COLUMNS="200",
    )
    return env


@pytest.mark.parametrize(
    "group",
    [
        pytest.param(g, marks=[pytest.mark.slow] if any("python -m verl" in c for c in g[0].commands) else [])
        for g in GROUPS
    ],
    ids=[f"{g[0].where}:{g[0].line}" for g in GROUPS],
)
def test_readme_session_replays(group: tuple[Session, ...], tmp_path: Path) -> None:
    work = tmp_path / "runs"
    work.mkdir()
    shutil.copytree(ROOT / "launch_examples", work / "launch_examples")
    env = _env(tmp_path)
    last = 0
    for index, command in enumerate(group[0].commands):
        if command == "echo $?":
            output = f"{last}\n"
        else:
            done = subprocess.run(
                ["bash", "-c", command],
                cwd=work,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                timeout=300,
                check=False,
            )
            last, output = done.returncode, done.stdout
        actual = output.replace(str(work), SHOWN_AS).splitlines()
        for session in group:
            miss = matches(session.steps[index].expected, actual)
            assert miss is None, (
                f"{session.where}:{session.line}: '$ {command}' did not print: {miss}\n--- it printed:\n"
                + "\n".join(actual)
            )
