"""Rendering findings and reports: text, tables and JSON."""

from __future__ import annotations

from verl_safe_launch.render.report import (
    counts,
    findings_json,
    render_finding,
    render_findings_table,
    render_findings_text,
    render_report,
    report_json,
    summary_line,
    verdict,
)

__all__ = [
    "counts",
    "findings_json",
    "render_finding",
    "render_findings_table",
    "render_findings_text",
    "render_report",
    "report_json",
    "summary_line",
    "verdict",
]
