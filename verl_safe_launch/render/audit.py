"""The report of an ``audit`` run: per script and launch in text, or the stable JSON document."""

from __future__ import annotations

from verl_safe_launch.findings import Finding
from verl_safe_launch.preflight import ScriptAudit
from verl_safe_launch.render.escape import escape, render_error
from verl_safe_launch.render.jsonout import json_document
from verl_safe_launch.render.report import counts, findings_json, render_report, summary_line


def render_audit_text(results: list[ScriptAudit], *, verbose: bool = True) -> str:
    """Per script and launch: a header, the findings, the verdict; then the total when there are several."""
    blocks: list[str] = []
    everything: list[Finding] = []
    for result in results:
        if result.error is not None:
            blocks.append(f"== {escape(result.path)}\n{render_error(result.error)}\n")
        if result.verl and result.verl != (results[0].verl if result is not results[0] else ()):
            blocks.append("\n".join(escape(line) for line in result.verl))
        for item in result.launches:
            launch = item.launch
            header = f"== {escape(launch.label)}: launch {launch.index} of {len(result.launches)}, {len(launch.tokens)} overrides"
            blocks.append(f"{header}\n{render_report(item.findings, item.unread, verbose=verbose)}")
            everything.extend(item.findings)
    if sum(len(r.launches) for r in results) > 1:
        unread = sum(item.unread for r in results for item in r.launches)
        blocks.append(f"== all launches: {summary_line(everything, unread)}\n")
    return "\n".join(blocks)


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
        "verl": list(result.verl),
        "launches": [
            {
                "line": item.launch.line,
                "index": item.launch.index,
                "verdict": item.verdict,
                "unread": item.unread,
                "summary": counts(item.findings),
                "overrides": [{"text": t.text, "line": t.source.line} for t in item.launch.tokens],
                "findings": findings_json(item.findings),
            }
            for item in result.launches
        ],
    }


__all__ = ["audit_json", "render_audit_text"]
