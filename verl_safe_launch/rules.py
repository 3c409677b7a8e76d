"""The rule table: small pure functions over a read-only config view, each returning findings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from verl_safe_launch.architecture import Architecture
from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.findings import Finding, Severity


@dataclass(frozen=True)
class HardwareFacts:
    """What the pre-flight knows about the machines (None where unknown)."""

    nodes: int | None = None
    gpus_per_node: int | None = None
    gpu_memory_gb: float | None = None
    gpu_name: str | None = None


@dataclass(frozen=True)
class RuleContext:
    """Everything a rule may read: the config view, the model architectures (if known) and the hardware."""

    view: ConfigView
    actor_arch: Architecture | None = None
    critic_arch: Architecture | None = None
    hardware: HardwareFacts = field(default_factory=HardwareFacts)


RuleFn = Callable[[RuleContext], list[Finding]]


@dataclass(frozen=True)
class Rule:
    """One registered rule: id, one-line description, default severity and the check."""

    rule_id: str
    description: str
    severity: Severity
    check: RuleFn


RULES: list[Rule] = []


def rule(rule_id: str, description: str, severity: Severity = Severity.ERROR) -> Callable[[RuleFn], RuleFn]:
    """Register a rule function in the table."""

    def register(fn: RuleFn) -> RuleFn:
        RULES.append(Rule(rule_id, description, severity, fn))
        return fn

    return register


def run_rules(ctx: RuleContext, rules: list[Rule] | None = None) -> list[Finding]:
    """Run every rule (all of them, never first-failure-only) and return all findings."""
    from verl_safe_launch import rules_catalog  # noqa: F401  (registers the rule modules)

    findings: list[Finding] = []
    for entry in RULES if rules is None else rules:
        findings.extend(entry.check(ctx))
    return findings
