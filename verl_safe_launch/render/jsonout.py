"""The one JSON shape of every verb: a ``schema`` number, a verdict where there is one, strict JSON only."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from verl_safe_launch.findings import Finding, verdict
from verl_safe_launch.preflight import safe_header_json
from verl_safe_launch.render.report import counts, findings_json

JSON_SCHEMA_VERSION = 1


def json_document(
    fields: Mapping[str, Any],
    findings: Sequence[Finding] | None = None,
    *,
    list_findings: bool = True,
    unread: int = 0,
    unreadable: bool = False,
) -> dict[str, Any]:
    """``{"schema": 1, "verl": {...}, ...fields}``; with ``findings`` also ``verdict``, ``summary`` first.

    ``verl`` names the release the checks were made for (None where no verl is found), ``findings`` come last.

    The outcome comes before the details, the long list of findings after everything else (left out with
    ``list_findings=False`` when ``fields`` list them in parts, as ``audit`` does per launch). ``unread`` parts
    of a script make a verdict without errors ``unverified``; an input that could not be read at all
    (``unreadable``) makes it ``input-error``: nothing was judged, so it is never ``go``.
    """
    if findings is None:
        return {"schema": JSON_SCHEMA_VERSION, "verl": safe_header_json(), **fields}
    outcome = {
        "schema": JSON_SCHEMA_VERSION,
        "verdict": "input-error" if unreadable else verdict(findings, unread),
        "summary": counts(findings),
        "verl": safe_header_json(),
    }
    listed = {"findings": findings_json(findings)} if list_findings else {}
    return outcome | dict(fields) | listed


def strict_json(value: Any) -> Any:
    """``value`` with every NaN and infinity replaced by ``None`` (JSON has no such numbers), tuples as lists."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(item) for item in value]
    return value


def json_text(data: Any) -> str:
    """Strict, indented JSON with a final newline (objects JSON cannot hold are written as strings)."""
    return json.dumps(strict_json(data), indent=2, allow_nan=False, default=str) + "\n"
