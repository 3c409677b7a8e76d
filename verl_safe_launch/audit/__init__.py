"""The override audit: repeated, shadowed, unknown, deprecated and mistyped keys; script migration."""

from __future__ import annotations

from verl_safe_launch.audit.aliases import ALIASES, IGNORED, covered, yaml_deprecations
from verl_safe_launch.audit.migrate import Migration, command_line, plan_migration, render_yaml
from verl_safe_launch.audit.run import AUDIT_RULES, audit, script_findings

__all__ = [
    "ALIASES",
    "AUDIT_RULES",
    "IGNORED",
    "Migration",
    "audit",
    "command_line",
    "covered",
    "plan_migration",
    "render_yaml",
    "script_findings",
    "yaml_deprecations",
]
