"""The pre-flight pipeline: composed config → audit → presets → rules → memory, every finding at once."""

from __future__ import annotations

from verl_safe_launch.preflight.pipeline import Preflight, launch_preflight, rule_context, run_preflight
from verl_safe_launch.preflight.recheck import rechecked

__all__ = ["Preflight", "launch_preflight", "rechecked", "rule_context", "run_preflight"]
