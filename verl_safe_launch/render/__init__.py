"""Rendering findings and reports: text, tables and JSON."""

from __future__ import annotations

from verl_safe_launch.findings import verdict
from verl_safe_launch.render.audit import (
    AuditText,
    Totals,
    all_launches,
    audit_json,
    render_audit_text,
    render_summary,
)
from verl_safe_launch.render.escape import escape, escape_hidden, escape_lines, render_error
from verl_safe_launch.render.guard import GuardedStream, guarded_output, shown
from verl_safe_launch.render.jsonout import JSON_SCHEMA_VERSION, json_document, json_text, strict_json
from verl_safe_launch.render.junit import JunitWriter
from verl_safe_launch.render.report import (
    counts,
    findings_json,
    render_finding,
    render_findings_table,
    render_findings_text,
    render_report,
    rule_hint,
    summary_line,
)
from verl_safe_launch.render.rules import example_command, render_rule_entry, render_rules_text, rule_pages
from verl_safe_launch.render.sarif import SARIF_SCHEMA, SarifWriter
from verl_safe_launch.render.table import Column, render_table, use_rich

__all__ = [
    "JSON_SCHEMA_VERSION",
    "SARIF_SCHEMA",
    "AuditText",
    "Column",
    "GuardedStream",
    "JunitWriter",
    "SarifWriter",
    "Totals",
    "all_launches",
    "audit_json",
    "counts",
    "escape",
    "escape_hidden",
    "escape_lines",
    "example_command",
    "findings_json",
    "guarded_output",
    "json_document",
    "json_text",
    "render_audit_text",
    "render_error",
    "render_finding",
    "render_findings_table",
    "render_findings_text",
    "render_report",
    "render_rule_entry",
    "render_rules_text",
    "render_summary",
    "render_table",
    "rule_hint",
    "rule_pages",
    "shown",
    "strict_json",
    "summary_line",
    "use_rich",
    "verdict",
]
