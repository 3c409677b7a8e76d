"""Render findings as text or JSON (deterministic, no timestamps)."""

from __future__ import annotations

from collections.abc import Sequence

from verl_safe_launch.findings import Finding, Severity, sort_findings

JSON_SCHEMA_VERSION = 1


def _format(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def render_finding(finding: Finding) -> str:
    """One finding: the header line, each involved value with its source, then the fix."""
    lines = [f"{finding.severity.value} [{finding.rule_id}] {finding.message}"]
    width = max((len(key) for key, _, _ in finding.sources), default=0)
    for key, value, source in finding.sources:
        lines.append(f"  {key:<{width}} = {_format(value):<6} from {source.describe()}")
    if finding.fix:
        lines.append(f"  fix: {finding.fix}")
    return "\n".join(lines)


def summary_line(findings: Sequence[Finding]) -> str:
    """``2 errors, 1 warning, 0 info`` and the verdict."""
    counts = {sev: sum(1 for f in findings if f.severity is sev) for sev in Severity}
    verdict = "NO-GO" if counts[Severity.ERROR] else "GO"
    parts = [
        f"{counts[Severity.ERROR]} error{'s' if counts[Severity.ERROR] != 1 else ''}",
        f"{counts[Severity.WARNING]} warning{'s' if counts[Severity.WARNING] != 1 else ''}",
        f"{counts[Severity.INFO]} info",
    ]
    return f"{verdict}: " + ", ".join(parts)


def render_findings_text(findings: Sequence[Finding]) -> str:
    """All findings, errors first, then the summary line."""
    ordered = sort_findings(list(findings))
    blocks = [render_finding(f) for f in ordered]
    return "\n\n".join([*blocks, summary_line(ordered)]) + "\n"


def findings_json(findings: Sequence[Finding]) -> list[dict[str, object]]:
    """Findings in their stable JSON form, errors first."""
    return [f.to_json() for f in sort_findings(list(findings))]
