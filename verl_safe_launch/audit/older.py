"""A launch written for another verl than the one it is checked against says so once, with the two ways forward.

When the keys of a launch that the verl in use refuses fit an older release (or keys no release has: a fork's or
the project's own) better than that verl, the refusals become one finding: which release the launch fits, how to
check it against that verl (``--verl DIR``) or rewrite it (``upgrade``), and under it every refused key with the
key it moved to, where the release history knows one.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import replace

from verl_safe_launch.audit.detect import detect, evidence_of, fits_text
from verl_safe_launch.audit.history import RELEASES, last_release_with, series_of
from verl_safe_launch.audit.upgrade import current_key, moves_after
from verl_safe_launch.compose import compose, model_engines
from verl_safe_launch.errors import VslError
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.inputs import (
    ComposeRequest,
    OverrideToken,
    VerlRelease,
    did_you_mean,
    typo_of,
    verl_cache,
    version_tuple,
)
from verl_safe_launch.provenance import Layer, Source

OLDER = "was written for"
"""Marks the grouped finding (the audit's ``unknown-key``, one per launch)."""


def group_older_keys(
    findings: Sequence[Finding],
    texts: Sequence[str],
    release: VerlRelease,
    script: str,
    exports: Sequence[tuple[str, str]] = (),
) -> list[Finding]:
    """The findings, with the keys ``release`` refuses grouped under one headline when the launch fits another
    verl better (unchanged otherwise); a key that is a typo of one ``release`` has keeps its own finding."""
    engines = engine_keys()
    refused = [f for f in findings if _refused_key(f) and not _typo(f, release) and not set(f.keys) & engines]
    if not refused:
        return list(findings)
    fits = _fits(texts, release, [k for f in refused for k in f.keys], exports)
    if fits is None:
        return list(findings)
    headline = _headline(refused, *fits, release, script)
    at = findings.index(refused[0])
    kept = [f for f in findings if f not in refused]
    return [*kept[:at], headline, *kept[at:]]


@verl_cache
def engine_keys() -> frozenset[str]:
    """Keys the verl in use has under another ``model_engine`` (``actor.megatron.*``): not another verl's keys."""
    keys: set[str] = set()
    for engine in model_engines():
        token = OverrideToken(f"model_engine={engine}", Source(Layer.CLI))
        try:
            keys.update(compose(ComposeRequest(overrides=(token,))).view.keys())
        except VslError:
            continue
    return frozenset(keys)


def _refused_key(finding: Finding) -> bool:
    """An ``unknown-key`` error about a key the verl in use does not have (not a '+' or a dataclass field)."""
    return (
        finding.rule_id == "unknown-key"
        and finding.severity is Severity.ERROR
        and finding.message.startswith("unknown key ")
    )


def _typo(finding: Finding, release: VerlRelease) -> bool:
    return any(typo_of(k, release.config_keys) is not None for k in finding.keys)


def _fits(
    texts: Sequence[str], release: VerlRelease, refused: Sequence[str], exports: Sequence[tuple[str, str]]
) -> tuple[str, str | None] | None:
    """What the launch fits better than ``release`` (``verl 0.3 to 0.4``, or a fork: two keys or more that no
    release has) and the release to install for it; None when it fits ``release`` itself."""
    older = [k for k in refused if last_release_with(k) is not None]
    found = detect(evidence_of(texts, frozenset(), exports), {k: None for k in release.config_keys})
    mine = _series(release.version)
    lo, hi = version_tuple(found.oldest), version_tuple(found.newest)
    if older and not found.why.startswith("no key") and not (mine and lo <= version_tuple(mine) <= hi):
        return f"verl {fits_text(found)}", RELEASES[found.newest].lstrip("v")
    if len(refused) - len(older) >= 2:
        return "a newer verl, a fork or the project's own code (keys no verl release we know has)", None
    return None


def _series(version: str | None) -> str | None:
    if version is None:
        return None
    series = ".".join(version.split(".")[:2])
    return series if series in RELEASES else None


def _headline(
    refused: list[Finding], fits: str, install: str | None, release: VerlRelease, script: str
) -> Finding:
    keys = tuple(k for f in refused for k in f.keys)
    moved = []
    for key in keys:
        last = last_release_with(key)
        target = current_key(key, moves_after(series_of(f"v{last}"))) if last else key
        if target not in release.config_keys:
            target = did_you_mean(key, release.config_keys) or key  # the same leaf in a moved section
        if target != key:
            moved.append(f"{key} → {target}")
    message = (
        f"this launch {OLDER} {fits}, not {release.name}: {release.name}'s config has none of the "
        f"{len(keys)} key{'s' if len(keys) > 1 else ''} below, so Hydra refuses the launch"
    )
    if moved:
        message += f" (moved since: {', '.join(moved)})"
    quoted = shlex.quote(script)
    where = (
        f"pip install --no-deps --target DIR {shlex.quote(f'verl=={install}')}"
        if install
        else "DIR holds the fork's verl"
    )
    fix = (
        f"check it against the verl it was written for: verl-safe-launch --verl DIR audit {quoted} ({where}); "
        f"or rewrite it for {release.name}: verl-safe-launch upgrade {quoted} -o DIR"
    )
    sources = tuple(s for f in refused for s in f.sources)
    reads = tuple(r for f in refused for r in f.reads)
    return replace(refused[0], keys=keys, message=message, fix=fix, sources=sources, reads=reads)
