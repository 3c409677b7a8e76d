"""Every batch, layout, mode, rollout, cluster and verl rule, in one table, and running it."""

from __future__ import annotations

from collections.abc import Iterable

from verl_safe_launch.context import RuleContext
from verl_safe_launch.findings import Finding, Rule, run_table
from verl_safe_launch.inputs import verl_release
from verl_safe_launch.rules import (
    batch,
    cluster,
    data,
    engines,
    layout,
    mcore,
    model,
    modes,
    registry,
    reward,
    rollout,
    verl_reads,
    verl_static,
)

RULES: tuple[Rule[RuleContext], ...] = (
    *batch.RULES,
    *cluster.RULES,
    *data.RULES,
    *engines.RULES,
    *layout.RULES,
    *mcore.RULES,
    *model.RULES,
    *modes.RULES,
    *registry.RULES,
    *reward.RULES,
    *rollout.RULES,
    *verl_static.RULES,
    *verl_reads.RULES,
)


def run_rules(ctx: RuleContext, rules: Iterable[Rule[RuleContext]] | None = None) -> list[Finding]:
    """Run every rule (all of them, never first-failure-only) and return all findings."""
    return run_table(RULES if rules is None else rules, ctx, verl_release().has)
