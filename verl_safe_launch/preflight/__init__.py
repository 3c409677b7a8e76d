"""The pre-flight pipeline: composed config → audit → presets → rules → memory, every finding at once."""

from __future__ import annotations

from verl_safe_launch.preflight.advice import AdviceJudge, verify_advice, verl_validation
from verl_safe_launch.preflight.baseline import Baseline, BaselineWriter, finding_key, script_key
from verl_safe_launch.preflight.catalog import Catalogued, catalogued, rule_catalog
from verl_safe_launch.preflight.fitfile import FittedFile, fitted_file
from verl_safe_launch.preflight.pipeline import Preflight, launch_preflight, rule_context, run_preflight
from verl_safe_launch.preflight.recheck import rechecked
from verl_safe_launch.preflight.release import (
    header_json,
    header_lines,
    safe_header_json,
    unjudged,
    use_project_verl,
)
from verl_safe_launch.preflight.scripts import Auditor, JobLint, LaunchAudit, ScriptAudit, TraceOptions
from verl_safe_launch.preflight.tree import Found, find_scripts, skip_reason
from verl_safe_launch.preflight.upgrading import (
    OldRun,
    UpgradeReport,
    old_run_of,
    unreadable_keys,
    upgrade_launch,
)

__all__ = [
    "AdviceJudge",
    "Auditor",
    "Baseline",
    "BaselineWriter",
    "Catalogued",
    "FittedFile",
    "Found",
    "JobLint",
    "LaunchAudit",
    "OldRun",
    "Preflight",
    "ScriptAudit",
    "TraceOptions",
    "UpgradeReport",
    "catalogued",
    "find_scripts",
    "finding_key",
    "fitted_file",
    "header_json",
    "header_lines",
    "launch_preflight",
    "old_run_of",
    "rechecked",
    "rule_catalog",
    "rule_context",
    "run_preflight",
    "safe_header_json",
    "script_key",
    "skip_reason",
    "unjudged",
    "unreadable_keys",
    "upgrade_launch",
    "use_project_verl",
    "verify_advice",
    "verl_validation",
]
