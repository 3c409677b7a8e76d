"""The override audit: every audit rule over a composed config, plus what a launch script's reader noticed."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from verl_safe_launch.audit import overrides as audit_overrides
from verl_safe_launch.audit import values as audit_values
from verl_safe_launch.audit.settle import settle_command
from verl_safe_launch.audit.table import AuditContext
from verl_safe_launch.compose import Composed
from verl_safe_launch.findings import Finding, Rule, Severity, run_table
from verl_safe_launch.inputs import verl_release
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.shell import ScriptLaunch, ScriptNote

AUDIT_RULES: tuple[Rule[AuditContext], ...] = (*audit_overrides.RULES, *audit_values.RULES)


def audit(composed: Composed, rules: Iterable[Rule[AuditContext]] | None = None) -> list[Finding]:
    """Run every audit rule (all of them, never first-failure-only) and return all findings."""
    table = AUDIT_RULES if rules is None else rules
    return run_table(table, AuditContext.build(composed), verl_release().has)


def script_findings(launch: ScriptLaunch) -> list[Finding]:
    """Findings about the script itself: passthrough, values it cannot resolve, defaults from the environment."""
    findings = [
        _note_finding(launch, note) for note in launch.notes if note.kind not in ("env-default", "machine")
    ]
    defaults = [n for n in launch.notes if n.kind == "env-default"]
    if defaults:
        findings.append(_env_defaults(launch, defaults))
    if launch.passthrough is not None:
        findings.append(_passthrough(launch))
    return findings


_NOTE_RULES: dict[str, tuple[str, Severity, str]] = {
    "unresolved": ("script-unresolved", Severity.INFO, "not audited: {raw} depends on {detail}"),
    "maybe": (
        "script-unresolved",
        Severity.INFO,
        "not audited: {raw} is passed only on some paths: {detail}",
    ),
    "hydra-option": ("script-hydra-option", Severity.INFO, "not audited: {raw} is a {detail}"),
    "config": ("script-config", Severity.INFO, "not audited: {raw}: {detail}"),
    "config-missing": ("script-config", Severity.ERROR, "{raw}: {detail}"),
    "config-path": ("script-config", Severity.INFO, "{raw}: {detail}"),
    "conditional": ("script-conditional", Severity.INFO, "line {line}: {detail}; it is audited as written"),
    "sourced": ("script-sourced", Severity.INFO, "line {line} runs {raw}; {detail}"),
    "crlf": ("script-crlf", Severity.ERROR, "{detail} (first at line {line})"),
    "deprecated-config": (
        "deprecated-alias",
        Severity.WARNING,
        "{raw} selects verl's deprecated ppo_megatron_trainer config; it means {detail}",
    ),
}


def _note_finding(launch: ScriptLaunch, note: ScriptNote) -> Finding:
    rule_id, severity, template = _NOTE_RULES.get(
        note.kind, ("script-note", Severity.INFO, "{raw}: {detail}")
    )
    message = template.format(raw=note.raw, detail=note.detail, line=note.line)
    source = Source(Layer.SCRIPT, launch.path, note.line, raw=note.raw)
    key, eq, value = note.raw.lstrip("+~").partition("=")
    shown = value if eq else note.raw
    return Finding(rule_id, severity, (key,), message, _note_fix(launch, note), ((key, shown, source),))


def _note_fix(launch: ScriptLaunch, note: ScriptNote) -> str:
    if note.kind == "deprecated-config":
        return f"replace --config-path/--config-name with the override {note.detail}"
    if note.kind == "config-missing":
        return "name a config file that exists (--config-path DIR --config-name NAME, NAME.yaml in DIR)"
    if note.kind == "crlf":
        return f"convert it to Unix line endings: sed -i 's/\\r$//' {shlex.quote(launch.path)}"
    if note.kind in ("unresolved", "maybe"):
        return f"audit it with the value the run gets: {settle_command(launch, (note,))}"
    return "nothing to do"


def _env_defaults(launch: ScriptLaunch, notes: list[ScriptNote]) -> Finding:
    names = ", ".join(n.detail.split(" ", 1)[0] for n in notes)
    message = f"values from ${{NAME:-default}} are audited with the script's defaults; the environment can change them ({names})"
    sources = tuple(
        (
            n.raw.partition("=")[0],
            n.raw.partition("=")[2],
            Source(Layer.SCRIPT, launch.path, n.line, raw=n.raw),
        )
        for n in notes
    )
    fix = "export the variables to audit other values, or pass the overrides after '--'"
    return Finding("script-env-default", Severity.INFO, tuple(s[0] for s in sources), message, fix, sources)


def _passthrough(launch: ScriptLaunch) -> Finding:
    assert launch.passthrough is not None
    pt = launch.passthrough
    message = (
        f"{launch.path}:{pt.line} passes the script's own arguments to verl ({pt.raw}); "
        "they come after the script's overrides and win over them"
    )
    source = Source(Layer.SCRIPT, launch.path, pt.line, raw=pt.raw)
    fix = f"audit them with the script: verl-safe-launch audit {shlex.quote(launch.path)} -- KEY=VALUE ..."
    return Finding("script-passthrough", Severity.INFO, ("$@",), message, fix, (("$@", pt.raw, source),))


__all__ = ["AUDIT_RULES", "audit", "script_findings"]
