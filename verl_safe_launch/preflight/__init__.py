"""The pre-flight pipeline: composed config → audit → presets → rules → memory, every finding at once."""

from __future__ import annotations

from verl_safe_launch.preflight.advice import verify_advice, verl_validation
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

__all__ = [
    "Auditor",
    "JobLint",
    "LaunchAudit",
    "Preflight",
    "ScriptAudit",
    "TraceOptions",
    "header_json",
    "header_lines",
    "launch_preflight",
    "rechecked",
    "rule_context",
    "run_preflight",
    "safe_header_json",
    "unjudged",
    "use_project_verl",
    "verify_advice",
    "verl_validation",
]
