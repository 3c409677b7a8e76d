"""The override audit: repeated, shadowed, unknown, deprecated and mistyped keys; script migration."""

from __future__ import annotations

from verl_safe_launch.audit.aliases import ALIASES, IGNORED, covered, yaml_deprecations
from verl_safe_launch.audit.history import (
    RELEASES,
    Move,
    generate_moves,
    generated_moves,
    history,
    last_release_with,
    moves_json,
    version,
)
from verl_safe_launch.audit.migrate import Migration, command_line, hydra_literal, plan_migration, render_yaml
from verl_safe_launch.audit.run import AUDIT_RULES, audit, script_findings
from verl_safe_launch.audit.table import AuditContext
from verl_safe_launch.audit.upgrade import (
    HAND_MOVES,
    Change,
    Upgrade,
    current_key,
    default_changes,
    detect_release,
    moves_after,
    override_value,
    plan_upgrade,
    token_key,
)

__all__ = [
    "ALIASES",
    "AUDIT_RULES",
    "HAND_MOVES",
    "IGNORED",
    "RELEASES",
    "AuditContext",
    "Change",
    "Migration",
    "Move",
    "Upgrade",
    "audit",
    "command_line",
    "covered",
    "current_key",
    "default_changes",
    "detect_release",
    "generate_moves",
    "generated_moves",
    "history",
    "hydra_literal",
    "last_release_with",
    "moves_after",
    "moves_json",
    "override_value",
    "plan_migration",
    "plan_upgrade",
    "render_yaml",
    "script_findings",
    "token_key",
    "version",
    "yaml_deprecations",
]
