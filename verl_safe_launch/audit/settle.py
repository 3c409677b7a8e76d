"""The command that settles what a launch left unread: built from what the script really reads, and re-read
with those names set before it is shown."""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Iterable, Sequence
from pathlib import Path

from verl_safe_launch.errors import VslError
from verl_safe_launch.shell import ScriptLaunch, ScriptNote, read_script, seeded_env

_ENV_WORD = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?, which the script does not set")
_ARGUMENT = re.compile(r"\$\{?([0-9]+|[@*])\}?, an argument of the script|the script's arguments")
_NAME = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
_ASSIGNED = re.compile(
    r"(?:^|[\s;(])(?:export\s+|declare\s+(?:-\w+\s+)*|local\s+|readonly\s+)?([A-Za-z_]\w*)(?:\[[^]]*\])?\+?="
)
_KEPT = frozenset({"HOME", "PWD", "USER", "RANDOM", "LINENO", "SECONDS", "BASH_SOURCE", "OLDPWD", "PPID"})
PROBE = "1"
"""The value each name gets when the command is tried before it is shown."""


def env_names(parts: Iterable[ScriptNote]) -> list[str]:
    """The environment variables the unread parts read (``$EXTRA, which the script does not set``)."""
    return list(dict.fromkeys(name for part in parts for name in _ENV_WORD.findall(part.detail)))


def settle_command(
    launch: ScriptLaunch, parts: Sequence[ScriptNote], passthrough: Sequence[str] = ()
) -> str | None:
    """The audit command that reads what ``parts`` (and the launch's undecided branches) left unread.

    Environment words become ``--env NAME="$NAME"`` (the value the shell running the command has). When the
    static reader, given those names, reads the whole launch, the command is a static audit; otherwise (a
    command substitution, a sourced file, the script's arguments) it runs the script with ``--trace``.
    None when there is nothing to settle.
    """
    if not parts and not launch.worlds:
        return None
    names = env_names(parts)
    if launch.worlds:
        names = list(dict.fromkeys([*names, *_outside_names(launch.path)]))
    arguments = any(_ARGUMENT.search(part.detail) for part in parts)
    # With no name to set, reading again would read what was read: the unread parts stay unread.
    static = bool(names) and not arguments and _reads_all(launch.path, launch.index, tuple(names))
    words = ["verl-safe-launch", "audit", *([] if static else ["--trace"])]
    words += [f'--env {name}="${name}"' for name in names]
    words.append(shlex.quote(launch.path))
    tail = [shlex.quote(arg) for arg in passthrough]
    if arguments and not passthrough:
        tail = ['"ARGUMENTS YOU RUN IT WITH"']
    return " ".join(words + (["--", *tail] if tail else []))


@functools.lru_cache(maxsize=256)
def _reads_all(path: str, index: int, names: tuple[str, ...]) -> bool:
    """Whether the static reader, given a value for each name, reads every part of launch ``index``."""
    try:
        launches = read_script(Path(path), env=seeded_env(dict.fromkeys(names, PROBE)))
    except VslError:
        return False
    if index > len(launches):
        return False
    launch = launches[index - 1]
    return not launch.worlds and not any(note.unread for note in launch.notes)


@functools.lru_cache(maxsize=256)
def _outside_names(path: str) -> tuple[str, ...]:
    """Variables the script reads and never assigns (what decides a branch it does not decide itself)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ()
    code = "\n".join(
        line.split("#", 1)[0] if not line.lstrip().startswith("#!") else "" for line in text.splitlines()
    )
    assigned = set(_ASSIGNED.findall(code)) | set(re.findall(r"\bfor\s+([A-Za-z_]\w*)\s+in\b", code))
    read = dict.fromkeys(_NAME.findall(code))
    return tuple(n for n in read if n not in assigned and n not in _KEPT and not n.startswith("SLURM_"))


__all__ = ["PROBE", "env_names", "settle_command"]
