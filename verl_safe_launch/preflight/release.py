"""The report header: which verl the checks were made for, and what could not be judged for that release."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_safe_launch.audit import AUDIT_RULES
from verl_safe_launch.errors import VslError
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import (
    TESTED,
    VerlRelease,
    choose_verl,
    chosen_verl,
    describe_need,
    package_in,
    verl_release,
    version_tuple,
)
from verl_safe_launch.rules import RULES

CHECKED = (
    "composition with its own YAML, Hydra's override rules, the batch and layout arithmetic, its registries"
)
NOT_CHECKED = "value types and renames (known for 0.5.0 to 0.9.1), the rules listed as not judged"


def unjudged(release: VerlRelease) -> dict[str, list[str]]:
    """Need → ids of the rules that do not run for this release because it lacks that need."""
    out: dict[str, list[str]] = {}
    table: list[Rule[Any]] = [*RULES, *AUDIT_RULES]
    for rule in table:
        missing = [need for need in rule.needs if not release.has(need)]
        if missing:
            out.setdefault(missing[0], []).append(rule.rule_id)
    return out


def release_notice(release: VerlRelease) -> str | None:
    """One line for a release outside the tested ones: what is checked and what is not."""
    if release.tested:
        return None
    if release.version is None:
        what = f"{release.name} is an unknown copy (no verl/version/version)"
    elif version_tuple(release.version) < version_tuple(TESTED[0]):
        what = f"{release.name} is older than the oldest release tested ({TESTED[0]})"
    else:
        what = f"{release.name} is not a tested release ({', '.join(TESTED)})"
    return f"{what}: checked: {CHECKED}; not checked: {NOT_CHECKED}"


def header_lines(release: VerlRelease | None = None) -> list[str]:
    """``verl 0.8.0 at PATH (origin)``, then one line per need the release lacks, then the untested notice."""
    release = release or verl_release()
    lines = [release.label]
    for need, ids in unjudged(release).items():
        lines.append(f"not judged for {release.name} ({describe_need(need)}): {', '.join(sorted(ids))}")
    notice = release_notice(release)
    return [*lines, notice] if notice else lines


def header_json(release: VerlRelease | None = None) -> dict[str, object]:
    """The header as JSON: the release, the rules not judged for it (by need), the notice."""
    release = release or verl_release()
    return release.to_json() | {"not_judged": unjudged(release), "notice": release_notice(release)}


def safe_header_json() -> dict[str, object] | None:
    """The header as JSON, or None where no verl can be found."""
    try:
        return header_json()
    except VslError:
        return None


def vendored_verl(script: Path, exports: Sequence[tuple[str, str]] = ()) -> tuple[Path, str] | None:
    """A ``verl`` package the script's launch imports instead of the installed one.

    On a ``PYTHONPATH`` the script exports (relative entries read from the script's directory), in the
    directory a literal ``cd DIR`` line moves to, or beside the script.
    """
    base = script.resolve().parent
    moved = _cd_target(script)
    if moved is not None and package_in(base / moved) is not None:
        return base / moved, f"vendored in {moved}, where {script.name} cd's"
    for name, value in exports:
        if name != "PYTHONPATH":
            continue
        for entry in value.split(":"):
            if entry and package_in(base / entry) is not None:
                return base / entry, f"PYTHONPATH set by {script.name}"
    if package_in(base) is not None and base.name != "verl":
        return base, f"vendored beside {script.name}"
    return None


def _cd_target(script: Path) -> str | None:
    """The directory of the last top-level ``cd DIR`` line with a literal argument (None: none, or not literal)."""
    import shlex

    target = None
    try:
        lines = script.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if len(words) == 2 and words[0] == "cd" and "$" not in words[1] and "`" not in words[1]:
            target = words[1]
    return target


def use_vendored_verl(script: Path, exports: Sequence[tuple[str, str]] = ()) -> None:
    """Choose the verl a script's launch imports (a vendored copy when there is one, else the usual one)."""
    found = vendored_verl(script, exports)
    if chosen_verl("script") == ((package_in(found[0]), found[1]) if found else None):
        return  # the same verl as the script before (a folder's scripts on the installed one): keep what was read
    choose_verl(found[0] if found else None, found[1] if found else "", scope="script")


PIN_FILES = ("requirements.txt", "requirements-train.txt", "setup.py", "pyproject.toml", "environment.yml")
_PIN = re.compile(r"(?<![\w-])verl(?:\[[^\]]*\])?\s*==\s*([0-9][0-9A-Za-z.]*)")
_ROOT_MARKS = (".git", "pyproject.toml", "setup.py")


@dataclass(frozen=True)
class ProjectVerl:
    """The verl a project's launch script was written for: its vendored copy, or the release it pins."""

    package: Path | None
    pinned: str | None
    how: str


def shown_path(path: Path) -> str:
    """A path as a report shows it: relative to the working directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def project_verl(script: Path, exports: Sequence[tuple[str, str]] = ()) -> ProjectVerl | None:
    """The project's own verl: a copy the script imports (a ``PYTHONPATH`` it exports, the directory it cd's to,
    beside it) or one above it in its checkout (``verl/``, or a vendored verl repository ``verl/verl/``), else a
    ``verl==X`` pin in the project's requirements, setup.py or pyproject.toml. None: nothing says."""
    found = vendored_verl(script, exports)
    if found is not None:
        package = package_in(found[0])
        if package is not None:
            return ProjectVerl(package, None, found[1])
    for folder in _upward(script):
        for candidate in (folder, folder / "verl", folder / "src"):
            package = package_in(candidate)
            if package is not None:
                return ProjectVerl(package, None, f"vendored at {shown_path(package)}")
    for folder in _upward(script):
        for name in PIN_FILES:
            pin = _pin_in(folder / name)
            if pin is not None:
                return ProjectVerl(None, pin, f"{shown_path(folder / name)} pins verl=={pin}")
    return None


def _upward(script: Path) -> list[Path]:
    """The script's directory and those above it, up to the first that marks a project root."""
    out: list[Path] = []
    for folder in script.resolve().parents:
        out.append(folder)
        if any((folder / mark).exists() for mark in _ROOT_MARKS):
            break
    return out


def _pin_in(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = _PIN.search(text)
    return found.group(1) if found else None
