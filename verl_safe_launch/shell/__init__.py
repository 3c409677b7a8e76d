"""Raw bash launch scripts → the override tokens of every verl launch in them, read without running them."""

from __future__ import annotations

from verl_safe_launch.shell.expand import OPAQUE
from verl_safe_launch.shell.launch import ScriptLaunch, ScriptNote, override_key, traced_launches
from verl_safe_launch.shell.script import parse_script, read_script
from verl_safe_launch.shell.trace import RECORDED, Trace, trace_script

__all__ = [
    "OPAQUE",
    "RECORDED",
    "ScriptLaunch",
    "ScriptNote",
    "Trace",
    "override_key",
    "parse_script",
    "read_script",
    "trace_script",
    "traced_launches",
]
