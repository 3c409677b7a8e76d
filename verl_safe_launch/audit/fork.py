"""A project's own verl: the defaults of its vendored copy, the upstream release it is closest to, and the settings
the project changed in it (which the run had, and an upgrade carries over).

A copy is read like any release: its trainer YAML (the generated reference where it has one), never imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from verl_safe_launch.audit.history import RELEASES, TAGS, history, series_of
from verl_safe_launch.audit.readings import same_value
from verl_safe_launch.audit.upgrade import override_value
from verl_safe_launch.inputs import OverrideToken, read_yaml, version_tuple
from verl_safe_launch.provenance import Layer, Source

GENERATED = "_generated_ppo_trainer.yaml"


@dataclass(frozen=True)
class OldDefaults:
    """The defaults a launch ran with: a release's history, or a project's vendored copy."""

    series: str
    defaults: Mapping[str, object]
    why: str
    file: Path | None = None
    """The copy's trainer YAML (None: the release history)."""
    lines: Mapping[str, int] = field(default_factory=dict)
    """Key → line in ``file``."""

    @property
    def upstream(self) -> Mapping[str, object]:
        """The defaults of the upstream release the series stands for."""
        return history(RELEASES[self.series])


def release_defaults(series: str, why: str) -> OldDefaults:
    """The defaults of an upstream release, from the shipped history."""
    return OldDefaults(series, history(RELEASES[series]), why)


def copy_defaults(package: Path) -> tuple[dict[str, object], dict[str, int], Path]:
    """The trainer defaults of a verl copy (key → value, key → line) and the file they were read from."""
    config = package / "trainer" / "config"
    path = config / GENERATED if (config / GENERATED).is_file() else config / "ppo_trainer.yaml"
    doc = read_yaml(path, expand_dots=False)
    values: dict[str, object] = {}
    lines: dict[str, int] = {}
    for leaf in doc.leaves:
        if leaf.key == "defaults" or leaf.key.startswith(("defaults.", "hydra.")):
            continue
        values[leaf.key] = leaf.value
        lines[leaf.key] = leaf.line
    return values, lines, path


def differing(a: Mapping[str, object], b: Mapping[str, object]) -> int:
    """How many keys two sets of defaults do not share with the same value."""
    keys = set(a) | set(b)
    return sum(1 for k in keys if k not in a or k not in b or not same_value(a[k], b[k]))


def closest_release(defaults: Mapping[str, object], version: str | None) -> tuple[str, int]:
    """The release series whose defaults differ from ``defaults`` in the fewest keys (the copy's own version file
    breaks ties), and how many keys differ."""
    scores = {tag: differing(defaults, history(tag)) for tag in TAGS}
    named = version_tuple(version or "")[:2]

    def rank(tag: str) -> tuple[int, int, int]:
        own = int(version_tuple(tag.lstrip("v"))[:2] != named)
        return scores[tag], own, TAGS.index(tag)

    best = min(TAGS, key=rank)
    series = series_of(best)
    return (series if series in RELEASES else max(RELEASES, key=version_tuple)), scores[best]


def project_defaults(package: Path, version: str | None, how: str) -> OldDefaults:
    """The defaults of a project's vendored copy, and the upstream release it is closest to."""
    values, lines, path = copy_defaults(package)
    series, count = closest_release(values, version)
    named = f"verl {version}" if version else "a verl with no version file"
    why = f"{how}: {named}, whose defaults are closest to verl {series}'s ({count} keys differ)"
    return OldDefaults(series, values, why, path, lines)


def in_some_release(key: str) -> bool:
    """True when an upstream release from 0.1 to 0.9 has ``key``."""
    return any(key in history(tag) for tag in TAGS)


def fork_settings(old: OldDefaults) -> list[tuple[str, object]]:
    """Defaults the project changed in its copy (or took from another release): (key, value), in file order."""
    if old.file is None:
        return []
    upstream = old.upstream
    out = []
    for key, value in old.defaults.items():
        if key in upstream and same_value(value, upstream[key]):
            continue
        if isinstance(value, dict) or not in_some_release(key):
            continue
        out.append((key, value))
    return out


def fork_only(old: OldDefaults) -> list[str]:
    """Keys of the copy that no upstream release has: the project's own settings, read by its own code."""
    if old.file is None:
        return []
    return [k for k in old.defaults if not in_some_release(k) and not isinstance(old.defaults[k], dict)]


def fork_tokens(old: OldDefaults, set_keys: Sequence[str]) -> tuple[OverrideToken, ...]:
    """The project's changed defaults as overrides (before the launch's own, which win), each citing its line in
    the copy's YAML (a layer of the launch: the upgraded YAML carries them)."""
    out = []
    for key, value in fork_settings(old):
        if key in set_keys:
            continue
        text = f"{key}={override_value(value)}"
        line = old.lines.get(key)
        source = Source(
            Layer.SCRIPT,
            file=str(old.file),
            line=line,
            raw=f"{key}: {value}",
            reason=f"the project's verl default ({old.file}:{line})",
        )
        out.append(OverrideToken(text, source))
    return tuple(out)
