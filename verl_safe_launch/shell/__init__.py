"""Raw bash launch scripts → the override tokens of every verl launch in them, read without running them."""

from __future__ import annotations

from verl_safe_launch.shell.sbatch import (
    GPU_OPTIONS,
    SLURM_VERB_OPTIONS,
    Allocation,
    Command,
    Directive,
    JobScript,
    parse_gres,
    parse_job_script,
    read_job_script,
    seeded_env,
)
from verl_safe_launch.shell.script import ScriptLaunch, ScriptNote, parse_script, read_script

__all__ = [
    "GPU_OPTIONS",
    "SLURM_VERB_OPTIONS",
    "Allocation",
    "Command",
    "Directive",
    "JobScript",
    "ScriptLaunch",
    "ScriptNote",
    "parse_gres",
    "parse_job_script",
    "parse_script",
    "read_job_script",
    "read_script",
    "seeded_env",
]
