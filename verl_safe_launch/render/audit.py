"""The report of an ``audit`` run: per script and launch in text (as each script is read, then a table of every
script and the totals), or the stable JSON document."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from verl_safe_launch.findings import Severity
from verl_safe_launch.preflight import ScriptAudit
from verl_safe_launch.render.escape import escape, render_error
from verl_safe_launch.render.jsonout import json_document
from verl_safe_launch.render.report import counts, findings_json, render_report, summary_line
from verl_safe_launch.render.table import Column, render_table

VERDICTS = {
    "go": "GO",
    "no-go": "NO-GO",
    "unverified": "UNVERIFIED",
    "skipped": "skipped",
    "unreadable": "unreadable",
}


@dataclass(frozen=True)
class Row:
    """One script in the closing table: its verdict, counts and first error's rule, or why it was not audited."""

    path: str
    verdict: str
    errors: int
    warnings: int
    first_rule: str
    why: str = ""
    baselined: int = 0

    @classmethod
    def of(cls, result: ScriptAudit) -> Row:
        """The row of one audited (or skipped, or unreadable) script."""
        findings = [f for launch in result.launches for f in launch.findings]
        errors = [f for f in findings if f.severity is Severity.ERROR]
        warnings = sum(1 for f in findings if f.severity is Severity.WARNING)
        why = result.skipped or (result.error.what if result.error is not None else "")
        baselined = sum(len(launch.baselined) for launch in result.launches)
        first = errors[0].rule_id if errors else ""
        return cls(result.path, result.verdict, len(errors), warnings, first, why, baselined)


@dataclass
class Totals:
    """The closing lines: scripts and launches per verdict, findings per severity."""

    rows: list[Row] = field(default_factory=list)
    launches: dict[str, int] = field(default_factory=dict)

    def add(self, result: ScriptAudit) -> Row:
        """Count one script; its row for the table."""
        row = Row.of(result)
        self.rows.append(row)
        for launch in result.launches:
            self.launches[launch.verdict] = self.launches.get(launch.verdict, 0) + 1
        return row

    def scripts(self, verdict: str) -> int:
        """How many scripts have ``verdict``."""
        return sum(1 for row in self.rows if row.verdict == verdict)


def render_audit_text(results: list[ScriptAudit], *, verbose: bool = True) -> str:
    """Per script and launch: a header, the findings, the verdict; then the total when there are several."""
    text = AuditText(verbose=verbose)
    blocks = [text.script(result) for result in results]
    if sum(len(r.launches) for r in results) > 1:
        blocks.append(all_launches(results))
    return "\n".join(block for block in blocks if block)


def all_launches(results: Sequence[ScriptAudit]) -> str:
    """The verdict over every launch of ``results`` (one line)."""
    everything = [f for r in results for item in r.launches for f in item.findings]
    unread = sum(item.unread for r in results for item in r.launches)
    return f"== all launches: {summary_line(everything, unread)}\n"


class AuditText:
    """The text report, one script at a time (nothing kept but the header last shown)."""

    def __init__(self, *, verbose: bool = True) -> None:
        self.verbose = verbose
        self.header: tuple[str, ...] | None = None

    def script(self, result: ScriptAudit) -> str:
        """The block of one script: its verl header when it changed, each launch's findings and verdict."""
        blocks: list[str] = []
        if result.error is not None:
            blocks.append(f"== {escape(result.path)}\n{render_error(result.error)}\n")
        if result.skipped is not None:
            blocks.append(f"== {escape(result.path)}: skipped: {escape(result.skipped)}\n")
        if result.verl and result.verl != self.header:
            blocks.append("\n".join(escape(line) for line in result.verl))
            self.header = result.verl
        for item in result.launches:
            launch = item.launch
            header = f"== {escape(launch.label)}: launch {launch.index} of {len(result.launches)}, {len(launch.tokens)} overrides"
            report = render_report(item.findings, item.unread, verbose=self.verbose)
            if item.baselined:
                report += f"{len(item.baselined)} more in the baseline\n"
            if item.settle and item.verdict == "unverified":
                report += f"to settle it, audit with the values the run gets: {escape(item.settle)}\n"
            blocks.append(f"{header}\n{report}")
        return "\n".join(blocks)


def render_summary(
    totals: Totals, stale: Sequence[tuple[str, str, str, str]] = (), *, rich: bool | None = None
) -> str:
    """The closing table (script, verdict, errors, warnings, first error's rule) and the totals."""
    columns = [
        Column("script"),
        Column("verdict"),
        Column("errors", "right"),
        Column("warnings", "right"),
        Column("first error"),
    ]
    rows = [
        [row.path, VERDICTS[row.verdict], str(row.errors), str(row.warnings), row.first_rule or row.why]
        for row in totals.rows
    ]
    lines = [render_table(columns, rows, rich=rich)] if rows else []
    by = ", ".join(
        f"{totals.scripts(v)} {VERDICTS[v]}" for v in ("no-go", "unverified", "go", "skipped", "unreadable")
    )
    errors = sum(row.errors for row in totals.rows)
    warnings = sum(row.warnings for row in totals.rows)
    launched = sum(totals.launches.values())
    baselined = sum(row.baselined for row in totals.rows)
    total = f"{len(totals.rows)} scripts ({by}); {launched} launches; {errors} errors, {warnings} warnings"
    lines.append(total + (f"; {baselined} findings in the baseline" if baselined else "") + "\n")
    for rule, script, key, value in stale:
        shown = f"{key}={value}" if key else "(no key)"
        lines.append(escape(f"stale baseline entry: [{rule}] {script}: {shown} no longer found") + "\n")
    return "".join(lines)


def audit_json(results: list[ScriptAudit]) -> dict[str, object]:
    """The stable JSON report of an audit (docs/concepts/findings.md): the verdict, then each script."""
    everything = [f for r in results for launch in r.launches for f in launch.findings]
    unread = sum(item.unread for r in results for item in r.launches)
    fields = {"scripts": [_script_json(r) for r in results]}
    unreadable = any(r.error is not None for r in results)
    return json_document(fields, everything, list_findings=False, unread=unread, unreadable=unreadable)


def _script_json(result: ScriptAudit) -> dict[str, object]:
    return {
        "path": result.path,
        "error": result.error.render() if result.error is not None else None,
        "skipped": result.skipped,
        "verl": list(result.verl),
        "launches": [
            {
                "line": item.launch.line,
                "index": item.launch.index,
                "verdict": item.verdict,
                "unread": item.unread,
                "settle": item.settle,
                "summary": counts(item.findings),
                "overrides": [{"text": t.text, "line": t.source.line} for t in item.launch.tokens],
                "findings": findings_json(item.findings),
                "baselined": findings_json(item.baselined),
            }
            for item in result.launches
        ],
    }


__all__ = [
    "VERDICTS",
    "AuditText",
    "Row",
    "Totals",
    "all_launches",
    "audit_json",
    "render_audit_text",
    "render_summary",
]
