"""The verl release a project pins (``verl==X``) in its requirements files, pyproject.toml, setup.py or setup.cfg."""

from __future__ import annotations

import ast
import configparser
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PIN_FILES = ("requirements*.txt", "pyproject.toml", "setup.py", "setup.cfg")
"""Where a project names its dependencies, in the order they are read within one directory."""
PROJECT_MARKERS = (".git", "pyproject.toml", "setup.py", "setup.cfg")
"""Files or directories that make a directory a project's root: the search upwards stops there."""
MAX_LEVELS = 6
"""How many directories above a script the search for its project's verl goes at most."""


@dataclass(frozen=True)
class Pin:
    """One exact pin of verl: the release, the file that pins it and the line."""

    version: str
    file: Path
    line: int | None

    @property
    def where(self) -> str:
        """``requirements.txt:3``."""
        return f"{self.file.name}:{self.line}" if self.line else self.file.name


def project_dirs(start: Path) -> list[Path]:
    """``start`` and the directories above it, up to the project's root (a ``.git``, ``pyproject.toml``,
    ``setup.py`` or ``setup.cfg``), the home directory or ``MAX_LEVELS`` levels, whichever comes first."""
    out: list[Path] = []
    home = Path.home().resolve()
    directory = start.resolve()
    for _ in range(MAX_LEVELS + 1):
        out.append(directory)
        if directory == home or directory.parent == directory:
            break
        if any((directory / marker).exists() for marker in PROJECT_MARKERS):
            break
        directory = directory.parent
    return out


def project_pin(directories: list[Path]) -> Pin | None:
    """The first exact pin of verl in the directories' dependency files (nearest directory first)."""
    for directory in directories:
        for pattern in PIN_FILES:
            for path in sorted(directory.glob(pattern)):
                pin = next(iter(pins_in(path)), None)
                if pin is not None:
                    return pin
    return None


def pins_in(path: Path) -> list[Pin]:
    """Every exact pin of verl in one dependency file (none when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    if path.name == "pyproject.toml":
        found = _pyproject(text)
    elif path.name == "setup.py":
        found = _setup_py(text)
    elif path.name == "setup.cfg":
        found = _setup_cfg(text)
    else:
        found = _requirement_lines(text)
    return [Pin(version, path, line or _line_of(text, version)) for version, line in found]


def exact_version(requirement: str) -> str | None:
    """``X`` when ``requirement`` pins verl to exactly one release (``verl==X``, ``verl[extra]===X``), else None."""
    from packaging.requirements import InvalidRequirement, Requirement

    try:
        parsed = Requirement(requirement)
    except InvalidRequirement:
        return None
    if parsed.name.lower() != "verl" or len(parsed.specifier) != 1:
        return None
    (spec,) = parsed.specifier
    if spec.operator not in ("==", "===") or "*" in spec.version:
        return None
    return spec.version


def _requirement_lines(text: str) -> Iterator[tuple[str, int | None]]:
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith(("#", "-")):
            version = exact_version(line)
            if version is not None:
                yield version, number


def _pyproject(text: str) -> Iterator[tuple[str, int | None]]:
    import tomllib

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return
    project = data.get("project", {})
    lists = [project.get("dependencies", []), *project.get("optional-dependencies", {}).values()]
    for entries in lists:
        for entry in entries if isinstance(entries, list) else []:
            version = exact_version(entry) if isinstance(entry, str) else None
            if version is not None:
                yield version, None
    poetry = data.get("tool", {}).get("poetry", {}).get("dependencies", {}).get("verl")
    wanted: Any = poetry.get("version") if isinstance(poetry, dict) else poetry
    if isinstance(wanted, str):
        version = exact_version(f"verl{wanted}" if wanted[:1] in "=<>!~" else f"verl=={wanted}")
        if version is not None:
            yield version, None


def _setup_py(text: str) -> Iterator[tuple[str, int | None]]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "verl" in node.value:
            version = exact_version(node.value)
            if version is not None:
                yield version, node.lineno


def _setup_cfg(text: str) -> Iterator[tuple[str, int | None]]:
    parser = configparser.ConfigParser()
    try:
        parser.read_string(text)
    except configparser.Error:
        return
    if parser.has_option("options", "install_requires"):
        for version, _ in _requirement_lines(parser.get("options", "install_requires")):
            yield version, None


def _line_of(text: str, version: str) -> int | None:
    for number, line in enumerate(text.splitlines(), 1):
        if "verl" in line and version in line:
            return number
    return None
