"""Which verl the checks are made for: its release, where it lives, and what it has (config nodes, modules)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_safe_launch.inputs.knowledge import cached_fact, read_version
from verl_safe_launch.inputs.verl_checks import PROBES, verl_check
from verl_safe_launch.inputs.verl_paths import verl_cache, verl_origin, verl_warning
from verl_safe_launch.inputs.yamlfile import read_yaml

TESTED = ("0.5.0", "0.6.1", "0.7.1", "0.8.0", "0.9.1")
"""Releases the test suite checks against their own composition and validation."""
GENERATED = "_generated_ppo_trainer.yaml"


def version_tuple(text: str) -> tuple[int, ...]:
    """``0.10.0.dev0`` → ``(0, 10, 0)``: the numeric release parts."""
    out: list[int] = []
    for part in text.split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


@dataclass(frozen=True)
class VerlRelease:
    """The verl in use: its version (None for a copy that names none), package directory and how it was found."""

    version: str | None
    package: Path
    origin: str
    config_keys: frozenset[str]
    warning: str | None = None
    """What was passed over while choosing it (a vendored copy that cannot be read, a pin not fetched)."""

    @property
    def name(self) -> str:
        """``verl 0.8.0`` (``verl (unknown release)`` for a copy without a version file)."""
        return f"verl {self.version}" if self.version else "verl (unknown release)"

    @property
    def shown_path(self) -> str:
        """Where it lives: ``site-packages/verl`` for an installed one, else the directory."""
        if self.origin.startswith("installed") and self.package.parent.name in (
            "site-packages",
            "dist-packages",
        ):
            return f"{self.package.parent.name}/verl"
        return str(self.package)

    @property
    def label(self) -> str:
        """``verl 0.8.0 at /opt/x/verl (vendored beside run.sh), a tested release``: every report's first line."""
        tested = "a tested release" if self.tested else "not a tested release"
        return f"{self.name} at {self.shown_path} ({self.origin}), {tested}"

    @property
    def tested(self) -> bool:
        """True for a release the test suite checks against verl's own composition and validation."""
        return self.version in TESTED

    def has(self, need: str) -> bool:
        """Whether this verl has what a rule needs (see ``describe_need`` for the forms; ``!`` negates one)."""
        if need.startswith("!"):
            return not self.has(need[1:])
        kind, _, what = need.partition(":")
        if kind == "code":
            return verl_check(what) is not None
        if kind == "config":
            return what in self.config_keys or any(k.startswith(what + ".") for k in self.config_keys)
        if kind == "module":
            path = self.package.parent.joinpath(*what.split("."))
            return path.is_dir() or path.with_suffix(".py").is_file()
        if kind == "since":
            return self.version is not None and version_tuple(self.version) >= version_tuple(what)
        raise ValueError(f"unknown need {need!r}")

    def to_json(self) -> dict[str, Any]:
        """``{"version": ..., "path": ..., "origin": ..., "tested": ..., "warning": ...}``."""
        return {
            "version": self.version,
            "path": self.shown_path,
            "origin": self.origin,
            "tested": self.tested,
            "warning": self.warning,
        }


def describe_need(need: str) -> str:
    """What a missing need says, for the header: ``its config has no trainer.v1``, ``it is older than 0.7.1``."""
    kind, _, what = need.lstrip("!").partition(":")
    if kind == "code":
        return f"{'' if need.startswith('!') else 'no '}{PROBES[what].what} in its code"
    if kind == "config":
        return f"its config has no {what}"
    if kind == "module":
        return f"it has no {what}"
    return f"it is older than {what}"


@verl_cache
def verl_release() -> VerlRelease:
    """The verl every check is made for (the installed one unless ``--verl`` or ``VSL_VERL`` names another)."""
    package, origin = verl_origin()
    keys = cached_fact("config_keys", lambda: sorted(_default_keys(package)))
    return VerlRelease(read_version(package), package, origin, frozenset(keys), verl_warning())


def _default_keys(package: Path) -> set[str]:
    """Every leaf key of verl's composed trainer defaults (its generated reference, else the primary YAML)."""
    config = package / "trainer" / "config"
    path = config / GENERATED
    if not path.is_file():
        path = config / "ppo_trainer.yaml"
    if not path.is_file():
        return set()
    return {leaf.key for leaf in read_yaml(path, expand_dots=False).leaves}
