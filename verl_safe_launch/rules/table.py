"""The batch and layout rules' registration: small pure functions over the rule context, each a ``Rule``."""

from __future__ import annotations

from collections.abc import Callable

from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Finding, Rule, Severity

RuleFn = Callable[[RuleContext], list[Finding]]


def rule(
    rule_id: str, description: str, severity: Severity = Severity.ERROR, needs: tuple[str, ...] = ()
) -> Callable[[RuleFn], Rule[RuleContext]]:
    """Make a rule of a function returning findings (the module lists it in its ``RULES`` tuple)."""

    def make(fn: RuleFn) -> Rule[RuleContext]:
        return Rule(rule_id, description, severity, fn, needs)

    return make
