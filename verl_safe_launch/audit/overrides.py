"""Override hygiene rules: repeated keys, silently replaced values, unknown and newly created keys."""

from __future__ import annotations

import itertools
import shlex
from dataclasses import replace

from verl_safe_launch.audit.aliases import covered
from verl_safe_launch.audit.history import last_release_with
from verl_safe_launch.audit.lookalike import code_points, lookalike
from verl_safe_launch.audit.table import SCHEMA, AuditContext, audit_rule, finding, position, short
from verl_safe_launch.audit.upgrade import current_key, moves_after
from verl_safe_launch.compose import Composed, Rejected, config_groups
from verl_safe_launch.config_view import format_value
from verl_safe_launch.findings import Finding, Rule, Severity
from verl_safe_launch.inputs import (
    OverrideToken,
    dataclass_field_names,
    did_you_mean,
    names_read_with_get,
    verl_release,
)
from verl_safe_launch.provenance import LAYER_TITLES, Layer, Source, Write

_USER_LAYERS = (Layer.FILE, Layer.SCRIPT, Layer.CLI)
_SEVERITY_BY_PAIR = {
    (Layer.FILE, Layer.SCRIPT): Severity.WARNING,
    (Layer.FILE, Layer.FILE): Severity.WARNING,
}
"""A file's value silently beaten: by a script that hard-codes the key, or by a later file of the same layer.
A command-line value replacing a file's is an intended override (info): that is how fixes are applied."""


def _group(source: Source) -> tuple[Layer, str | None]:
    """Writes in one group come from one layer and (for files and scripts) one file."""
    return source.layer, source.file if source.layer is not Layer.CLI else None


def _where(source: Source) -> str:
    if source.layer is Layer.CLI:
        return "the command line"
    title = "script" if source.layer is Layer.SCRIPT else "file"
    return f"{title} {source.file}"


@audit_rule("duplicate-key", "the same key set more than once in one layer (Hydra keeps the last silently)")
def duplicate_keys(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for key, writes in [*ctx.explicit.items(), *_group_writes(ctx).items()]:
        groups: dict[tuple[Layer, str | None], list[Write]] = {}
        for write in writes:
            if write.source.layer in _USER_LAYERS:
                groups.setdefault(_group(write.source), []).append(write)
        findings.extend(_duplicate(key, group) for group in groups.values() if len(group) > 1)
    return findings


def _group_writes(ctx: AuditContext) -> dict[str, list[Write]]:
    """Config group choices (``model_engine=megatron``) as writes, so repeats of them are caught too."""
    groups = config_groups()
    out: dict[str, list[Write]] = {}
    for token in ctx.composed.verl_overrides:
        key, sep, value = token.text.partition("=")
        if sep and key in groups:
            out.setdefault(key, []).append(Write(key, value, token.source))
    return out


def _duplicate(key: str, writes: list[Write]) -> Finding:
    last = writes[-1]
    where = _where(last.source)
    steps = ", then ".join(f"{format_value(w.value)} ({position(w.source)})" for w in writes)
    earlier = " and ".join(position(w.source) for w in writes[:-1])
    if all(w.value == last.value for w in writes):
        message = f"{key} is set {len(writes)} times in {where}, each time to {format_value(last.value)} ({_positions(writes)})"
        return finding(
            "duplicate-key", Severity.INFO, (key,), message, f"delete the repeat on {earlier}", writes
        )
    message = f"{key} is set {len(writes)} times in {where}: {steps}; Hydra silently keeps the last, {format_value(last.value)}"
    fix = f"keep one: {key}={format_value(last.value)} (delete {earlier})"
    if len(writes) == 2:
        fix += f", or {key}={format_value(writes[0].value)} (delete {position(last.source)})"
    return finding("duplicate-key", Severity.WARNING, (key,), message, fix, writes)


def _positions(writes: list[Write]) -> str:
    return ", ".join(position(w.source) for w in writes)


@audit_rule(
    "shadowed-value",
    "a user file's value silently replaced by a script or a later file (a command line or preset value: info)",
)
def shadowed_values(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for key, writes in ctx.explicit.items():
        for old, new in itertools.pairwise(writes):
            if _group(old.source) == _group(new.source) or old.value == new.value or new.delete:
                continue
            pair = (old.source.layer, new.source.layer)
            if pair in _SEVERITY_BY_PAIR:
                findings.append(_shadowed(key, old, new, _SEVERITY_BY_PAIR[pair]))
            elif old.source.layer in (Layer.PRESET, Layer.FILE) and new.source.layer in _USER_LAYERS:
                findings.append(_intended(key, old, new))
    return findings


def _shadowed(key: str, old: Write, new: Write, severity: Severity) -> Finding:
    title = LAYER_TITLES[new.source.layer]
    message = (
        f"{key} is {format_value(old.value)} in {short(old.source)} but {format_value(new.value)} on {short(new.source)}; "
        f"the {title} wins, so the run uses {format_value(new.value)}"
    )
    fix = (
        f"keep one: set {key}: {format_value(new.value)} in {short(old.source)} and drop the override, "
        f"or drop the override to keep {format_value(old.value)}"
    )
    return finding("shadowed-value", severity, (key,), message, fix, [old, new])


def _intended(key: str, old: Write, new: Write) -> Finding:
    """A preset's value replaced by the user, or a file's by the command line: intended, said as info."""
    message = f"{key}: {format_value(new.value)} from {short(new.source)} replaces {format_value(old.value)} from {short(old.source)}"
    whose = "the preset's" if old.source.layer is Layer.PRESET else "the file's"
    fix = f"nothing to do if intended; drop {short(new.source)} to keep {whose} {format_value(old.value)}"
    return finding("shadowed-value", Severity.INFO, (key,), message, fix, [old, new])


@audit_rule("script-passthrough", "an argument passed through a script's \"$@\" replacing the script's value")
def passthrough_overrides(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for key, writes in ctx.explicit.items():
        for old, new in itertools.pairwise(writes):
            if old.source.layer is Layer.SCRIPT and new.source.layer is Layer.CLI and old.value != new.value:
                message = (
                    f"{key}={format_value(new.value)} passed to the script ({short(new.source)}) replaces the script's "
                    f'{format_value(old.value)} ({short(old.source)}), as "$@" intends'
                )
                fix = f"nothing to do; drop the argument to keep {format_value(old.value)}"
                findings.append(
                    finding("script-passthrough", Severity.INFO, (key,), message, fix, [old, new])
                )
    return findings


@audit_rule("unknown-key", "an override of a key verl's config does not have (Hydra refuses it)")
def unknown_keys(ctx: AuditContext) -> list[Finding]:
    return [_rejected(ctx, r) for r in ctx.composed.rejected]


def refused_whatever_the_value(
    composed: Composed, written: dict[tuple[int | None, str], str]
) -> list[Finding]:
    """Overrides whose value was not read (``key=$X``) but whose key Hydra refuses anyway.

    ``composed`` holds each of them as ``key=null`` (its source's line and raw text: ``written``, the key
    mapped to the override as written); the refusal does not depend on the value.
    """
    ctx = AuditContext.build(composed)
    out: list[Finding] = []
    for rejected in composed.rejected:
        source = rejected.token.source
        shown = written.get((source.line, source.raw or ""))
        if shown is None:
            continue
        token = replace(rejected.token, text=shown)
        found = _rejected(ctx, replace(rejected, token=token))
        out.append(replace(found, message=f"{found.message}, whatever the value"))
    return out


def _rejected(ctx: AuditContext, rejected: Rejected) -> Finding:
    token, key = rejected.token, rejected.key
    value = token.text.partition("=")[2]
    write = Write(key, value, token.source)
    if rejected.reason.startswith("Could not append"):
        message = f"'{token.text}' cannot add {key}: verl's config already has it, so Hydra refuses the '+'"
        return finding("unknown-key", Severity.ERROR, (key,), message, token.text.lstrip("+"), [write])
    info = ctx.facts.dc_only.get(key)
    if info is not None:
        message = (
            f"{key} is a field of {info.owner} that verl's YAML does not list, so Hydra refuses '{token.text}' "
            "without '+'"
        )
        return finding("unknown-key", Severity.ERROR, (key,), message, f"+{token.text}", [write])
    message = (
        f"unknown key {key}: {verl_release().name}'s config has no such key, so Hydra refuses '{token.text}'"
    )
    older = _older_release(key, value, token)
    if older is not None:
        return finding("unknown-key", Severity.ERROR, (key,), message + older[0], older[1], [write])
    return finding("unknown-key", Severity.ERROR, (key,), message, _suggest(ctx, key, value), [write])


def _older_release(key: str, value: str, token: OverrideToken) -> tuple[str, str] | None:
    """For a key of an older verl release: where the message says it comes from, and the upgrade as the fix."""
    release = last_release_with(key)
    if release is None:
        return None
    moved = current_key(key, moves_after(release))
    command = "verl-safe-launch upgrade " + (shlex.quote(token.source.file) if token.source.file else "FILE")
    where = f" (it is a key of verl {release}, the last release that had it)"
    if moved != key:
        return (
            where,
            f"{moved}={value} (moved after verl {release}); or upgrade the whole launch: {command} -o DIR",
        )
    return (
        where,
        f"remove it (verl dropped it after {release}); or upgrade the whole launch: {command} -o DIR",
    )


def _suggest(ctx: AuditContext, key: str, value: str) -> str:
    close = did_you_mean(key, [*ctx.facts.defaults, *ctx.facts.dc_only])
    if close:
        prefix = "+" if close in ctx.facts.dc_only else ""
        return f"did you mean {close}? {prefix}{close}={value}"
    return f"remove it, or create it with ++{key}={value} if your own code reads it"


@audit_rule(
    "lookalike-key",
    "a key with invisible or look-alike characters that reads as one of verl's keys (the run keeps verl's value)",
    needs=SCHEMA,
)
def lookalike_keys(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for write in ctx.user_writes():
        key = write.key
        target = _posing_as(ctx, key)
        if target is None:
            continue
        message = (
            f"{key} prints like {target} but holds {', '.join(code_points(key))}, so Hydra adds it as a new key "
            f"that nothing reads and {target} keeps its value"
        )
        fix = f"{target}={format_value(write.value)}"
        findings.append(finding("lookalike-key", Severity.ERROR, (key,), message, fix, [write]))
    return findings


def _posing_as(ctx: AuditContext, key: str) -> str | None:
    """The real key ``key`` is drawn like, when ``key`` itself is not one."""
    if ctx.facts.known(key):
        return None
    target = lookalike(key)
    return target if target is not None and ctx.facts.known(target) else None


@audit_rule(
    "new-key",
    "'+'/'++' (or a user file) creating a key that verl's config and dataclasses lack",
    needs=SCHEMA,
)
def new_keys(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for write in ctx.user_writes():
        key = write.key
        if ctx.facts.known(key) or ctx.facts.free_form_parent(key) or covered(key):
            continue
        if _posing_as(ctx, key) is not None:
            continue  # lookalike-key says what it is
        parent, _, leaf = key.rpartition(".")
        backing = ctx.facts.backing_class(parent)
        if backing is not None:
            findings.append(_not_a_field(key, leaf, backing, write))
            continue
        if leaf in names_read_with_get():
            message = (
                f"{key} is not in {verl_release().name}'s config; verl's code reads a key named '{leaf}' with .get(), "
                "so check that it reads it at this path"
            )
            findings.append(
                finding("new-key", Severity.INFO, (key,), message, "nothing to do if intended", [write])
            )
            continue
        message = (
            f"{key} is neither in {verl_release().name}'s config nor a field of its config dataclasses, "
            "so nothing in verl reads it"
        )
        close = did_you_mean(key, [*ctx.facts.defaults, *ctx.facts.dc_only])
        fix = (
            f"did you mean {close}? {close}={format_value(write.value)}"
            if close
            else f"remove {key} (nothing reads it)"
        )
        findings.append(finding("new-key", Severity.WARNING, (key,), message, fix, [write]))
    return findings


BUILT_BY_VALIDATE = ("actor_rollout_ref.actor", "critic")
"""Sections verl's ``validate_config`` turns into dataclasses (every node below them too)."""


def _not_a_field(key: str, leaf: str, target: str, write: Write) -> Finding:
    owner = target.rpartition(".")[2]
    early = any(key.startswith(section + ".") for section in BUILT_BY_VALIDATE)
    name = verl_release().name
    when = f"{name}'s validate_config fails" if early else f"{name} fails if a worker builds this config"
    message = (
        f"{key}: {owner} has no field '{leaf}', so {when}: "
        f"{owner}.__init__() got an unexpected keyword argument '{leaf}'"
    )
    severity = Severity.ERROR if early else Severity.WARNING
    close = did_you_mean(key, [key.rpartition(".")[0] + "." + name for name in dataclass_field_names(target)])
    fix = f"did you mean {close}? {close}={format_value(write.value)}" if close else f"remove {key}"
    return finding("new-key", severity, (key,), message, fix, [write])


@audit_rule(
    "dataclass-field", "'+key' adding a config-dataclass field that verl's YAML does not list (allowed)"
)
def dataclass_fields(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for write in ctx.user_writes():
        info = ctx.facts.dc_only.get(write.key)
        if info is None or covered(write.key):
            continue
        default = f", default {info.default}" if info.default is not None else ""
        message = (
            f"{write.key} is a field of {info.owner} ({info.text}{default}) that verl's YAML does not "
            "list; adding it with '+' is allowed and verl passes it to the dataclass"
        )
        findings.append(
            finding("dataclass-field", Severity.INFO, (write.key,), message, "nothing to do", [write])
        )
    return findings


RULES: tuple[Rule[AuditContext], ...] = (
    duplicate_keys,
    shadowed_values,
    passthrough_overrides,
    unknown_keys,
    lookalike_keys,
    new_keys,
    dataclass_fields,
)
