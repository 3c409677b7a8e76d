"""Every fix is applied and checked again before it is shown: one that changes nothing, leaves its problem in
place or raises a new one at least as severe is dropped."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import yaml

from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import SEVERITY_ORDER, Finding, Severity
from verl_safe_launch.memory import memory_findings
from verl_safe_launch.rules import run_rules, with_values

Check = Callable[[RuleContext], list[Finding]]
_TOKEN = re.compile(r"^([A-Za-z_][\w.]*)=(\S+)$")
_SHOWN = (Severity.ERROR, Severity.WARNING)
PLACEHOLDER = "/path/to/"
"""A value the user fills in (``data.train_files=/path/to/your/train.parquet``): shown, not re-checked."""


def rules_and_memory(ctx: RuleContext) -> list[Finding]:
    """The findings a config change can move: the rules and the memory verdicts."""
    return [*run_rules(ctx), *memory_findings(ctx)]


def rechecked(
    findings: Sequence[Finding], ctx: RuleContext, check: Check = rules_and_memory
) -> list[Finding]:
    """The findings with each fix's alternatives re-checked; those that fail the re-check are left out."""
    before = {(f.rule_id, f.keys) for f in findings if f.severity in _SHOWN}
    out = []
    for finding in findings:
        if finding.fix and finding.severity in _SHOWN:
            finding = replace(finding, fix=_checked(finding, ctx, before, check))
        out.append(finding)
    return out


def _checked(
    finding: Finding, ctx: RuleContext, before: set[tuple[str, tuple[str, ...]]], check: Check
) -> str | None:
    assert finding.fix is not None
    kept = []
    for alternative in finding.fix.split("; or "):
        changes = fix_changes(alternative, ctx)
        if changes is None:
            kept.append(alternative)  # prose, or a token that is not a plain config value: shown as it is
            continue
        if all(ctx.view.get(key) == value for key, value in changes.items()):
            continue  # the value already set
        joined = _joined(alternative, changes, finding, ctx, before, check)
        if joined is not None:
            kept.append(joined)
    return "; or ".join(kept) or None


def _joined(
    alternative: str,
    changes: dict[str, Any],
    finding: Finding,
    ctx: RuleContext,
    before: set[tuple[str, tuple[str, ...]]],
    check: Check,
) -> str | None:
    """The alternative if it passes the re-check; else it joined with the first fixes of the problems it raises,
    if that passes; else None."""
    changed = replace(ctx, view=with_values(ctx.view, changes))
    after = check(changed)
    if not _worse(after, finding, before):
        return alternative
    extra: dict[str, Any] = {}
    tokens: list[str] = []
    for found in after:
        if found.severity is Severity.ERROR and (found.rule_id, found.keys) not in before and found.fix:
            first = found.fix.split("; or ")[0]
            more = fix_changes(first, changed)
            if more and not set(more) & (set(changes) | set(extra)):
                extra.update(more)
                tokens.append(first.split(" (")[0].split(";")[0].strip())
    if not extra or _worse(
        check(replace(ctx, view=with_values(ctx.view, {**changes, **extra}))), finding, before
    ):
        return None
    head = alternative.split(" (")[0].split(";")[0].strip()
    return " ".join([head, *tokens]) + alternative[len(head) :]


def fix_changes(alternative: str, ctx: RuleContext) -> dict[str, Any] | None:
    """The config values one alternative sets (``key=value ...`` before any parenthesis), or None if it is not
    only plain assignments of keys the config has."""
    head = alternative.split(" (")[0].split(";")[0].strip()
    changes: dict[str, Any] = {}
    for token in head.split():
        match = _TOKEN.match(token)
        if match is None or match.group(1) not in ctx.view.values or PLACEHOLDER in match.group(2):
            return None
        try:
            changes[match.group(1)] = yaml.safe_load(match.group(2))
        except yaml.YAMLError:
            return None
    return changes or None


def _worse(after: Sequence[Finding], finding: Finding, before: set[tuple[str, tuple[str, ...]]]) -> bool:
    """The problem is still there, or a new one at least as severe appeared."""
    rank = SEVERITY_ORDER[finding.severity]
    for found in after:
        if found.severity not in _SHOWN or SEVERITY_ORDER[found.severity] > rank:
            continue
        ident = (found.rule_id, found.keys)
        if ident == (finding.rule_id, finding.keys) or ident not in before:
            return True
    return False
