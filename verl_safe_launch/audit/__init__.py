"""The override audit: repeated, shadowed, unknown, deprecated and mistyped keys; script migration."""

from __future__ import annotations

from verl_safe_launch.audit.aliases import ALIASES, IGNORED, covered, yaml_deprecations
from verl_safe_launch.audit.defaults import NEW_DEFAULTS, default_changes, installed_defaults
from verl_safe_launch.audit.detect import Detection, Evidence, detect, evidence_of
from verl_safe_launch.audit.history import (
    INSTALLED_SERIES,
    RELEASES,
    TAGS,
    Move,
    flatten_release_yaml,
    generate_moves,
    generated_moves,
    history,
    history_json,
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
from verl_safe_launch.audit.older import group_older_keys
from verl_safe_launch.audit.overrides import refused_whatever_the_value
from verl_safe_launch.audit.parallel import ACTOR_SP, CRITIC_SP, GPUS_KEYS, REF_SP, Layout, read_layout
from verl_safe_launch.audit.project import (
    GROUP_ESTIMATORS,
    group_estimators,
    lone_group,
    project_changes,
    project_keys,
)
from verl_safe_launch.audit.run import AUDIT_RULES, audit, script_findings
from verl_safe_launch.audit.table import AuditContext
from verl_safe_launch.audit.upgrade import (
    HAND_MOVES,
    Change,
    Upgrade,
    current_key,
    moves_after,
    override_value,
    plan_upgrade,
    token_key,
)
from verl_safe_launch.audit.values import STRATEGY_KEYS
from verl_safe_launch.audit.verify import (
    CANNOT_VERIFY,
    Unread,
    deciding_parts,
    depends_on,
    qualify,
)
from verl_safe_launch.audit.worlds import Reading, across_worlds

__all__ = [
    "ACTOR_SP",
    "ALIASES",
    "AUDIT_RULES",
    "CANNOT_VERIFY",
    "CRITIC_SP",
    "GPUS_KEYS",
    "GROUP_ESTIMATORS",
    "HAND_MOVES",
    "IGNORED",
    "INSTALLED_SERIES",
    "NEW_DEFAULTS",
    "REF_SP",
    "RELEASES",
    "STRATEGY_KEYS",
    "TAGS",
    "AuditContext",
    "Change",
    "Detection",
    "Evidence",
    "Layout",
    "Migration",
    "Move",
    "Reading",
    "Unread",
    "Upgrade",
    "across_worlds",
    "audit",
    "check_command",
    "command_line",
    "covered",
    "current_key",
    "deciding_parts",
    "default_changes",
    "depends_on",
    "detect",
    "evidence_of",
    "flatten_release_yaml",
    "generate_moves",
    "generated_moves",
    "group_estimators",
    "group_older_keys",
    "history",
    "history_json",
    "hydra_literal",
    "installed_defaults",
    "last_release_with",
    "lone_group",
    "moves_after",
    "moves_json",
    "override_value",
    "plan_migration",
    "plan_upgrade",
    "project_changes",
    "project_keys",
    "qualify",
    "read_layout",
    "refused_whatever_the_value",
    "render_yaml",
    "script_findings",
    "token_key",
    "version",
    "yaml_deprecations",
]
