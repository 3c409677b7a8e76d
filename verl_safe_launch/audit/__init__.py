"""The override audit: repeated, shadowed, unknown, deprecated and mistyped keys; script migration."""

from __future__ import annotations

from verl_safe_launch.audit.aliases import ALIASES, IGNORED, covered, yaml_deprecations
from verl_safe_launch.audit.history import (
    INSTALLED_SERIES,
    RELEASES,
    Move,
    generate_moves,
    generated_moves,
    history,
    last_release_with,
    moves_json,
    version,
)
from verl_safe_launch.audit.migrate import (
    Migration,
    check_command,
    command_line,
    hydra_literal,
    plan_migration,
    render_yaml,
)
from verl_safe_launch.audit.run import AUDIT_RULES, audit, script_findings
from verl_safe_launch.audit.table import AuditContext
from verl_safe_launch.audit.upgrade import (
    HAND_MOVES,
    Change,
    Upgrade,
    current_key,
    default_changes,
    detect_release,
    installed_defaults,
    moves_after,
    override_value,
    plan_upgrade,
    token_key,
)
from verl_safe_launch.audit.values import STRATEGY_KEYS
from verl_safe_launch.audit.verify import CANNOT_VERIFY, depends_on, qualify, unread_count

__all__ = [
    "ALIASES",
    "AUDIT_RULES",
    "CANNOT_VERIFY",
    "HAND_MOVES",
    "IGNORED",
    "INSTALLED_SERIES",
    "RELEASES",
    "STRATEGY_KEYS",
    "AuditContext",
    "Change",
    "Migration",
    "Move",
    "Upgrade",
    "audit",
    "check_command",
    "command_line",
    "covered",
    "current_key",
    "default_changes",
    "depends_on",
    "detect_release",
    "generate_moves",
    "generated_moves",
    "history",
    "hydra_literal",
    "installed_defaults",
    "last_release_with",
    "moves_after",
    "moves_json",
    "override_value",
    "plan_migration",
    "plan_upgrade",
    "qualify",
    "render_yaml",
    "script_findings",
    "token_key",
    "unread_count",
    "version",
    "yaml_deprecations",
]
