"""Presets: what each is for, which one auto picks, and their adaptation to the hardware."""

from __future__ import annotations

from verl_safe_launch.presets.adapt import (
    AUTO,
    PRESETS,
    PresetInfo,
    choose_auto,
    compose_for_launch,
    compose_with_preset,
    preset_findings,
    preset_values,
)

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
