"""verl-safe-launch: pre-flight checks, memory planning and launch for verl RL post-training runs."""

from verl_safe_launch.config_view import ConfigView
from verl_safe_launch.environment import missing_modules
from verl_safe_launch.errors import ConfigError, InputError, LaunchError, UsageError, VslError
from verl_safe_launch.findings import Finding, Severity
from verl_safe_launch.provenance import Layer, Provenance, Source, Write

if not missing_modules():  # else ``python -m verl_safe_launch`` says what this Python lacks
    from verl_safe_launch.compose import Composed, compose
    from verl_safe_launch.inputs import ComposeRequest

__all__ = [
    "ComposeRequest",
    "Composed",
    "ConfigError",
    "ConfigView",
    "Finding",
    "InputError",
    "LaunchError",
    "Layer",
    "Provenance",
    "Severity",
    "Source",
    "UsageError",
    "VslError",
    "Write",
    "compose",
]

__version__ = "0.1.0"
