"""The override audit: repeated, shadowed, unknown, deprecated and mistyped keys; script migration."""

from __future__ import annotations

from verl_safe_launch.audit.aliases import ALIASES, IGNORED, covered, yaml_deprecations
from verl_safe_launch.audit.migrate import Migration, command_line, plan_migration, render_yaml
from verl_safe_launch.audit.run import AUDIT_RULES, audit, script_findings
from verl_safe_launch.audit.values import STRATEGY_KEYS
from verl_safe_launch.audit.verify import CANNOT_VERIFY, depends_on, qualify, unread_count

__all__ = [
    "ALIASES",
    "AUDIT_RULES",
    "CANNOT_VERIFY",
    "IGNORED",
    "STRATEGY_KEYS",
    "Migration",
    "audit",
    "command_line",
    "covered",
    "depends_on",
    "plan_migration",
    "qualify",
    "render_yaml",
    "script_findings",
    "unread_count",
    "yaml_deprecations",
]
