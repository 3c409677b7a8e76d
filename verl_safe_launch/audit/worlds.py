"""One launch read in every possible world: a finding that holds in every world is as sure as one with no branch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from verl_safe_launch.audit.verify import CANNOT_VERIFY, doubtful_severity
from verl_safe_launch.findings import Finding, Severity


@dataclass(frozen=True)
class Reading:
    """The findings of a launch in one world, how many parts stayed unread there, and the branches it took."""

    findings: tuple[Finding, ...]
    unread: int
    branch: str


def across_worlds(readings: Sequence[Reading], settle: str | None = None) -> tuple[list[Finding], int]:
    """The findings of a launch over its worlds, and how many parts decide them without being read.

    An error or warning found in every world stands; one found in some worlds only becomes "cannot verify", naming
    the branches it needs (the branch bash takes depends on a value the script does not set); its fix is
    ``settle``, the command that reads the branch bash takes.
    """
    everywhere = set.intersection(*({_key(f) for f in r.findings} for r in readings))
    out: list[Finding] = []
    seen: set[tuple[str, ...]] = set()
    doubtful = False
    for reading in readings:
        for finding in reading.findings:
            key = _key(finding)
            if finding.severity is Severity.INFO or finding.rule_id == CANNOT_VERIFY or key in everywhere:
                if key not in seen:
                    seen.add(key)
                    out.append(finding)
                continue
            doubtful = True
            only = _only_in(finding, reading.branch, settle)
            if _key(only) not in seen:
                seen.add(_key(only))
                out.append(only)
    unread = max(r.unread for r in readings) + doubtful
    return out, unread


def _key(finding: Finding) -> tuple[str, ...]:
    if finding.severity is Severity.INFO:
        return (finding.rule_id, finding.message)
    return (finding.rule_id, finding.severity.value, *finding.keys)


def _only_in(finding: Finding, branch: str, settle: str | None) -> Finding:
    message = (
        f"cannot verify [{finding.rule_id}]: {finding.message}; this holds only where {branch}, and that branch "
        "is chosen by a value the script does not set"
    )
    fix = f"audit the path bash takes, with the values the run gets: {settle or 'verl-safe-launch audit --trace --env NAME=VALUE SCRIPT'}"
    return Finding(CANNOT_VERIFY, doubtful_severity(finding), finding.keys, message, fix, finding.sources)


__all__ = ["Reading", "across_worlds"]
