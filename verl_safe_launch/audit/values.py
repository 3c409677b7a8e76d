"""Value rules: deprecated aliases, ignored keys, types and ranges, missing values, engine mismatches."""

from __future__ import annotations

import math
import re
from dataclasses import replace

from verl_safe_launch.audit.aliases import (
    ALIASES,
    CRITIC_BUDGET,
    IGNORED,
    Alias,
    Ignored,
    covered,
    legacy_reward_key,
    matches,
)
from verl_safe_launch.audit.aliases import yaml_deprecations as _yaml_deprecations
from verl_safe_launch.audit.table import PINNED, SCHEMA, AuditContext, audit_rule, finding, short
from verl_safe_launch.config_view import ARR, format_value, is_missing
from verl_safe_launch.findings import Finding, Rule, Severity
from verl_safe_launch.inputs import TypeSpec, verl_release
from verl_safe_launch.provenance import Write

_PER_GPU_ALIASES = frozenset(
    a.old for a in ALIASES if a.new.endswith("micro_batch_size_per_gpu") and a.fix == "{new}={value}"
)
SIZE_LEAF = re.compile(
    r"(^|_)(batch_size(_per_gpu)?|max_token_len(_per_gpu)?|parallel_size|n_gpus_per_node|"
    r"max_prompt_length|max_response_length|ppo_epochs)$"
)
SIZE_KEYS = frozenset({f"{ARR}.rollout.n", "trainer.nnodes"})
FRACTION_LEAVES = frozenset({"gpu_memory_utilization", "top_p"})
BOOL_SPELLINGS = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}
REQUIRED_WHEN = {"reward.reward_model.rollout.name": "reward.reward_model.enable"}
REQUIRED_HINTS = {
    f"{ARR}.rollout.name": "vllm (or sglang, trtllm)",
    "reward.reward_model.rollout.name": "vllm (or sglang)",
}
FSDP_FAMILY = frozenset({"fsdp", "fsdp2", "fsdp_turbo"})
ENGINE_OF_STRATEGY = {"megatron": "megatron", "veomni": "veomni", "torchtitan": "torchtitan"}
STRATEGY_KEYS = (f"{ARR}.actor.strategy", f"{ARR}.ref.strategy", "critic.strategy")


@audit_rule(
    "deprecated-alias", "a deprecated spelling of a key, alone or next to its replacement", needs=PINNED
)
def deprecated_aliases(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for alias in ALIASES:
        old, new = ctx.last(alias.old), ctx.last(alias.new)
        if old is None or old.value is None or old.delete:
            continue
        dynamic = bool(alias.gate) and ctx.view.get(alias.gate) is True
        checked = ctx.role_used(alias.old, validated=new is not None)
        if alias.gate and checked and not dynamic:
            continue  # one root cause, one finding: the verl-*-micro-keys rule reports it
        if new is not None and new.value is not None:
            findings.append(_alias_pair(alias, old, new, dynamic, checked))
        else:
            findings.append(_alias_alone(ctx, alias, old))
    return findings


def _alias_pair(alias: Alias, old: Write, new: Write, dynamic: bool, checked: bool) -> Finding:
    both = (
        f"verl checks the pair only while {alias.gate} is false, so it ignores {alias.old}"
        if dynamic
        else alias.both
    )
    harmless = bool(alias.gate) and (dynamic or not checked)
    if not checked:
        both += " (this run does not use that model, so it stays harmless)"
    message = (
        f"both the deprecated {alias.old}={format_value(old.value)} ({short(old.source)}) and its replacement "
        f"{alias.new}={format_value(new.value)} ({short(new.source)}) are set; {both}"
    )
    fix = f"delete {alias.old} and keep {alias.new}={format_value(new.value)}"
    severity = Severity.WARNING if harmless else Severity.ERROR
    keys = (alias.old, alias.new, *((alias.gate,) if dynamic else ()))
    return finding("deprecated-alias", severity, keys, message, fix, [old, new])


def _alias_alone(ctx: AuditContext, alias: Alias, old: Write) -> Finding:
    severity = alias.alone if ctx.role_used(alias.old) else Severity.WARNING
    unused = "" if ctx.role_used(alias.old) else " (this run does not use that model, so it stays harmless)"
    message = f"{alias.old}={format_value(old.value)} is deprecated: {alias.why}{unused}"
    found = finding(
        "deprecated-alias", severity, (alias.old,), message, _alias_fix(ctx, alias, old.value), [old]
    )
    return replace(found, reads=(alias.new,))  # set, it would be the pair


def _alias_fix(ctx: AuditContext, alias: Alias, value: object) -> str:
    if alias.old in _PER_GPU_ALIASES and isinstance(value, int) and not isinstance(value, bool):
        gpus = _gpus(ctx)
        return f"{alias.new}={max(value // gpus, 1)} (the global {value} over {gpus} GPUs)"
    return alias.fix.format(old=alias.old, new=alias.new, value=format_value(value), budget=CRITIC_BUDGET)


def _gpus(ctx: AuditContext) -> int:
    nodes, per_node = ctx.view.get("trainer.nnodes"), ctx.view.get("trainer.n_gpus_per_node")
    if isinstance(nodes, int) and isinstance(per_node, int) and nodes > 0 and per_node > 0:
        return nodes * per_node
    return 1


@audit_rule("ignored-key", "a key verl 0.9.1 accepts but does not act on", needs=PINNED)
def ignored_keys(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for write in ctx.user_writes():
        for entry in _IGNORED_EXACT.get(write.key, ()) or _ignored_prefixed(write.key):
            if entry.when(write.value, ctx.view):
                findings.append(_ignored(entry, write))
                break
    return findings


_IGNORED_EXACT: dict[str, tuple[Ignored, ...]] = {}
for _entry in IGNORED:
    if not _entry.pattern.endswith(".*"):
        _IGNORED_EXACT[_entry.pattern] = (*_IGNORED_EXACT.get(_entry.pattern, ()), _entry)
_IGNORED_PREFIXED = tuple(e for e in IGNORED if e.pattern.endswith(".*"))


def _ignored_prefixed(key: str) -> tuple[Ignored, ...]:
    return tuple(e for e in _IGNORED_PREFIXED if matches(e.pattern, key))


def _ignored(entry: Ignored, write: Write) -> Finding:
    verb = "is not supported by" if entry.severity is Severity.ERROR else "has no effect in"
    message = f"{write.key}={format_value(write.value)} {verb} verl 0.9.1: {entry.why}"
    fix = entry.fix.format(
        value=format_value(write.value), new=legacy_reward_key(write.key), budget=CRITIC_BUDGET
    )
    return finding("ignored-key", entry.severity, (write.key,), message, fix, [write])


@audit_rule("deprecated-key", "a key verl's own YAML marks deprecated (not covered by the alias table)")
def deprecated_keys(ctx: AuditContext) -> list[Finding]:
    marked = _yaml_deprecations(ctx.composed.writes)
    findings: list[Finding] = []
    for write in ctx.user_writes():
        comment = marked.get(write.key)
        if comment is None or covered(write.key) or write.value == ctx.facts.defaults.get(write.key):
            continue
        use = re.search(r"\b[Uu]se ([a-z_]+\.[\w.]*\w)", comment)
        default = format_value(ctx.facts.defaults.get(write.key))
        fix = (
            f"use {use.group(1)} instead" if use else f"remove it, or {write.key}={default} (verl's default)"
        )
        message = (
            f'{write.key}={format_value(write.value)}: verl\'s own config marks it deprecated ("{comment}")'
        )
        findings.append(finding("deprecated-key", Severity.WARNING, (write.key,), message, fix, [write]))
    return findings


@audit_rule("type-mismatch", "a value of the wrong type for the key (verl itself checks none)", needs=SCHEMA)
def type_mismatches(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for write in ctx.user_writes():
        spec = ctx.facts.types.get(write.key)
        value = _checked_value(ctx, write)
        resolved = value is not write.value
        if spec is None or _skip_value(value, spec) or _bool_string(value, spec):
            continue
        if write.value is None and _null_allowed(ctx, write.key):
            continue
        if resolved and _number_text(value, spec):
            continue
        severity = _type_problem(value, spec)
        if severity is not None:
            got = _describe(value)
            if resolved:
                got += f", from {write.value}"
            message = f"{write.key} expects {_expected(spec)} ({spec.origin}), got {got}"
            fix = f"{write.key}={_example(ctx, write, spec)}"
            findings.append(finding("type-mismatch", severity, (write.key,), message, fix, [write]))
    return findings


def _checked_value(ctx: AuditContext, write: Write) -> object:
    """The value verl reads: an interpolation that decides the key's value is checked resolved (``${oc.env:X}``)."""
    if not (isinstance(write.value, str) and "${" in write.value):
        return write.value
    prov = ctx.view.prov(write.key)
    if prov is None or prov.source != write.source or prov.interpolation != write.value:
        return write.value
    return prov.value


def _number_text(value: object, spec: TypeSpec) -> bool:
    """An interpolation that resolves to the text of a number (``oc.env`` returns text): OmegaConf converts it."""
    if spec.kind not in ("int", "float") or not isinstance(value, str):
        return False
    try:
        number = float(value)
    except ValueError:
        return False
    return math.isfinite(number) and (spec.kind == "float" or number.is_integer())


NULL_WHEN = {f"{ARR}.rollout.expert_parallel_size": (f"{ARR}.rollout.name", "trtllm")}
"""Keys whose type allows null only when another key has a value (verl 0.9.1's RolloutConfig.__post_init__ turns
the trtllm expert parallel size 1 into None, "unspecified", and TensorRT-LLM accepts None)."""


def _null_allowed(ctx: AuditContext, key: str) -> bool:
    other = NULL_WHEN.get(key)
    return other is not None and ctx.view.get(other[0]) == other[1]


def _skip_value(value: object, spec: TypeSpec) -> bool:
    if value is None:
        return spec.optional or spec.origin == "verl's default"
    return isinstance(value, str) and ("${" in value or is_missing(value))


MAX_INT64 = 2**63 - 1
"""The largest integer torch and verl's arithmetic hold; a larger one overflows."""


def _type_problem(value: object, spec: TypeSpec) -> Severity | None:
    """None when the value fits the expected kind, else how bad the mismatch is."""
    if spec.kind == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return None if abs(value) <= MAX_INT64 else Severity.ERROR
        if isinstance(value, bool) and spec.origin == "verl's default":
            return Severity.WARNING  # no dataclass types it: Python takes a bool as 0 or 1
        lenient = (
            isinstance(value, float)
            and math.isfinite(value)
            and not value.is_integer()
            and spec.origin == "verl's default"
        )
        return Severity.WARNING if lenient else Severity.ERROR
    if spec.kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
        return None if ok else Severity.ERROR
    if spec.kind == "bool":
        if isinstance(value, bool):
            return None
        return Severity.WARNING if isinstance(value, int) and value in (0, 1) else Severity.ERROR
    if spec.kind == "list":
        return None if isinstance(value, list) else Severity.WARNING
    return None


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{format_value(value)} (a boolean)"
    if isinstance(value, float):
        return f"{value} (a float)"
    if isinstance(value, str):
        return f"'{value}' (a string)"
    if isinstance(value, list | dict):
        return f"{format_value(value)} (a {'list' if isinstance(value, list) else 'mapping'})"
    return f"{value} (an integer)"


def _expected(spec: TypeSpec) -> str:
    names = {"int": "an integer", "float": "a number", "bool": "true or false", "list": "a list"}
    return names[spec.kind] + (" or null" if spec.optional else "")


def _example(ctx: AuditContext, write: Write, spec: TypeSpec) -> str:
    value = write.value
    if spec.kind == "int" and isinstance(value, float) and value.is_integer():
        return str(int(value))
    if spec.kind in ("int", "float") and isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None:
            return str(int(number)) if spec.kind == "int" and number.is_integer() else str(number)
    default = ctx.facts.defaults.get(write.key)
    return f"{format_value(default)} (verl's default)" if default is not None else f"<{_expected(spec)}>"


def _bool_string(value: object, spec: TypeSpec) -> bool:
    return spec.kind == "bool" and isinstance(value, str) and value.strip().lower() in BOOL_SPELLINGS


@audit_rule("bool-as-string", "a boolean key given a quoted string ('false' is truthy in Python)")
def bool_strings(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for write in ctx.user_writes():
        spec = ctx.facts.types.get(write.key)
        if spec is None or not _bool_string(write.value, spec):
            continue
        meant = BOOL_SPELLINGS[str(write.value).strip().lower()]
        message = (
            f"{write.key} expects true or false, got the string '{write.value}'; any non-empty string is true "
            "in Python, so verl would read it as true"
        )
        fix = f"{write.key}={format_value(meant)} (without quotes)"
        findings.append(finding("bool-as-string", Severity.ERROR, (write.key,), message, fix, [write]))
    return findings


@audit_rule("value-range", "sizes below 1 and fractions outside (0, 1]")
def value_ranges(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    for write in ctx.user_writes():
        value, key = write.value, write.key
        if not isinstance(value, int | float) or isinstance(value, bool):
            continue
        leaf = key.rpartition(".")[2]
        if leaf in FRACTION_LEAVES and not 0 < value <= 1:
            message = f"{key}={value} must be a fraction in (0, 1]"
            fix = f"{key}={_fraction_default(ctx, key)}"
            findings.append(finding("value-range", Severity.ERROR, (key,), message, fix, [write]))
        elif _is_size(ctx, key, leaf) and value < 1:
            default = ctx.facts.defaults.get(key)
            good = default if isinstance(default, int) and default >= 1 else 1
            message = f"{key}={value} must be at least 1"
            findings.append(finding("value-range", Severity.ERROR, (key,), message, f"{key}={good}", [write]))
    return findings


def _is_size(ctx: AuditContext, key: str, leaf: str) -> bool:
    if key not in SIZE_KEYS and not SIZE_LEAF.search(leaf):
        return False
    default = ctx.facts.defaults.get(key)
    return not (isinstance(default, int | float) and not isinstance(default, bool) and default < 1)


def _fraction_default(ctx: AuditContext, key: str) -> str:
    default = ctx.facts.defaults.get(key)
    return format_value(default) if isinstance(default, float) and 0 < default <= 1 else "0.5"


@audit_rule("missing-required", "a mandatory key ('???') nobody set")
def missing_required(ctx: AuditContext) -> list[Finding]:
    findings: list[Finding] = []
    candidates = [*ctx.facts.mandatory, *(w.key for w in ctx.user_writes() if is_missing(w.value))]
    for key in dict.fromkeys(candidates):
        value = ctx.view.get(key)
        if not is_missing(value):
            continue
        gate = REQUIRED_WHEN.get(key)
        if (gate is not None and not ctx.view.get(gate)) or _switched_off(ctx, key):
            continue
        message = (
            f"{key} has no value: {verl_release().name} leaves it mandatory ('???') and fails when it is read"
        )
        fix = f"{key}={REQUIRED_HINTS.get(key, '<value>')}"
        prov = ctx.view.prov(key)
        writes = [Write(key, value, prov.source)] if prov else []
        findings.append(finding("missing-required", Severity.ERROR, (key,), message, fix, writes))
    return findings


OFF_SWITCHES = {"rollout": "use_reward_loop"}
"""Sections a sibling switch turns off besides ``enable``: a reward model's ``rollout`` under ``use_reward_loop:
false`` (releases that have the switch), where the legacy reward-model worker scores and never reads it."""


def _switched_off(ctx: AuditContext, key: str) -> bool:
    """True when a section above ``key`` has ``enable: false``, or a sibling switch (``OFF_SWITCHES``) that turns
    it off is false: verl reads nothing below it."""
    parts = key.split(".")
    for cut in range(1, len(parts)):
        above = parts[:cut]
        if ctx.view.get(".".join([*above, "enable"])) is False:
            return True
        switch = OFF_SWITCHES.get(above[-1])
        if switch and ctx.view.get(".".join([*above[:-1], switch])) is False:
            return True
    return False


@audit_rule("engine-mismatch", "a strategy that needs another model_engine than the one composed")
def engine_mismatches(ctx: AuditContext) -> list[Finding]:
    engine = ctx.view.get("model_engine")
    findings: list[Finding] = []
    for key in STRATEGY_KEYS:
        write = ctx.last(key)
        native = ctx.facts.defaults.get(key)
        if write is None or not isinstance(write.value, str) or not isinstance(native, str):
            continue
        value = write.value
        if value == native or (native in FSDP_FAMILY and value in FSDP_FAMILY) or "${" in native + value:
            continue
        needed = ENGINE_OF_STRATEGY.get(value, "dp")
        failure = (
            "inside validate_config (ConfigAttributeError: Key 'megatron' is not in struct)"
            if value == "megatron"
            else "when it builds the workers"
        )
        message = (
            f"{key}={value} needs model_engine={needed}, but this run composes model_engine={engine}, whose "
            f"config has no {value} settings; {verl_release().name} fails {failure}"
        )
        fix = f"model_engine={needed} (it sets {key} itself; drop {key}={value})"
        findings.append(
            finding("engine-mismatch", Severity.ERROR, (key, "model_engine"), message, fix, [write])
        )
    return findings


RULES: tuple[Rule[AuditContext], ...] = (
    deprecated_aliases,
    ignored_keys,
    deprecated_keys,
    type_mismatches,
    bool_strings,
    value_ranges,
    missing_required,
    engine_mismatches,
)
