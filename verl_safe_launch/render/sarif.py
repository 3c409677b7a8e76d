"""SARIF 2.1.0 for code scanning, written as each script is audited: the rule metadata first (from the rule
table), then one result per finding with its file, line and fix, then the run's outcome."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import IO, Any

from verl_safe_launch.data.rulebook import docs_url
from verl_safe_launch.errors import VslError
from verl_safe_launch.findings import Finding
from verl_safe_launch.preflight import Catalogued, ScriptAudit, finding_key, script_key
from verl_safe_launch.provenance import Layer

SARIF_SCHEMA = "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
LEVELS = {"error": "error", "warning": "warning", "info": "note"}
UNREADABLE = "script-unreadable"
"""The result of a script found in a folder that could not be read (it fails the gate)."""


def rule_descriptor(row: Catalogued) -> dict[str, Any]:
    """A rule's ``reportingDescriptor``: its description, help text and page, default level, needs."""
    info = row.info
    example = " ".join(info.example.argv()) if info.example else None
    text = f"{info.checks}. Fix: {info.fix}." + (f" Example: verl-safe-launch {example}" if example else "")
    markdown = f"{info.checks}.\n\n**Fix:** {info.fix}.\n\nSee [{info.id}]({info.url})."
    return {
        "id": info.id,
        "name": "".join(part.title() for part in info.id.split("-")),
        "shortDescription": {"text": info.checks},
        "fullDescription": {"text": info.checks},
        "help": {"text": text, "markdown": markdown},
        "helpUri": info.url,
        "defaultConfiguration": {"level": LEVELS[info.severity]},
        "properties": {"tags": [info.group], "since": row.since, "fix": info.fix},
    }


class SarifWriter:
    """Streams one SARIF log: ``start`` with the rule table, ``script`` per audited script, ``end``."""

    def __init__(
        self, out: IO[str], catalog: Sequence[Catalogued], version: str, *, baseline: bool = False
    ) -> None:
        self.out = out
        self.index = {row.info.id: i for i, row in enumerate(catalog)}
        self.catalog = catalog
        self.version = version
        self.baseline = baseline
        self.first = True
        self.notes: list[dict[str, Any]] = []

    def start(self) -> None:
        """The log's head: the tool and every rule it can report."""
        driver = {
            "name": "verl-safe-launch",
            "version": self.version,
            "rules": [rule_descriptor(row) for row in self.catalog],
        }
        if docs_url():
            driver["informationUri"] = docs_url()
        head = json.dumps({"version": "2.1.0", "$schema": SARIF_SCHEMA})[:-1]
        self.out.write(f'{head}, "runs": [{{"tool": {{"driver": {json.dumps(driver)}}}, "results": [\n')

    def script(self, result: ScriptAudit) -> None:
        """The results of one script (its baselined findings as suppressed ones); a skip as a notification."""
        if result.skipped is not None:
            self.notes.append({"level": "note", "message": {"text": f"{result.path}: {result.skipped}"}})
            return
        if result.error is not None:
            self.notes.append({"level": "error", "message": {"text": f"{result.path}: {result.error.what}"}})
            self._write(self.unreadable(result.error, script_key(result.path)))
            return
        script = script_key(result.path)
        for launch in result.launches:
            for finding in launch.findings:
                self._write(self.result(finding, script, launch.launch.line, "new"))
            for finding in launch.baselined:
                self._write(self.result(finding, script, launch.launch.line, "unchanged"))

    def _write(self, item: dict[str, Any]) -> None:
        self.out.write(("" if self.first else ",\n") + json.dumps(item, default=str))
        self.first = False

    def result(self, finding: Finding, script: str, launch_line: int, state: str) -> dict[str, Any]:
        """One finding as a SARIF result: rule, level, message with the fix, where in the script."""
        line = _line_in(finding, script) or launch_line or 1
        message = finding.message + (f"\nfix: {finding.fix}" if finding.fix else "")
        key = "/".join(finding_key(finding, script))
        item: dict[str, Any] = {
            "ruleId": finding.rule_id,
            "level": LEVELS[finding.severity.value],
            "message": {"text": message},
            "locations": [
                {"physicalLocation": {"artifactLocation": {"uri": script}, "region": {"startLine": line}}}
            ],
            "partialFingerprints": {"verlSafeLaunch/v1": hashlib.sha256(key.encode()).hexdigest()[:32]},
            "properties": {"fix": finding.fix, "keys": list(finding.keys)},
        }
        if finding.rule_id in self.index:
            item["ruleIndex"] = self.index[finding.rule_id]
        if self.baseline:
            item["baselineState"] = state
        if state == "unchanged":
            item["suppressions"] = [{"kind": "external", "justification": "accepted in the baseline"}]
        return item

    def unreadable(self, error: VslError, script: str) -> dict[str, Any]:
        """A script the reader could not read, as an error result on the line it stopped at (code scanning shows
        results, not notifications: the gate fails on it, so the reason is shown where the script is)."""
        where = re.search(r":(\d+)$", error.where or "")
        region = {"startLine": int(where.group(1)) if where else 1}
        item: dict[str, Any] = {
            "ruleId": UNREADABLE,
            "level": "error",
            "message": {"text": error.what + (f"\nfix: {error.fix}" if error.fix else "")},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": script}, "region": region}}],
            "partialFingerprints": {
                "verlSafeLaunch/v1": hashlib.sha256(f"{UNREADABLE}/{script}".encode()).hexdigest()[:32]
            },
        }
        if UNREADABLE in self.index:
            item["ruleIndex"] = self.index[UNREADABLE]
        if self.baseline:
            item["baselineState"] = "new"
        return item

    def end(self, exit_code: int) -> None:
        """The run's outcome: the exit code and the scripts skipped or unreadable."""
        invocation = {
            "executionSuccessful": True,
            "exitCode": exit_code,
            "toolExecutionNotifications": self.notes,
        }
        self.out.write(f'\n], "invocations": [{json.dumps(invocation)}]}}]}}\n')


def _line_in(finding: Finding, script: str) -> int | None:
    """The first line of the script a finding cites."""
    for _key, _value, source in finding.sources:
        if source.layer is Layer.SCRIPT and source.line and source.file and script_key(source.file) == script:
            return source.line
    return None


__all__ = ["LEVELS", "SARIF_SCHEMA", "SarifWriter", "rule_descriptor"]
