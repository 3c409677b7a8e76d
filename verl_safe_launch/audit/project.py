"""Keys of a project's own code (a vendored verl) that no verl release reads, and what leaving them behind does."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from verl_safe_launch.audit.history import TAGS, history
from verl_safe_launch.audit.upgrade import Change, token_key
from verl_safe_launch.config_view import ARR, ConfigView, format_value
from verl_safe_launch.inputs import OverrideToken, group_estimators

GROUP_SIZE = f"{ARR}.rollout.n"


def in_any_release(key: str, installed: Mapping[str, object]) -> bool:
    """True when the installed verl or any release in the history has ``key`` (or a node above it)."""
    parts = key.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
    known = [installed, *(history(t) for t in TAGS)]
    return any(p in keys for keys in known for p in prefixes)


def project_keys(
    tokens: Sequence[OverrideToken], installed: Mapping[str, object]
) -> list[tuple[str, str, int | None]]:
    """(key, value, line) of every override that no verl release has: the project's own settings."""
    out: list[tuple[str, str, int | None]] = []
    for token in tokens:
        prefix, key, value = token_key(token.text)
        if prefix == "~" or not key or "/" in key or key.startswith(("preset", "hardware.")):
            continue
        if not in_any_release(key, installed):
            out.append((key, value or "", token.source.line))
    return out


def project_changes(found: Iterable[tuple[str, str, int | None]]) -> list[Change]:
    """One line per project key: verl does not read it, so whatever it meant to the run must be carried over."""
    return [
        Change(
            "project",
            key,
            f"{key}={value} is the project's own setting (no verl release from 0.1 to 0.9.1 has it); verl 0.9.1 "
            "does not read it, so whatever it did for the run is lost unless the project's code is carried over",
            line,
        )
        for key, value, line in found
    ]


def lone_group(view: ConfigView, project: Sequence[tuple[str, str, int | None]]) -> list[Change]:
    """A group estimator left with one response per prompt once the project's own keys are left behind (one of
    them may have set the group size): there is no group, so the run no longer trains the estimator it names."""
    estimator = view.get("algorithm.adv_estimator")
    if not project or not isinstance(estimator, str) or estimator not in group_estimators():
        return []
    if view.get(GROUP_SIZE) != 1:
        return []
    keys = ", ".join(f"{k}={v} (line {line})" for k, v, line in project)
    detail = (
        f"algorithm.adv_estimator={estimator} compares the responses of one prompt with each other, and "
        f"{GROUP_SIZE}={format_value(view.get(GROUP_SIZE))} gives each prompt one response: {estimator} without a "
        f"group is not {estimator} (verl takes a group of one as mean 0 and std 1: the advantage is the raw reward, "
        f"with no baseline). Project keys that may have carried the group size: "
        f"{keys}"
    )
    return [Change("refused", GROUP_SIZE, detail, None, GROUP_SIZE, None)]
