"""Render findings as text or JSON (deterministic, no timestamps)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from verl_safe_launch.config_view import format_value
from verl_safe_launch.findings import Finding, Severity, sort_findings
from verl_safe_launch.render.escape import escape
from verl_safe_launch.render.table import use_rich

CANNOT_VERIFY = "cannot-verify"

if TYPE_CHECKING:
    from rich.text import Text


def render_finding(finding: Finding) -> str:
    """One finding: the header line, each involved value with its source, then the fix."""
    lines = [f"{finding.severity.value} [{finding.rule_id}] {escape(finding.message)}"]
    width = max((len(escape(key)) for key, _, _ in finding.sources), default=0)
    for key, value, source in finding.sources:
        shown = escape(format_value(value))
        lines.append(f"  {escape(key):<{width}} = {shown:<6} from {escape(source.describe())}")
    if finding.fix:
        lines.append(f"  fix: {escape(finding.fix)}")
    lines.append(f"  see: {rule_hint(finding.rule_id)}")
    return "\n".join(lines)


def rule_hint(rule_id: str) -> str:
    """Where a rule is explained: ``verl-safe-launch explain RULE`` (its page in docs/rules/ says the same)."""
    return f"verl-safe-launch explain {escape(rule_id)}"


def doubt_lines(findings: Sequence[Finding]) -> list[str]:
    """One line per info ``cannot-verify`` finding: what it would say, and the unread word that could change it.

    Shown without ``--verbose``: which finding depends on which word the script does not set is never routine.
    """
    lines = []
    for finding in findings:
        if finding.rule_id != CANNOT_VERIFY or finding.severity is not Severity.INFO:
            continue
        words = [(raw, source.line) for key, raw, source in finding.sources if key == "unread"]
        rule = finding.message.removeprefix("cannot verify [").partition("]")[0]
        keys = ", ".join(finding.keys) or "the launch"
        word = f"{words[0][0]} (line {words[0][1]})" if words else "a branch the script does not decide"
        lines.append(escape(f"info [cannot-verify] {rule} on {keys}: {word} is not read and could change it"))
    return lines


def summary_line(findings: Sequence[Finding], unread: int = 0) -> str:
    """``2 errors, 1 warning, 0 info`` and the verdict (``UNVERIFIED`` when ``unread`` parts were not read)."""
    counts = {sev: sum(1 for f in findings if f.severity is sev) for sev in Severity}
    verdict = "NO-GO" if counts[Severity.ERROR] else "GO"
    if verdict == "GO" and unread:
        verdict = f"UNVERIFIED: {unread} part{'s' if unread != 1 else ''} not read"
    parts = [
        f"{counts[Severity.ERROR]} error{'s' if counts[Severity.ERROR] != 1 else ''}",
        f"{counts[Severity.WARNING]} warning{'s' if counts[Severity.WARNING] != 1 else ''}",
        f"{counts[Severity.INFO]} info",
    ]
    return f"{verdict}{'; ' if unread and verdict != 'NO-GO' else ': '}" + ", ".join(parts)


def render_findings_text(findings: Sequence[Finding], unread: int = 0, *, verbose: bool = True) -> str:
    """All findings, errors first, then the summary line; without ``verbose`` the info notes are one line."""
    ordered = sort_findings(list(findings))
    shown = ordered if verbose else [f for f in ordered if f.severity is not Severity.INFO]
    blocks = [render_finding(f) for f in shown]
    notes = [] if verbose else ["\n".join(doubt_lines(ordered))] if doubt_lines(ordered) else []
    notes += [] if verbose else notes_line(ordered)
    return "\n\n".join([*blocks, *notes, summary_line(ordered, unread)]) + "\n"


def notes_line(findings: Sequence[Finding]) -> list[str]:
    """The info findings as one line (``info: 3 notes (hardware-unknown, ...)``), or nothing when there are none."""
    infos = [f.rule_id for f in findings if f.severity is Severity.INFO and f.rule_id != CANNOT_VERIFY]
    if not infos:
        return []
    by_rule = {rule: infos.count(rule) for rule in dict.fromkeys(infos)}
    named = ", ".join(f"{rule} ×{n}" if n > 1 else rule for rule, n in by_rule.items())
    count = f"{len(infos)} note{'s' if len(infos) != 1 else ''}"
    return [f"info: {count} ({named}); --verbose lists them"]


def findings_json(findings: Sequence[Finding]) -> list[dict[str, object]]:
    """Findings in their stable JSON form, errors first."""
    return [f.to_json() for f in sort_findings(list(findings))]


def counts(findings: Sequence[Finding]) -> dict[str, int]:
    """Findings per severity: ``{"errors": 1, "warnings": 0, "info": 2}``."""
    by = {sev: sum(1 for f in findings if f.severity is sev) for sev in Severity}
    return {"errors": by[Severity.ERROR], "warnings": by[Severity.WARNING], "info": by[Severity.INFO]}


_GROUP_TITLES = {Severity.ERROR: "errors", Severity.WARNING: "warnings", Severity.INFO: "info"}
_GROUP_STYLES = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def render_findings_table(
    findings: Sequence[Finding],
    *,
    width: int = 110,
    color: bool = False,
    unread: int = 0,
    verbose: bool = True,
) -> str:
    """Findings as rich tables, one per severity (errors first), then the summary line.

    Deterministic for a given width when ``color`` is false (no ANSI codes), so it can be compared in tests.
    """
    import io

    from rich.console import Console
    from rich.table import Table

    out = io.StringIO()
    console = Console(file=out, width=width, no_color=not color, force_terminal=color, highlight=False)
    for severity in Severity:
        group = [f for f in sort_findings(list(findings)) if f.severity is severity]
        if not group or (severity is Severity.INFO and not verbose):
            continue
        title = f"{_GROUP_TITLES[severity]} ({len(group)})"
        table = Table(
            title=title,
            title_justify="left",
            title_style=_GROUP_STYLES[severity],
            show_lines=True,
            expand=True,
        )
        table.add_column("rule", style=_GROUP_STYLES[severity], no_wrap=True)
        table.add_column("finding", overflow="fold")
        for finding in group:
            table.add_row(finding.rule_id, _cell(finding))
        console.print(table)
    for line in [] if verbose else [*doubt_lines(findings), *notes_line(findings)]:
        console.print(line, markup=False)
    console.print(summary_line(findings, unread), markup=False)
    return out.getvalue()


def _cell(finding: Finding) -> Text:
    from rich.text import Text

    text = Text(escape(finding.message))
    for key, value, source in finding.sources:
        line = f"{escape(key)} = {escape(format_value(value))}  from {escape(source.describe())}"
        text.append(f"\n  {line}", style="dim")
    if finding.fix:
        text.append("\n  fix: ", style="bold")
        text.append(escape(finding.fix))
    text.append(f"\n  see: {rule_hint(finding.rule_id)}", style="dim")
    return text


def render_report(findings: Sequence[Finding], unread: int = 0, *, verbose: bool = True) -> str:
    """The text report: rich tables grouped by severity on a terminal, plain deterministic text otherwise.

    Without ``verbose`` the info findings (routine notes) are one summary line.
    """
    import shutil

    if use_rich():
        return render_findings_table(
            findings, width=shutil.get_terminal_size().columns, color=True, unread=unread, verbose=verbose
        )
    return render_findings_text(findings, unread, verbose=verbose)
