"""The report header: which verl the checks were made for, and what could not be judged for that release."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_safe_launch.audit import AUDIT_RULES
from verl_safe_launch.errors import VslError
from verl_safe_launch.findings import Rule
from verl_safe_launch.inputs import (
    TESTED,
    VerlChoice,
    VerlRelease,
    choose_verl,
    chosen_verl,
    describe_need,
    package_in,
    project_verl,
    user_verl,
    verl_release,
    verl_warning,
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
    if release.warning:
        lines.append(f"warning: {release.warning}")
    in_code: list[str] = []
    for need, ids in unjudged(release).items():
        if need.lstrip("!").startswith("code:"):
            in_code += ids  # one line for them all; JSON names each check
        else:
            lines.append(f"not judged for {release.name} ({describe_need(need)}): {', '.join(sorted(ids))}")
    if in_code:
        lines.append(
            f"not judged for {release.name} (its code does not make the check): {', '.join(sorted(in_code))}"
        )
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


def use_project_verl(where: Path | None = None, exports: Sequence[tuple[str, str]] = ()) -> VerlChoice:
    """Make the verl the project of ``where`` uses (a script, or a directory) the one every later check reads.

    ``--verl`` and ``VSL_VERL`` win over the project's own copy; see ``project_verl`` for the order.
    """
    choice = project_verl(where, exports)
    if user_verl() is None and (chosen_verl("project"), verl_warning()) != (
        (package_in(choice.path), choice.how),
        choice.warning,
    ):  # the same verl as before (a folder's scripts on one copy) keeps what was read from it
        choose_verl(choice.path, choice.how, scope="project", warning=choice.warning)
    return choice
