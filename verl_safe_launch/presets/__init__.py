"""Presets: what each is for, which one auto picks, and their adaptation to the hardware."""

from __future__ import annotations

from verl_safe_launch.presets.catalog import AUTO, PRESETS, PresetInfo, choose_auto, preset_values
from verl_safe_launch.presets.composition import compose_for_launch, compose_with_preset
from verl_safe_launch.presets.report import preset_findings

__all__ = [
    "AUTO",
    "PRESETS",
    "PresetInfo",
    "choose_auto",
    "compose_for_launch",
    "compose_with_preset",
    "preset_findings",
    "preset_values",
]
