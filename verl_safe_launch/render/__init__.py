"""Rendering findings and reports: text, tables and JSON."""

from __future__ import annotations

from verl_safe_launch.findings import verdict
from verl_safe_launch.render.audit import audit_json, render_audit_text
from verl_safe_launch.render.escape import escape, escape_hidden, escape_lines, render_error
from verl_safe_launch.render.guard import GuardedStream, guarded_output, shown
from verl_safe_launch.render.jsonout import JSON_SCHEMA_VERSION, json_document, json_text, strict_json
from verl_safe_launch.render.report import (
    counts,
    findings_json,
    render_finding,
    render_findings_table,
    render_findings_text,
    render_report,
    summary_line,
)
from verl_safe_launch.render.table import Column, render_table, use_rich

__all__ = [
    "JSON_SCHEMA_VERSION",
    "Column",
    "GuardedStream",
    "audit_json",
    "counts",
    "escape",
    "escape_hidden",
    "escape_lines",
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
    "render_table",
    "shown",
    "strict_json",
    "summary_line",
    "use_rich",
    "verdict",
]
