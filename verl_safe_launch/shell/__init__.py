"""Raw bash launch scripts → the override tokens of every verl launch in them, read without running them."""

from __future__ import annotations

from verl_safe_launch.shell.configs import ConfigChoice, choose_config
from verl_safe_launch.shell.contain import MAX_TIMEOUT_S, check_timeout, containment
from verl_safe_launch.shell.expand import OPAQUE
from verl_safe_launch.shell.job_commands import Command, seeded_env
from verl_safe_launch.shell.launch import (
    Export,
    ScriptLaunch,
    ScriptNote,
    choose_launch,
    override_key,
    traced_launches,
)
from verl_safe_launch.shell.sbatch import (
    GPU_OPTIONS,
    SLURM_VERB_OPTIONS,
    Allocation,
    Directive,
    JobScript,
    parse_gres,
    parse_job_script,
    read_job_script,
)
from verl_safe_launch.shell.script import NoLaunch, parse_script, read_script
from verl_safe_launch.shell.trace import RECORDED, Trace, trace_script

__all__ = [
    "GPU_OPTIONS",
    "MAX_TIMEOUT_S",
    "OPAQUE",
    "RECORDED",
    "SLURM_VERB_OPTIONS",
    "Allocation",
    "Command",
    "ConfigChoice",
    "Directive",
    "Export",
    "JobScript",
    "NoLaunch",
    "ScriptLaunch",
    "ScriptNote",
    "Trace",
    "check_timeout",
    "choose_config",
    "choose_launch",
    "containment",
    "override_key",
    "parse_gres",
    "parse_job_script",
    "parse_script",
    "read_job_script",
    "read_script",
    "seeded_env",
    "trace_script",
    "traced_launches",
]
