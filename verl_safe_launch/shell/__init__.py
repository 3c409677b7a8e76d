"""Raw bash launch scripts → the override tokens of every verl launch in them, read without running them."""

from __future__ import annotations

from verl_safe_launch.shell.expand import OPAQUE
from verl_safe_launch.shell.script import ScriptLaunch, ScriptNote, override_key, parse_script, read_script

__all__ = ["OPAQUE", "ScriptLaunch", "ScriptNote", "override_key", "parse_script", "read_script"]
