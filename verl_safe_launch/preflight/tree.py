"""Which scripts an ``audit PATH...`` reads: files as named, folders walked in order (``.gitignore`` and
``--exclude`` honoured, symlinks never followed out of the folder or round in a loop)."""

from __future__ import annotations

import fnmatch
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.errors import UsageError

SCRIPT_SUFFIXES = frozenset({".sh", ".bash", ".sbatch", ".slurm"})
"""Files a folder walk reads as scripts; a file without a suffix is read when its first line names a shell."""
_SHELLS = re.compile(rb"^#!\s*\S*(?:/|env\s+)(?:ba|z|k|da)?sh\b")


@dataclass(frozen=True)
class Found:
    """A path to audit, as the user will read it, or one the walk passed over with why (``skip``)."""

    path: str
    named: bool = False
    """Named on the command line (an unreadable one is an unusable command line), not found by a walk."""
    skip: str | None = None


def find_scripts(paths: Sequence[str], exclude: Sequence[str] = ()) -> Iterator[Found]:
    """Every script under ``paths``: a named file as is, a folder walked in sorted order.

    A path that does not exist is a usage error before anything is read. In a folder, files and folders that a
    ``.gitignore`` (of the folder, its parents up to the repository root, or below it) or an ``--exclude`` glob
    matches are left out; a symlink is read at most once, through the first path that reaches its target, and
    one that leads out of the folder (or nowhere) is listed as skipped, not followed.
    """
    for path in paths:
        if not os.path.lexists(path):
            raise UsageError(f"{path} does not exist", where="command line", fix="check the path")
    seen: set[str] = set()
    for path in paths:
        if Path(path).is_dir():
            yield from _walk(Path(path), exclude, seen)
        else:
            yield Found(path, named=True)


def _walk(root: Path, exclude: Sequence[str], seen: set[str]) -> Iterator[Found]:
    real_root = root.resolve()
    ignores = Ignores.above(root)
    stack: list[tuple[Path, Ignores]] = [(root, ignores)]
    while stack:
        folder, ignores = stack.pop()
        ignores = ignores.with_file(folder)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        subfolders: list[tuple[Path, Ignores]] = []
        for entry in entries:
            path = Path(folder, entry.name)
            rel = path.relative_to(root).as_posix()
            is_dir = entry.is_dir(follow_symlinks=False)
            if entry.name == ".git" or _excluded(rel, entry.name, exclude) or ignores.ignored(path, is_dir):
                continue
            if entry.is_symlink():
                found = _symlink(path, real_root, root, seen)
                if found is not None:
                    yield found
            elif is_dir:
                subfolders.append((path, ignores))
            elif entry.is_file(follow_symlinks=False) and is_script(path):
                real = str(path.resolve())
                if real not in seen:
                    seen.add(real)
                    yield Found(str(path))
        stack.extend(reversed(subfolders))


def _symlink(path: Path, real_root: Path, root: Path, seen: set[str]) -> Found | None:
    """A symlink met in a walk: its target once if it is a script in the folder; why not otherwise."""
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):
        return Found(str(path), skip=f"a symlink to {os.readlink(path)}, which does not exist (or loops)")
    if not target.is_relative_to(real_root):
        what = "folder" if target.is_dir() else "file"
        return Found(str(path), skip=f"a symlink to the {what} {target}, outside {root}; name it to audit it")
    if target.is_dir() or not target.is_file() or not is_script(target):
        return None  # a folder inside the tree is walked where it is; a non-script is no concern
    if str(target) in seen:
        return None
    seen.add(str(target))
    return Found(str(path))


def _excluded(rel: str, name: str, exclude: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(rel, glob) or fnmatch.fnmatchcase(name, glob) for glob in exclude)


def is_script(path: Path) -> bool:
    """A shell or Slurm job script by its suffix, or (without a suffix) by a shell ``#!`` line."""
    if path.suffix in SCRIPT_SUFFIXES:
        return True
    if path.suffix:
        return False
    try:
        with path.open("rb") as handle:
            return bool(_SHELLS.match(handle.read(64)))
    except OSError:
        return False


class Ignores:
    """The ``.gitignore`` patterns in force in a folder: each file's, from the repository root down."""

    def __init__(self, patterns: tuple[tuple[Path, Pattern], ...] = ()) -> None:
        self.patterns = patterns

    @classmethod
    def above(cls, folder: Path) -> Ignores:
        """The patterns of the folders above ``folder`` up to its repository's root (none outside a repository)."""
        real = folder.resolve()
        chain = [real, *real.parents]
        root = next((p for p in chain if (p / ".git").exists()), None)
        if root is None:
            return cls()
        ignores = cls(tuple((root, p) for p in _read(root / ".git" / "info" / "exclude")))
        for parent in reversed(chain[1 : chain.index(root) + 1]):
            ignores = ignores.with_file(parent, base=parent)
        return ignores

    def with_file(self, folder: Path, base: Path | None = None) -> Ignores:
        """These patterns and those of ``folder/.gitignore`` (which are relative to ``folder``)."""
        found = _read(folder / ".gitignore")
        where = (base or folder).resolve()
        return Ignores((*self.patterns, *((where, p) for p in found))) if found else self

    def ignored(self, path: Path, is_dir: bool) -> bool:
        """Git's answer: the last pattern that matches decides (a ``!`` pattern re-includes)."""
        decided = False
        real = path.parent.resolve() / path.name
        for base, pattern in self.patterns:
            if real.is_relative_to(base) and pattern.matches(real.relative_to(base).as_posix(), is_dir):
                decided = not pattern.negated
        return decided


@dataclass(frozen=True)
class Pattern:
    """One ``.gitignore`` line as a regular expression over a path relative to the file's folder."""

    regex: re.Pattern[str]
    negated: bool
    dir_only: bool

    def matches(self, rel: str, is_dir: bool) -> bool:
        """Whether the pattern matches ``rel`` (a folder only when ``is_dir``, for a pattern ending in ``/``)."""
        return (is_dir or not self.dir_only) and self.regex.fullmatch(rel) is not None


def _read(path: Path) -> list[Pattern]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return [p for line in lines if (p := parse_pattern(line)) is not None]


def parse_pattern(line: str) -> Pattern | None:
    """A ``.gitignore`` line (gitignore(5)): comments, ``!``, a trailing ``/``, anchoring, ``*``, ``?``, ``**``."""
    if not line.strip() or line.startswith("#"):
        return None
    line = re.sub(r"(?<!\\)\s+$", "", line)
    negated = line.startswith("!")
    if negated or line.startswith("\\"):
        line = line[1:]
    dir_only = line.endswith("/")
    line = line.rstrip("/")
    if not line:
        return None
    anchored = "/" in line
    line = line.lstrip("/")
    body = _translate(line)
    regex = body if anchored else f"(?:.*/)?{body}"
    return Pattern(re.compile(regex), negated, dir_only)


def _translate(glob: str) -> str:
    out: list[str] = []
    i = 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif glob.startswith("/**", i) and i + 3 == len(glob):
            out.append("/.*")
            i += 3
        elif glob[i] == "*":
            out.append(".*" if glob.startswith("**", i) else "[^/]*")
            i += 2 if glob.startswith("**", i) else 1
        elif glob[i] == "?":
            out.append("[^/]")
            i += 1
        elif glob[i] == "[" and (end := glob.find("]", i + 2)) != -1:
            inner = glob[i + 1 : end]
            out.append("[" + ("^" + inner[1:] if inner[:1] in "!^" else inner).replace("\\", "\\\\") + "]")
            i = end + 1
        elif glob[i] == "\\" and i + 1 < len(glob):
            out.append(re.escape(glob[i + 1]))
            i += 2
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return "".join(out)


_MODULE = re.compile(r"(?:^|\s)-m\s+([\w.]+)")
_SCRIPT_PY = re.compile(r"\b(?:python3?|torchrun|accelerate launch)\b[^\n]*?\s([\w./-]+\.py)\b")
_KINDS = (
    ("sft", "SFT"),
    ("generation", "generation"),
    ("eval", "evaluation"),
    ("preprocess", "data preparation"),
)


def skip_reason(text: str) -> str:
    """Why a script with no ``verl.trainer.main_ppo`` launch is skipped: what it runs instead, when that shows."""
    code = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    module = next(
        (m for m in _MODULE.findall(code) if m not in ("pip", "venv", "torch.distributed.run")), None
    )
    program = module or next(iter(_SCRIPT_PY.findall(code)), None)
    if program is None:
        return "no verl PPO launch (python -m verl.trainer.main_ppo) in it"
    kind = next((label for word, label in _KINDS if word in program.lower()), None)
    what = f"{program} ({kind})" if kind else program
    return f"runs {what}, not a verl PPO launch (python -m verl.trainer.main_ppo)"


__all__ = ["Found", "Ignores", "find_scripts", "is_script", "parse_pattern", "skip_reason"]
