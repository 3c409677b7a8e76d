"""The one shape shared by audit, rule and memory findings."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Generic, TypeVar

from verl_safe_launch.provenance import Source


class Severity(StrEnum):
    """How much a finding matters: errors block the launch."""

    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


SEVERITY_ORDER = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}


@dataclass(frozen=True)
class Finding:
    """One problem or observation: rule id, severity, keys, message, a pasteable fix, and value sources."""

    rule_id: str
    severity: Severity
    keys: tuple[str, ...]
    message: str
    fix: str | None = None
    sources: tuple[tuple[str, object, Source], ...] = field(default=())
    reads: tuple[str, ...] = field(default=(), compare=False)
    """Every key the rule's arithmetic read to reach this finding (beyond ``keys``): what could change it."""

    def to_json(self) -> dict[str, object]:
        """Stable JSON form (see docs/concepts/findings.md, 'JSON reports')."""
        return {
            "rule_id": self.rule_id,
            "severity": self.severity.value,
            "keys": list(self.keys),
            "message": self.message,
            "fix": self.fix,
            "sources": [
                {"key": key, "value": value, "source": src.to_json()} for key, value, src in self.sources
            ],
        }


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Errors first, then warnings, then info; stable within a severity."""
    return sorted(findings, key=lambda f: SEVERITY_ORDER[f.severity])


def has_errors(findings: list[Finding] | tuple[Finding, ...]) -> bool:
    """True when any finding blocks the launch."""
    return any(f.severity is Severity.ERROR for f in findings)


C = TypeVar("C")


@dataclass(frozen=True)
class Rule(Generic[C]):
    """One rule of a rule table (audit or batch/layout rules): id, one-line description, severity, check."""

    rule_id: str
    description: str
    severity: Severity
    check: Callable[[C], list[Finding]]
    needs: tuple[str, ...] = ()
    """What the rule needs of verl (``config:trainer.v1``, ``module:verl.x``, ``since:0.7.1``); none: every verl."""

    def __call__(self, ctx: C) -> list[Finding]:
        """Run the check."""
        return self.check(ctx)


def run_table(rules: Iterable[Rule[C]], ctx: C, has: Callable[[str], bool] | None = None) -> list[Finding]:
    """Run every rule of a table (all of them, never first-failure-only) and collect the findings.

    With ``has``, a rule runs only where the verl in use has everything it needs.
    """
    findings: list[Finding] = []
    for entry in rules:
        if has is None or all(has(need) for need in entry.needs):
            findings.extend(entry.check(ctx))
    return findings


def verdict(findings: Sequence[Finding], unread: int = 0) -> str:
    """``go`` when nothing blocks the launch, ``no-go`` when something does, ``unverified`` when parts were not read."""
    if any(f.severity is Severity.ERROR for f in findings):
        return "no-go"
    return "unverified" if unread else "go"
